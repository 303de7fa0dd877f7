"""The tracer: ``trace(model, example_inputs) -> OpGraph``.

1. Lift (:mod:`flexsearch.graph.lift`): ``torch.fx`` symbolic tracing, standard
   ``torch.nn`` layers kept as single nodes; if that fails, ``torch.export``; if both
   fail, a one-line :class:`TraceError` naming the offending source line.
2. Measure (:class:`~flexsearch.graph.measure.Measure`, an ``fx.Interpreter``): every node runs on fake tensors
   (``FakeTensorMode``; parameters and buffers are swapped for fakes with
   ``torch.func.functional_call``), so no real memory is used. Each op runs on fresh
   leaf inputs under ``FlopCounterMode``: its forward FLOPs, then the FLOPs of its
   backward (``torch.autograd.grad`` of its outputs w.r.t. its inputs and parameters).
   Bytes read are the tensor inputs plus the parameters used, bytes written the
   outputs; an output that aliases an input (a view) moves no bytes. What autograd
   saves for the backward is recorded too (``saved_tensors_hooks`` around each op's
   forward): each node is given the saved storages it created
   (:mod:`flexsearch.graph.saved`; ``OpNode.saved_bytes``). Under mixed precision the
   graph is measured a second time with the parameters in autocast's dtype, as FSDP2
   computes it (``OpGraph.low_param_nodes``), in a forked process beside the first
   where the machine has a second core.
3. Label: the op registry gives each node its kind and SOAP dims; the batch dim is
   followed from the inputs (dim 0 of every example input).
4. Find repeated blocks (:mod:`flexsearch.graph.blocks`).
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Sequence
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from flexsearch.collector import cycles_paused
from flexsearch.errors import TraceError
from flexsearch.graph import moe, registry
from flexsearch.graph.blocks import find_blocks
from flexsearch.graph.calls import OpCall
from flexsearch.graph.lift import lift, own_checkpointing, short_reason, training_outputs
from flexsearch.graph.measure import Measure, fake_like
from flexsearch.graph.modules import module_facts
from flexsearch.graph.opgraph import ModuleFacts, OpGraph, OpNode
from flexsearch.graph.saved import fused_rnn_saves
from flexsearch.precision import FP32, Precision
from flexsearch.precision import precision as precision_of
from flexsearch.workers import Helper, worker_count


def trace(model: nn.Module, example_inputs: tuple | Any, *, name: str | None = None,
          precision: Precision | str | None = None, workers: int | None = None) -> OpGraph:
    """Lift ``model`` called on ``example_inputs`` into an :class:`OpGraph`.

    ``example_inputs`` is a tuple of positional arguments (a single tensor is accepted);
    a trailing ``dict`` is taken as keyword arguments. Dim 0 of every input tensor is
    the batch. Real, meta or fake tensors all work; nothing is computed for real.
    ``precision`` (:mod:`flexsearch.precision`, default ``fp32``: the model as
    it is): every op runs under ``torch.autocast`` for mixed precision, or on the model
    cast to ``bf16``, so the graph's dtypes, FLOPs and bytes are that precision's.
    ``workers``: processes the trace may use (default: this machine's CPUs; with 2 or
    more, mixed precision's second pass runs beside the first). The graph is the same.
    """
    return trace_calls(model, example_inputs, name=name, precision=precision, workers=workers)[0]


def check_call(model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    """TraceError unless ``model``'s forward takes ``args`` and ``kwargs`` (the example
    inputs, a trailing dict as keyword arguments): an input it does not take would
    otherwise be dropped from the graph, and the plan made without it."""
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):  # no signature to check (a builtin, a C extension)
        return
    try:
        sig.bind(*args, **kwargs)
    except TypeError as e:
        raise TraceError(f"the example inputs do not fit {type(model).__name__}.forward{sig}: {e}; pass inputs "
                         "its forward takes (a trailing dict: keyword arguments)") from None


@cycles_paused()  # a trace allocates a million objects and few cycles (flexsearch.collector)
def trace_calls(
    model: nn.Module, example_inputs: tuple | Any, *, name: str | None = None,
    precision: Precision | str | None = None, workers: int | None = None,
) -> tuple[OpGraph, dict[str, OpCall]]:
    """:func:`trace`, plus for every op node an :class:`OpCall` to run it again (the
    profiler runs ops alone at full and partitioned shapes with these)."""
    if not isinstance(model, nn.Module):
        raise TraceError(f"trace() needs an nn.Module, got {type(model).__name__}; pass the model object")
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    kwargs: dict[str, Any] = {}
    if args and isinstance(args[-1], dict):
        args, kwargs = args[:-1], dict(args[-1])
    check_call(model, args, kwargs)
    seen = {id(a) for a in args if isinstance(a, torch.Tensor)}
    for k, v in kwargs.items():  # one tensor passed twice (`labels=input_ids`): two inputs, as a batch has
        if isinstance(v, torch.Tensor):
            if id(v) in seen:
                kwargs[k] = v.clone()
            seen.add(id(kwargs[k]))
    prec = precision_of(precision) if isinstance(precision, str) else (precision or FP32)
    was_training = model.training
    model.train()
    notes: list[str] = []
    registry.register_grouped_mm(moe.register())
    try:
        with training_outputs(model, kwargs, notes):
            gm, via, inputs = lift(model, args, kwargs)
        measure, low = _passes(gm, model, inputs, prec, workers)
        nodes = _with_saved(measure, model)
        low_params = _low_param_nodes(nodes, low, prec, notes) if low is not None else ()
    finally:
        model.train(was_training)
    used = set(measure.owner_of)
    unused = sum(p.numel() for n, p in model.named_parameters() if n not in used)
    if any(moe.is_grouped_mm(n.target) for n in nodes):
        notes.append(moe.NOTE)
    if own_checkpointing(model):
        notes.append(f"{type(model).__name__} enables its own activation checkpointing (Hugging Face's "
                     "activation_checkpointing_enable()):"
                     " plans choose their own activation checkpointing (plan --recompute), which they cost; the "
                     "emitted module turns the model's off")
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    if frozen:
        total = sum(p.numel() for p in model.parameters())
        notes.append(f"{frozen:,} of {total:,} parameters are frozen (requires_grad=False): held and gathered, "
                     "without weight gradients, optimizer state, update or gradient synchronisation")
    blocks, refs = find_blocks(nodes, measure.signature, measure.module_types)
    graph = OpGraph(
        model=name or type(model).__name__,
        via=via,
        family=type(model).__name__,
        nodes=tuple(n.model_copy(update={"block": refs[n.name]}) if n.name in refs else n for n in nodes),
        low_param_nodes=tuple(n.model_copy(update={"block": refs[n.name]}) if n.name in refs else n
                              for n in low_params),
        blocks=blocks,
        unused_params=unused,
        frozen_params=tuple(n for n, p in model.named_parameters() if not p.requires_grad),
        modules=read_outside(module_facts(model), nodes),
        precision=prec.name,
        notes=tuple(notes),
        input_names=_input_names(inputs, args, kwargs),
        constant_inputs=tuple((k, v) for k, v in kwargs.items() if v is None or isinstance(v, bool | int | float | str)),
    )
    return graph, measure.calls


def read_outside(modules: tuple[ModuleFacts, ...], nodes: Sequence[OpNode]) -> tuple[ModuleFacts, ...]:
    """``modules`` with :attr:`ModuleFacts.read_outside` set from the ops that read
    their parameters."""
    readers: dict[str, set[str]] = {}
    for n in nodes:
        for q in n.params:
            readers.setdefault(q, set()).add(n.module)
    out = []
    for m in modules:
        outside = any(not (r == m.path or r.startswith(m.path + ".")) for q in m.params for r in readers.get(q, ()))
        out.append(m.model_copy(update={"read_outside": True}) if outside else m)
    return tuple(out)


def _with_saved(measure: Measure, model: nn.Module) -> tuple[OpNode, ...]:
    """The measured nodes, each with the bytes autograd saves that it created."""
    saved = measure.saved.saved_bytes()
    saved.update(fused_rnn_saves(model, measure.nodes))
    saves = measure.saved.saved_inputs()
    order = {n.name: i for i, n in enumerate(measure.nodes)}
    return tuple(n.model_copy(update={"saved_bytes": 0 if n.kind == "input" else saved.get(n.name, 0),
                                      "saves": tuple(sorted(saves.get(n.name, ()), key=order.__getitem__))})
                 for n in measure.nodes)


AUTOCAST_FSDP = "FSDP plans are costed with autocast's dtypes"
"""How a note ends when the graph has no :attr:`OpGraph.low_param_nodes` under mixed
precision."""


def _run_graph(gm: fx.GraphModule, model: nn.Module, inputs: list, autocast: str | None, state_cast: str | None,
               input_cast: str | None, cast_buffers: bool = True) -> Measure:
    """The graph run on fake tensors under ``autocast``, the parameters (and buffers,
    with ``cast_buffers``) cast to ``state_cast``, the inputs to ``input_cast``."""
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    measure = Measure(gm, model, fake_mode, cast=state_cast, cast_buffers=cast_buffers)
    with fake_mode:
        fake_inputs = [fake_like(x, input_cast) for x in inputs]
    measure.run_all(fake_inputs, autocast=autocast)
    return measure


def _model_pass(gm: fx.GraphModule, model: nn.Module, inputs: list, prec: Precision) -> Measure:
    """The graph as the model trains in ``prec``: the model and its inputs cast as the
    precision casts them, every op under its autocast."""
    return _run_graph(gm, model, inputs, prec.autocast, prec.cast, prec.cast)


def _low_pass(gm: fx.GraphModule, model: nn.Module, inputs: list, prec: Precision) -> tuple[OpNode, ...] | str:
    """The nodes as FSDP2 under mixed precision computes them: the graph run again under
    autocast with the parameters in autocast's dtype (``MixedPrecisionPolicy(param_dtype=...)``
    gathers them so; buffers and inputs as they are, ``cast_forward_inputs=False``), each
    with what autograd saves. Why it could not run, a string, where it fails: the model
    as traced stands, this pass only refines FSDP's costs."""
    try:
        with warnings.catch_warnings():  # the model's own warnings were said in the first pass
            warnings.simplefilter("ignore")
            measure = _run_graph(gm, model, inputs, prec.autocast, prec.autocast, None, cast_buffers=False)
            return _with_saved(measure, model)
    except Exception as e:
        return short_reason(e)


