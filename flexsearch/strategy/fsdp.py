"""The FSDP units of a sharded data-parallel plan: decided once, from the model's facts.

**Rule** (FSDP2 wrapping, as torchtitan applies it per block): every top-level module
that holds parameters is one ``fully_shard`` unit; a plain container (``ModuleList``,
``ModuleDict``) is not a unit itself, its items are, and neither is a module outside
a container that holds one below it (Hugging Face's ``model`` around ``model.layers``:
its children are, recursively, so each decoder layer is a unit, not the whole stack); a unit that shares
a parameter with another unit (a tied embedding and output layer) is not wrapped, so
the shared weight stays in the root unit, which holds every parameter no unit takes; nor
is a module whose parameters an op outside it reads (``ModuleFacts.read_outside``: FSDP2
gathers a unit's parameters for its own forward only).

:func:`fsdp_units` applies the rule to the graph's
:attr:`~flexsearch.graph.opgraph.OpGraph.modules` (the planner records the result in
the plan) or to :func:`flexsearch.graph.modules.module_facts` of a model (the emitter,
for plans that record none): one rule, one set of facts, so the simulator and the
emitter agree by construction.
"""

from __future__ import annotations

from collections.abc import Sequence

from flexsearch.graph.opgraph import ModuleFacts, OpGraph

ROOT = ""
"""The root unit's name."""


def fsdp_units(modules: Sequence[ModuleFacts]) -> tuple[str, ...]:
    """The paths of the modules wrapped as FSDP units, in module order (module docstring)."""
    candidates = [m for m in modules if not m.container and not m.read_outside and _top_or_item(m, modules)]
    holders: dict[str, int] = {}
    for m in candidates:
        for q in m.params:
            holders[q] = holders.get(q, 0) + 1
    return tuple(m.path for m in candidates if all(holders[q] == 1 for q in m.params))


def _top_or_item(m: ModuleFacts, modules: Sequence[ModuleFacts]) -> bool:
    """Is ``m`` a top-level module or an item of a container (the facts hold no others)?"""
    parent = m.path.rpartition(".")[0]
    return parent == "" or any(o.path == parent and o.container for o in modules)


def unit_of(module_path: str, units: Sequence[str]) -> str:
    """The unit a module at ``module_path`` belongs to (:data:`ROOT` when none)."""
    for u in units:
        if module_path == u or module_path.startswith(u + "."):
            return u
    return ROOT


def node_units(graph: OpGraph, units: Sequence[str]) -> dict[str, str]:
    """Graph node name -> the FSDP unit whose parameters it uses (:data:`ROOT` when
    none: a node of the root module, or one using a weight the root keeps)."""
    return {n.name: unit_of(n.module, units) for n in graph.nodes}


def param_units(graph: OpGraph, units: Sequence[str] | None = None) -> dict[str, list[int]]:
    """FSDP unit -> indexes of its nodes that own parameters, for the units FSDP2 gathers
    and reduce-scatters (``units``: the unit paths, default :func:`fsdp_units` of the
    graph; a unit without parameters, the root among them, is left out)."""
    units = fsdp_units(graph.modules) if units is None else units
    of = node_units(graph, units)
    out: dict[str, list[int]] = {}
    for i, n in enumerate(graph.nodes):
        if n.param_bytes:
            out.setdefault(of[n.name], []).append(i)
    return out
