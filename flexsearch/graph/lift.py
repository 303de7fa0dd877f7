"""Lifting a model into an FX graph: ``torch.fx`` first, ``torch.export`` when fx cannot.

``torch.fx`` symbolic tracing keeps every standard ``torch.nn`` layer as one node
(:class:`LayerTracer`, the node names the emitter re-lifts with: :func:`fx_graph_module`);
when it fails (Python control flow, Hugging Face-style code), ``torch.export`` (non-strict,
an ATen-level graph) is tried; when both fail, a one-line :class:`TraceError` names the
offending source line of the user's code.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.fx as fx
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._pytree import tree_flatten

from flexsearch.errors import TraceError
from flexsearch.graph.opgraph import in_place_op

TORCH_DIR = str(Path(torch.__file__).parent)
OWN_DIR = str(Path(__file__).parent.parent)


class LayerTracer(fx.Tracer):
    """Symbolic tracer keeping every ``torch.nn`` layer whole and recording source lines."""

    def __init__(self) -> None:
        super().__init__()
        self.record_stack_traces = True


_APPLIERS: dict[type, object] = {}


def function_call(cls: type[torch.autograd.Function]):
    """The one callable per custom ``torch.autograd.Function`` that a graph calls it by:
    ``cls.apply``, named after ``cls`` (not its module: a model file's module is named
    per process, and the graph's fingerprint holds the name)."""
    if cls not in _APPLIERS:
        def apply(*args, **kwargs):
            return cls.apply(*args, **kwargs)

        apply.__name__ = f"{cls.__name__}_apply"
        apply.__qualname__ = f"{cls.__qualname__.replace('.', '_')}_apply"
        apply.__module__ = "autograd_function"
        apply.function = cls  # type: ignore[attr-defined]
        _APPLIERS[cls] = apply
    return _APPLIERS[cls]


@contextlib.contextmanager
def functions_whole(tracer: fx.Tracer) -> Iterator[None]:
    """While ``tracer`` traces: a custom ``autograd.Function`` applied to traced values is
    one call in the graph (:func:`function_call`), as layers are, not the ops of its
    ``forward``, which would lose its ``backward`` (a straight-through estimator's
    gradient became zero)."""
    base = torch.autograd.Function.__dict__["apply"]

    def apply(cls, *args, **kwargs):  # torch's own (reentrant checkpointing's, with a function argument) run through
        if not cls.__module__.startswith("torch.") and \
                any(isinstance(a, fx.Proxy) for a in tree_flatten((args, kwargs))[0]):
            return tracer.create_proxy("call_function", function_call(cls), args, kwargs)
        return base.__func__(cls, *args, **kwargs)

    torch.autograd.Function.apply = classmethod(apply)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.autograd.Function.apply = base  # type: ignore[method-assign]


def fx_graph_module(model: nn.Module) -> fx.GraphModule:
    """``model`` symbolically traced with every ``torch.nn`` layer and every custom
    ``autograd.Function`` call kept whole (the node names of the op graph; the emitter
    re-lifts models with it)."""
    tracer = LayerTracer()
    with functions_whole(tracer):
        graph = tracer.trace(model)
    return fx.GraphModule(tracer.root, graph, type(model).__name__)


def lift(model: nn.Module, args: tuple, kwargs: dict) -> tuple[fx.GraphModule, str, list]:
    """The graph module, how it was made, and the flat list of its placeholder values."""
    try:
        with state_kept(model):
            gm = fx_graph_module(model)
        _state_written(gm)
        _unused_defaults(gm, args, kwargs)
        return gm, "fx", flat_inputs(gm, args, kwargs)
    except Exception as fx_error:
        try:
            # the attention backend the tracer measures with (its outputs' strides are
            # the math kernel's: a `.contiguous()` after it is a real copy, kept)
            with quiet_torch_logs(), sdpa_kernel([SDPBackend.MATH]):
                ep = torch.export.export(model, args, kwargs or None, strict=False)
        except Exception as export_error:
            every = unsupported(model, args, kwargs)
            if every:
                raise TraceError(f"cannot trace the model: {len(every)} unsupported construct"
                                 f"{'s' if len(every) > 1 else ''}: {'; '.join(every)}; {advice(every)}"
                                 ) from export_error
            raise TraceError(failure_line(fx_error, export_error)) from export_error
        gm = ep.graph_module
        _drop_checks(gm)
        _devices_to_cpu(gm)
        return gm, "export", export_inputs(ep, model, args, kwargs)


@contextlib.contextmanager
def state_kept(model: nn.Module) -> Iterator[None]:
    """TraceError when symbolic tracing wrote a parameter or buffer for real (an
    in-place update with constant arguments, ``self.ema.mul_(0.9)``, runs on the real
    tensor while tracing and is not in the graph), its values put back first."""
    state = {n: t for n, t in [*model.named_parameters(), *model.named_buffers()]}
    versions = {n: t._version for n, t in state.items()}
    saved = {n: t.detach().clone() for n, t in model.named_buffers() if t.device.type != "meta"}
    changed: list[str] = []
    try:
        yield
    finally:  # put back what tracing wrote, whether it went on or failed
        changed = [n for n, t in state.items() if t._version != versions[n]]
        with torch.no_grad():
            for n in changed:
                if n in saved:
                    state[n].copy_(saved[n])
    if changed:
        raise TraceError(f"the model updates {changed[0]!r} in place in forward, which symbolic tracing runs "
                         "once instead of recording it")


def _state_written(gm: fx.GraphModule) -> None:
    """TraceError when ``gm`` writes a parameter or buffer in place (an EMA of a
    buffer updated under ``torch.no_grad()``: the traced graph has the update but not
    the ``no_grad``, so the buffer joins the autograd graph)."""
    for n in gm.graph.nodes:
        name = n.target if n.op == "call_method" else getattr(n.target, "__name__", "")
        if n.op in ("call_method", "call_function") and isinstance(name, str) and in_place_op(name) and \
                n.args and isinstance(n.args[0], fx.Node) and n.args[0].op == "get_attr":
            raise TraceError(f"the model updates {n.args[0].target!r} in place in forward ({name}), which a traced "
                             "graph does not run as the model does")


def _unused_defaults(gm: fx.GraphModule, args: tuple, kwargs: dict) -> None:
    """TraceError when ``gm`` reads a ``forward`` argument the call leaves at its default
    ``None`` (``forward(x, mask=None)`` called without ``mask``): symbolic tracing binds
    a proxy to it, so ``if mask is not None`` took the branch this call does not run.
    ``torch.export``, which traces the call as made, is tried instead."""
    for ph in [n for n in gm.graph.nodes if n.op == "placeholder"][len(args):]:
        if ph.target not in kwargs and ph.args and ph.args[0] is None and ph.users:
            raise TraceError(f"forward() argument {ph.target!r} is not given (None), and symbolic tracing "
                             "ran the code that uses it")


DEVICE_NAME = re.compile(r"(meta|cuda|mps|xpu|hpu)(:\d+)?")
"""A device written as a string in an op's arguments (other strings are left alone)."""
CHECKS = ("aten._assert_tensor_metadata", "aten._assert_scalar", "aten.sym_constrain_range_for_size")
"""Ops ``torch.export`` inserts to check what it assumed (an input's dtype before a
``.to()``): they compute nothing, and fail under autocast (a bf16 matmul output where
the fp32 trace saw fp32)."""


def export_module(model: nn.Module, args: tuple, kwargs: dict) -> fx.GraphModule:
    """``model`` exported on ``args``/``kwargs`` as the tracer exports it (``use_cache``
    off, the math attention kernel) and unlifted into a runnable graph module: its
    parameters and buffers are ``model``'s own (``get_attr`` nodes, original names), its
    placeholders the flat user inputs, its ops named as in the op graph. The checks
    export inserts (:data:`CHECKS`) are removed. The shapes are those of the inputs:
    export them at the size the module will run at (a pipeline's microbatch)."""
    try:
        with training_outputs(model, kwargs, []), quiet_torch_logs(), sdpa_kernel([SDPBackend.MATH]):
            gm = torch.export.export(model, args, kwargs or None, strict=False).module()
    except Exception as e:  # noqa: BLE001 - it traced at the plan's shapes; this is the user's shape
        shapes = [tuple(x.shape) for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
        raise TraceError(f"cannot export the model at input shapes {shapes}: {short_reason(e)}") from e
    _drop_checks(gm)
    return gm


def _drop_checks(gm: fx.GraphModule) -> None:
    """Remove the :data:`CHECKS` export inserted, the input guard an unlifted module calls
    (``_guards_fn``), and fetches of tensors nothing uses (an unlifted module fetches a
    tied weight under each of its names): they compute nothing a training step needs."""
    for n in reversed(list(gm.graph.nodes)):
        check = n.op == "call_function" and any(str(n.target).startswith(c) for c in CHECKS)
        guard = n.op == "call_module" and n.target == "_guards_fn"
        if not n.users and (check or guard or n.op == "get_attr"):
            gm.graph.erase_node(n)
    gm.recompile()


def flat_inputs(gm: fx.GraphModule, args: tuple, kwargs: dict) -> list:
    """The values of ``gm``'s placeholders for a call ``model(*args, **kwargs)``: an
    exported module's flat inputs in its signature's order (keyword inputs by name);
    a symbolically traced one's positional parameters, keyword ones by name, defaults
    for the rest."""
    spec = getattr(gm, "_in_spec", None)
    if spec is not None:
        order = spec.child(1).context if spec.num_children > 1 else []
        missing = [k for k in order if k not in kwargs]
        if missing or set(kwargs) - set(order):
            raise TraceError(f"the model was exported with keyword inputs {list(order)}, called with {list(kwargs)}")
        return tree_flatten((tuple(args), {k: kwargs[k] for k in order}))[0]
    values = list(args)
    for ph in [n for n in gm.graph.nodes if n.op == "placeholder"][len(args):]:
        if ph.target in kwargs:
            values.append(kwargs[ph.target])
        elif ph.args:
            values.append(ph.args[0])  # the default value
        else:
            raise TypeError(f"forward() argument {ph.target!r} has no example input")
    return values


def own_checkpointing(model: nn.Module) -> bool:
    """Does ``model``, or a model inside it, checkpoint its own activations (Hugging
    Face's ``activation_checkpointing_enable()``, formerly
    ``gradient_checkpointing_enable()``)? Read without the deprecated property's warning
    where the new one exists."""
    return any(_checkpointing(m) for m in model.modules())


def _checkpointing(m: nn.Module) -> bool:
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(m), name):
            return bool(getattr(m, name))
    return False


def own_checkpointing_off(model: nn.Module) -> None:
    """Turn the own activation checkpointing of ``model`` and of every model inside it
    off (:func:`own_checkpointing`)."""
    for m in model.modules():
        if not _checkpointing(m):
            continue
        for name in ("activation_checkpointing_disable", "gradient_checkpointing_disable"):
            if hasattr(m, name):
                getattr(m, name)()
                break


@contextlib.contextmanager
def training_outputs(model: nn.Module, kwargs: dict, notes: list[str]) -> Iterator[None]:
    """Trace what a training step computes: a model configured to return its key/value
    cache (Hugging Face ``config.use_cache``; the cache is an inference-time object no
    tracer can return and training does not use) runs with ``use_cache`` off, unless
    the inputs set it, and ``notes`` says so."""
    configs = {id(c): c for m in model.modules() if getattr(c := getattr(m, "config", None), "use_cache", False)
               is True}
    if "use_cache" in kwargs or not configs:
        yield
        return
    for c in configs.values():  # an encoder-decoder's decoder has a config of its own
        c.use_cache = False
    notes.append(f"traced with {type(model).__name__}.config.use_cache = False: a training step "
                 "keeps no key/value cache")
    try:
        yield
    finally:
        for c in configs.values():
            c.use_cache = True


def _devices_to_cpu(gm: fx.GraphModule) -> None:
    """A model exports with its device baked into the tensors its ops create (``arange``,
    ``ones``; also inside higher-order ops' sub-graphs): ``meta`` for a model built
    there, ``cuda:0`` for one on a GPU (``flexsearch profile`` there). The tracer
    measures on fake CPU tensors, so every device becomes ``cpu``."""
    cpu_device = torch.device("cpu")
    for m in gm.modules():
        if not isinstance(m, fx.GraphModule):
            continue
        changed = False

        def cpu(v):
            nonlocal changed
            if isinstance(v, str) and DEVICE_NAME.fullmatch(v):
                v = torch.device(v)
            if isinstance(v, torch.device) and v.type != "cpu":
                changed = True
                return cpu_device
            if isinstance(v, (tuple, list)):
                return type(v)(cpu(x) for x in v)
            return v

        for n in m.graph.nodes:
            if n.op in ("call_function", "call_method"):
                n.args = cpu(n.args)
                n.kwargs = {k: cpu(v) for k, v in n.kwargs.items()}
        if changed:
            m.recompile()


def canonical_names(model: nn.Module) -> dict[int, str]:
    """id(parameter or buffer) -> its first qualified name (tied weights share one)."""
    canon: dict[int, str] = {}
    for n, t in list(model.named_parameters()) + list(model.named_buffers()):
        canon.setdefault(id(t), n)
    return canon


def clean_path(path: str) -> str:
    """A module path without the ``L['self'].`` prefix some torch.export versions add."""
    return re.sub(r"^L\['self'\]\.?", "", str(path))


@contextlib.contextmanager
def quiet_torch_logs() -> Iterator[None]:
    """torch.export logs warnings and prints partial graphs to stderr on failure; the
    user gets our one line instead."""
    previous = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        logging.disable(previous)


@dataclass(frozen=True)
class StateRef:
    """Placeholder value standing for the model's parameter or buffer ``name``."""

    name: str


@dataclass(frozen=True, eq=False)
class Constant:
    """Placeholder value standing for a tensor ``torch.export`` lifted out of ``forward``
    (``torch.tensor([0, 1])`` made inside it, Falcon's and Whisper's): a constant of
    the graph, as a tensor attribute is, not an input of the model."""

    value: torch.Tensor


def export_inputs(ep, model: nn.Module, args: tuple, kwargs: dict) -> list:
    """Values for the exported graph's placeholders in the order of its signature: the
    user inputs, and :class:`StateRef` references for parameters and buffers."""
    from torch.export.graph_signature import InputKind

    state = dict(model.named_parameters(remove_duplicate=False))
    state.update(model.named_buffers(remove_duplicate=False))
    canon = canonical_names(model)
    user = iter(tree_flatten((args, kwargs))[0])
    values: list = []
    for spec in ep.graph_signature.input_specs:
        if spec.kind == InputKind.USER_INPUT:
            values.append(next(user))
        elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER) and spec.target in state:
            values.append(StateRef(canon[id(state[spec.target])]))
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            values.append(Constant(ep.constants[spec.target]))
        else:
            values.append(ep.constants[spec.target])
    return values


