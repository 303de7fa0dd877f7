"""Activation checkpointing at run time: the plan's units (:mod:`flexsearch.strategy.recompute`)
under ``torch.utils.checkpoint`` (non-reentrant), without renaming a parameter.

- ``full``: a unit's forward runs under ``checkpoint``: only its inputs are kept, and it
  runs again in the backward;
- ``selective``: the same, with a policy (``create_selective_checkpoint_contexts``) that
  saves the outputs of matmul-class ATen ops (``mm``, ``addmm``, ``bmm``, attention,
  convolution) and recomputes everything else.

:func:`checkpoint_modules` replaces each unit module's ``forward`` by a checkpointed
call of the original (data-parallel, FSDP2 and D-PSGD plans: the module tree is the
user's, names unchanged). :func:`checkpoint_stage` rewrites a pipeline stage's FX graph:
each unit's contiguous run of nodes becomes one call of a sub-``GraphModule`` under
``checkpoint``; the sub-module shares the stage's layers (the same objects, still
registered under their original names in the stage), so parameters and state dicts
are unchanged.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from flexsearch.emit.stages import BOUNDARY
from flexsearch.graph.opgraph import OpGraph
from flexsearch.strategy.recompute import recompute_units

_SAVED = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
          torch.ops.aten.convolution.default, torch.ops.aten._scaled_dot_product_flash_attention.default,
          torch.ops.aten._scaled_dot_product_efficient_attention.default,
          torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}
"""What the selective policy saves: the matmul-class ATen ops (the simulator's
:data:`~flexsearch.strategy.recompute.SAVED_KINDS`)."""


def _policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVED else CheckpointPolicy.PREFER_RECOMPUTE


def context_fn(mode: str) -> Callable | None:
    """``checkpoint``'s ``context_fn`` for ``mode`` (None: plain full recomputation)."""
    return functools.partial(create_selective_checkpoint_contexts, _policy) if mode == "selective" else None


def run_checkpointed(fn: Callable, mode: str, *args: Any, whole: bool = False, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` under non-reentrant checkpointing in ``mode``; ``whole``:
    the recomputation runs all of ``fn``, not only up to its last saved tensor (torch's
    early stop), so every rank runs the same collectives again (a SOAP unit's
    redistributions, as the simulator reruns them)."""
    extra = {"context_fn": cf} if (cf := context_fn(mode)) is not None else {}
    return checkpoint(fn, *args, use_reentrant=False, early_stop=not whole, **extra, **kwargs)


def checkpoint_modules(model: nn.Module, graph: OpGraph, mode: str) -> nn.Module:
    """Checkpoint each unit of ``graph`` in ``model`` (module docstring); ``model`` is the
    emitter's own copy."""
    if mode == "none":
        return model
    for unit in recompute_units(graph):
        m = model.get_submodule(unit.path)
        m.forward = functools.partial(run_checkpointed, m.forward, mode)
    return model


def unit_runs(gm: fx.GraphModule, graph: OpGraph) -> list[list[fx.Node]]:
    """Each unit's contiguous run of op nodes in ``gm`` (in order; a stage's boundary
    copies belong to none; a ``get_attr`` among them, which the callers fetch first,
    neither)."""
    unit_of: dict[str, int] = {}
    for k, u in enumerate(recompute_units(graph)):
        for n in graph.nodes[u.start:u.end]:
            unit_of[n.name] = k
    runs: list[list[fx.Node]] = []
    current: int | None = None
    for n in gm.graph.nodes:
        if n.op == "get_attr":  # a weight or buffer fetched inside a unit (a mask) does not end it
            continue
        op = n.op in ("call_function", "call_method", "call_module") and not n.meta.get(BOUNDARY)
        u = unit_of.get(n.name) if op else None
        if u is None:
            current = None
            continue
        if u != current:
            runs.append([])
            current = u
        runs[-1].append(n)
    return runs


def run_edges(run: list[fx.Node]) -> tuple[list[fx.Node], list[fx.Node]]:
    """The values a run of nodes reads from outside it, and those of its nodes read
    outside it (both in order)."""
    inside = set(run)
    inputs: list[fx.Node] = []
    for n in run:
        for a in n.all_input_nodes:
            if a not in inside and a not in inputs:
                inputs.append(a)
    return inputs, [n for n in run if any(u not in inside for u in n.users)]


def checkpoint_stage(gm: fx.GraphModule, graph: OpGraph, mode: str) -> fx.GraphModule:
    """Rewrite a stage's graph module so each unit's run of nodes runs checkpointed
    (module docstring)."""
    if mode == "none":
        return gm
    first = next(n for n in gm.graph.nodes if n.op != "placeholder")
    for n in [n for n in gm.graph.nodes if n.op == "get_attr"]:  # fetched before any unit's call
        first.prepend(n)
    for run in unit_runs(gm, graph):
        _outline(gm, run, mode)
    gm.graph.lint()
    gm.recompile()
    return gm


class _Region:
    """A checkpointed unit as a callable an FX graph can call (FX names a call by its
    target's ``__name__``): not a module, so the stage's parameters keep their names."""

    __name__ = "checkpointed_unit"

    def __init__(self, region: fx.GraphModule, mode: str):
        self.region, self.mode = region, mode
        self.__module__ = __name__

    def __call__(self, *args: Any) -> Any:
        return run_checkpointed(self.region, self.mode, *args)


def _outline(gm: fx.GraphModule, run: list[fx.Node], mode: str) -> None:
    """Replace ``run`` (a unit's nodes, in order) by one checkpointed call."""
    inside = set(run)
    inputs, outputs = run_edges(run)
    if not outputs:
        return
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {a: sub.placeholder(a.name) for a in inputs}
    for n in run:
        env[n] = sub.node_copy(n, env.__getitem__)
    sub.output(tuple(env[o] for o in outputs))
    target = _Region(fx.GraphModule(gm, sub, "checkpointed_unit"), mode)  # the stage's own layers, shared
    with gm.graph.inserting_before(run[0]):
        call = gm.graph.create_node("call_function", target, tuple(inputs), {}, name=f"checkpointed_{run[0].name}")
        results = [gm.graph.call_function(operator.getitem, (call, i)) for i in range(len(outputs))]
    for o, r in zip(outputs, results, strict=True):
        o.replace_all_uses_with(r, delete_user_cb=lambda user: user not in inside)
    for n in reversed(run):
        gm.graph.erase_node(n)
