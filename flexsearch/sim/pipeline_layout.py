"""What a pipeline plan is to the simulators: each stage's costs (:class:`StageCost`),
where its stages and replicas run (:class:`PipelineLayout`), and the ordered actions each
replica's lane runs (:func:`lanes`, from :mod:`flexsearch.strategy.schedules`). The task
simulation (:mod:`flexsearch.sim.pipeline`) and the memory model
(:mod:`flexsearch.sim.pipeline_memory`) both read them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flexsearch.strategy.schedules import Action, rank_actions, warmup_then_alternate


@dataclass(frozen=True)
class StageCost:
    """One stage's costs (:mod:`flexsearch.sim.pipeline`); times in seconds, sizes in bytes per device."""

    forward_s: float
    backward_s: float
    param_bytes: float
    stash_bytes: float
    send_bytes: float
    working_bytes: float = 0.0
    """Bytes needed once, whatever the microbatches in flight (with activation
    recomputation: one microbatch's activations, rebuilt during its backward)."""
    tensors: int = 0
    """Parameter tensors per device (a calibrated update pays a fixed cost per tensor)."""
    largest_param_bytes: float = 0.0
    """The largest parameter tensor per device (a calibrated update's temporaries)."""
    loss_bytes: float = 0.0
    """What the loss holds over one microbatch's output (the stage that returns it)."""
    loss_copy_bytes: float = 0.0
    """The part of it the loss saves until that microbatch's backward (the fp32 copy of
    a lower-precision output): kept once per microbatch in flight."""
    grad_working_bytes: float = 0.0
    """``W``: one microbatch's backward gradients above its kept activations and, under
    checkpointing, above the largest unit's rebuilt ones (``working_bytes``, ``C``: the
    two count together, ``C + W``; :func:`flexsearch.sim.footprint.backward_working`)."""

    trained_bytes: float | None = None
    """Of ``param_bytes``, those that train (None: all of them): what has gradients,
    optimizer state, an update and a synchronisation."""

    @property
    def trains(self) -> float:
        return self.param_bytes if self.trained_bytes is None else self.trained_bytes

    @property
    def loss_working_bytes(self) -> float:
        """``T``: the loss's fp32 working tensor over one microbatch's output, the part
        of ``loss_bytes`` that is not its copy
        (:func:`flexsearch.sim.footprint.loss_working_bytes`)."""
        return self.loss_bytes - self.loss_copy_bytes


