"""The search space of one graph: decision units and the expansion of decisions.

Searches choose a :class:`~flexsearch.strategy.config.Config` for each *decision unit*:
one decision op (a layer or compute op), or the same op of every instance of a
repeated block (identical transformer layers share one decision). :meth:`Space.expand`
turns decisions into a configuration for every node: followers take their carrier's
layout (:func:`~flexsearch.strategy.config.follow`), sources stay whole.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import cached_property

from flexsearch.graph.opgraph import OpGraph, OpNode
from flexsearch.strategy.config import Config, candidates, follow, is_follower, is_source, legal


@dataclass(frozen=True)
class Unit:
    """A decision shared by ``nodes``: one op, or the same op of every instance of a
    repeated block. ``name`` is its first node's name."""

    name: str
    nodes: tuple[str, ...]


class Space:
    """The search space of one graph on ``devices`` devices: decision units, their
    candidate configurations, and the expansion of a decision into a configuration for
    every node.

    For a graph only ``torch.export`` traces, every op runs on all the devices (no
    operator placement on a subset): the emitter runs its ATen ops on DTensor, and ranks
    outside an op's mesh would run the model's mask-building ops (advanced indexing,
    ``new_ones``) on empty shards, which DTensor does not keep shape-correct."""

    def __init__(self, graph: OpGraph, devices: int):
        self.graph = graph
        self.devices = devices
        self.whole_blocks = graph.via == "export"
        self._followed: dict[tuple[str, Config], Config] = {}  # (follower, its carrier's config) -> its config
        self._carriers: dict[str, OpNode] = {}  # follower -> :meth:`carrier`

    @cached_property
    def decision_nodes(self) -> tuple[str, ...]:
        """Nodes the search decides: non-source nodes that are not followers, and
        followers fed only by sources (nothing to follow)."""
        by = self.graph.by_name
        return tuple(
            n.name
            for n in self.graph.nodes
            if not is_source(n)
            and (not is_follower(n) or all(is_source(by[i]) for i in n.inputs))
        )

    @cached_property
    def units(self) -> tuple[Unit, ...]:
        """Decision units: block instances share one decision per position."""
        decision = set(self.decision_nodes)
        grouped: dict[str, list[str]] = {}
        head_of: dict[str, str] = {}
        for g in self.graph.blocks:
            for pos in range(len(g.instances[0])):
                names = [inst[pos] for inst in g.instances]
                if names[0] in decision:
                    for nm in names:
                        head_of[nm] = names[0]
                    grouped[names[0]] = names
        out: list[Unit] = []
        for name in self.decision_nodes:
            if name in head_of:
                if head_of[name] == name:
                    out.append(Unit(name, tuple(grouped[name])))
            else:
                out.append(Unit(name, (name,)))
        return tuple(out)

    @cached_property
    def unit_index(self) -> dict[str, int]:
        return {u.name: i for i, u in enumerate(self.units)}

    def unit(self, unit: Unit | str) -> Unit:
        return unit if isinstance(unit, Unit) else self.units[self.unit_index[unit]]

    def allows(self, unit: Unit | str, c: Config) -> bool:
        """Is ``c`` legal for every node of the unit?"""
        return self._placeable(c) and all(legal(self.graph.node(nm), c, self.devices) for nm in self.unit(unit).nodes)

    def _placeable(self, c: Config) -> bool:
        return not self.whole_blocks or c.s * c.t == self.devices

    def candidates(self, unit: Unit | str, *, full_block_only: bool = False) -> tuple[Config, ...]:
        """Configurations legal for every node of the unit."""
        u = self.unit(unit)
        cands = candidates(self.graph.node(u.nodes[0]), self.devices, full_block_only=full_block_only)
        return tuple(c for c in cands if self.allows(u, c))

    def expand(self, decisions: Mapping[str, Config]) -> dict[str, Config]:
        """A configuration for every node: a unit's decision for each of its nodes
        (missing units: ``Config()``), followers derived in topological order (each
        follower's layout for a carrier's configuration computed once, the same object
        after: a delta simulation tells unchanged nodes by identity), sources whole."""
        out: dict[str, Config] = {}
        for u in self.units:
            c = decisions.get(u.name, Config())
            for nm in u.nodes:
                out[nm] = c
        followed = self._followed
        for n in self.graph.nodes:
            if n.name in out:
                continue
            if is_source(n):
                out[n.name] = Config()
                continue
            p = self._carriers.get(n.name)
            if p is None:
                p = self._carriers[n.name] = self.carrier(n)  # a follower: decisions and sources come first
            pc = out[p.name]
            c = followed.get((n.name, pc))
            if c is None:
                c = followed[(n.name, pc)] = follow(n, p, pc, self.devices)
            out[n.name] = c
        return out

    def carrier(self, n: OpNode) -> OpNode:
        """The input a follower takes its layout from: its first non-source input."""
        return next(p for p in map(self.graph.node, n.inputs) if not is_source(p))

    def data_parallel(self, unit: Unit | str) -> Config:
        """The unit's data-parallel configuration: the largest sample split over all
        devices that is legal, the rest of the devices replicating; for an op that sums
        over the samples into a number (a loss), its samples split over all the devices
        (a reduce split, each device its replica's loss)."""
        cands = self.candidates(unit, full_block_only=True)
        over = self.graph.node(self.unit(unit).nodes[0]).dims.over_samples
        return max((c for c in cands if c.kind in ("", "x") or c.kind == "r" and over),
                   key=lambda c: (c.s * (c.t if c.kind == "r" else 1), c))

    def check(self, decisions: Mapping[str, Config]) -> None:
        """Raise ValueError naming the first unknown unit or illegal configuration."""
        for name, c in decisions.items():
            if name not in self.unit_index:
                raise ValueError(f"{name!r} is not a decision of this graph")
            for nm in self.units[self.unit_index[name]].nodes:
                if not self._placeable(c) or not legal(self.graph.node(nm), c, self.devices):
                    raise ValueError(
                        f"configuration {c.text} is not legal for {nm} on {self.devices} devices"
                    )

    def iter_decisions(self) -> Iterator[dict[str, Config]]:
        """Every combination of unit candidates (for exhaustive search on tiny graphs)."""
        cands = [self.candidates(u) for u in self.units]
        for combo in itertools.product(*cands):
            yield {u.name: c for u, c in zip(self.units, combo, strict=True)}
