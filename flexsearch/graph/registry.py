"""The op registry: per real torch op, its node kind and its SOAP dimensions.

Rules are keyed by the real object: an ``nn.Module`` subclass (``nn.Linear``), a
function (``torch.matmul``, ``F.scaled_dot_product_attention``, ``operator.add``), a
tensor method name (``"view"``, FX ``call_method`` nodes) or an ATen op packet
(``torch.ops.aten.linear``, nodes of the ``torch.export`` fallback). A module type is
looked up along its MRO, so a subclass of ``nn.Linear`` gets the Linear rule. An op
with no rule is *opaque*: it keeps its measured cost but has no parallel dimensions.

A rule maps a :class:`Call` (the op's tensor inputs with their batch dims, its outputs,
its constant arguments, its module) to a :class:`Ruling`: the node kind, the SOAP
dimensions of its first output, and which output dim carries the batch (propagated
from the inputs, whose dim 0 is the batch).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from flexsearch.graph.modules import parametrized
from flexsearch.graph.opgraph import (
    SAMPLES,
    DimKind,
    NodeKind,
    OutputDim,
    ParallelDims,
    ReducedDim,
)

aten = torch.ops.aten


@dataclass(frozen=True)
class Call:
    """What a rule sees of one op call."""

    in_shapes: tuple[tuple[int, ...], ...]
    in_batch: tuple[int | None, ...]
    out_shape: tuple[int, ...] | None
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    module: nn.Module | None = None

    @property
    def batch(self) -> int | None:
        """Batch dim of the first input that has one."""
        return next((b for b in self.in_batch if b is not None), None)

    def arg(self, index: int, name: str, default: Any = None) -> Any:
        if name in self.kwargs:
            return self.kwargs[name]
        return self.args[index] if len(self.args) > index else default


@dataclass(frozen=True)
class Ruling:
    kind: NodeKind
    dims: ParallelDims = ParallelDims()
    out_batch: int | None = None
    opaque: bool = False
    reads_params: bool = True  # False for lookups, which read only the rows they gather


Rule = Callable[[Call], Ruling]
_RULES: dict[Any, Rule] = {}


def rule(*keys: Any) -> Callable[[Rule], Rule]:
    """Register a rule for modules types, functions, method names or ATen packets."""

    def deco(fn: Rule) -> Rule:
        for k in keys:
            _RULES[k] = fn
        return fn

    return deco


def lookup(key: Any) -> Rule | None:
    """The rule for a module type (by MRO), function, method name or ATen op."""
    if isinstance(key, type):
        for cls in key.__mro__:
            if cls in _RULES:
                return _RULES[cls]
        return None
    if isinstance(key, torch._ops.OpOverload):
        key = key.overloadpacket
    try:
        return _RULES.get(key)
    except TypeError:  # unhashable target
        return None


def rule_for(key: Any, call: Call) -> Ruling:
    """Apply the registered rule, or the generic ATen pointwise rule, or opaque."""
    fn = lookup(key)
    if fn is None and isinstance(key, torch._ops.OpOverload) and torch.Tag.pointwise in key.tags:
        fn = _elementwise
    if fn is None and isinstance(getattr(key, "function", None), type) and \
            issubclass(key.function, torch.autograd.Function):  # flexsearch.graph.lift.function_call
        fn = _custom_function
    if fn is None:
        return Ruling("opaque", out_batch=_follow_batch(call), opaque=True)
    ruling = fn(call)
    if call.module is not None and parametrized(call.module):
        # a weight computed from parameters each call (weight_norm's norm over all of the
        # other dims): no share of its parameters makes the share of the weight
        out = tuple(d for d in ruling.dims.output if d.kind != "parameter")
        ruling = replace(ruling, dims=ParallelDims(output=out))
    return ruling


# ----------------------------------------------------------------------------- helpers


def _follow_batch(call: Call) -> int | None:
    """Output batch dim for shape-preserving or broadcasting ops: the first input's
    batch dim at the same index, else right-aligned (broadcast), if the size holds."""
    out = call.out_shape
    for shape, b in zip(call.in_shapes, call.in_batch, strict=False):
        if b is None or out is None:
            continue
        if len(out) > b and out[b] == shape[b]:
            return b
        ob = b + len(out) - len(shape)
        if 0 <= ob < len(out) and out[ob] == shape[b]:
            return ob
    return None


def _dims(
    shape: Sequence[int] | None,
    batch: int | None,
    *,
    skip: Sequence[int] = (),
    parameter: Sequence[int] = (),
) -> tuple[OutputDim, ...]:
    """Label every dim of ``shape`` of size > 1 not in ``skip``: the batch as sample,
    ``parameter`` dims as parameter, the rest attribute."""
    if shape is None:
        return ()
    n = len(shape)
    skip_set = {d % n for d in skip} if n else set()
    param_set = {d % n for d in parameter} if n else set()
    out = []
    for d, size in enumerate(shape):
        if d in skip_set or size <= 1:
            continue
        kind: DimKind = "sample" if d == batch else "parameter" if d in param_set else "attribute"
        out.append(OutputDim(dim=d, kind=kind, size=size))
    return tuple(out)


def _norm_dim(d: int | None, n: int) -> int | None:
    return None if d is None else d % n if n else d


# ----------------------------------------------------------------------------- layers


@rule(nn.Linear, F.linear, aten.linear)
def _linear(c: Call) -> Ruling:
    b = _follow_batch(c)
    in_features = c.in_shapes[0][-1]
    return Ruling(
        "linear",
        ParallelDims(
            output=_dims(c.out_shape, b, parameter=(-1,)),
            reduced=(ReducedDim(name="in_features", size=in_features, parameter=True),),
        ),
        b,
    )


@rule(torch.addmm, "addmm", aten.addmm)
def _addmm(c: Call) -> Ruling:
    """``bias + x @ w`` with a 2-D ``x (M, K)`` and ``w (K, N)``: a Linear with its
    weight transposed (Hugging Face GPT-2's ``Conv1D``): the output's columns split
    with ``w``'s, the ``K`` reduction split row-wise."""
    if len(c.in_shapes) < 3 or len(c.in_shapes[1]) != 2:
        return Ruling("opaque", out_batch=_follow_batch(c), opaque=True)
    b = _follow_batch(c)
    return Ruling(
        "linear",
        ParallelDims(
            output=_dims(c.out_shape, b, parameter=(-1,)),
            reduced=(ReducedDim(name="in_features", size=c.in_shapes[1][-1], parameter=True),),
        ),
        b,
    )


@rule(nn.Bilinear)
def _bilinear(c: Call) -> Ruling:
    b = _follow_batch(c)
    return Ruling("linear", ParallelDims(output=_dims(c.out_shape, b, parameter=(-1,))), b)


@rule(
    nn.Conv1d, nn.Conv2d, nn.Conv3d, F.conv1d, F.conv2d, F.conv3d,
    aten.conv1d, aten.conv2d, aten.conv3d, aten.convolution,
)  # fmt: skip
def _conv(c: Call) -> Ruling:
    """A convolution: the batch, and the output channels as a parameter dim (each device
    its filters), the input channels reduced. A grouped one (depthwise: ConvNeXt,
    MobileNet) has neither: a share of its filters reads the matching share of the input
    channels, as ``groups / t`` groups, which no configuration expresses."""
    b = 0 if c.batch == 0 else None
    if c.module is not None:
        groups = c.module.groups
    else:  # F.conv2d(input, weight, bias, stride, padding, dilation, groups); aten.convolution's 9th
        groups = c.arg(8 if len(c.args) > 8 else 6, "groups", 1)
    if groups != 1:
        return Ruling("conv", ParallelDims(output=_dims(c.out_shape, b, skip=(1,))), b)
    reduced = (ReducedDim(name="in_channels", size=c.in_shapes[0][1], parameter=True),)
    return Ruling("conv", ParallelDims(output=_dims(c.out_shape, b, parameter=(1,)), reduced=reduced), b)


@rule(nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
def _conv_t(c: Call) -> Ruling:
    b = 0 if c.batch == 0 else None
    return Ruling("conv", ParallelDims(output=_dims(c.out_shape, b, parameter=(1,))), b)


@rule(nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm, F.batch_norm, aten.batch_norm)
def _batch_norm(c: Call) -> Ruling:
    # Splitting the batch gives per-replica statistics (what DDP runs); channels are
    # independent and index the affine parameters; spatial dims feed the statistics.
    b = _follow_batch(c)
    shape = c.out_shape or ()
    spatial = tuple(range(2, len(shape)))
    return Ruling("norm", ParallelDims(output=_dims(shape, b, skip=spatial, parameter=(1,))), b)


@rule(nn.LayerNorm, F.layer_norm, aten.layer_norm, nn.RMSNorm, F.rms_norm, aten.rms_norm)
def _layer_norm(c: Call) -> Ruling:
    b = _follow_batch(c)
    if c.module is not None:
        normalized = len(c.module.normalized_shape)
    else:
        ns = c.arg(1, "normalized_shape")
        normalized = len(ns) if isinstance(ns, (list, tuple)) else 1
    shape = c.out_shape or ()
    skip = tuple(range(len(shape) - normalized, len(shape)))
    return Ruling("norm", ParallelDims(output=_dims(shape, b, skip=skip)), b)


@rule(nn.GroupNorm, F.group_norm, aten.group_norm, nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d, nn.LocalResponseNorm)
def _group_norm(c: Call) -> Ruling:
    b = _follow_batch(c)
    shape = c.out_shape or ()
    return Ruling("norm", ParallelDims(output=_dims(shape, b, skip=tuple(range(1, len(shape))))), b)


@rule(nn.Embedding, F.embedding, aten.embedding)
def _embedding(c: Call) -> Ruling:
    # Output [*index_shape, D]: index dims (batch, sequence) and the embedding columns
    # (parameter); splitting the vocabulary rows gives partial sums (masked lookups).
    if c.module is not None:
        vocab = c.module.num_embeddings
    else:  # the weight is the 2-D input without a batch dim
        vocab = next((s[0] for s, b in zip(c.in_shapes, c.in_batch, strict=False) if b is None and len(s) == 2), 0)
    b = _follow_batch(c)
    return Ruling(
        "embedding",
        ParallelDims(
            output=_dims(c.out_shape, b, parameter=(-1,)),
            reduced=(ReducedDim(name="vocab", size=vocab, parameter=True),) if vocab else (),
        ),
        b,
        reads_params=False,
    )


@rule(nn.EmbeddingBag, F.embedding_bag)
def _embedding_bag(c: Call) -> Ruling:
    b = 0 if c.batch == 0 else None
    vocab = c.module.num_embeddings if c.module is not None else 0
    return Ruling(
        "embedding",
        ParallelDims(
            output=_dims(c.out_shape, b, parameter=(-1,)),
            reduced=(ReducedDim(name="vocab", size=vocab, parameter=True),) if vocab else (),
        ),
        b,
        reads_params=False,
    )


@rule(nn.LSTM, nn.GRU, nn.RNN, aten.lstm, aten.gru, aten.rnn_tanh, aten.rnn_relu)
def _rnn(c: Call) -> Ruling:
    # Time steps are sequential and the hidden state mixes all hidden units at every
    # step: only the batch splits without communication inside the recurrence.
    if c.module is not None:
        b = 0 if c.module.batch_first else 1
    else:
        b = c.batch
    return Ruling("rnn", ParallelDims(output=_dims(c.out_shape, b, skip=[d for d in range(len(c.out_shape or ())) if d != b])), b)


@rule(nn.LSTMCell, nn.GRUCell, nn.RNNCell)
def _rnn_cell(c: Call) -> Ruling:
    return Ruling("rnn", ParallelDims(output=_dims(c.out_shape, 0, skip=(-1,))), 0)


@rule(nn.MultiheadAttention)
def _mha(c: Call) -> Ruling:
    b = 0 if c.module.batch_first else 1
    shape = c.out_shape or ()
    return Ruling("attention", ParallelDims(output=_dims(shape, b, skip=(-1,))), b)


@rule(F.scaled_dot_product_attention, aten.scaled_dot_product_attention)
def _sdpa(c: Call) -> Ruling:
    # [B, H, S_q, D]: batch, heads (attribute), query positions (attribute).
    b = _follow_batch(c)
    return Ruling("attention", ParallelDims(output=_dims(c.out_shape, b, skip=(-1,))), b)


@rule(torch.matmul, operator.matmul, torch.bmm, torch.mm, "matmul", "bmm", "mm", aten.matmul, aten.bmm, aten.mm)
def _matmul(c: Call) -> Ruling:
    a_shape = c.in_shapes[0]
    k = a_shape[-1] if a_shape else 1
    b = _follow_batch(c)
    return Ruling(
        "matmul",
        ParallelDims(
            output=_dims(c.out_shape, b),
            reduced=(ReducedDim(name="k", size=k, parameter=False),) if k > 1 else (),
        ),
        b,
    )


@rule(torch.einsum)
def _einsum(c: Call) -> Ruling:
    b = _follow_batch(c)
    return Ruling("matmul", ParallelDims(output=_dims(c.out_shape, b)), b)


# ----------------------------------------------------------------------------- pointwise


def _custom_function(c: Call) -> Ruling:
    """A custom ``autograd.Function``: what it computes is unknown but per sample, as
    data parallelism (DDP runs it on each device's samples) takes every op to be; so
    split by the samples only, its other dims whole."""
    b = _follow_batch(c)
    n = len(c.out_shape or ())
    return Ruling("elementwise", ParallelDims(output=_dims(c.out_shape, b, skip=tuple(d for d in range(n) if d != b))),
                  b)


@rule(
    operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, operator.pow,
    operator.iadd, operator.imul, operator.floordiv,
    torch.add, torch.sub, torch.mul, torch.div, torch.neg, torch.pow, torch.exp, torch.log,
    torch.sqrt, torch.rsqrt, torch.abs, torch.where, torch.clamp, torch.masked_fill,
    torch.sin, torch.cos, torch.tril, torch.triu, torch.sign, torch.erf, torch.maximum, torch.minimum,
    "add", "sub", "mul", "div", "neg", "pow", "exp", "log", "sqrt", "rsqrt", "abs", "clamp",
    "masked_fill", "masked_fill_", "float", "half", "bfloat16", "to", "type", "type_as",
    "add_", "mul_", "div_", "sin", "cos", "tril", "triu", "sign", "__add__", "__mul__",
    "__radd__", "__rmul__", "__sub__", "__truediv__", "clone",
    # ATen ops torch.export leaves without the `pointwise` tag: casts (an exported RMSNorm's
    # first op), `where` with a scalar, the mask algebra and the *_like factories
    aten.to, aten._to_copy, aten.type_as, aten.where, aten.__and__, aten.__or__, aten.__xor__,
    aten.bitwise_and, aten.bitwise_or, aten.bitwise_xor, aten.bitwise_not, aten.logical_and, aten.logical_or,
    aten.logical_not, aten.full_like, aten.empty_like, aten.zeros_like, aten.ones_like,
)  # fmt: skip
def _elementwise(c: Call) -> Ruling:
    b = _follow_batch(c)
    return Ruling("elementwise", ParallelDims(output=_dims(c.out_shape, b)), b)


@rule(
    nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU, nn.Mish,
    nn.Hardswish, nn.Hardtanh, nn.Softplus, nn.PReLU,
    F.relu, F.gelu, F.silu, F.tanh, F.sigmoid, F.leaky_relu, F.elu, F.mish, F.hardswish,
    F.relu6, F.softplus, torch.relu, torch.tanh, torch.sigmoid,
    "relu", "gelu", "tanh", "sigmoid", "silu", "relu_",
)  # fmt: skip
def _activation(c: Call) -> Ruling:
    b = _follow_batch(c)
    return Ruling("activation", ParallelDims(output=_dims(c.out_shape, b)), b)


@rule(nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, F.dropout, aten.dropout)
def _dropout(c: Call) -> Ruling:
    b = _follow_batch(c)
    return Ruling("dropout", ParallelDims(output=_dims(c.out_shape, b)), b)


@rule(nn.Softmax, nn.LogSoftmax, F.softmax, F.log_softmax, torch.softmax, torch.log_softmax,
      "softmax", "log_softmax", aten.softmax, aten._softmax, aten.log_softmax, aten._log_softmax)
def _softmax(c: Call) -> Ruling:
    b = _follow_batch(c)
    n = len(c.out_shape or ())
    dim = c.module.dim if c.module is not None else c.arg(1, "dim", -1)
    dim = -1 if dim is None else dim
    return Ruling("softmax", ParallelDims(output=_dims(c.out_shape, b, skip=(_norm_dim(dim, n),))), b)


# ----------------------------------------------------------------------------- reductions


def _samples(c: Call) -> tuple[ReducedDim, ...]:
    """The samples as the reduced dim of an op that sums (or averages) over the batch
    into an output without one (a loss, ``x.sum()``), when every tensor input is
    batch-first with the same number of samples: split, each device sums its samples
    and an all-reduce adds the partial results, as a data-parallel step does."""
    shapes = [s for s, b in zip(c.in_shapes, c.in_batch, strict=False) if b is not None]
    if not shapes or c.batch != 0 or any(b not in (0, None) for b in c.in_batch) or \
            len({s[0] for s in shapes if s}) != 1 or not shapes[0]:
        return ()
    return (ReducedDim(name=SAMPLES, size=shapes[0][0], parameter=False),)


@rule(torch.amax, torch.amin, torch.max, torch.min, torch.logsumexp,
      "amax", "amin", "max", "min", "logsumexp", "norm", torch.norm, aten.amax, aten.amin)
def _reduction(c: Call) -> Ruling:
    out = c.out_shape or ()
    shape = c.in_shapes[0] if c.in_shapes else ()
    b = c.batch
    if len(out) == len(shape) and out == shape:
        ob = b
    elif len(out) == len(shape):  # keepdim
        ob = b if b is not None and out[b] == shape[b] else None
    else:
        dims = c.arg(1, "dim")
        if dims is None:
            ob = None
        else:
            dims = {d % len(shape) for d in (dims if isinstance(dims, (list, tuple)) else [dims])}
            ob = None if b is None or b in dims else b - sum(1 for d in dims if d < b)
    return Ruling("reduction", ParallelDims(output=_dims(out, ob)), ob)


@rule(torch.sum, torch.mean, "sum", "mean", aten.sum, aten.mean)
def _sum(c: Call) -> Ruling:
    """A sum or mean; over the samples (no batch dim left), splittable by them
    (:func:`_samples`)."""
    r = _reduction(c)
    if r.out_batch is not None:
        return r
    return replace(r, dims=ParallelDims(output=r.dims.output, reduced=_samples(c)))


@rule(nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
      F.max_pool1d, F.max_pool2d, F.avg_pool2d, F.avg_pool1d,
      aten.max_pool2d, aten.avg_pool2d, aten.max_pool2d_with_indices)
def _pool(c: Call) -> Ruling:
    b = 0 if c.batch == 0 else None
    return Ruling("pool", ParallelDims(output=_dims(c.out_shape, b)), b)


@rule(nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d, nn.AdaptiveMaxPool2d,
      F.adaptive_avg_pool2d, F.adaptive_max_pool2d, aten.adaptive_avg_pool2d)
def _adaptive_pool(c: Call) -> Ruling:
    b = 0 if c.batch == 0 else None
    shape = c.out_shape or ()
    return Ruling("pool", ParallelDims(output=_dims(shape, b, skip=tuple(range(2, len(shape))))), b)


@rule(nn.MSELoss, nn.BCEWithLogitsLoss, nn.L1Loss, F.mse_loss, F.binary_cross_entropy_with_logits, F.l1_loss)
def _loss(c: Call) -> Ruling:
    return Ruling("loss", ParallelDims(), None)


@rule(nn.CrossEntropyLoss, nn.NLLLoss, F.cross_entropy, F.nll_loss, aten.cross_entropy_loss, aten.nll_loss,
      aten.nll_loss_nd)
def _class_loss(c: Call) -> Ruling:
    """Cross entropy and NLL reduced to a number: splittable by the samples (the SOAP
    emitter sums each shard's losses and counts its labels:
    :mod:`flexsearch.emit.losses`); not with class weights, whose mean would weigh the
    shards by their weights."""
    out = c.out_shape or ()
    weighted = len(c.in_shapes) > 2 or c.arg(2, "weight") is not None
    if c.module is not None:
        weighted = getattr(c.module, "weight", None) is not None
    return Ruling("loss", ParallelDims(reduced=() if out or weighted else _samples(c)), None)


def _grouped_mm(c: Call) -> Ruling:
    """A mixture-of-experts grouped matmul (:mod:`flexsearch.graph.moe`): matmul-class
    FLOPs, whole (its rows are routed by data, no split is legal)."""
    return Ruling("matmul", ParallelDims(output=_dims(c.out_shape, None)), _follow_batch(c), opaque=True)


def register_grouped_mm(ops) -> None:
    """Give the grouped-matmul ``ops`` (op packets) the :func:`_grouped_mm` rule."""
    for op in ops:
        _RULES.setdefault(op, _grouped_mm)


from flexsearch.graph import movement as _movement  # noqa: E402,F401  (registers the data-movement rules)