@dataclass(frozen=True)
class PipelineLayout:
    """Where a pipeline runs: ``ranks[r][i]`` = the devices of replica ``i`` of pipeline
    rank ``r``; ``units`` = how many schedule microbatches make one iteration (the
    microbatch count for a synchronous schedule; the minibatches per global batch for
    PipeDream, whose window is ``microbatches`` long)."""

    schedule: str
    microbatches: int
    ranks: tuple[tuple[tuple[int, ...], ...], ...]
    chunks: int = 1
    units: int | None = None
    tied: tuple[tuple[int, int, float], ...] = ()
    """(stage a, stage b, gradient bytes per device) of weights both stages hold."""
    shard: str = "none"
    """``zero1``: optimizer state sharded over each rank's replicas; ``zero2``: FSDP2
    stages, parameters, gradients and optimizer state sharded over them
    (:mod:`flexsearch.sim.pipeline`)."""
    gather: float = 1.0
    """``zero2``: bytes FSDP2 gathers per stored parameter byte (its ``param_dtype``:
    :meth:`flexsearch.precision.Precision.gather_factor`)."""
    runtime: str = "pipeline"
    """The emitter's runtime that runs the stages (a calibration ``Mode``): ``pipeline``;
    for a data-parallel plan accumulating gradients, simulated as one stage on every
    device (:func:`flexsearch.sim.predict.predict`), ``ddp`` (DDP, with ZeRO-1 too: its
    gradient buckets and their all-reduce's cost per tensor) or ``fsdp``; its fixed cost
    per step is the update's, its allocation the runtime term of the memory."""
    fsdp_calls: int = 1
    """FSDP2 stages: the FSDP units a stage's parameters are gathered and its gradients
    reduce-scattered in, one collective each (a pipeline's stage is one unit; a
    data-parallel plan's, its FSDP units and the root)."""
    fsdp_unit_share: float = 1.0
    """FSDP2 stages: the largest of those units' share of a stage's parameters (1: a
    pipeline's stage), what :attr:`grad_copies` holds in the gathered dtype at a time."""

    def shards(self, device_rank: int) -> int:
        """Over how many devices pipeline rank ``device_rank``'s optimizer state is
        sharded: its replicas under ``zero1`` and ``zero2``, else 1."""
        return len(self.ranks[device_rank]) if self.shard in ("zero1", "zero2") else 1

    @property
    def fsdp(self) -> bool:
        """Stages run as FSDP2 modules over their replicas (``zero2``)?"""
        return self.shard == "zero2"

    @property
    def grad_copies(self) -> float:
        """A stage's gradient bytes during a backward, per stored parameter byte
        (:func:`fsdp_grad_copies` for FSDP2 stages, else 1)."""
        return fsdp_grad_copies(self.gather, self.fsdp_unit_share) if self.fsdp else 1.0

    def __post_init__(self) -> None:
        if self.runtime not in RUNTIMES or (self.runtime == "fsdp") != self.fsdp and self.runtime != "pipeline":
            raise ValueError(f"runtime {self.runtime!r} does not run {self.shard!r} stages; use one of "
                             f"{', '.join(RUNTIMES)} (fsdp for zero2 only)")

    @property
    def stages(self) -> int:
        return len(self.ranks) * self.chunks

    @property
    def asynchronous(self) -> bool:
        return self.schedule == "pipedream"

    def rank_of(self, stage: int) -> int:
        return stage % len(self.ranks)

    def replicas(self, stage: int) -> tuple[tuple[int, ...], ...]:
        """The device groups of ``stage``'s replicas."""
        return self.ranks[self.rank_of(stage)]


RUNTIMES = ("pipeline", "ddp", "fsdp")
"""The runtimes that run a pipeline layout's stages (:attr:`PipelineLayout.runtime`)."""


def fsdp_grad_copies(gather: float, unit_share: float = 1.0) -> float:
    """An FSDP2 stage's gradient bytes during a backward, per stored parameter byte: gathered
    in a lower precision it makes each microbatch's gradients in it and, at each FSDP
    unit's post-backward, adds them to the fp32 ones it accumulates or turns them into
    those (torch's ``_fsdp_param_group.py: post_backward``,
    ``accumulate_unsharded_grad_if_needed``, ``to_accumulated_grad_if_needed``), so the
    low-precision gradients of one unit (``unit_share`` of the stage's parameters) are
    alive beside the fp32 ones at a time: ``1 + gather x unit_share``; else 1."""
    return 1.0 + gather * unit_share if gather < 1 else 1.0


def lanes(layout: PipelineLayout) -> dict[tuple[int, int], tuple[Action, ...]]:
    """(rank, replica) -> the actions that replica runs."""
    p, m = len(layout.ranks), layout.microbatches
    out: dict[tuple[int, int], tuple[Action, ...]] = {}
    if not layout.asynchronous:
        per_rank = rank_actions(layout.schedule, p, m, chunks=layout.chunks)
        for r, reps in enumerate(layout.ranks):
            for i in range(len(reps)):
                out[(r, i)] = per_rank[r]
        return out
    if layout.chunks != 1:
        raise ValueError("the pipedream schedule has one chunk per rank")
    sizes = [len(reps) for reps in layout.ranks]
    for r, n in enumerate(sizes):
        noam = math.ceil(sum(sizes[r:]) / n)
        for i in range(n):
            mine = [j for j in range(m) if j % n == i]
            fw = [Action(r, "F", j) for j in mine]
            bw = [Action(r, "B", j) for j in mine]
            out[(r, i)] = warmup_then_alternate(fw, bw, min(noam, len(mine)))
    return out
