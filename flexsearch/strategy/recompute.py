"""Activation checkpointing: which activations a plan keeps for the backward pass, and
what it recomputes instead.

A plan checkpoints **units**: the instances of the graph's repeated blocks (each
transformer layer), or, in a graph without repeated blocks, its top-level modules (the
FSDP unit rule, :mod:`flexsearch.strategy.fsdp`). A unit is a contiguous range of node
positions. Modes (:data:`MODES`):

- ``none``: every op keeps what its backward needs;
- ``full`` (Chen et al. 2016; Megatron's "full recompute"): a unit keeps only its input;
  its backward reruns the unit's forward first, so at most one unit's activations are
  alive at a time in the backward;
- ``selective``: a unit keeps its input and the outputs of its matmul-class ops
  (:data:`SAVED_KINDS`), and recomputes the rest (norms, activations, dropout,
  elementwise: cheap in FLOPs, most of the bytes): torch's selective activation
  checkpointing with a "save the matmuls" policy, as torchtitan applies it. The policy
  caches a matmul's outputs, whoever reads them, and nothing else it saved (autocast's
  low-precision copies of its input and weights are recomputed):
  :meth:`Checkpointing.cached_bytes`.

:func:`checkpointed` tells, per node position, whether its output is dropped and
recomputed; the simulator turns that into memory (unit inputs kept, one unit's dropped
activations rebuilt at a time) and time (the dropped ops' forwards run again in the
backward). The emitter wraps the same units in ``torch.utils.checkpoint``.
"""

from __future__ import annotations

from dataclasses import dataclass

from flexsearch.graph.opgraph import OpGraph
from flexsearch.precision import MATMUL_KINDS
from flexsearch.strategy.fsdp import fsdp_units

MODES = ("none", "selective", "full")
SAVED_KINDS = MATMUL_KINDS - {"rnn"}
"""The op kinds whose outputs selective checkpointing caches: the emitter's policy saves
the outputs of ``mm``, ``addmm``, ``bmm``, convolutions and fused attention
(:mod:`flexsearch.emit.recompute`); a recurrent layer's kernels are recomputed."""


@dataclass(frozen=True)
class Unit:
    """A checkpointed unit: a module path and its node positions ``[start, end)``."""

    path: str
    start: int
    end: int


def recompute_units(graph: OpGraph) -> tuple[Unit, ...]:
    """The graph's checkpoint units (module docstring), in order; a module whose nodes
    are not contiguous in the graph's order is left out (it cannot be one region)."""
    if graph.blocks:
        paths = [m for b in graph.blocks for m in b.modules]
    else:
        paths = list(fsdp_units(graph.modules))
    wanted = set(paths)
    positions: dict[str, list[int]] = {}  # path -> the positions of the nodes in it
    for i, n in enumerate(graph.nodes):
        parts = n.module.split(".")
        for k in range(1, len(parts) + 1):  # the module and the modules it is in
            within = ".".join(parts[:k])
            if within in wanted:
                positions.setdefault(within, []).append(i)
    out = []
    for path in paths:
        pos = positions.get(path)
        if pos and pos[-1] - pos[0] + 1 == len(pos):
            out.append(Unit(path, pos[0], pos[-1] + 1))
    return tuple(sorted(out, key=lambda u: u.start))


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"unknown recompute mode {mode!r}; use one of {', '.join(MODES)}")
    return mode


def checkpointed(graph: OpGraph, mode: str, units: tuple[Unit, ...] | None = None) -> tuple[bool, ...]:
    """Per node position: is its output dropped after the forward and recomputed in the
    backward under ``mode``?"""
    check_mode(mode)
    out = [False] * len(graph.nodes)
    if mode == "none":
        return tuple(out)
    for u in recompute_units(graph) if units is None else units:
        for i in range(u.start, u.end):
            out[i] = mode == "full" or graph.nodes[i].kind not in SAVED_KINDS
    return tuple(out)


