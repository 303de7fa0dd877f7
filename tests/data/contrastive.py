"""Models whose loss couples the samples of a batch (``tests/test_coupling.py``)."""

import torch
import torch.nn.functional as F
from torch import nn


class TwoTowers(nn.Module):
    """CLIP's contrastive loss on two small encoders: every image against every text of
    the batch (``img @ txt.T``), cross-entropy towards the matching pair."""

    def __init__(self, dim: int = 32, embed: int = 16):
        super().__init__()
        self.image = nn.Sequential(nn.Linear(dim, 64), nn.GELU(), nn.Linear(64, embed))
        self.text = nn.Sequential(nn.Linear(dim, 64), nn.GELU(), nn.Linear(64, embed))
        self.logit_scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, images: torch.Tensor, texts: torch.Tensor) -> torch.Tensor:
        img = F.normalize(self.image(images), dim=-1)
        txt = F.normalize(self.text(texts), dim=-1)
        logits = img @ txt.t() * self.logit_scale.exp()
        labels = torch.arange(logits.shape[0], device=logits.device)
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2


class Routed(nn.Module):
    """A token classifier with a mixture-of-experts router's load-balancing loss (Switch
    Transformer's, as Mixtral computes it): the fraction of tokens sent to each expert
    times the mean router probability, both over the whole batch."""

    def __init__(self, dim: int = 32, experts: int = 4, classes: int = 8):
        super().__init__()
        self.router = nn.Linear(dim, experts)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        probs = self.router(x).softmax(-1)
        top = F.one_hot(probs.argmax(-1), probs.shape[-1]).float()
        balance = (top.mean(0) * probs.mean(0)).sum() * probs.shape[-1]
        return F.cross_entropy(self.head(x), y) + 0.01 * balance


class PerSample(nn.Module):
    """The control: a classifier whose loss is a mean of per-sample terms."""

    def __init__(self, dim: int = 32, classes: int = 8):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, 64), nn.GELU(), nn.Linear(64, classes))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.net(x), y) + 0.1 * self.net(x).pow(2).mean()


def two_towers():
    torch.manual_seed(0)
    return TwoTowers(), (torch.randn(8, 32), torch.randn(8, 32))


def routed():
    torch.manual_seed(0)
    return Routed(), (torch.randn(8, 32), torch.randint(0, 8, (8,)))


def per_sample():
    torch.manual_seed(0)
    return PerSample(), (torch.randn(8, 32), torch.randint(0, 8, (8,)))
