"""The tracer: ``trace(model, example_inputs) -> OpGraph``.

1. Lift (:mod:`flexsearch.graph.lift`): ``torch.fx`` symbolic tracing, standard
   ``torch.nn`` layers kept as single nodes; if that fails, ``torch.export``; if both
   fail, a one-line :class:`TraceError` naming the offending source line.
2. Measure (:class:`_Measure`, an ``fx.Interpreter``): every node runs on fake tensors
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
   computes it (``OpGraph.low_param_nodes``).
3. Label: the op registry gives each node its kind and SOAP dims; the batch dim is
   followed from the inputs (dim 0 of every example input).
4. Find repeated blocks (:mod:`flexsearch.graph.blocks`).
"""

from __future__ import annotations

import contextlib
import hashlib
import re
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import FlopCounterMode

from flexsearch.errors import TraceError
from flexsearch.graph import moe, registry
from flexsearch.graph.blocks import find_blocks
from flexsearch.graph.calls import ArgTensor, OpCall
from flexsearch.graph.lift import (
    OWN_DIR,
    TORCH_DIR,
    StateRef,
    canonical_names,
    clean_path,
    lift,
    short_reason,
    training_outputs,
)
from flexsearch.graph.modules import module_facts
from flexsearch.graph.opgraph import OpGraph, OpNode, ParallelDims, TensorMeta
from flexsearch.graph.saved import SavedTensors, fused_rnn_saves
from flexsearch.precision import FP32, Precision
from flexsearch.precision import precision as precision_of

_VIEW_TARGETS = {"getitem", "size", "dim"}


def trace(model: nn.Module, example_inputs: tuple | Any, *, name: str | None = None,
          precision: Precision | str | None = None) -> OpGraph:
    """Lift ``model`` called on ``example_inputs`` into an :class:`OpGraph`.

    ``example_inputs`` is a tuple of positional arguments (a single tensor is accepted);
    a trailing ``dict`` is taken as keyword arguments. Dim 0 of every input tensor is
    the batch. Real, meta or fake tensors all work; nothing is computed for real.
    ``precision`` (:mod:`flexsearch.precision`, default ``fp32``: the model as
    it is): every op runs under ``torch.autocast`` for mixed precision, or on the model
    cast to ``bf16``, so the graph's dtypes, FLOPs and bytes are that precision's.
    """
    return trace_calls(model, example_inputs, name=name, precision=precision)[0]


def trace_calls(
    model: nn.Module, example_inputs: tuple | Any, *, name: str | None = None,
    precision: Precision | str | None = None,
) -> tuple[OpGraph, dict[str, OpCall]]:
    """:func:`trace`, plus for every op node an :class:`OpCall` to run it again (the
    profiler runs ops alone at full and partitioned shapes with these)."""
    if not isinstance(model, nn.Module):
        raise TraceError(f"trace() needs an nn.Module, got {type(model).__name__}; pass the model object")
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    kwargs: dict[str, Any] = {}
    if args and isinstance(args[-1], dict):
        args, kwargs = args[:-1], dict(args[-1])
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
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        measure = _Measure(gm, model, fake_mode, cast=prec.cast)
        with fake_mode:
            fake_inputs = [_fake_like(x, prec.cast) for x in inputs]
        measure.run_all(fake_inputs, autocast=prec.autocast)
        nodes = _with_saved(measure, model)
        low_params = _low_param_nodes(gm, model, inputs, prec, nodes, notes) if prec.autocast is not None else ()
    finally:
        model.train(was_training)
    used = set(measure.owner_of)
    unused = sum(p.numel() for n, p in model.named_parameters() if n not in used)
    if any(moe.is_grouped_mm(n.target) for n in nodes):
        notes.append(moe.NOTE)
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
        modules=module_facts(model),
        precision=prec.name,
        notes=tuple(notes),
        input_names=_input_names(inputs, args, kwargs),
    )
    return graph, measure.calls


def _with_saved(measure: _Measure, model: nn.Module) -> tuple[OpNode, ...]:
    """The measured nodes, each with the bytes autograd saves that it created."""
    saved = measure.saved.saved_bytes()
    saved.update(fused_rnn_saves(model, measure.nodes))
    return tuple(n.model_copy(update={"saved_bytes": 0 if n.kind == "input" else saved.get(n.name, 0)})
                 for n in measure.nodes)


