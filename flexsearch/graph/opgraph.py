"""The operator graph: the immutable IR every later stage reads.

An :class:`OpGraph` is a list of :class:`OpNode` in topological order. Each node is one
operator of the forward pass (a standard layer such as ``nn.Linear`` kept whole, or a
tensor function), with its measured forward and backward FLOPs, the bytes it moves,
the parameters it owns, its output shapes and its parallelizable dimensions in SOAP
terms (:class:`ParallelDims`). Identical repeated blocks (transformer layers) are
recorded as :class:`BlockGroup` values so searches can share one decision per block.

Everything here is a frozen pydantic model: graphs are values, they serialise to JSON
(``to_json``/``from_json``) and have a content :attr:`OpGraph.fingerprint`.
"""

from __future__ import annotations

import hashlib
import math
from functools import cached_property
from typing import Literal

from pydantic import BaseModel, ConfigDict

DimKind = Literal["sample", "attribute", "parameter"]
Constant = bool | int | float | str | None
"""A keyword input that is not a tensor (``return_loss=True``), as a plan file keeps it."""

NodeKind = Literal[
    "input",
    "output",
    "param",
    "linear",
    "conv",
    "embedding",
    "norm",
    "rnn",
    "attention",
    "matmul",
    "elementwise",
    "activation",
    "softmax",
    "reduction",
    "pool",
    "view",
    "dropout",
    "loss",
    "opaque",
]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class TensorMeta(_Frozen):
    """Shape and dtype of one tensor (``dtype`` as ``str(torch.dtype)`` minus ``torch.``)."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_size(self.dtype)


class OutputDim(_Frozen):
    """One splittable dimension of a node's first output.

    ``kind`` is the SOAP role: ``sample`` (the batch), ``attribute`` (another
    non-parameter dimension: sequence, height, width, heads), ``parameter`` (a dimension
    that indexes the node's parameters: out features, out channels, embedding columns).
    """

    dim: int
    kind: DimKind
    size: int


SAMPLES = "samples"
"""The :class:`ReducedDim` name of the batch, when an op sums or averages over it (a
loss reduced to a number, ``x.sum()``)."""


class ReducedDim(_Frozen):
    """A dimension the node sums over; splitting it leaves partial sums to be reduced.

    ``name`` says which (``in_features``, ``in_channels``, ``k``, ``vocab``,
    :data:`SAMPLES`); ``parameter`` is true when splitting it also splits the node's
    parameters.
    """

    name: str
    size: int
    parameter: bool


class ParallelDims(_Frozen):
    """A node's SOAP dimensions: the output dims it may be split along and the reduced
    input dims it may be split along (partial sums). An opaque node has neither."""

    output: tuple[OutputDim, ...] = ()
    reduced: tuple[ReducedDim, ...] = ()

    def of_kind(self, kind: DimKind) -> tuple[OutputDim, ...]:
        return tuple(d for d in self.output if d.kind == kind)

    @property
    def over_samples(self) -> bool:
        """Is the (first) reduced dim the batch (:data:`SAMPLES`)?"""
        return bool(self.reduced) and self.reduced[0].name == SAMPLES


class BlockRef(_Frozen):
    """Where a node sits in a repeated block: group id, instance index, position."""

    group: int
    instance: int
    position: int


class OpNode(_Frozen):
    """One operator of the forward pass.

    ``signature`` identifies the op call up to names (target, layer configuration,
    input and parameter shapes, constant arguments): identical layers share it, and
    measured profiles are keyed by it.
    """

    name: str
    kind: NodeKind
    target: str
    inputs: tuple[str, ...]
    outputs: tuple[TensorMeta, ...]
    flops: int
    backward_flops: int
    bytes_read: int
    bytes_written: int
    params: tuple[str, ...] = ()
    num_params: int = 0
    param_bytes: int = 0
    """Bytes of the parameters the node owns (the first node to use a parameter owns it)."""
    frozen_param_bytes: int = 0
    """Of those, the bytes of frozen ones (``requires_grad=False``): held, read and
    gathered like the others, but without gradient, optimizer state, update or gradient
    synchronisation (:attr:`trained_param_bytes` has those)."""
    used_param_bytes: int = 0
    """Bytes of every parameter the node reads, owned or not (a tied output layer's
    embedding table)."""
    saved_bytes: int | None = None
    """Bytes of activations autograd keeps for the backward that the node created (its
    outputs some op saves or the model returns, and tensors it saved internally), as
    measured by the tracer; ``None`` when not measured (a profile from elsewhere)."""
    saves: tuple[str, ...] | None = None
    """The nodes whose outputs live in a storage this op saves for its backward (the
    storage's maker, its views and in-place results; the op itself when it saves its
    own output), as measured by the tracer; ``None`` when not measured. A pipeline stage
    that receives such an output keeps its copy of it
    (:class:`flexsearch.sim.stages.BoundaryCopies`)."""
    dims: ParallelDims = ParallelDims()
    opaque: bool = False
    module: str = ""
    source: str = ""
    signature: str = ""
    block: BlockRef | None = None

    @property
    def output_shapes(self) -> tuple[tuple[int, ...], ...]:
        return tuple(t.shape for t in self.outputs)

    @property
    def trained_param_bytes(self) -> int:
        """Bytes of the owned parameters that train: what has gradients, optimizer state
        and an update, and what data parallelism synchronises."""
        return self.param_bytes - self.frozen_param_bytes

    @property
    def output_bytes(self) -> int:
        return sum(t.nbytes for t in self.outputs)


class BlockGroup(_Frozen):
    """A set of identical blocks: ``instances[i]`` lists instance i's node names, in the
    same order for every instance, so ``instances[i][k]`` and ``instances[j][k]`` are the
    same operator of different copies."""

    id: int
    module_type: str
    modules: tuple[str, ...]
    instances: tuple[tuple[str, ...], ...]


def in_place_op(name: str) -> bool:
    """Does the op named ``name`` write its first argument in place: ``copy_``, ``add_``
    (a method's name, a function's ``__name__``, or an ATen overload's ``add_.Tensor``),
    not a dunder such as ``__iadd__``?"""
    op = name.split(".")[0]
    return op.endswith("_") and not op.startswith("__")


class ModuleFacts(_Frozen):
    """One module of the model's tree, as sharding rules see it
    (:func:`flexsearch.graph.modules.module_facts`): its path, whether it is looked
    into (a plain container, ``ModuleList``/``ModuleDict``, or a module holding one
    below it: its children are the candidates, not itself), and the
    canonical names of every parameter under it (a tied weight has one name, the
    first ``named_parameters`` gives)."""

    path: str
    container: bool
    params: tuple[str, ...]
    read_outside: bool = False
    """Does an op outside the module's own calls read one of its parameters (DeBERTa's
    encoder reading ``self.rel_embeddings.weight``)? FSDP2 gathers a unit's parameters
    for its own forward only, so such a module is no unit (set by the tracer, from the
    graph; False for facts of a model alone)."""


class OpGraph(_Frozen):
    """The operator graph of one model's forward pass, nodes in topological order."""

    model: str
    via: Literal["fx", "export"]
    family: str = ""
    """The model's class name (what per-family measurements, e.g. convergence files,
    are keyed by; ``model`` may be a caller's label)."""
    nodes: tuple[OpNode, ...]
    blocks: tuple[BlockGroup, ...] = ()
    unused_params: int = 0
    frozen_params: tuple[str, ...] = ()
    """The names (as in ``OpNode.params``) of the parameters that do not train
    (``requires_grad=False``)."""
    modules: tuple[ModuleFacts, ...] = ()
    """The model's top-level modules holding parameters, and the items of containers
    among them, recursively (what FSDP's unit rule reads)."""
    precision: str = "fp32"
    """The training precision it was traced under (:mod:`flexsearch.precision`)."""
    input_names: tuple[str, ...] = ()
    """Per input node, in order, the keyword it was passed by (``""``: positional)."""
    constant_inputs: tuple[tuple[str, Constant], ...] = ()
    """The keyword inputs that are not tensors but constants (``return_loss=True``), as
    given: traced with them, so the emitter traces with them too."""
    notes: tuple[str, ...] = ()
    """What the tracer changed or assumed to trace the model (one line each; the plan
    repeats them)."""
    low_param_nodes: tuple[OpNode, ...] = ()
    """Under mixed precision, ``nodes`` as a runtime that holds the parameters in
    autocast's dtype computes them: FSDP2 with ``MixedPrecisionPolicy(param_dtype=...)``
    gathers them so, and then ops autocast leaves alone compute in that dtype too (an
    embedding's output, and the residual stream after it), where the model's fp32
    parameters give fp32. The same ops, parameters and signatures; other output dtypes,
    bytes moved and saved (:func:`flexsearch.graph.tracer.trace`). Empty otherwise, or
    when the model did not trace so (a note says)."""

    @cached_property
    def by_name(self) -> dict[str, OpNode]:
        return {n.name: n for n in self.nodes}

    def node(self, name: str) -> OpNode:
        return self.by_name[name]

    @cached_property
    def consumers(self) -> dict[str, tuple[str, ...]]:
        out: dict[str, list[str]] = {n.name: [] for n in self.nodes}
        for n in self.nodes:
            for i in n.inputs:
                out[i].append(n.name)
        return {k: tuple(v) for k, v in out.items()}

    @cached_property
    def low_param_graph(self) -> OpGraph:
        """The graph of :attr:`low_param_nodes` (this graph when there are none): what a
        plan run by FSDP2 under mixed precision computes (:func:`flexsearch.sim.predict.runtime_graph`)."""
        if not self.low_param_nodes:
            return self
        fields = {k: getattr(self, k) for k in type(self).model_fields}  # not model_copy: it would copy
        # this graph's cached properties (by_name, consumers) along
        return type(self)(**{**fields, "nodes": self.low_param_nodes, "low_param_nodes": ()})

    @property
    def num_params(self) -> int:
        return sum(n.num_params for n in self.nodes)

    @property
    def param_bytes(self) -> int:
        return sum(n.param_bytes for n in self.nodes)

    @property
    def param_dtype(self) -> str:
        """The dtype the model's parameters are stored in (the first node's that has
        any; ``float32`` without parameters)."""
        n = next((n for n in self.nodes if n.num_params), None)
        return {2: "bfloat16", 8: "float64"}.get(n.param_bytes // n.num_params, "float32") if n else "float32"

    @property
    def flops(self) -> int:
        """Total forward FLOPs."""
        return sum(n.flops for n in self.nodes)

    @property
    def backward_flops(self) -> int:
        return sum(n.backward_flops for n in self.nodes)

    @property
    def opaque_nodes(self) -> tuple[OpNode, ...]:
        return tuple(n for n in self.nodes if n.opaque)

    @cached_property
    def fingerprint(self) -> str:
        """A hash of the graph's structure (names, kinds, targets, edges, shapes, params),
        independent of cost numbers, so a plan can tell which model it was made for."""
        h = hashlib.sha256()
        for n in self.nodes:
            h.update(repr((n.name, n.kind, n.target, n.inputs, n.output_shapes, n.params)).encode())
        return h.hexdigest()[:16]

    def to_json(self, indent: int | None = None) -> str:
        return self.model_dump_json(indent=indent, exclude={"by_name", "consumers", "fingerprint",
                                                            "low_param_graph"})

    @classmethod
    def from_json(cls, text: str) -> OpGraph:
        return cls.model_validate_json(text)


_DTYPE_SIZES = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "complex64": 8,
    "complex128": 16,
}


def dtype_size(dtype: str) -> int:
    """Bytes per element of a dtype named as in :class:`TensorMeta`."""
    try:
        return _DTYPE_SIZES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}") from None
