"""The tracer's measurement (:func:`flexsearch.graph.tracer.trace`, step 2): :class:`Measure`,
an ``fx.Interpreter`` that runs the lifted graph on fake tensors (``FakeTensorMode``;
parameters and buffers swapped for fakes) and records one :class:`OpNode` per op: its
forward FLOPs (``FlopCounterMode``), the FLOPs of its backward (``torch.autograd.grad`` of
its outputs on fresh leaf inputs), the bytes it reads and writes (none for a view), its
kind and SOAP dims (the op registry), and what autograd saves for the backward
(:mod:`flexsearch.graph.saved`).

**Repeated calls** (:mod:`flexsearch.graph.replay`): a call identical to an earlier one
up to names is replayed, not run again; the graph is the one running every call gives
(``tests/test_tracer.py`` compares them)."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import re
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    UnsupportedOperatorException,
)
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import FlopCounterMode

from flexsearch.errors import TraceError
from flexsearch.graph import registry
from flexsearch.graph.calls import ArgTensor, OpCall
from flexsearch.graph.lift import (
    OWN_DIR,
    SHAPE_ADVICE,
    TORCH_DIR,
    Constant,
    StateRef,
    canonical_names,
    clean_path,
    short_reason,
)
from flexsearch.graph.modules import parametrized
from flexsearch.graph.opgraph import OpNode, ParallelDims, TensorMeta
from flexsearch.graph.replay import Replay, meta_of, recorded, replay_key
from flexsearch.graph.saved import SavedTensors

_VIEW_TARGETS = {"getitem", "size", "dim"}


def fake_like(x: Any, cast: str | None = None) -> Any:
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


REPLAY = True
"""Whether :class:`Measure` replays repeated calls by default (module docstring; the
tests trace with it off to compare)."""


_NOT_SHAPE_ONLY = (DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException,
                   GuardOnDataDependentSymNode, NotImplementedError)
"""Why an op cannot run on fake tensors that the model's code must change for (a value
read off a tensor, an output shape that depends on data, an op without a fake kernel);
any other failure is the op's own check of its inputs (shapes that do not fit)."""