def user_frame(exc: BaseException) -> traceback.FrameSummary | None:
    """The deepest frame of a traceback that is the user's code, not torch's or ours."""
    frames = traceback.extract_tb(exc.__traceback__)
    mine = [
        f
        for f in frames
        if not f.filename.startswith((TORCH_DIR, OWN_DIR)) and not f.filename.startswith("<")
    ]
    return mine[-1] if mine else None


ADVICE = ("neither torch.fx nor torch.export can follow control flow that depends on tensor values — "
          "compute both branches and select with torch.where, or move the decision out of forward()")


TRACING_WORDS = ("data-dependent", "data dependent", "guard", "symbolic", "control flow", "dynamic", "proxy",
                 "unsupported", "graph break", "constraint")
"""Words of an error that tracing, not the model, raised (else the forward fails when run)."""


def failure_line(fx_error: Exception, export_error: Exception) -> str:
    frame = user_frame(fx_error) or user_frame(export_error)
    where = f"{frame.filename}:{frame.lineno} `{(frame.line or '').strip()}`" if frame else "the model's forward"
    reason = short_reason(export_error) or short_reason(fx_error)
    traced = any(w in f"{type(export_error).__name__} {export_error}".lower() for w in TRACING_WORDS)
    advice = ADVICE if traced else ("the forward raised this on the example inputs, which tracing runs as the "
                                    "model would: fix it there (or pass inputs it runs on) and run again")
    if "pack_padded_sequence" in where or "pack_sequence" in where:  # fake lengths cannot size the packed batch
        advice = PACKED_ADVICE
    elif any(w in f"{reason} {export_error}" for w in SHAPE_WORDS):
        advice = SHAPE_ADVICE
    return f"cannot trace the model at {where}: {reason}; {advice}"


