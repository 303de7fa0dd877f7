"""``flexsearch calibrate --convergence MODEL``: train a model for real on local gloo
ranks under synchronous all-reduce and under D-PSGD on each topology, and fit how many
iterations each topology needs (file format and fit: :mod:`flexsearch.strategy.convergence`).

**Data**: scikit-learn's bundled ``load_digits`` (1,797 8x8 images of 10 digits, pixel
values scaled to ``[0, 1]``; shipped with the package, nothing is downloaded). Each
sample is shaped like the model's example input: a ``(B, F)`` input takes the 64 pixels
(zero-padded or cut to ``F``); a ``(B, C, H, W)`` input takes the image resized to ``H x
W`` (bilinear) in each of the ``C`` channels. The model must return 10 logits per sample;
the loss is cross-entropy.

**Protocol** (the same for every algorithm of a rank count and split): the model's
initial weights (the builder's, broadcast from rank 0); plain SGD at ``lr`` (Lian et
al.'s update; no momentum, whose state D-PSGD keeps local); ``batch_per_rank`` samples per
rank per iteration; each epoch's global batches from one seeded permutation
(``seed + epoch``), so every algorithm sees the same data in the same order. The loss
is evaluated ``evals_per_epoch`` times per epoch (default 4) over ``epochs`` (default
20); the target is all-reduce's loss once it falls to a quarter of its initial loss
(:data:`~flexsearch.strategy.convergence.TARGET_FRACTION`), early in the run, so a
topology many times slower is still measured.

- ``iid``: global batch ``k`` is samples ``k nb .. (k+1) nb - 1`` of the permutation, and
  rank ``r`` trains on its ``r``-th slice of ``b`` (what the emitted modules do with a
  shuffled global batch);
- ``non-iid``: rank ``r`` draws only digits ``c`` with ``c mod n == r`` (a few classes
  per rank; only for ``n <= 10``), from its own permuted pool; an epoch ends when the
  smallest pool is used up.

All-reduce is the emitted ``data`` plan (DDP); D-PSGD the emitted ``decentralized`` plan
(:mod:`flexsearch.emit.decentralized`, gossip before the optimizer step). After every
epoch the curve records the loss on the whole training set of the ranks' **average
model** (parameters and floating-point buffers averaged: what a decentralized run ends
with, one all-reduce; under all-reduce the ranks' models are equal), its BatchNorm
layers normalising with the evaluated samples' own statistics, so the loss does not
depend on how each algorithm kept running statistics (DDP keeps rank 0's, which on a
non-i.i.d. split describe rank 0's classes only). One process group per (rank count,
split) runs every algorithm in turn.
"""

from __future__ import annotations

import copy
import datetime
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from flexsearch.cost.hardware import user_dir
from flexsearch.errors import FlexsearchError
from flexsearch.strategy.convergence import (
    TARGET_FRACTION,
    ConvergenceFile,
    Curve,
    fit,
    measured_factors,
)

CLASSES = 10
TOPOLOGIES = ("ring", "torus", "exponential", "one_peer_exponential")


@dataclass(frozen=True)
class Settings:
    ranks: tuple[int, ...] = (2, 4, 8)
    topologies: tuple[str, ...] = TOPOLOGIES
    splits: tuple[str, ...] = ("iid", "non-iid")
    epochs: int = 20
    evals_per_epoch: int = 4
    target_fraction: float = TARGET_FRACTION
    batch_per_rank: int = 16
    lr: float = 0.1
    seed: int = 0
    timeout_s: float = 3600.0


def digits() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's bundled digits: ``(X (1797, 64) in [0, 1], y (1797,))``."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise FlexsearchError("convergence runs use scikit-learn's bundled digits; install it with "
                              "pip install scikit-learn torch==2.13.0") from None
    d = load_digits()
    return torch.tensor(d.data, dtype=torch.float32) / 16.0, torch.tensor(d.target, dtype=torch.long)


def shaped(x: torch.Tensor, example: torch.Tensor) -> torch.Tensor:
    """The digits ``x`` (N, 64) shaped like one sample of ``example`` (module docstring)."""
    if not isinstance(example, torch.Tensor) or not example.is_floating_point():
        raise FlexsearchError("convergence runs need a model whose one input is a float tensor (B, F) or "
                              "(B, C, H, W); pass a model file with such an input")
    if example.dim() == 2:
        f = example.shape[1]
        return F.pad(x, (0, f - 64)) if f >= 64 else x[:, :f].contiguous()
    if example.dim() == 4:
        c, h, w = example.shape[1:]
        img = x.view(-1, 1, 8, 8)
        if (h, w) != (8, 8):
            img = F.interpolate(img, size=(h, w), mode="bilinear", align_corners=False)
        return img.expand(-1, c, h, w).contiguous()
    raise FlexsearchError(f"convergence runs need an input of shape (B, F) or (B, C, H, W), not "
                          f"{tuple(example.shape)}; pass a model file with such an input")


