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


class Losses(nn.Module):
    """A classifier over a sequence computing its own mean loss (``variant``: how), with
    ignored targets."""

    def __init__(self, variant: str):
        super().__init__()
        self.variant = variant
        self.fc = nn.Linear(16, 8)
        self.register_buffer("weights", torch.linspace(0.5, 2.0, 8))

    def forward(self, x, y):
        h = self.fc(x)  # (batch, positions, classes)
        flat, labels = h.flatten(0, 1), y.flatten()
        if self.variant == "nll":  # the loss alone, as research scripts return it (it was not taken as the loss)
            return F.nll_loss(F.log_softmax(flat, -1), labels)
        if self.variant == "weighted":
            return h, F.cross_entropy(flat, labels, weight=self.weights, label_smoothing=0.1)
        if self.variant == "classes_second":  # (batch, classes, positions), ignore_index of its own
            return h, F.cross_entropy(h.transpose(1, 2), y.masked_fill(y < 0, 7).clamp(max=6), ignore_index=6)
        # two losses, the second on the first position only: two counts
        return h, F.cross_entropy(flat, labels) + 0.5 * F.cross_entropy(h[:, 0], y[:, 0])


DATA_VARIANTS = ("nll", "weighted", "classes_second", "two_losses")


def sequences(variant: str):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    model = Losses(variant)
    x = torch.randn(4, 6, 16, generator=g)
    y = torch.randint(0, 8, (4, 6), generator=g)
    y[0, 1:] = -100  # the first rank's samples mostly ignored (padded)
    y[1, 3:] = -100
    return model, (x, y)


def data_job(rank: int, world: int, cases: list) -> list[tuple[str, float, float]]:
    from flexsearch.emit.verify import verify

    out = []
    for variant, plan in cases:
        model, x = build(variant) if variant in VARIANTS else sequences(variant)
        r = verify(model, plan, x, steps=2)
        out.append((variant, r["loss"], r["reference_loss"]))
    return out


def test_data_parallel_mean_losses_are_the_whole_batch_s():
    """DDP and FSDP2 (ZeRO-3) on 2 ranks whose samples hold different numbers of
    ignored targets: every mean class loss is the whole batch's (``GlobalMean``), its
    value and its gradients: NLL (the forward returning the loss alone), class weights
    with label smoothing, classes in dim 1
    with an ``ignore_index`` of its own, and two losses of different counts summed. Each
    rank's own mean gave the mean of the ranks' means (``verify`` failed on every case).
    With 2 accumulated microbatches (``DeferredMean``: a loss that is one call), DDP and
    FSDP2, fp32 and fp16-mixed; and fp16-mixed accumulation on a loss that needs no count
    (class probabilities), whose earlier microbatches' gradients were divided by the loss
    scale once per later microbatch (gradients off by 95%). A D-PSGD plan keeps each
    rank's own mean (by design): ``verify`` checks it against the mean of the shards'
    means (it compared it with the whole batch's and failed)."""
    cases = []
    for variant in DATA_VARIANTS:
        model, x = sequences(variant)
        plan = flexsearch.plan(model, x, devices=2, cluster="cpu", kinds=["data"], max_iters=0, precision="fp32")
        for shard in ("none", "zero3"):  # ZeRO-1 is DDP's step with another optimizer
            cases.append((variant, plan.model_copy(update={"shard": shard})))
    for variant, precision, shard in (("nll", "fp32", "zero3"), ("weighted", "fp16-mixed", "none"),
                                      ("probabilities", "fp16-mixed", "none")):
        model, x = (build if variant in VARIANTS else sequences)(variant)
        plan = flexsearch.plan(model, x, devices=2, cluster="cpu", kinds=["data"], max_iters=0, precision=precision)
        cases.append((variant, plan.model_copy(update={"shard": shard, "microbatches": 2})))
    model, x = sequences("nll")  # D-PSGD keeps each rank's own mean, by design: verify's reference too
    plan = flexsearch.plan(model, x, devices=2, cluster="cpu", kinds=["decentralized"], max_iters=0,
                           precision="fp32")
    cases.append(("nll", plan))
    for rank in run_ranks(data_job, 2, cases, timeout_s=600):
        for variant, got, ref in rank:
            assert got == pytest.approx(ref, rel=1e-4), variant


def warned_job(rank: int, world: int, cases: list) -> list[list[str]]:
    import warnings

    from flexsearch.emit import parallelize

    out = []
    for variant, plan in cases:
        model, x = sequences(variant)
        module = parallelize(model, plan)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            module.train_step(x)
        out.append([str(w.message) for w in seen if "mean class loss" in str(w.message)])
    return out


def test_a_loss_that_cannot_be_reweighed_under_microbatches_warns():
    """Two class losses summed, over microbatches counting different shares of their
    targets (padded labels), under 2 accumulated microbatches: the step keeps the mean
    of the microbatches' means, which is not the model's loss, and says so with the
    fixes (it did not: gradients 50% off, silently); the loss alone is reweighed, no
    warning."""
    from flexsearch.emit.losses import MEAN_OF_MEANS

    cases = []
    for variant in ("two_losses", "nll"):
        model, x = sequences(variant)
        plan = flexsearch.plan(model, x, devices=2, cluster="cpu", kinds=["data"], max_iters=0, precision="fp32")
        cases.append((variant, plan.model_copy(update={"microbatches": 2})))
    got = run_ranks(warned_job, 2, cases, timeout_s=300)
    for rank in got:
        assert rank == [[MEAN_OF_MEANS], []], rank