def _passes(gm: fx.GraphModule, model: nn.Module, inputs: list, prec: Precision,
            workers: int | None) -> tuple[Measure, tuple[OpNode, ...] | str | None]:
    """:func:`_model_pass` and, under mixed precision, :func:`_low_pass` (else None). The
    two are independent: with ``workers`` (default: this machine's CPUs) of 2 or more the
    second runs in a forked process (:class:`flexsearch.workers.Helper`) beside the
    first, with the same result (the nodes are pickled back). Not where CUDA is
    initialised (a forked child cannot use it) or the model or its inputs live on a GPU."""
    if prec.autocast is None:
        return _model_pass(gm, model, inputs, prec), None

    def run(low: bool):
        return _low_pass(gm, model, inputs, prec) if low else _model_pass(gm, model, inputs, prec)

    on_cpu = not torch.cuda.is_initialized() and all(
        t.device.type in ("cpu", "meta") for t in (*model.parameters(), *model.buffers(), *inputs)
        if isinstance(t, torch.Tensor))
    helper = Helper(run, enabled=on_cpu and worker_count(workers) > 1)
    try:
        measure, low = helper.map([(False,), (True,)])
    except BrokenProcessPool:  # the second process died (killed, out of memory): both here
        measure, low = run(False), run(True)
    finally:
        helper.close()
    return measure, low