def unit_of_position(graph: OpGraph, units: tuple[Unit, ...] | None = None) -> tuple[int, ...]:
    """Per node position, the index of its unit (-1 outside every unit)."""
    out = [-1] * len(graph.nodes)
    for k, u in enumerate(recompute_units(graph) if units is None else units):
        for i in range(u.start, u.end):
            out[i] = k
    return tuple(out)


@dataclass(frozen=True)
class Checkpointing:
    """A recompute mode laid over a graph's positions: per position, whether its output
    is dropped (and its forward rerun in the backward), its unit (-1: none), whether a
    dropped output is kept anyway because a node outside its unit reads it (a unit's
    output is the next unit's input, which checkpointing keeps), whether its outputs are
    cached (a selective unit's matmul-class op, :data:`SAVED_KINDS`) and whether an op
    saves its output's storage for the backward (what the tracer measured,
    ``OpNode.saves``; assumed saved where it did not)."""

    mode: str
    dropped: tuple[bool, ...]
    unit_of: tuple[int, ...]
    boundary: tuple[bool, ...]
    cached: tuple[bool, ...] = ()
    saved: tuple[bool, ...] = ()

    def __post_init__(self):  # by default nothing cached, every output saved
        n = len(self.dropped)
        if not self.cached:
            object.__setattr__(self, "cached", (False,) * n)
        if not self.saved:
            object.__setattr__(self, "saved", (True,) * n)

    @classmethod
    def of(cls, graph: OpGraph, mode: str) -> Checkpointing:
        units = recompute_units(graph)
        dropped = checkpointed(graph, mode, units)
        unit_of = unit_of_position(graph, units)
        index = {n.name: i for i, n in enumerate(graph.nodes)}
        boundary = [False] * len(graph.nodes)
        for j, n in enumerate(graph.nodes):
            for name in n.inputs:
                i = index[name]
                if dropped[i] and unit_of[j] != unit_of[i]:
                    boundary[i] = True
        cached = tuple(mode == "selective" and unit_of[i] >= 0 and not dropped[i] for i in range(len(dropped)))
        measured = any(n.saves is not None for n in graph.nodes)
        savers = {name for n in graph.nodes for name in n.saves or ()}
        saved = tuple(not measured or n.name in savers for n in graph.nodes)
        return cls(mode, dropped, unit_of, tuple(boundary), cached, saved)

    def cached_bytes(self, i: int, stash: float, cast: float, output: float) -> tuple[float, float]:
        """What a cached op ``i`` (``cached[i]``) keeps from the forward, and what its
        unit's recomputation adds (negative: frees), given what it keeps unchecked
        (``stash``: autograd's saves that it made, its output among them when an op
        saves that), its weights' autocast copy (``cast``) and its outputs' bytes: torch's
        policy keeps the outputs (``output``) and drops the rest; the recomputation
        rebuilds the rest (the copy, and what it saved beside its output: autocast's
        copy of its input), takes the cached outputs back, and frees them unless an op
        saves them. Measured (``tests/test_memory_tracker.py``, data and pipeline plans,
        fp32 and bf16-mixed): what the forward keeps within 3.1% of torch's allocator
        on the tiny GPT and AlexNet; kept as an op unchecked keeps them (what it saved:
        its input's copy, not its output), they were -98% to +39%."""
        own = output if self.saved[i] else 0.0
        return output, cast + max(0.0, stash - own) - (output - own)

    @classmethod
    def none(cls, n: int) -> Checkpointing:
        return cls("none", (False,) * n, (-1,) * n, (False,) * n)


def partial_unit_op(graph: OpGraph, configs, devices: int) -> str | None:
    """The first op inside a checkpointed unit that a SOAP configuration runs on fewer
    than ``devices`` devices (None: none): a rank outside an op's devices saves nothing
    of it, so torch would rebuild other ops, and other collectives, on each rank. A SOAP
    plan recomputes only where every unit's op runs on every device."""
    for u in recompute_units(graph):
        for n in graph.nodes[u.start:u.end]:
            c = configs.get(n.name)
            if c is not None and (c.first or c.n != devices):
                return n.name
    return None