def unsupported(model: nn.Module, args: tuple, kwargs: dict) -> list[str]:
    """Every construct of the user's code that breaks the graph, each as ``file:line
    `code`: reason``, found in one pass by ``torch._dynamo.explain`` (which, unlike
    export, goes on after a break); empty when it finds none or fails itself."""
    import torch._dynamo as dynamo

    try:
        with quiet_torch_logs():
            found = dynamo.explain(model)(*args, **kwargs)
    except Exception:  # noqa: BLE001 - a diagnosis that fails leaves the first error to report
        return []
    finally:
        dynamo.reset()
    out: list[str] = []
    for br in found.break_reasons:
        mine = [f for f in br.user_stack if not f.filename.startswith((TORCH_DIR, OWN_DIR))]
        if not mine:
            continue
        f = mine[-1]
        text = f"{f.filename}:{f.lineno} `{(f.line or '').strip()}`: {_break_reason(br.reason)}"
        if text not in out:
            out.append(text)
    return out


PACKED_ADVICE = ("pad the sequences and mask the padding instead of packing them (a PackedSequence's shapes "
                 "depend on the lengths' values, which no tracer follows)")
SKIPPED_ADVICE = "call it outside forward() or write it with tensor ops"
SHAPE_ADVICE = ("keep every shape independent of the values: compute densely and mask instead of selecting "
                "(nonzero, torch.where(cond) alone, boolean indexing); a mixture of experts: each expert on every "
                "token weighted by its scattered gate, or a fixed-capacity dispatch")