def _low_param_nodes(gm: fx.GraphModule, model: nn.Module, inputs: list, prec: Precision,
                     nodes: tuple[OpNode, ...], notes: list[str]) -> tuple[OpNode, ...]:
    """The nodes as FSDP2 under mixed precision computes them
    (:attr:`OpGraph.low_param_nodes`): the graph measured again under autocast with the
    parameters in autocast's dtype (``MixedPrecisionPolicy(param_dtype=...)`` gathers
    them so; buffers and inputs as they are, ``cast_forward_inputs=False``). Each keeps
    the model's node but for what the dtypes change: its outputs, the bytes it moves and
    what autograd saves (its parameters stay the model's: FSDP2 stores them, and their
    gradients and the optimizer's state, in fp32). Empty, with a note, when the model does
    not run so."""
    try:
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        measure = _Measure(gm, model, fake_mode, cast=prec.autocast, cast_buffers=False)
        with fake_mode:
            fake_inputs = [_fake_like(x) for x in inputs]
        measure.run_all(fake_inputs, autocast=prec.autocast)
        low = _with_saved(measure, model)
    except Exception as e:  # the model as traced stands: the second pass only refines FSDP's costs
        notes.append(f"not traced with {prec.autocast} parameters (FSDP2 under {prec.name}): {short_reason(e)}; "
                     "FSDP plans are costed with autocast's dtypes")
        return ()
    if [n.name for n in low] != [n.name for n in nodes]:
        notes.append(f"with {prec.autocast} parameters (FSDP2 under {prec.name}) the model traced to other ops; "
                     "FSDP plans are costed with autocast's dtypes")
        return ()
    return tuple(n.model_copy(update={"outputs": v.outputs, "bytes_read": _reads(n, v),
                                      "bytes_written": v.bytes_written, "saved_bytes": v.saved_bytes})
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


# ----------------------------------------------------------------------------- measuring


def _fake_like(x: Any, cast: str | None = None) -> Any:
    """A fake CPU tensor with x's shape, stride and dtype (inside an active FakeTensorMode);
    a floating-point one in ``cast`` when given (the model cast to a low precision)."""
    if not isinstance(x, torch.Tensor):
        return x
    dtype = getattr(torch, cast) if cast is not None and x.is_floating_point() else x.dtype
    return torch.empty_strided(tuple(x.shape), tuple(x.stride()), dtype=dtype, device="cpu")


def _fused_attention(n: fx.Node) -> bool:
    """Is ``n`` scaled dot-product attention? The tracer runs it as matmuls (the math
    backend, for FLOPs), which save the ``T x T`` probabilities; the fused kernels that
    train (flash, memory-efficient; CPU flash too) save their inputs and output."""
    return "scaled_dot_product" in str(getattr(n.target, "__name__", n.target))


def _digest(signature: tuple) -> str:
    return hashlib.sha1(repr(signature).encode()).hexdigest()[:16]


def _meta(t: torch.Tensor) -> TensorMeta:
    return TensorMeta(shape=tuple(int(s) for s in t.shape), dtype=str(t.dtype).removeprefix("torch."))


def _target_name(node: fx.Node, module: nn.Module | None) -> str:
    if module is not None:
        cls = type(module)
        if cls.__module__.startswith("torch.nn.modules."):
            return f"torch.nn.{cls.__qualname__}"
        return f"{cls.__module__}.{cls.__qualname__}"
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return str(t)
    mod = getattr(t, "__module__", None) or ""
    return f"{mod}.{getattr(t, '__qualname__', getattr(t, '__name__', str(t)))}".lstrip(".")


def _source(node: fx.Node) -> str:
    st = node.meta.get("stack_trace") or ""
    found = re.findall(r'File "([^"]+)", line (\d+)', st)
    user = [f for f in found if not f[0].startswith((TORCH_DIR, OWN_DIR)) and not f[0].startswith("<")]
    if not user:
        return ""
    file, line = user[-1]
    return f"{file}:{line}"


def _module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if node.op == "call_module":
        return str(node.target)
    if not stack:
        return ""
    return clean_path(list(stack.values())[-1][0])


@contextlib.contextmanager
def _native_rnn() -> Iterator[None]:
    """Run RNNs through ATen's native kernels (matmuls and pointwise ops the FLOP
    counter sees) instead of oneDNN's fused layer, which it cannot count."""
    previous = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(previous)


class _Measure(fx.Interpreter):
    """Runs the graph on fake tensors and records one :class:`OpNode` per op."""

    def __init__(self, gm: fx.GraphModule, model: nn.Module, fake_mode: FakeTensorMode, cast: str | None = None,
                 cast_buffers: bool = True):
        super().__init__(gm, garbage_collect_values=False)
        self.fake_mode = fake_mode
        self.nodes: list[OpNode] = []
        self.signature: dict[str, tuple] = {}
        self.owner_of: dict[str, str] = {}  # canonical param name -> owning node
        self.batch_of: dict[int, int | None] = {}  # id(fake tensor) -> batch dim
        self.param_of: dict[int, str] = {}  # id(fake param) -> canonical name
        self.stands_for: dict[str, tuple[str, ...]] = {}  # fx node -> op nodes it carries
        self._backward_flops: dict[tuple, int] = {}  # op signature -> backward FLOPs
        self.module_types: dict[str, str] = {}  # module path -> class name
        self.calls: dict[str, OpCall] = {}
        self.canon = canonical_names(model)
        self.fakes: dict[str, torch.Tensor] = {}
        self.is_param: dict[str, bool] = {}
        with fake_mode:
            for n, p in model.named_parameters():
                f = _fake_like(p, cast).requires_grad_(p.requires_grad)
                self.fakes[n] = f
                self.is_param[n] = True
                self.param_of[id(f)] = n
            for n, b in model.named_buffers():
                f = _fake_like(b, cast if cast_buffers else None)
                self.fakes[n] = f
                self.is_param[n] = False
                self.param_of[id(f)] = n
        self.saved = SavedTensors(self.fakes.values(), self.param_of)

    # -- running -------------------------------------------------------------------

    def run_all(self, inputs: list, autocast: str | None = None) -> None:
        # The math attention backend runs attention as matmuls FlopCounterMode counts
        # (the CPU flash kernel has no FLOP formula registered in torch). Autocast on the
        # CPU dispatch keys gives the dtypes autocast gives on any device for these ops.
        with (
            self.fake_mode,
            sdpa_kernel([SDPBackend.MATH]),
            _native_rnn(),
            torch.autocast("cpu", dtype=getattr(torch, autocast), enabled=autocast is not None)
            if autocast is not None else contextlib.nullcontext(),
            FlopCounterMode(display=False) as counter,
        ):
            self.counter = counter
            self.run(*inputs)

    def run_node(self, n: fx.Node) -> Any:
        for path, cls in (n.meta.get("nn_module_stack") or {}).values():
            self.module_types.setdefault(clean_path(path), getattr(cls, "__qualname__", str(cls)))
        with self._rethrow(n):
            count = len(self.nodes)
            if n.op == "placeholder":
                value = self._placeholder(n)
            elif n.op == "get_attr":
                value = self._get_attr(n)
            elif n.op == "output":
                value = self._output(n)
            else:
                value = self._op(n)
        # An FX node that became an op node is a data edge; one that did not (sizes,
        # shapes, parameters) carries no activation: shapes are static in the graph.
        self.stands_for[n.name] = (n.name,) if len(self.nodes) > count else ()
        return value

    def _inputs_of(self, n: fx.Node) -> tuple[str, ...]:
        return tuple(dict.fromkeys(o for i in n.all_input_nodes for o in self.stands_for.get(i.name, ())))

    @contextlib.contextmanager
    def _rethrow(self, n: fx.Node) -> Iterator[None]:
        try:
            yield
        except TraceError:
            raise
        except Exception as exc:
            src = _source(n)
            where = f" ({src})" if src else ""
            raise TraceError(
                f"cannot run op {n.name} ({n.op} {_target_name(n, None) if n.op != 'call_module' else n.target})"
                f"{where} on fake tensors: {short_reason(exc)}; make it shape-only "
                "(no .item(), .tolist(), data-dependent shapes) or report the op"
            ) from exc

    def _placeholder(self, n: fx.Node) -> Any:
        value = super().run_node(n)
        if isinstance(value, StateRef):  # export: a parameter or buffer comes in as input
            return self.fakes[value.name]
        if isinstance(value, torch.Tensor):
            with self.fake_mode:
                fake = _fake_like(value) if not isinstance(value, torch._subclasses.FakeTensor) else value
            self.batch_of[id(fake)] = 0 if fake.dim() > 0 else None
            self._record(n, fake, kind="input", dims=registry.Ruling("input", out_batch=0))
            return fake
        return value

    def _get_attr(self, n: fx.Node) -> Any:
        name = str(n.target)
        real = self.fetch_attr(name)
        canon = self.canon.get(id(real))
        if canon is not None:
            return self.fakes[canon]
        if isinstance(real, torch.Tensor):  # a constant tensor attribute
            with self.fake_mode:
                return _fake_like(real)
        return real

    def _output(self, n: fx.Node) -> Any:
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        value = args[0]
        inputs = self._inputs_of(n)
        outs = [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
        self.saved.returned(outs)
        metas = [_meta(t) for t in outs]
        self.nodes.append(
            OpNode(
                name="output", kind="output", target="output", inputs=inputs, outputs=tuple(metas),
                flops=0, backward_flops=0, bytes_read=0, bytes_written=0,
            )  # fmt: skip
        )
        return value

    def _op(self, n: fx.Node) -> Any:
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        module = self.fetch_attr(n.target) if n.op == "call_module" else None
        key: Any = type(module) if module is not None else n.target
        if n.op == "call_method":
            key = n.target
        flat_in = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        mod_params: dict[str, torch.Tensor] = {}
        if module is not None:
            for local, real in list(module.named_parameters(remove_duplicate=False)) + list(
                module.named_buffers(remove_duplicate=False)
            ):
                mod_params[local] = self.fakes[self.canon[id(real)]]

        name = n.target if n.op == "call_method" else getattr(n.target, "__name__", "")
        if name in _VIEW_TARGETS or not flat_in and not mod_params and n.op != "call_function":
            out = super().run_node(n)  # pure data movement: no leaves, no counting
            fwd = bwd = 0
            ran_on = flat_in
        else:
            out, fwd, bwd, ran_on = self._measured_call(n, module, mod_params, args, kwargs)

        flat_out = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if not flat_out:  # sizes, shapes, Python scalars: not an op
            return out

        # Parameters used: the module's own, plus fakes passed as arguments.
        state = [self.param_of[id(t)] for t in [*mod_params.values(), *flat_in] if id(t) in self.param_of]
        used = list(dict.fromkeys(p for p in state if self.is_param[p]))
        acts = [t for t in flat_in if id(t) not in self.param_of]
        call = registry.Call(
            in_shapes=tuple(tuple(t.shape) for t in flat_in),
            in_batch=tuple(self.batch_of.get(id(t)) for t in flat_in),
            out_shape=tuple(flat_out[0].shape),
            args=tuple(a if not isinstance(a, torch.Tensor) else None for a in args),
            kwargs={k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)},
            module=module,
        )
        ruling = registry.rule_for(key, call)
        self._label_outputs(flat_out, ruling.out_batch)

        # a view moves no bytes: its outputs alias the inputs it ran on (an in-place op
        # returns its input itself, and reads and writes it; `.contiguous()` of a
        # contiguous tensor returns it and copies nothing)
        copies_self = "contiguous" not in str(n.target)
        alias = all(any(torch._C._is_alias_of(o, i) and (o is not i or not copies_self) for i in ran_on)
                    for o in flat_out)
        bytes_written = 0 if alias else sum(t.numel() * t.element_size() for t in flat_out)
        all_params = sum(self.fakes[p].numel() * self.fakes[p].element_size() for p in used)
        param_bytes_used = all_params
        if not ruling.reads_params:  # a lookup reads the rows it gathers, not the table
            param_bytes_used = min(param_bytes_used, bytes_written)
        bytes_read = 0 if alias else sum(t.numel() * t.element_size() for t in acts) + param_bytes_used
        owned = [p for p in used if p not in self.owner_of]
        for p in owned:
            self.owner_of[p] = n.name
        inputs = self._inputs_of(n)
        self.calls[n.name] = self._call_spec(n, module, mod_params, args, kwargs)
        self._record(
            n,
            out,
            kind=ruling.kind,
            dims=ruling,
            module=module,
            inputs=inputs,
            flops=fwd,
            backward_flops=bwd,
            bytes_read=bytes_read,
            bytes_written=bytes_written,
            params=tuple(used),
            owned=owned,
            used_param_bytes=all_params,
        )
        return out

    def _call_spec(self, n: fx.Node, module: nn.Module | None, mod_params: dict[str, torch.Tensor], args, kwargs) -> OpCall:
        def spec(x: Any) -> Any:
            if not isinstance(x, torch.Tensor):
                return x
            return ArgTensor(tuple(x.shape), x.dtype, self.batch_of.get(id(x)), self.param_of.get(id(x)),
                             x.requires_grad)

        state = tuple((local, tuple(t.shape), t.dtype, t.requires_grad) for local, t in mod_params.items())
        sargs, skwargs = tree_map(spec, (args, kwargs))
        return OpCall(n.op, n.target, module, state, tuple(sargs), dict(skwargs))

    def _label_outputs(self, flat_out: list[torch.Tensor], batch: int | None) -> None:
        """Batch dim of every output: the ruling's for the first; for others the same
        index if the size matches, else the first dim of that size."""
        if not flat_out:
            return
        first = flat_out[0]
        self.batch_of.setdefault(id(first), batch)
        size = first.shape[batch] if batch is not None and batch < first.dim() else None
        for t in flat_out[1:]:
            if id(t) in self.batch_of:
                continue
            b = None
            if size is not None:
                if batch < t.dim() and t.shape[batch] == size:
                    b = batch
                else:
                    b = next((d for d, s in enumerate(t.shape) if s == size), None)
            self.batch_of[id(t)] = b

    def _measured_call(self, n: fx.Node, module, mod_params, args, kwargs) -> tuple[Any, int, int, list]:
        """Run the op on fresh leaf inputs; count forward and backward FLOPs. Also the
        tensors it ran on (its outputs may alias them)."""
        leaves: list[torch.Tensor] = []

        def leafify(x: Any) -> Any:
            if not isinstance(x, torch.Tensor) or id(x) in self.param_of:
                if isinstance(x, torch.Tensor) and x.requires_grad:
                    leaves.append(x)
                return x
            if x.is_floating_point():
                # an input needs a gradient as in the model: one computed from a
                # parameter does, a model input, a buffer or a table made from them
                # (RoPE's cos and sin, a mask) does not, and autograd saves nothing
                # and computes no gradient for it
                leaf = x.detach().requires_grad_(x.requires_grad)
                if x.requires_grad:
                    leaves.append(leaf)
                copy = leaf.clone()  # in-place ops (ReLU(inplace=True), +=) need a non-leaf
                self.saved.cloned(copy, x)
                return copy
            return x

        largs, lkwargs = tree_map(leafify, (args, kwargs))
        leaves += [p for p in mod_params.values() if p.requires_grad]
        sig = self._signature(n, module, args, kwargs)
        before = self.counter.get_total_flops()
        packed: list[torch.Tensor] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            packed.append(t)
            return t

        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = self._call(n, module, mod_params, largs, lkwargs)
        except RuntimeError as e:  # an op autograd cannot differentiate (an integer result): no backward
            if "autograd" not in str(e).lower():
                raise
            leaves.clear()
            packed.clear()
            largs, lkwargs = tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, (args, kwargs))
            out = self._call(n, module, mod_params, largs, lkwargs)
        if _fused_attention(n) and isinstance(out, torch.Tensor) and out.dim() == 4:
            # as a fused kernel lays its output out ((B, T, H, D) memory, so the usual
            # transpose(1, 2) that follows is a view) and saves: q, k, v and the output
            out = out.transpose(1, 2).contiguous().transpose(1, 2)
            # an input of another dtype than the output (autocast's: RoPE's fp32 queries
            # beside bf16 values) reaches the kernel cast, and the cast copy is what it saves
            packed = [t if t.dtype == out.dtype else t.to(out.dtype) for t in largs[:3] if isinstance(t, torch.Tensor)]
            packed += [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            if not out.requires_grad:  # no input needs a gradient: the kernel saves nothing
                packed = []
        self.saved.packed(n.name, packed, [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)])
        fwd = self.counter.get_total_flops() - before
        bwd = self._backward_flops.get(sig, 0)
        if sig not in self._backward_flops:
            grads_of = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.grad_fn is not None]
            if grads_of and leaves:
                before = self.counter.get_total_flops()
                torch.autograd.grad(
                    grads_of,
                    leaves,
                    grad_outputs=[torch.ones_like(t) for t in grads_of],
                    allow_unused=True,
                )
                bwd = self.counter.get_total_flops() - before
            self._backward_flops[sig] = bwd
        self.signature[n.name] = sig
        return out, fwd, bwd, [t for t in tree_flatten((largs, lkwargs))[0] if isinstance(t, torch.Tensor)]

    @staticmethod
    def _call(n: fx.Node, module, mod_params, args, kwargs) -> Any:
        if module is not None:
            return torch.func.functional_call(module, mod_params, tuple(args), kwargs, strict=False)
        if n.op == "call_method":
            self_obj, *rest = args
            return getattr(self_obj, n.target)(*rest, **kwargs)
        return n.target(*args, **kwargs)

    def _signature(self, n: fx.Node, module, args, kwargs) -> tuple:
        """Identity of an op call up to names: target, configuration, shapes, constants,
        and which floating inputs need no gradient (a model input, a table made from
        buffers: the op's backward computes less, and the profiler measures it apart;
        marked only then, so that every other op's identity is as before)."""

        def norm(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                param = id(x) in self.param_of
                if x.is_floating_point() and not param and not x.requires_grad:
                    return ("T", tuple(x.shape), str(x.dtype), param, "no grad")
                return ("T", tuple(x.shape), str(x.dtype), param)
            if isinstance(x, (int, float, bool, str, type(None), torch.dtype, torch.device)):
                return x
            return type(x).__name__

        config = ""
        if module is not None:
            config = (type(module).__qualname__, module.extra_repr(), module.training)
            shapes = tuple((k, tuple(v.shape), str(v.dtype)) for k, v in module.state_dict(keep_vars=True).items())
            config = (config, shapes)
        target = n.target if isinstance(n.target, str) else getattr(n.target, "__qualname__", repr(n.target))
        return (n.op, target if module is None else "", config, tree_map(norm, (args, kwargs)))

    def _record(self, n: fx.Node, out: Any, *, kind: str, dims: registry.Ruling, module=None,
                inputs=(), flops=0, backward_flops=0, bytes_read=0, bytes_written=0,
                params=(), owned=(), used_param_bytes=0) -> None:  # fmt: skip
        flat_out = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        shapes = tuple(tuple(t.shape) for t in flat_out)
        self.saved.created(n.name, flat_out)  # an input node owns the batch; trace() counts it for none
        if n.op == "placeholder":
            self.signature[n.name] = ("input", shapes)
        else:  # measured ops have theirs; data movement is identified by target and shapes
            self.signature.setdefault(n.name, (n.op, str(n.target), shapes))
        self.nodes.append(
            OpNode(
                name=n.name,
                kind=kind,
                target=_target_name(n, module) if n.op != "placeholder" else "input",
                inputs=tuple(inputs),
                outputs=tuple(_meta(t) for t in flat_out),
                flops=int(flops),
                backward_flops=int(backward_flops),
                bytes_read=int(bytes_read),
                bytes_written=int(bytes_written),
                params=tuple(params),
                num_params=sum(self.fakes[p].numel() for p in owned),
                param_bytes=sum(self.fakes[p].numel() * self.fakes[p].element_size() for p in owned),
                used_param_bytes=int(used_param_bytes),
                dims=dims.dims if isinstance(dims.dims, ParallelDims) else ParallelDims(),
                opaque=dims.opaque,
                module=_module_path(n),
                source=_source(n),
                signature=_digest(self.signature[n.name]),
            )
        )
