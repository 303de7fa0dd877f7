"""The emitter: ``parallelize(model, plan)`` returns the module this rank runs.

One module per plan kind, all on torch.distributed machinery:

- ``data``: :mod:`flexsearch.emit.data` (DDP; FSDP2 ``fully_shard`` when the plan
  shards parameters);
- ``soap``: :mod:`flexsearch.emit.sharded` (DTensor placements per op);
- ``pipeline`` / ``hybrid``: :mod:`flexsearch.emit.staged` (the model cut into stage
  modules by :mod:`flexsearch.emit.stages`, ``torch.distributed.pipelining`` schedules,
  data parallel and DTensor tensor parallel inside the stages).

A model only ``torch.export`` traces runs as its exported ATen graph
(:func:`lift_exported`): whole for SOAP, at one microbatch's shapes for pipelines.
- ``decentralized``: :mod:`flexsearch.emit.decentralized` (D-PSGD: every rank keeps its
  own model and averages it with its gossip neighbours by point-to-point messages; the
  gradients left on the parameters are local, not averaged).

Every emitted module has ``train_step(inputs, target, loss_fn) -> loss``: every rank
passes the same global batch and target; the step runs forward and backward as the
plan says, leaves the gradients on the module's parameters for any torch optimizer,
and returns the global mean loss (``loss_fn`` must average over the batch).
:func:`make_optimizer` builds the optimizer the plan trains with (ZeRO-1 plans shard
its state; any other plan takes a plain torch optimizer over the module's parameters).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from flexsearch.emit.precision import check_runs_here
from flexsearch.emit.runtime import Runtime
from flexsearch.errors import EmitError, FlexsearchError
from flexsearch.graph.lift import own_checkpointing, own_checkpointing_off
from flexsearch.graph.opgraph import OpGraph
from flexsearch.plan import Plan
from flexsearch.precision import precision as precision_of

EMITTABLE_KINDS = ("data", "soap", "pipeline", "hybrid", "decentralized")


def example_inputs(plan: Plan, parts: int = 1) -> tuple:
    """Zero tensors of the plan's input shapes (tracing needs shapes, not values), the
    keyword ones in a trailing dict with the constant ones (``return_loss=True``); with
    ``parts``, one of that many equal slices of the batch (a pipeline's microbatch)."""
    from flexsearch.emit.data import batch_shard

    names = plan.input_names or ("",) * len(plan.inputs)
    zeros = [batch_shard(torch.zeros(m.shape, dtype=getattr(torch, m.dtype)), 0, parts) for m in plan.inputs]
    args = tuple(z for z, k in zip(zeros, names, strict=True) if not k)
    kwargs = {k: z for z, k in zip(zeros, names, strict=True) if k} | dict(plan.constant_inputs)
    return (*args, kwargs) if kwargs else args


def graph_of(model: nn.Module, plan: Plan) -> OpGraph:
    """``model``'s graph, checked to be the one ``plan`` was made for."""
    from flexsearch.graph.tracer import trace

    if not plan.inputs:
        raise EmitError("this plan records no input shapes (made by an older flexsearch); plan the model again")
    try:
        graph = trace(model, example_inputs(plan), name=plan.model, precision=plan.precision)
    except FlexsearchError:
        raise EmitError(f"this plan was made for another model or input shapes (model {plan.model!r}, inputs "
                        f"{[m.shape for m in plan.inputs]}): the model does not run on them; plan this model "
                        "with `flexsearch plan`") from None
    try:
        plan.check_graph(graph)
    except FlexsearchError as e:
        raise EmitError(str(e)) from None
    return graph


def lift(model: nn.Module) -> fx.GraphModule:
    """``model``'s FX graph module, as the tracer lifts it (same node names)."""
    from flexsearch.graph.lift import fx_graph_module

    try:
        return fx_graph_module(model)
    except Exception as e:  # noqa: BLE001 - any tracing failure is the same user error
        raise EmitError(f"the emitter runs models torch.fx can trace; this one fails ({type(e).__name__}); "
                        "use a data-parallel plan for it") from None


def lift_exported(model: nn.Module, plan: Plan, parts: int = 1) -> fx.GraphModule:
    """``model``, which only ``torch.export`` traces, exported
    (:func:`flexsearch.graph.lift.export_module`) on the plan's inputs split ``parts``
    ways along the batch (an exported graph's shapes are fixed: a pipeline's runs one
    microbatch)."""
    from flexsearch.emit.inputs import split
    from flexsearch.graph.lift import export_module

    try:
        return export_module(model, *split(example_inputs(plan, parts)))
    except FlexsearchError as e:
        raise EmitError(f"{e}; plan the model with fewer microbatches or another plan kind") from None


def parallelize(model: nn.Module, plan: Plan, *, group: dist.ProcessGroup | None = None) -> nn.Module:
    """The module this rank runs for ``plan`` (made for ``model``) on the process group
    ``group`` (default: the default group; its size must be the plan's devices).

    The caller's ``model`` is not modified: the emitted module holds a copy (load a
    checkpoint into it with :mod:`flexsearch.emit.checkpoint`). A model's own gradient
    checkpointing (Hugging Face's ``activation_checkpointing_enable()``) is off in that
    copy: the plan's ``recompute``, which its prediction costs, decides what is rebuilt."""
    if plan.kind not in EMITTABLE_KINDS:
        raise EmitError(f"the emitter cannot run {plan.kind!r} plans yet (it runs {', '.join(EMITTABLE_KINDS)}); "
                        "plan again without that kind")
    rt = Runtime(plan, group)
    check_runs_here(model, precision_of(plan.precision), rt.device_type)
    if own_checkpointing(model):
        model = copy.deepcopy(model)  # the plan's recompute setting decides what is checkpointed, as costed
        own_checkpointing_off(model)
    graph = graph_of(model, plan)
    if plan.kind == "data":
        from flexsearch.emit.data import data_parallel

        return data_parallel(model, rt, plan, graph)
    if plan.kind == "decentralized":
        from flexsearch.emit.decentralized import decentralized

        return decentralized(model, plan, rt)
    if plan.kind == "soap":
        from flexsearch.emit.sharded import shard
        from flexsearch.strategy.config import legal

        for name, c in plan.node_configs().items():  # a plan from an older flexsearch may split what it cannot run
            if name in graph.by_name and not legal(graph.node(name), c, plan.devices):
                raise EmitError(f"the plan runs op {name} as {c.text}, which this version of flexsearch does not "
                                "run; plan this model again")
        relift = (lambda m: lift_exported(m, plan)) if graph.via == "export" else lift
        return shard(model, relift, graph, plan.node_configs(), rt, plan.recompute)
    from flexsearch.emit.staged import pipeline

    return pipeline(model, graph, plan, rt)


def make_optimizer(module: nn.Module, cls: type[torch.optim.Optimizer] = torch.optim.AdamW,
                   **kwargs) -> torch.optim.Optimizer:
    """The optimizer ``cls(..., **kwargs)`` for an emitted ``module``, as its plan runs
    it: sharded (``ZeroRedundancyOptimizer``) for a ``zero1`` plan, else ``cls`` over
    the module's trainable parameters (FSDP and DTensor plans shard the state with the
    parameters)."""
    own = getattr(module, "make_optimizer", None)
    if own is not None:
        return own(cls, **kwargs)
    return cls([p for p in module.parameters() if p.requires_grad], **kwargs)


__all__ = ["EMITTABLE_KINDS", "make_optimizer", "parallelize"]