SHAPE_WORDS = ("Dynamic shape operator", "output shape depends on input Tensor data", "aten.nonzero",
               "masked_select", "data-dependent output size")
"""An op whose output's shape depends on its input's values (a graph break's reason)."""


def advice(breaks: list[str]) -> str:
    """What to do about ``breaks`` (:func:`unsupported`'s lines): pad instead of packing
    sequences, avoid a function tracing does not enter, keep shapes independent of values
    (:data:`SHAPE_ADVICE`), else :data:`ADVICE` (control flow on tensor values)."""
    fixes = []
    packed = [b for b in breaks if any(w in b for w in ("pack_padded_sequence", "pack_sequence", "PackedSequence"))]
    if packed:
        fixes.append(PACKED_ADVICE)
    shaped = [b for b in breaks if b not in packed and any(w in b for w in SHAPE_WORDS)]
    if shaped:
        fixes.append(SHAPE_ADVICE)
    if any("cannot enter" in b and b not in packed for b in breaks):
        fixes.append(SKIPPED_ADVICE)
    if not fixes or any("cannot enter" not in b and b not in packed and b not in shaped for b in breaks):
        fixes.append(ADVICE)
    return "; ".join(fixes)


def _break_reason(reason: str) -> str:
    """A graph break's reason, on one short line (cut at a word)."""
    if reason.startswith("generic_jump"):
        return "a branch on a tensor's value"
    if "Tensor.item()" in reason:
        return "Tensor.item(): a Python number from a tensor's value"
    if "marked as skipped" in reason:
        name = re.search(r"function `([\w.]+)`", reason)
        return f"a function tracing cannot enter{f' ({name.group(1)})' if name else ''}"
    text = " ".join(reason.split())
    return text if len(text) <= 160 else text[:160].rsplit(" ", 1)[0] + " ..."


def short_reason(exc: Exception) -> str:
    """The exception's first sentence, on one line."""
    text = " ".join(str(exc).split())
    parts = re.split(r"(?<=[.:])\s+(?=[A-Z(])", text)
    text = parts[0]
    while re.fullmatch(r"[\w.:]+\(\):", text) and len(parts) > 1:  # "scatter(): Expected ...": the op's name
        parts = parts[1:]
        text = f"{text} {parts[0]}"
    text = text.rstrip(".:")
    if text.count("(") > text.count(")"):
        text = text[: text.rfind("(")].rstrip()
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__
