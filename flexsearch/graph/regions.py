"""How a partition's input regions follow from its output region.

A *region* is a box in a tensor's index space: one half-open interval ``(lo, hi)`` per
dim. When an op is split, each task computes one region of the op's first output and
needs, from every input, the region this module derives. The derivation is a **dim
map**: for each output dim, the input dim it indexes (or none) and a scale::

    input interval = (floor(lo * num / den), ceil(hi * num / den))

An output dim with no input counterpart (the out-features of a Linear, a dim a reshape
merges into its inner part) leaves the input dim it would have indexed whole; every
input dim no output dim maps to is needed whole too. A split *reduced* dim (the
in-features of a Linear, the shared ``k`` of a matmul) adds its own interval on the
input dims listed by :func:`reduced_input_dims`.

Rules by node kind (``k`` is the input's position in ``node.inputs``):

- linear: every output dim but the last maps to the same input dim (right-aligned);
- matmul: batch dims right-aligned; ``out[-2]`` maps to ``in0[-2]``, ``out[-1]`` to ``in1[-1]``;
- conv / pool: batch to batch; pool channels to channels; spatial dims scaled by
  input/output size (the kernel halo is not modelled: spatial splits are not legal);
- embedding: every output dim but the last maps to the index input's dim;
- attention: ``q`` maps one to one; ``k``/``v`` map batch, heads and head dim, their
  sequence is needed whole;
- shape-preserving and broadcasting ops (elementwise, activation, dropout, norm,
  softmax, reduction, loss): right-aligned dims of equal size;
- views: a permutation when both shapes hold the same sizes, else reshape groups
  (consecutive dims with equal products; the leading dim of a group maps to the leading
  dim of the other side, scaled), else dims of equal size at the same position;
- opaque: nothing maps (every input is needed whole).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from functools import lru_cache

from flexsearch.graph.opgraph import OpNode

Interval = tuple[int, int]
Region = tuple[Interval, ...]
DimLink = tuple[int, int, int]  # (input dim, num, den): input = output * num / den
DimMap = tuple[DimLink | None, ...]

_SAME_SHAPE = frozenset(
    {"elementwise", "activation", "dropout", "norm", "softmax", "reduction", "loss", "output"}
)


def volume(region: Region) -> int:
    return math.prod(hi - lo for lo, hi in region)


def intersect(a: Region, b: Region) -> Region | None:
    """The overlap of two regions of the same tensor, or None when empty."""
    out = []
    for (alo, ahi), (blo, bhi) in zip(a, b, strict=True):
        lo, hi = max(alo, blo), min(ahi, bhi)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


class TileIndex:
    """The regions of ``tiles`` that overlap a region, in ``tiles``' order, as a scan
    with :func:`intersect` finds them. Per dim the tiles' distinct non-empty intervals
    are sorted; when they are disjoint (a block partition's) the overlapping ones are
    found by bisection and the candidates are their product, kept when they are tiles:
    ``O(overlaps)`` per lookup where the scan is ``O(tiles)`` (an edge between two
    256-way sample splits: 256 lookups of 256 tiles each). Tiles with overlapping
    intervals in some dim are scanned."""

    def __init__(self, tiles: Sequence[Region]):
        self.tiles = list(tiles)
        self.position = {r: i for i, r in enumerate(self.tiles)}
        self.dims: list[tuple[list[Interval], list[int]]] | None = []
        for k in range(len(self.tiles[0]) if self.tiles else 0):
            iv = sorted({r[k] for r in self.tiles if r[k][0] < r[k][1]})
            if any(a[1] > b[0] for a, b in zip(iv, iv[1:], strict=False)):
                self.dims = None
                break
            self.dims.append((iv, [hi for _, hi in iv]))

    def overlapping(self, need: Region) -> list[Region]:
        if self.dims is None:
            return [r for r in self.tiles if intersect(need, r) is not None]
        per_dim: list[list[Interval]] = []
        for (iv, his), (lo, hi) in zip(self.dims, need, strict=True):
            i = bisect.bisect_right(his, lo)  # the first interval ending after lo
            got = []
            while i < len(iv) and iv[i][0] < hi:
                got.append(iv[i])
                i += 1
            if not got or lo >= hi:
                return []
            per_dim.append(got)
        found = [r for r in itertools.product(*per_dim) if r in self.position]
        found.sort(key=self.position.__getitem__)
        return found


def split_interval(size: int, parts: int, index: int) -> Interval:
    """The ``index``-th of ``parts`` equal pieces of ``range(size)`` (parts divides size)."""
    step = size // parts
    return (index * step, (index + 1) * step)


def _right_aligned(out: Sequence[int], inp: Sequence[int], skip_last: bool = False) -> DimMap:
    ro, ri = len(out), len(inp)
    links: list[DimLink | None] = []
    for i in range(ro):
        j = i - (ro - ri)
        if skip_last and i == ro - 1:
            links.append(None)
        elif 0 <= j < ri and (not skip_last or j < ri - 1) and inp[j] == out[i]:
            links.append((j, 1, 1))
        else:
            links.append(None)
    return tuple(links)


def _permutation(out: Sequence[int], inp: Sequence[int]) -> DimMap | None:
    if len(out) != len(inp) or sorted(out) != sorted(inp):
        return None
    used: set[int] = set()
    links: list[DimLink | None] = []
    for i, size in enumerate(out):
        options = [j for j, s in enumerate(inp) if s == size and j not in used]
        j = min(options, key=lambda j: (abs(j - i), j))
        used.add(j)
        links.append((j, 1, 1))
    return tuple(links)


def _reshape(out: Sequence[int], inp: Sequence[int]) -> DimMap | None:
    """Reshape groups: walk both shapes, closing a group when the products agree; the
    leading dim of each output group maps to the leading dim of its input group."""
    if math.prod(out) != math.prod(inp):
        return None
    links: list[DimLink | None] = [None] * len(out)
    i = j = 0
    while i < len(out) or j < len(inp):
        gi, gj = [i], [j]
        po = out[i] if i < len(out) else 1
        pi = inp[j] if j < len(inp) else 1
        i, j = i + 1, j + 1
        while po != pi:
            if po < pi and i < len(out):
                po *= out[i]
                gi.append(i)
                i += 1
            elif j < len(inp):
                pi *= inp[j]
                gj.append(j)
                j += 1
            else:
                return None
        o0, i0 = gi[0], gj[0]
        if o0 < len(out) and i0 < len(inp):
            # leading out dim of size a covers inner size po/a; in leading dim b inner pi/b
            inner_out = po // out[o0]
            inner_in = pi // inp[i0]
            g = math.gcd(inner_out, inner_in)
            links[o0] = (i0, inner_out // g, inner_in // g)
    return tuple(links)


def _positional(out: Sequence[int], inp: Sequence[int]) -> DimMap:
    links: list[DimLink | None] = []
    for i, size in enumerate(out):
        if i < len(inp) and inp[i] == size:
            links.append((i, 1, 1))
        else:
            j = i - (len(out) - len(inp))
            links.append((j, 1, 1) if 0 <= j < len(inp) and inp[j] == size else None)
    return tuple(links)


def view_map(out: Sequence[int], inp: Sequence[int]) -> DimMap:
    """Dim map of a data-movement op from shapes alone (see the module docstring)."""
    if tuple(out) == tuple(inp):
        return tuple((i, 1, 1) for i in range(len(out)))
    return _permutation(out, inp) or _reshape(out, inp) or _positional(out, inp)


@lru_cache(maxsize=65536)
def _dim_map(kind: str, target: str, out: tuple[int, ...], inp: tuple[int, ...], k: int) -> DimMap:
    ro = len(out)
    if kind == "linear":
        return _right_aligned(out, inp, skip_last=True)
    if kind == "matmul":
        links: list[DimLink | None] = [None] * ro
        if ro >= 2 and len(inp) >= 2:
            for i in range(ro - 2):
                j = i - (ro - len(inp))
                if 0 <= j < len(inp) - 2 and inp[j] == out[i]:
                    links[i] = (j, 1, 1)
            if k == 0:
                links[ro - 2] = (len(inp) - 2, 1, 1)
            elif k == 1:
                links[ro - 1] = (len(inp) - 1, 1, 1)
        return tuple(links)
    if kind in ("conv", "pool"):
        links = [None] * ro
        if ro == len(inp) and ro >= 2:
            links[0] = (0, 1, 1) if inp[0] == out[0] else None
            if kind == "pool" and inp[1] == out[1]:
                links[1] = (1, 1, 1)
            for i in range(2, ro):
                g = math.gcd(inp[i], out[i])
                links[i] = (i, inp[i] // g, out[i] // g)
        return tuple(links)
    if kind == "embedding":
        return tuple((i, 1, 1) if i < len(inp) and inp[i] == out[i] else None for i in range(ro))
    if kind == "attention":
        if k == 0 or ro != len(inp):
            return _right_aligned(out, inp)
        if k in (1, 2):
            return tuple(
                (i, 1, 1) if i != ro - 2 and inp[i] == out[i] else None for i in range(ro)
            )
        return _right_aligned(out, inp)
    if kind in _SAME_SHAPE:
        return _right_aligned(out, inp)
    if kind == "view":
        return view_map(out, inp)
    if kind == "rnn":
        return _positional(out, inp)
    return (None,) * ro


def dim_map(node: OpNode, k: int, in_shape: Sequence[int]) -> DimMap:
    """For each dim of ``node``'s first output, the dim of input ``k`` (of shape
    ``in_shape``) it indexes, as ``(input dim, num, den)``, or None."""
    if not node.outputs:
        return ()
    return _dim_map(node.kind, node.target, node.outputs[0].shape, tuple(in_shape), k)


def reduced_input_dims(node: OpNode, k: int, in_shape: Sequence[int]) -> tuple[int, ...]:
    """The dims of input ``k`` that a split of the node's (first) reduced dim splits:
    the last dim of a Linear's input, ``k`` of a matmul (``in0[-1]``, ``in1[-2]``), the
    channels of a conv input, the samples of a loss's input and targets (a sum's
    input); none for an embedding (its vocab splits the table)."""
    r = len(in_shape)
    if node.dims.over_samples:  # a loss's input and targets, a sum's input: batch-first
        return (0,) if k < 2 and r and in_shape[0] == node.dims.reduced[0].size else ()
    if node.kind == "linear" and k == 0 and r:
        return (r - 1,)
    if node.kind == "matmul" and r >= 2:
        return (r - 1,) if k == 0 else (r - 2,) if k == 1 else ()
    if node.kind == "conv" and k == 0 and r >= 2:
        return (1,)
    return ()


def input_region(
    node: OpNode,
    k: int,
    in_shape: Sequence[int],
    out_region: Region,
    reduce: tuple[int, int] = (1, 0),
) -> Region:
    """The region of input ``k`` one task needs to compute ``out_region`` of the node's
    first output; ``reduce = (parts, index)`` when the node's reduced dim is split."""
    dmap = dim_map(node, k, in_shape)
    need = [(0, s) for s in in_shape]
    for (lo, hi), link in zip(out_region, dmap, strict=False):
        if link is None:
            continue
        j, num, den = link
        a, b = (lo * num) // den, -((-hi * num) // den)
        need[j] = (max(0, a), min(in_shape[j], b))
    parts, index = reduce
    if parts > 1:
        for j in reduced_input_dims(node, k, in_shape):
            need[j] = split_interval(in_shape[j], parts, index)
    return tuple(need)


def inverse_dim(dmap: DimMap, in_dim: int) -> int | None:
    """The output dim whose link is the *leading* (exact or coarse) image of ``in_dim``."""
    for i, link in enumerate(dmap):
        if link is not None and link[0] == in_dim:
            return i
    return None
