"""One small immutable value per plan kind: what the simulator predicts
(:func:`flexsearch.sim.predict.predict`), the planner chooses and a plan file records.

- :class:`DataParallel`: every op data parallel over all devices; DDP, or sharded data
  parallelism (``fsdp``) at one of the ZeRO stages of :data:`SHARDINGS`;
- :class:`Soap`: a configuration per op (FlexFlow's SOAP), run on DTensors;
- :class:`Pipelined`: a uniform pipeline of stages (node positions ``bounds``), each on
  ``replicas`` data-parallel replicas of ``tensor`` devices (Megatron's layout inside a
  stage when ``tensor > 1``: ``hybrid``), under a schedule;
- :class:`Decentralized`: D-PSGD, every device its own replica, gossip on a topology.

``Strategy`` is their union. :data:`KINDS` names the plan kinds a search may be
restricted to (``fsdp`` is a data-parallel plan whose ``shard`` is not ``none``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from flexsearch.strategy.config import Config
from flexsearch.strategy.recompute import check_mode
from flexsearch.strategy.topology import Topology

KINDS = ("data", "fsdp", "soap", "pipeline", "hybrid", "decentralized")
"""The plan kinds (``plan --kind``)."""

SHARDINGS = ("none", "zero1", "zero2", "zero3", "hsdp")
"""How a data-parallel plan shards its training state over the ``n`` devices (ZeRO's
stages, Rajbhandari et al. 2020), each as the emitter runs it:

- ``none``: replicated, DDP;
- ``zero1``: optimizer state sharded (DDP, then ``ZeroRedundancyOptimizer``: each rank
  updates its share of the parameters and broadcasts it);
- ``zero2``: optimizer state and gradients sharded, parameters gathered once per
  iteration and kept through the backward (FSDP2, ``reshard_after_forward=False``);
- ``zero3``: parameters too, gathered again for the backward (FSDP2,
  ``reshard_after_forward=True``);
- ``hsdp``: ``zero3`` within groups of ``shard_group`` devices (a node), replicated across
  the groups (FSDP2 on a 2-D ``(replicate, shard)`` mesh): the gradient shards are
  all-reduced across the groups."""
PIPELINE_SHARDINGS = ("none", "zero1", "zero2")
"""How a pipeline or hybrid plan shards its training state over a stage's data-parallel
replicas:

