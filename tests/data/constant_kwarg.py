"""A model taking a constant keyword input (``return_loss=True``, as Hugging Face's
CLIP does): traced with it, so every plan's emitter must trace and run with it too."""

import torch
import torch.nn.functional as F
from torch import nn


class WithLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, x, labels=None, return_loss=False):
        h = self.net(x)
        return F.cross_entropy(h, labels) if return_loss else h


def model():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
    return WithLoss(), (x, {"labels": y, "return_loss": True})


class Scaled(nn.Module):
    """A constant keyword input fx traces as a placeholder, read by the last layer."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, x, scale=1.0):
        return ((self.net(x) * scale) ** 2).mean()  # its loss


def scaled():
    torch.manual_seed(0)
    return Scaled(), (torch.randn(8, 16, generator=torch.Generator().manual_seed(0)), {"scale": 2.0})
