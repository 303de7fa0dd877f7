"""One small immutable value per plan kind: what the simulator predicts
(:func:`flexsearch.sim.predict.predict`), the planner chooses and a plan file records.

- :class:`DataParallel`: every op data parallel over all devices; DDP, or FSDP2
  ``fully_shard`` over :attr:`DataParallel.fsdp_units` when ``shard`` (``fsdp``);
- :class:`Soap`: a configuration per op (FlexFlow's SOAP), run on DTensors;
- :class:`Pipelined`: a uniform pipeline of stages (node positions ``bounds``), each on
  ``replicas`` data-parallel replicas of ``tensor`` devices (Megatron's layout inside a
  stage when ``tensor > 1``: ``hybrid``), under a schedule;
- :class:`Decentralized`: D-PSGD, every device its own replica, gossip on a topology.

``Strategy`` is their union. :data:`KINDS` names the plan kinds a search may be
restricted to (``fsdp`` is a data-parallel plan with ``shard``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from flexsearch.strategy.config import Config
from flexsearch.strategy.recompute import check_mode
from flexsearch.strategy.topology import Topology

KINDS = ("data", "fsdp", "soap", "pipeline", "hybrid", "decentralized")
"""The plan kinds (``plan --kind``)."""


@dataclass(frozen=True)
class DataParallel:
    """Data parallel over every device: ``configs`` gives every node its data-parallel
    configuration (``decisions`` the decision units'); ``shard`` runs it fully sharded
    over the FSDP units ``fsdp_units`` (module paths, :mod:`flexsearch.strategy.fsdp`)."""

    configs: Mapping[str, Config]
    decisions: Mapping[str, Config] = field(default_factory=dict)
    shard: bool = False
    fsdp_units: tuple[str, ...] = ()
    microbatches: int = 1
    """Gradient accumulation: the per-device batch runs as this many microbatches, one
    gradient synchronisation after the last."""
    recompute: str = "none"
    """Activation checkpointing (:mod:`flexsearch.strategy.recompute`)."""

    def __post_init__(self) -> None:
        check_mode(self.recompute)
        if self.microbatches < 1:
            raise ValueError(f"microbatches must be >= 1 (got {self.microbatches})")

    @property
    def kind(self) -> str:
        return "fsdp" if self.shard else "data"


@dataclass(frozen=True)
class Soap:
    """A configuration per node (``decisions``: per decision unit, expanded into
    ``configs``)."""

    configs: Mapping[str, Config]
    decisions: Mapping[str, Config] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return "soap"


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

    def __post_init__(self) -> None:
        check_mode(self.recompute)
        if self.chunks < 1 or len(self.bounds) % self.chunks:
            raise ValueError(f"{len(self.bounds)} stages do not split into {self.chunks} chunks per rank")

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