class Measure(fx.Interpreter):
    """Runs the graph on fake tensors and records one :class:`OpNode` per op."""

    def __init__(self, gm: fx.GraphModule, model: nn.Module, fake_mode: FakeTensorMode, cast: str | None = None,
                 cast_buffers: bool = True, replay: bool | None = None):
        super().__init__(gm, garbage_collect_values=False)
        self.extra_traceback = False  # fx would append the node and its source to our one-line errors
        self.replay = REPLAY if replay is None else replay
        self._replays: dict[tuple, Replay | None] = {}
        self.replayed = 0  # calls not run again
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
                f = fake_like(p, cast).requires_grad_(p.requires_grad)
                self.fakes[n] = f
                self.is_param[n] = True
                self.param_of[id(f)] = n
            for n, b in model.named_buffers():
                f = fake_like(b, cast if cast_buffers else None)
                self.fakes[n] = f
                self.is_param[n] = False
                self.param_of[id(f)] = n
        self.saved = SavedTensors(self.fakes.values(), self.param_of)

    # -- running -------------------------------------------------------------------

    def run_all(self, inputs: list, autocast: str | None = None) -> None:
        # The math attention backend runs attention as matmuls FlopCounterMode counts
        # (the CPU flash kernel has no FLOP formula registered in torch). Autocast on the
        # CPU dispatch keys gives the dtypes autocast gives on any device for these ops.
        # The FLOP counter is entered around each measured call only (what else runs,
        # data movement and replayed outputs, has no FLOPs and runs faster outside it).
        self.counter = FlopCounterMode(display=False)
        self.autocast = autocast
        with (
            self.fake_mode,
            sdpa_kernel([SDPBackend.MATH]),
            _native_rnn(),
            torch.autocast("cpu", dtype=getattr(torch, autocast), enabled=autocast is not None)
            if autocast is not None else contextlib.nullcontext(),
        ):
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
            if isinstance(exc, DynamicOutputShapeException):  # nonzero, torch.where(cond), boolean indexing
                fix = SHAPE_ADVICE
            elif isinstance(exc, _NOT_SHAPE_ONLY):
                fix = "make it shape-only (no .item(), .tolist(), data-dependent shapes) or report the op"
            elif getattr(self, "autocast", None) and "dtype" in str(exc):  # autocast's dtype meets the model's
                fix = (f"traced under autocast to {self.autocast} (the plan's mixed precision): an op mixes it with a "
                       "tensor the model made in fp32; make that tensor in its input's dtype (e.g. "
                       "torch.zeros(..., dtype=x.dtype)) or plan with --precision fp32")
            else:
                fix = "check that the model file's example inputs have the shapes and dtypes the model takes"
            raise TraceError(
                f"cannot run op {n.name} ({n.op} {_target_name(n, None) if n.op != 'call_module' else n.target})"
                f"{where} on fake tensors: {short_reason(exc)}; {fix}"
            ) from exc

    def run(self, *args, **kwargs) -> Any:
        """The graph on fake tensors, torch's fake-tensor logger quiet (a failing op is
        one line of :class:`TraceError`, not the kernel's traceback logged first)."""
        logger = logging.getLogger("torch._subclasses.fake_tensor")
        level = logger.level
        logger.setLevel(logging.CRITICAL)
        try:
            return super().run(*args, **kwargs)
        finally:
            logger.setLevel(level)

    def _placeholder(self, n: fx.Node) -> Any:
        value = super().run_node(n)
        if isinstance(value, StateRef):  # export: a parameter or buffer comes in as input
            return self.fakes[value.name]
        if isinstance(value, Constant):  # export: a constant made in forward, no model input
            with self.fake_mode:
                return fake_like(value.value)
        if isinstance(value, torch.Tensor):
            with self.fake_mode:
                fake = fake_like(value) if not isinstance(value, torch._subclasses.FakeTensor) else value
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
                return fake_like(real)
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
        tensors it ran on (its outputs may alias them). A call identical to an earlier
        one is replayed (module docstring)."""
        sig = self._signature(n, module, args, kwargs)
        flat_in = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        key = replay_key(self.saved, sig, module, mod_params, args, kwargs, flat_in) if self.replay else None
        replay = self._replays.get(key) if key is not None else None
        if replay is not None:
            out, bases, ran_on = replay.outputs(flat_in, self.saved)
            flat_out = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            self.saved.packed(n.name, replay.stand_ins(flat_in, bases), flat_out)
            self.signature[n.name] = sig
            self.replayed += 1
            return out, replay.fwd, self._backward_flops[sig], ran_on
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

        before = [meta_of(t) for t in flat_in]
        largs, lkwargs = tree_map(leafify, (args, kwargs))
        leaves += [p for p in mod_params.values() if p.requires_grad]
        if module is not None and parametrized(module):
            # a parametrization (weight_norm) is a submodule called on the parameters: the FLOP
            # counter's module tracker hooks its inputs, and a hooked leaf fails autograd.grad;
            # the parameters as views (the same storage: saved tensors still count as theirs)
            mod_params = {k: v.view_as(v) if v.requires_grad else v for k, v in mod_params.items()}
        packed: list[torch.Tensor] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            packed.append(t)
            return t

        with self.counter:  # its counts start at 0
            try:
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    out = self._call(n, module, mod_params, largs, lkwargs)
            except RuntimeError as e:  # an op autograd cannot differentiate (an integer result): no backward
                if "autograd" not in str(e).lower():
                    raise
                leaves.clear()
                packed.clear()
                key = None  # run so every time: its inputs are not the copies a replay makes
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
            fwd = self.counter.get_total_flops()
            bwd = self._backward_flops.get(sig, 0)
            if sig not in self._backward_flops:
                grads_of = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.grad_fn is not None]
                if grads_of and leaves:
                    torch.autograd.grad(
                        grads_of,
                        leaves,
                        grad_outputs=[torch.ones_like(t) for t in grads_of],
                        allow_unused=True,
                    )
                    bwd = self.counter.get_total_flops() - fwd
                self._backward_flops[sig] = bwd
        self.signature[n.name] = sig
        ran_on = [t for t in tree_flatten((largs, lkwargs))[0] if isinstance(t, torch.Tensor)]
        if key is not None and key not in self._replays:  # None: not replayable, run every time
            self._replays[key] = recorded(self.saved, fwd, out, packed, flat_in, ran_on, before)
        return out, fwd, bwd, ran_on

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
        buffers) and which parameters are frozen (``requires_grad=False``): the op's
        backward computes less, and the profiler measures it apart; marked only then, so
        that every other op's identity is as before (a frozen layer and its trainable
        twin shared one backward count: the first measured)."""

        def norm(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                param = id(x) in self.param_of
                if x.is_floating_point() and not param and not x.requires_grad:
                    return ("T", tuple(x.shape), str(x.dtype), param, "no grad")
                if param and self.is_param[self.param_of[id(x)]] and not x.requires_grad:
                    return ("T", tuple(x.shape), str(x.dtype), param, "frozen")
                return ("T", tuple(x.shape), str(x.dtype), param)
            if isinstance(x, (int, float, bool, str, type(None), torch.dtype, torch.device)):
                return x
            return type(x).__name__

        config = ""
        if module is not None:
            config = (type(module).__qualname__, module.extra_repr(), module.training)
            frozen = {k for k, v in module.named_parameters() if not v.requires_grad}
            shapes = tuple((k, tuple(v.shape), str(v.dtype), *(("frozen",) if k in frozen else ()))
                           for k, v in module.state_dict(keep_vars=True).items())
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
                frozen_param_bytes=sum(self.fakes[p].numel() * self.fakes[p].element_size() for p in owned
                                       if not self.fakes[p].requires_grad),
                used_param_bytes=int(used_param_bytes),
                dims=dims.dims if isinstance(dims.dims, ParallelDims) else ParallelDims(),
                opaque=dims.opaque,
                module=_module_path(n),
                source=_source(n),
                signature=_digest(self.signature[n.name]),
            )
        )
