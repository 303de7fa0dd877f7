"""A model's own cross-entropy split by its samples in a SOAP plan (``emit/losses.py``):
each rank's sum of losses over the sum of the counts is the whole batch's loss, however
the loss is called and whichever devices run it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import flexsearch
from flexsearch.emit.launch import run_ranks
from flexsearch.strategy.config import Config, parse_config

VARIANTS = ("module_keywords", "probabilities", "smoothing_ignored")


class Head(nn.Module):
    """A classifier computing its own loss (``variant``: how)."""

    def __init__(self, variant: str):
        super().__init__()
        self.variant = variant
        self.fc = nn.Linear(16, 8)
        self.ce = nn.CrossEntropyLoss()

    def forward(self, x, y):
        h = self.fc(x)
        if self.variant == "module_keywords":
            return h, self.ce(input=h, target=y)
        if self.variant == "probabilities":
            return h, F.cross_entropy(h, y)
        return h, F.cross_entropy(h, y, label_smoothing=0.2)


def build(variant: str):
    torch.manual_seed(0)  # the same weights on every rank
    g = torch.Generator().manual_seed(0)
    model = Head(variant)
    x = torch.randn(8, 16, generator=g)
    if variant == "probabilities":
        y = torch.softmax(torch.randn(8, 8, generator=g), -1)
    else:  # the first rank's samples mostly ignored: uneven counts
        y = torch.randint(0, 8, (8,), generator=g)
        y[:3] = -100
    return model, (x, y)


def forced(variant: str, devices: int, config: str):
    """The SOAP plan with the loss as ``config``."""
    model, x = build(variant)
    plan = flexsearch.plan(model, x, devices=devices, cluster="cpu", kinds=["soap"], max_iters=0,
                           precision="fp32")
    configs = dict(plan.configs)
    (loss,) = [k for k in configs if "cross_entropy" in k or k.startswith("ce")]
    configs[loss] = config if isinstance(configs[loss], str) else parse_config(config)
    return plan.model_copy(update={"configs": configs})


def job(rank: int, world: int, cases: list) -> list[tuple[float, float]]:
    from flexsearch.emit.verify import verify

    out = []
    for variant, plan in cases:
        model, x = build(variant)
        r = verify(model, plan, x)
        out.append((r["loss"], r["reference_loss"]))
    return out


def test_split_losses_are_the_whole_batch_s():
    """On 2 ranks: ``nn.CrossEntropyLoss`` called with keywords (it raised), class
    probabilities as targets (the loss was 8x too small: every element counted as a
    label), label smoothing with ignored labels; on 4 ranks, the loss on ranks 2 and 3
    only (ranks outside the block made a loss of another shape, and gloo aborted)."""
    assert parse_config("s1.r2:0@2") == Config(1, "r", 2, 0, 2)
    for devices, config in ((2, "s1.r2:0"), (4, "s1.r2:0@2")):
        cases = [(v, forced(v, devices, config)) for v in VARIANTS]
        for rank in run_ranks(job, devices, cases, timeout_s=600):
            for got, ref in rank:
                assert got == pytest.approx(ref, rel=1e-5)