def _low_param_nodes(nodes: tuple[OpNode, ...], low: tuple[OpNode, ...] | str, prec: Precision,
                     notes: list[str]) -> tuple[OpNode, ...]:
    """The nodes as FSDP2 under mixed precision computes them
    (:attr:`OpGraph.low_param_nodes`), from :func:`_low_pass`'s: each keeps the model's
    node but for what the dtypes change: its outputs, the bytes it moves and what
    autograd saves (its parameters stay the model's: FSDP2 stores them, and their
    gradients and the optimizer's state, in fp32). Empty, with a note, when the model does
    not run so."""
    if isinstance(low, str):
        notes.append(f"not traced with {prec.autocast} parameters (FSDP2 under {prec.name}): {low}; "
                     + AUTOCAST_FSDP)
        return ()
    if [n.name for n in low] != [n.name for n in nodes]:
        notes.append(f"with {prec.autocast} parameters (FSDP2 under {prec.name}) the model traced to other ops; "
                     + AUTOCAST_FSDP)
        return ()
    return tuple(n.model_copy(update={"outputs": v.outputs, "bytes_read": _reads(n, v),
                                      "bytes_written": v.bytes_written, "saved_bytes": v.saved_bytes,
                                      "saves": v.saves})
                 for n, v in zip(nodes, low, strict=True))


def _reads(n: OpNode, v: OpNode) -> int:
    """The low-precision node ``v``'s bytes read, its parameters counted at the model's
    node ``n``'s size (the cost model tells a node's parameter reads, which a split of
    the batch does not divide, from its activations' by ``OpNode.param_bytes``, which
    stays the stored fp32 size): FSDP2's bf16 weight reads priced at fp32, the
    activations' at what they are. A lookup (an embedding reads the rows it gathers,
    fewer than its parameters) as measured."""
    if v.bytes_read < v.used_param_bytes:
        return v.bytes_read
    return v.bytes_read + n.used_param_bytes - v.used_param_bytes


def _input_names(values: list, args: tuple, kwargs: dict) -> tuple[str, ...]:
    """Per tensor input of the lifted graph (the input nodes, in order), the keyword it
    came by, ``""`` for a positional one. Positional inputs come first; one tensor may
    be passed twice (``labels=input_ids``)."""
    positional = [a for a in args if isinstance(a, torch.Tensor)]
    keys: dict[int, list[str]] = {}
    for k, v in kwargs.items():
        if isinstance(v, torch.Tensor):
            keys.setdefault(id(v), []).append(k)
    names, j = [], 0
    for v in values:
        if not isinstance(v, torch.Tensor):
            continue
        if j < len(positional) and v is positional[j]:
            names.append("")
            j += 1
        else:
            names.append(keys[id(v)].pop(0) if keys.get(id(v)) else "")
    return tuple(names)
