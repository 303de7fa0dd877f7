"""One op's parallel configuration, and which configurations the emitter can run.

A :class:`Config` splits one op over a contiguous, aligned block of devices laid out as
an ``s x t`` mesh (``t`` innermost, so model-parallel groups sit on neighbouring
devices, inside a node when they fit):

- ``s``: degree along the op's sample (batch) dim;
- ``kind``/``t``/``dim``: one model-parallel split of degree ``t``: ``"a"`` attribute
  (output dim ``dim``), ``"p"`` parameter (output dim ``dim``), ``"r"`` reduce (the
  first reduced dim: partial sums, summed by an all-reduce), or ``"x"``: the op is
  replicated on the ``t`` devices (every one computes the whole ``1/s`` slice);
- ``first``: the first device; the block is ``first .. first + s*t - 1``. Blocks
  smaller than the cluster put different ops on different devices (the "operation"
  dimension of SOAP: branches or layers running side by side).

Text form (:meth:`Config.text`, :func:`parse_config`): ``s4``, ``s2.p4:2``,
``s1.r8:0``, ``s2.x2@4`` (``@first`` when not 0).

**The emitter rule** (:func:`legal`): a configuration is legal exactly when the emitter
can run it as DTensor placements on a sub-mesh: the block is aligned (``first`` a
multiple of its size, its size divides the cluster); every split degree divides its dim
evenly; a sample split needs a sample dim; an attribute split is only on a dim the op
computes from the same slice of its inputs (not conv/pool spatial dims, which need a
halo; not an RNN's time; for attention only the heads dim, since a causal mask on a
slice of queries is not the op); a parameter split only on a dim that indexes the op's
own parameters (Linear/Conv out features, embedding columns, BatchNorm channels); a
reduce split only for Linear (row-wise), Embedding (vocab-wise), matmul (``k``) and
an op that sums or averages over the samples into a number (a cross-entropy or NLL
loss, ``x.sum()``, ``x.mean()``: each device its share of the samples, as DTensor runs
it on a batch-sharded input); opaque ops only whole (``s = 1``, replicated or on one
device).

**Decisions and followers.** Searches choose configurations for *decision* ops (layers
and compute ops: :data:`DECISION_KINDS`). Data-movement and pointwise ops follow the
layout of their first input as DTensor's sharding propagation does
(:func:`follow`); sources (inputs, constants) and the output are free. Decision units
and the expansion of decisions into every node's configuration are
:class:`flexsearch.strategy.space.Space`'s.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from flexsearch.graph.microbatch import batch_dim
from flexsearch.graph.opgraph import OpNode
from flexsearch.graph.regions import dim_map, inverse_dim

ModelKind = Literal["", "a", "p", "r", "x"]

DECISION_KINDS = frozenset(
    {"linear", "conv", "embedding", "norm", "rnn", "attention", "matmul", "pool", "reduction",
     "loss", "opaque"}
)
FOLLOWER_KINDS = frozenset({"view", "elementwise", "activation", "dropout", "softmax"})
SOURCE_KINDS = frozenset({"input", "param", "output"})

_ATTRIBUTE_KINDS = frozenset(
    {"linear", "embedding", "norm", "matmul", "pool", "reduction", "elementwise", "activation",
     "dropout", "softmax", "view", "attention"}
)
_PARAMETER_KINDS = frozenset({"linear", "conv", "embedding", "norm"})
_REDUCE_KINDS = frozenset({"linear", "embedding", "matmul"})


@dataclass(frozen=True, slots=True, order=True)
class Config:
    """One op's parallel configuration (see the module docstring)."""

    s: int = 1
    kind: ModelKind = ""
    t: int = 1
    dim: int = -1
    first: int = 0

    def __post_init__(self) -> None:
        if self.s < 1 or self.t < 1 or self.first < 0:
            raise ValueError(f"bad config {self!r}: degrees must be >= 1 and first >= 0")
        if (self.kind == "") != (self.t == 1):
            raise ValueError(f"bad config {self!r}: a model split kind needs t > 1 and t > 1 a kind")
        if (self.kind in ("a", "p", "r")) != (self.dim >= 0):
            raise ValueError(f"bad config {self!r}: kinds a/p/r need dim >= 0, others dim = -1")

    @property
    def n(self) -> int:
        """Devices used: ``s * t``."""
        return self.s * self.t

    @property
    def devices(self) -> range:
        return range(self.first, self.first + self.n)

    def device(self, i_s: int, i_t: int) -> int:
        return self.first + i_s * self.t + i_t

    @property
    def text(self) -> str:
        out = f"s{self.s}"
        if self.kind:
            out += f".{self.kind}{self.t}"
            if self.dim >= 0:
                out += f":{self.dim}"
        if self.first:
            out += f"@{self.first}"
        return out

    def __str__(self) -> str:
        return self.text


_CONFIG_RE = re.compile(r"^s(\d+)(?:\.([aprx])(\d+)(?::(\d+))?)?(?:@(\d+))?$")


