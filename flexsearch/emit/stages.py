"""Cutting a model into pipeline stages (the mechanism; where to cut is the planner's).

:func:`cut` takes the model's FX graph module and the plan's stages (op names, in
order) and returns one ``fx.GraphModule`` per stage:

- every op runs in the stage the plan put it in, except that a ``getitem`` of a
  tuple-valued op stays with that op (a stage boundary carries tensors only);
- nodes that are not ops (parameter fetches, ``x.size(1)``, ``getattr``) are copied
  into every stage that uses them (a parameter used by two stages, a tied weight,
  is held by both: :func:`tied_parameters` names them, the runtime sums their
  gradients);
- stage 0 takes the model's inputs; stage ``k`` takes the tensors live across boundary
  ``k-1`` and returns those live across boundary ``k`` (defined at or before ``k``,
  used after it), in graph order and contiguous (they are sent as dense buffers), so a
  value skipping stages is passed along; the last stage returns the model's output (a
  dict or nested output as a flat tuple, its structure in the module's ``out_spec``).

Stage modules are built from the original module (``fx.GraphModule(root, graph)``), so
their parameter names are the original qualified names.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch.fx as fx
from torch import nn
from torch.utils._pytree import tree_flatten

from flexsearch.emit.dense import dense_input
from flexsearch.errors import EmitError
from flexsearch.graph.opgraph import OpGraph

BOUNDARY = "flexsearch_stage_boundary"
"""Meta key on the nodes a stage adds at its edges (received-input copies, sent buffers):
not the model's ops, so no recompute unit takes them."""


def assign(gm: fx.GraphModule, graph: OpGraph, stages: Sequence[Sequence[str]]) -> dict[fx.Node, set[int]]:
    """The stage(s) each FX node runs in."""
    stage_of = {name: k for k, names in enumerate(stages) for name in names}
    by = graph.by_name
    out: dict[fx.Node, set[int]] = {}
    nodes = list(gm.graph.nodes)
    for n in nodes:
        if n.op == "placeholder":
            out[n] = {0}
        elif n.op == "output":
            out[n] = {len(stages) - 1}
        elif n.name in stage_of:
            k = stage_of[n.name]
            if n.op == "call_function" and n.target is operator.getitem:
                src = n.args[0]
                if isinstance(src, fx.Node) and src.name in by and (
                        len(by[src.name].outputs) > 1 or isinstance(src.meta.get("val"), (tuple, list))):
                    k = min(out[src])  # a tuple of one (an exported no_grad region's result) too
            out[n] = {k}
    for n in reversed(nodes):  # non-op nodes: wherever they are used
        if n not in out:
            out[n] = set().union(*(out[u] for u in n.users)) if n.users else {0}
    return out


def cut(gm: fx.GraphModule, graph: OpGraph, stages: Sequence[Sequence[str]],
        constants: dict[str, Any] | None = None) -> list[fx.GraphModule]:
    """One graph module per stage (see the module docstring). ``constants``: the values
    of the placeholders that take no tensor (a keyword input ``return_loss=True``), which
    are no stage's inputs (a pipeline stage takes tensors only) but their values."""
    constants = constants or {}
    where = assign(gm, graph, stages)
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    copied = {n for n in nodes if len(where[n]) > 1 or n.op == "get_attr"}  # recomputed where used
    defined = {n: min(where[n]) for n in nodes if n not in copied}
    last = len(stages) - 1

    def live(k: int) -> list[fx.Node]:
        """Tensors crossing boundary k (between stage k and k + 1)."""
        out = []
        for n, d in defined.items():
            if n.op == "output" or d > k or n.name in constants:  # a constant is a value in every stage
                continue
            if any(max(where[u]) > k for u in n.users):
                out.append(n)
        return sorted(out, key=order.__getitem__)

    modules = []
    for k in range(len(stages)):
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        inputs = [n for n in nodes if n.op == "placeholder" and n.name not in constants] if k == 0 else live(k - 1)
        for n in nodes:
            if n.op == "placeholder" and n.name in constants:
                env[n] = constants[n.name]
        for n in inputs:
            env[n] = g.placeholder(n.name)
            if k == 0 and n.op == "placeholder":
                env[n].meta = dict(n.meta)
            elif k > 0:  # the gradient sent back to stage k - 1 fills a dense buffer
                env[n] = g.call_function(dense_input, (env[n],))
                env[n].meta[BOUNDARY] = True
        for n in nodes:
            if n.op == "placeholder" or k not in where[n] or n in env:
                continue
            if n.op == "output":
                continue
            missing = [a for a in n.all_input_nodes if a not in env]
            if missing:
                raise EmitError(f"stage {k} needs {missing[0].name} before {n.name}; the model cannot be cut "
                                "there (a non-tensor value crosses the stage boundary)")
            env[n] = g.node_copy(n, env.__getitem__)
        spec = None
        if k == last:
            out = next(n for n in nodes if n.op == "output")
            result = fx.node.map_arg(out.args[0], env.__getitem__)
            if not isinstance(result, fx.Node) and not (isinstance(result, tuple) and
                                                         all(isinstance(v, fx.Node) for v in result)):
                # a dict (``{"loss": ..., "pred": ...}``) or nested output: a flat tuple, the
                # structure kept for the loss (a pipeline stage returns tensors)
                flat, spec = tree_flatten(result)
                result = tuple(flat)
            g.output(result)
        else:
            outs = [g.call_method("contiguous", (env[n],)) for n in live(k)]  # sent as dense buffers
            for o in outs:
                o.meta[BOUNDARY] = True
            g.output(tuple(outs) if len(outs) != 1 else outs[0])
        g.lint()
        modules.append(_constants_plain(fx.GraphModule(gm, g, f"stage{k}"), gm))
        if spec is not None:
            modules[-1].out_spec = spec
    return modules


def _constants_plain(stage: fx.GraphModule, gm: fx.GraphModule) -> fx.GraphModule:
    """``stage`` with the tensors it fetches that are plain attributes of ``gm`` (an
    exported graph's constants, ``_tensor_constant0``: a tensor made in ``forward``)
    plain attributes again: ``fx.GraphModule`` registers every fetched tensor as a
    buffer, and a tensor-parallel stage distributes buffers (DTensor has no rule for
    ``lift_fresh_copy``, which reads such a constant)."""
    for n in stage.graph.nodes:
        if n.op != "get_attr":
            continue
        path, _, name = n.target.rpartition(".")
        src, dst = gm.get_submodule(path), stage.get_submodule(path)
        if name in dst._buffers and name not in src._buffers:
            setattr(dst, name, dst._buffers.pop(name))
    return stage


def tied_parameters(stages: Sequence[nn.Module]) -> dict[str, list[int]]:
    """Parameter names held by more than one stage -> the stages holding them."""
    held: dict[str, list[int]] = {}
    for k, m in enumerate(stages):
        for name, _ in m.named_parameters():
            held.setdefault(name, []).append(k)
    return {n: ks for n, ks in held.items() if len(ks) > 1}