- ``zero1``, the optimizer state (what Megatron-LM's distributed optimizer and
  DeepSpeed's pipeline engine, which takes ZeRO stage 1 only, shard);
- ``zero2``, FSDP2 stages (torchtitan's FSDP x PP, and with ``tensor > 1`` its FSDP x TP
  x PP; one stage of ``tensor > 1``: its 2-D FSDP x TP): each stage ``fully_shard`` over
  its replicas with ``reshard_after_forward=False`` (a tensor-parallel stage's DTensor
  weights on a ``(dp, s, t)`` mesh, FSDP2 sharding each one's local shard over ``dp``),
  under GPipe, 1F1B, or the interleaved schedule with at most
  :data:`FSDP_ACTIVE_STAGES` stages per rank. torch 2.13's pipeline runtime runs every microbatch's backward of an
  FSDP stage without gradient sync and without resharding
  (``torch/distributed/pipelining/stage.py``, ``backward_maybe_with_nosync``) and
  reduce-scatters once after the last (``perform_reduce_grad``; the interleaved
  runtime's ``REDUCE_GRAD`` action after the stage's last backward), so the stage
  gathers its parameters at its first forward (interleaved: the runtime's ``UNSHARD``
  actions, posted at the step's start for the next :data:`FSDP_ACTIVE_STAGES` stages)
  and holds them, with its whole gradients
  (accumulated in fp32 under mixed precision, each microbatch's made in bf16 first:
  ``_fsdp_param.py``, ``to_accumulated_grad_if_needed``), through the step. Per device
  ``(1 + k) P / d`` at rest (``k`` the optimizer's state), ``g P`` gathered (``g`` the
  gathered dtype's share of the stored one) and ``(1 + g') P`` of gradients (``g' = g``
  under mixed precision, else 0), but no autocast weight copies, which the other
  pipelines keep per microbatch in flight (``q``): against ZeRO-1 it saves ``(1 - 1/d)
  P`` of parameters and ``q g P`` of copies for ``(g + g') P``, in bf16-mixed
  ``(q / 2 - 1 / d) P``, in fp32 a loss of ``P / d``. Its traffic, a reduce-scatter and
  an all-gather (in ``g``), is ZeRO-1's all-reduce and all-gather less one pass. Not run: ``zero3`` (under the
  runtime a resharding stage gathers its parameters again for microbatches' forwards
  and backwards while its whole gradients stay: more traffic to save at most the
  gathered parameters), FSDP under an interleaved schedule of more stages per rank
  than :data:`FSDP_ACTIVE_STAGES` (the runtime reshards and gathers again the ones past
  them), and FSDP2 stages of one rank sharing a weight (one tensor, two FSDP modules:
  :func:`flexsearch.sim.stages.shared_within_rank`)."""
ACCUMULATING_SHARDINGS = ("none", "zero1", "zero2")
"""The data-parallel shardings that accumulate gradients over microbatches, each as one
pipeline stage on every device runs them (:func:`flexsearch.sim.predict.predict`): DDP
under ``no_sync``; ZeRO-1 the same, then its sharded update; ZeRO-2 as FSDP2 stages
under a pipeline run (:data:`PIPELINE_SHARDINGS`): the parameters gathered at the
first microbatch and kept, the gradients accumulated whole, reduce-scattered after the
last (the emitter turns FSDP2's gradient sync and its resharding after the backward
off until the last microbatch). ZeRO-3 and HSDP, which gather again for every
microbatch, do not."""
FSDP_PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved")
"""The schedules whose runtime reduce-scatters an FSDP stage's gradients (``zero2``)."""
FSDP_ACTIVE_STAGES = 3
"""The FSDP2 stages a rank of torch 2.13's interleaved runtime keeps gathered at once
(``_add_unshard_reshard``'s ``max_active_stages``)."""
FSDP_SHARDINGS = ("zero2", "zero3", "hsdp")
"""The shardings FSDP2 runs (parameters sharded at rest, over FSDP units)."""


@dataclass(frozen=True)
class DataParallel:
    """Data parallel over every device: ``configs`` gives every node its data-parallel
    configuration (``decisions`` the decision units'); ``shard`` (:data:`SHARDINGS`) how it
    shards the training state, FSDP's over the units ``fsdp_units`` (module paths,
    :mod:`flexsearch.strategy.fsdp`), HSDP's within groups of ``shard_group`` devices."""

    configs: Mapping[str, Config]
    decisions: Mapping[str, Config] = field(default_factory=dict)
    shard: str = "none"
    fsdp_units: tuple[str, ...] = ()
    shard_group: int = 0
    """``hsdp``: devices per shard group (consecutive devices; the groups replicate)."""
    microbatches: int = 1
    """Gradient accumulation: the per-device batch runs as this many microbatches, one
    gradient synchronisation after the last (:data:`ACCUMULATING_SHARDINGS`)."""
    recompute: str = "none"
    """Activation checkpointing (:mod:`flexsearch.strategy.recompute`)."""

    def __post_init__(self) -> None:
        check_mode(self.recompute)
        if self.microbatches < 1:
            raise ValueError(f"microbatches must be >= 1 (got {self.microbatches})")
        if self.shard not in SHARDINGS:
            raise ValueError(f"unknown sharding {self.shard!r}; use one of {', '.join(SHARDINGS)}")
        if (self.shard == "hsdp") != (self.shard_group > 1):
            raise ValueError("an hsdp plan needs shard_group > 1 devices per group, and only hsdp has one")
        if self.shard not in ACCUMULATING_SHARDINGS and self.microbatches > 1:
            raise ValueError(f"gradient accumulation is modelled and emitted with sharding "
                             f"{', '.join(ACCUMULATING_SHARDINGS)}, not {self.shard}")

    @property
    def kind(self) -> str:
        return "fsdp" if self.shard != "none" else "data"

    @property
    def fsdp(self) -> bool:
        """Run with FSDP2 (parameters sharded at rest, :data:`FSDP_SHARDINGS`)?"""
        return self.shard in FSDP_SHARDINGS


@dataclass(frozen=True)
class Soap:
    """A configuration per node (``decisions``: per decision unit, expanded into
    ``configs``)."""

    configs: Mapping[str, Config]
    decisions: Mapping[str, Config] = field(default_factory=dict)
    recompute: str = "none"
    """Activation checkpointing (:mod:`flexsearch.strategy.recompute`): each unit's ops,
    their redistributions included, run again in its backward (under ``selective`` the
    matmuls return their cached outputs and compute nothing again)."""

    def __post_init__(self) -> None:
        check_mode(self.recompute)


    @property
    def kind(self) -> str:
        return "soap"


def check_pipeline_shard(shard: str, replicas: int, tensor: int, schedule: str, chunks: int = 1) -> None:
    """ValueError unless a pipeline of ``replicas`` x ``tensor`` devices per stage under
    ``schedule``, ``chunks`` stages per rank, can shard its state with ``shard``
    (:data:`PIPELINE_SHARDINGS`)."""
    if shard not in PIPELINE_SHARDINGS:
        raise ValueError(f"a pipeline shards its state with one of {', '.join(PIPELINE_SHARDINGS)}, not {shard!r}")
    if shard != "none" and replicas < 2:
        raise ValueError(f"{shard} shards the state over a stage's replicas: it needs replicas > 1")
    if shard == "zero2" and schedule not in FSDP_PIPELINE_SCHEDULES:
        raise ValueError(f"zero2 (FSDP2 stages) runs under {' or '.join(FSDP_PIPELINE_SCHEDULES)}, "
                         f"not under {schedule!r}")
    if shard == "zero2" and chunks > FSDP_ACTIVE_STAGES:
        raise ValueError(f"zero2 (FSDP2 stages) runs at most {FSDP_ACTIVE_STAGES} stages per rank, not {chunks}: "
                         "the runtime would gather the others again")


@dataclass(frozen=True)
class Pipelined:
    """A pipeline: stage ``k`` holds the nodes at positions ``bounds[k]`` and runs on
    pipeline rank ``k mod ranks`` (``chunks`` stages per rank: interleaved), each rank
    on ``replicas`` x ``tensor`` devices (rank ``r`` on devices ``r g .. (r + 1) g - 1``,
    ``g = replicas x tensor``)."""

    bounds: tuple[tuple[int, int], ...]
    tensor: int
    replicas: int
    schedule: str
    microbatches: int
    chunks: int = 1
    recompute: str = "none"
    """Activation checkpointing (:mod:`flexsearch.strategy.recompute`)."""
    shard: str = "none"
    """:data:`PIPELINE_SHARDINGS`: ``zero1`` shards each stage's optimizer state over its
    ``replicas`` (each replica updates its share of the stage's parameters, then the
    replicas all-gather them: ``ZeroRedundancyOptimizer`` over the replica group);
    ``zero2`` runs each stage as an FSDP2 module over its replicas (parameters,
    gradients and optimizer state sharded at rest)."""

    def __post_init__(self) -> None:
        check_mode(self.recompute)
        if self.chunks < 1 or len(self.bounds) % self.chunks:
            raise ValueError(f"{len(self.bounds)} stages do not split into {self.chunks} chunks per rank")
        check_pipeline_shard(self.shard, self.replicas, self.tensor, self.schedule, self.chunks)

    @property
    def kind(self) -> str:
        return "hybrid" if self.tensor > 1 else "pipeline"

    @property
    def ranks(self) -> int:
        """Pipeline ranks: stages per chunk."""
        return len(self.bounds) // self.chunks

    def devices(self, stage: int) -> tuple[int, ...]:
        """The devices of ``stage`` (all its replicas)."""
        g = self.replicas * self.tensor
        r = stage % self.ranks
        return tuple(range(r * g, (r + 1) * g))


@dataclass(frozen=True)
class Decentralized:
    """D-PSGD on ``topology`` (rank ``i`` on device ``i``)."""

    topology: Topology

    @property
    def kind(self) -> str:
        return "decentralized"


Strategy = DataParallel | Soap | Pipelined | Decentralized