def parse_config(text: str) -> Config:
    """Inverse of :attr:`Config.text`; raises ValueError on anything else."""
    m = _CONFIG_RE.match(text.strip())
    if not m:
        raise ValueError(f"not a configuration: {text!r} (expected e.g. 's4', 's2.p4:2', 's1.x2@4')")
    s, kind, t, dim, first = m.groups()
    return Config(int(s), kind or "", int(t or 1), int(dim) if dim is not None else -1, int(first or 0))


sample_dim = batch_dim
"""The output dim that carries the batch, if any (:func:`flexsearch.graph.microbatch.batch_dim`)."""


def _dim_size(node: OpNode, dim: int) -> int:
    return node.outputs[0].shape[dim]


def legal(node: OpNode, c: Config, devices: int) -> bool:
    """The emitter rule (module docstring): can the emitter run ``node`` as ``c`` on a
    cluster of ``devices`` devices?"""
    n = c.n
    if devices % n or c.first % n or c.first + n > devices:
        return False
    if node.kind in SOURCE_KINDS or not node.outputs:
        return c == Config()
    if node.opaque or node.kind == "opaque":
        return c.s == 1 and c.kind in ("", "x")
    if c.s > 1:
        d = sample_dim(node)
        if d is None or _dim_size(node, d) % c.s:
            return False
    if c.kind in ("", "x"):
        return True
    if c.kind == "r":
        red = node.dims.reduced
        if not red or c.dim != 0 or red[0].size % c.t:
            return False
        if node.dims.over_samples:
            return node.kind in ("loss", "reduction")
        return node.kind in _REDUCE_KINDS and (node.kind == "matmul" or red[0].parameter)
    want = "attribute" if c.kind == "a" else "parameter"
    dims = {d.dim: d for d in node.dims.output if d.kind == want}
    if c.dim not in dims or dims[c.dim].size % c.t:
        return False
    if c.kind == "p":
        return node.kind in _PARAMETER_KINDS and node.num_params > 0
    if node.kind not in _ATTRIBUTE_KINDS:
        return False
    if node.kind == "attention":
        return c.dim == 1
    if node.kind == "pool":
        return c.dim == 1
    return True


def _block_sizes(devices: int) -> list[int]:
    return [n for n in range(1, devices + 1) if devices % n == 0]


def candidates(node: OpNode, devices: int, *, full_block_only: bool = False) -> tuple[Config, ...]:
    """Every legal configuration of ``node`` on ``devices`` devices, sorted; with
    ``full_block_only`` only those that use all devices (the ILP's candidate set)."""
    if node.kind in SOURCE_KINDS or not node.outputs:
        return (Config(),)
    out: set[Config] = set()
    splits: list[tuple[ModelKind, int]] = [("", -1)]
    for d in node.dims.output:
        if d.kind in ("attribute", "parameter"):
            splits.append(("a" if d.kind == "attribute" else "p", d.dim))
    if node.dims.reduced:
        splits.append(("r", 0))
    sizes = [devices] if full_block_only else _block_sizes(devices)
    for n in sizes:
        for s in _block_sizes(n):
            t = n // s
            for kind, dim in splits:
                if t == 1:
                    kinds = [("", -1)]
                elif kind == "":
                    kinds = [("x", -1)]
                else:
                    kinds = [(kind, dim)]
                for k, dm in kinds:
                    for first in range(0, devices, n):
                        c = Config(s, k, t, dm, first)
                        if legal(node, c, devices):
                            out.add(c)
    return tuple(sorted(out))


def is_source(node: OpNode) -> bool:
    """Free nodes: inputs, parameters, the output and constants (no tensor inputs)."""
    return node.kind in SOURCE_KINDS or not node.inputs


def is_follower(node: OpNode) -> bool:
    return not is_source(node) and node.kind in FOLLOWER_KINDS and not node.opaque


def _replicated(s: int, n: int, first: int) -> Config:
    """``s``-way sample split, replicated on the rest of ``n`` devices from ``first``."""
    t = n // s
    return Config(s, "x" if t > 1 else "", t, -1, first)


def follow(node: OpNode, producer: OpNode, pc: Config, devices: int) -> Config:
    """The layout a follower takes from its first input's configuration ``pc`` (as
    DTensor propagates a placement): the sample split and an attribute/parameter split
    carry over when their dim maps to one of the follower's output dims and stays
    legal; a partial (reduced) or unmappable split becomes a replication over the same
    devices."""
    if not producer.outputs or not node.outputs:
        return _replicated(1, pc.n, pc.first)
    dmap = dim_map(node, 0, producer.outputs[0].shape)
    s = 1
    ps = sample_dim(producer)
    if pc.s > 1 and ps is not None:
        od = inverse_dim(dmap, ps)
        if od is not None and od == sample_dim(node) and _dim_size(node, od) % pc.s == 0:
            s = pc.s
    if pc.kind in ("a", "p") and s == pc.s:
        od = inverse_dim(dmap, pc.dim)
        if od is not None and legal(node, c := Config(s, "a", pc.t, od, pc.first), devices):
            return c
    c = _replicated(s, pc.n, pc.first)
    return c if legal(node, c, devices) else _replicated(1, pc.n, pc.first)