def epoch_batches(y: torch.Tensor, n: int, b: int, split: str, epoch: int, seed: int) -> list[torch.Tensor]:
    """The global batches (sample indices, rank ``r``'s slice at ``r b .. (r+1) b``) of one
    epoch (module docstring). Pure: a function of its arguments."""
    g = torch.Generator().manual_seed(seed + epoch)
    if split == "iid":
        perm = torch.randperm(len(y), generator=g)
        nb = n * b
        return [perm[k * nb:(k + 1) * nb] for k in range(len(y) // nb)]
    if split != "non-iid":
        raise ValueError(f"split is 'iid' or 'non-iid', not {split!r}")
    if n > CLASSES:
        raise ValueError(f"a non-i.i.d. split gives each rank its own classes: at most {CLASSES} ranks, not {n}")
    pools = []
    for r in range(n):
        idx = torch.nonzero(y % n == r).flatten()
        pools.append(idx[torch.randperm(len(idx), generator=g)])
    steps = min(len(p) for p in pools) // b
    return [torch.cat([p[k * b:(k + 1) * b] for p in pools]) for k in range(steps)]


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """The training-set loss of the ranks' average model (collective): a copy whose
    parameters and floating-point buffers are averaged over the ranks, in eval mode;
    each rank evaluates every n-th sample (one batch) and the sums are added up."""
    import torch.distributed as dist

    avg = copy.deepcopy(model).eval()
    for m in avg.modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            m.train()  # the evaluated samples' statistics (module docstring)
    n, r = dist.get_world_size(), dist.get_rank()
    with torch.no_grad():
        for t in [*avg.parameters(), *avg.buffers()]:
            if t.is_floating_point():
                dist.all_reduce(t.data)
                t.data.div_(n)
        total = F.cross_entropy(avg(x[r::n]).float(), y[r::n], reduction="sum").reshape(1).double()
        dist.all_reduce(total)
    return float(total) / len(y)


def _job(rank: int, world: int, spec: str, plans: list[tuple[str, str]], split: str, epochs: int, evals: int,
         b: int, lr: float, seed: int) -> dict[str, tuple[list[float], float]]:
    from flexsearch.emit import parallelize
    from flexsearch.model_files import load_model
    from flexsearch.plan import Plan

    model0, inputs = load_model(spec)
    x_all, y = digits()
    x = shaped(x_all, inputs[0])
    out = {}
    for name, plan_json in plans:
        module = parallelize(copy.deepcopy(model0), Plan.model_validate_json(plan_json))
        opt = torch.optim.SGD(module.parameters(), lr=lr)
        t0 = time.perf_counter()
        losses = [_loss(module.model, x, y)]
        for e in range(epochs):
            batches = epoch_batches(y, world, b, split, e, seed)
            marks = {round(len(batches) * (k + 1) / evals) for k in range(evals)}
            for i, idx in enumerate(batches, 1):
                opt.zero_grad(set_to_none=True)
                module.train_step((x[idx],), y[idx], F.cross_entropy)
                opt.step()
                if i in marks:
                    losses.append(_loss(module.model, x, y))
        out[name] = (losses, time.perf_counter() - t0)
    return out


def _plans(spec: str, n: int, b: int, topologies: Sequence[str]) -> list[tuple[str, str]]:
    """``[("all-reduce", data plan), (topology, decentralized plan), ...]`` as JSON for
    ``n`` cpu ranks (topologies that do not apply to ``n`` are left out)."""
    from flexsearch.api import resolve_cluster
    from flexsearch.graph.tracer import trace
    from flexsearch.model_files import load_model
    from flexsearch.search.decentralized import candidate_topologies
    from flexsearch.search.planner import plan_graph

    model, inputs = load_model(spec)
    x, _ = digits()
    graph = trace(model, (shaped(x[: n * b], inputs[0]),))
    cl = resolve_cluster("cpu", n)
    out = [("all-reduce", plan_graph(graph, cl, kinds=("data",), max_iters=0).model_dump_json())]
    tops, _ = candidate_topologies(n, [t for t in topologies if t != "complete"])
    if tops:
        base = plan_graph(graph, cl, kinds=("decentralized",), max_iters=0)
        for t in tops:
            out.append((t.name, base.model_copy(update={"topology": t.name, "topology_edges": ()}).model_dump_json()))
    return out


def _check_model(spec: str) -> str:
    from flexsearch.model_files import load_model

    model, inputs = load_model(spec)
    if len(inputs) != 1:
        raise FlexsearchError(f"{spec}: convergence runs need a model with one input tensor, not {len(inputs)}")
    x, _ = digits()
    with torch.no_grad():
        out = model(shaped(x[:2], inputs[0]))
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (2, CLASSES):
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise FlexsearchError(f"{spec}: convergence runs train on the 10 digit classes, so the model must return "
                              f"(B, 10) logits; it returns {shape}")
    return type(model).__name__


def measure(spec: str, settings: Settings = Settings(), *, source: str | None = None,
            progress: Callable[[str], None] | None = None) -> ConvergenceFile:
    """Train ``spec`` under every algorithm, rank count and split of ``settings`` and
    fit the bound's constants (module docstring); ``source`` is the command recorded in
    the file (default: the ``flexsearch calibrate`` command these settings match)."""
    from flexsearch.cost.profiler import host_info
    from flexsearch.emit.launch import RanksFailed, run_ranks

    if max(settings.ranks, default=0) < 3:
        raise FlexsearchError("every topology on 2 ranks is the exact average, which tells nothing about D-PSGD's "
                              "slowdown; measure on 4 or more ranks (--ranks 4)")
    if not 0.0 < settings.target_fraction < 1.0:
        raise FlexsearchError(f"the target fraction must be between 0 and 1, not {settings.target_fraction}")
    family = _check_model(spec)
    curves: list[Curve] = []
    for n in settings.ranks:
        plans = _plans(spec, n, settings.batch_per_rank, settings.topologies)
        for split in settings.splits:
            if split == "non-iid" and n > CLASSES:
                continue
            if progress:
                progress(f"{n} ranks, {split}: {', '.join(name for name, _ in plans)}")
            try:
                res = run_ranks(_job, n, spec, plans, split, settings.epochs, settings.evals_per_epoch,
                                settings.batch_per_rank, settings.lr, settings.seed, timeout_s=settings.timeout_s)
            except RanksFailed as e:
                raise FlexsearchError(f"convergence run on {n} ranks ({split}) failed: "
                                      f"{' '.join(str(e).split())[:400]}") from None
            for name, (losses, wall) in res[0].items():
                curves.append(Curve(algorithm=name, ranks=n, split=split, losses=tuple(losses), wall_s=wall))
    factors = measured_factors(curves, settings.target_fraction)
    try:
        fits = fit(factors)
    except ValueError as e:
        raise FlexsearchError(f"cannot fit {spec}'s convergence: {e}") from None
    return ConvergenceFile(
        family=family, model=spec, dataset="sklearn load_digits (1797 8x8 images, 10 classes)",
        source=source or _command(spec, settings),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        host={k: v for k, v in host_info().items()}, seed=settings.seed, epochs=settings.epochs,
        evals_per_epoch=settings.evals_per_epoch, target_fraction=settings.target_fraction,
        batch_per_rank=settings.batch_per_rank, optimizer="sgd", lr=settings.lr,
        curves=tuple(curves), factors=factors, fits=fits)


def _command(spec: str, s: Settings) -> str:
    return (f"flexsearch calibrate --convergence {spec} --ranks {max(s.ranks)} --epochs {s.epochs} "
            f"(rank counts {', '.join(map(str, s.ranks))}; topologies {', '.join(s.topologies)}; "
            f"batch {s.batch_per_rank} per rank; lr {s.lr}; seed {s.seed})")


def rank_counts(largest: int) -> tuple[int, ...]:
    """2, 4, 8, ... up to ``largest`` (and ``largest`` itself)."""
    out, n = [], 2
    while n < largest:
        out.append(n)
        n *= 2
    return (*out, largest)


def write(data: ConvergenceFile, out: str | os.PathLike[str] | None = None) -> Path:
    """Write ``data`` atomically to ``out`` (default: the user's convergence directory,
    ``<family>.json``, where the planner finds it)."""
    path = Path(out) if out is not None else user_dir() / "convergence" / f"{data.family}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(data.model_dump_json(indent=1) + "\n")
    os.replace(tmp, path)
    return path

