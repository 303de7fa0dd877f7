"""The op registry's rules for data movement: views, permutes, parts of a tensor,
concatenation and factories, which move no bytes through an op but move the batch dim
(:mod:`flexsearch.graph.registry` registers them on import)."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from flexsearch.graph.opgraph import ParallelDims
from flexsearch.graph.registry import Call, Ruling, _dims, _follow_batch, aten, rule


def _view_batch(c: Call) -> int | None:
    """A reshape keeps the batch dim when it stays the leading dim: with the same size,
    or merged with the dims after it (``(B, T, C) -> (B*T, C)``: contiguous rows, so a
    split of them is a split of the samples), or split back (``(B*T, C) -> (B, T, C)``)."""
    out = c.out_shape
    shape = c.in_shapes[0] if c.in_shapes else ()
    b = c.in_batch[0] if c.in_batch else None
    if out is None or b is None or b != 0 or not out or not shape:
        return None
    if out[0] == shape[0] or out[0] in _leading_products(shape) or shape[0] in _leading_products(out):
        return 0
    return None


def _leading_products(shape: Sequence[int]) -> set[int]:
    """Sizes of dim 0 merged with the next 1, 2, ... dims."""
    out, p = set(), shape[0]
    for d in shape[1:]:
        p *= d
        out.add(p)
    return out


@rule(nn.Flatten, nn.Unflatten, nn.Identity, torch.flatten, torch.reshape, "view", "reshape", "flatten",
      "contiguous", "unflatten", "view_as", "reshape_as", "expand", "expand_as", "repeat", "unsqueeze",
      "squeeze", torch.unsqueeze, torch.squeeze, "detach", "narrow", "clone_",
      aten.view, aten.reshape, aten._unsafe_view, aten.flatten, aten.unsqueeze, aten.squeeze,
      aten.expand, aten.clone, aten.contiguous, aten.alias, aten.detach, aten.unflatten)
def _reshape(c: Call) -> Ruling:
    # unsqueeze/squeeze in front of the batch shift it; otherwise it must stay leading.
    b = _view_batch(c)
    if b is None:
        b = _follow_batch(c)
    return Ruling("view", ParallelDims(output=_dims(c.out_shape, b)), b)


def _moved_batch(c: Call, perm: list[int]) -> Ruling:
    """A view whose output dim ``k`` is input dim ``perm[k]``: the batch moves with it."""
    b = c.in_batch[0] if c.in_batch else None
    b = perm.index(b) if b is not None and b in perm else None
    return Ruling("view", ParallelDims(output=_dims(c.out_shape, b)), b)


def _arguments(c: Call) -> tuple:
    """The call's arguments after its tensor (a tensor argument is None in ``c.args``)."""
    return c.args[1:] if c.args and c.args[0] is None else c.args


@rule("permute", torch.permute, aten.permute)
def _permute(c: Call) -> Ruling:
    """``x.permute(dims)``, ``x.permute(*dims)``."""
    n = len(c.in_shapes[0]) if c.in_shapes else 0
    args = _arguments(c)
    perm = list(range(n))
    if "dims" in c.kwargs:
        perm = [d % n for d in c.kwargs["dims"]]
    elif args and isinstance(args[0], (list, tuple)):
        perm = [d % n for d in args[0]]
    elif n and len(args) == n and all(isinstance(a, int) for a in args):  # the dims as separate arguments
        perm = [a % n for a in args]
    return _moved_batch(c, perm)


@rule("transpose", torch.transpose, aten.transpose)
def _transpose(c: Call) -> Ruling:
    """``x.transpose(i, j)``: dims ``i`` and ``j`` swapped."""
    n = len(c.in_shapes[0]) if c.in_shapes else 0
    args = _arguments(c)
    perm = list(range(n))
    i = c.kwargs.get("dim0", args[0] if args else None)
    j = c.kwargs.get("dim1", args[1] if len(args) > 1 else None)
    if isinstance(i, int) and isinstance(j, int) and n:
        perm[i % n], perm[j % n] = perm[j % n], perm[i % n]
    return _moved_batch(c, perm)


@rule(torch.t, "t", aten.t, "mT")
def _swap_last(c: Call) -> Ruling:
    """``x.t()`` (a 2-D tensor's two dims swapped), ``x.mT`` (the last two)."""
    n = len(c.in_shapes[0]) if c.in_shapes else 0
    perm = list(range(n))
    if n >= 2:
        perm[-1], perm[-2] = perm[-2], perm[-1]
    return _moved_batch(c, perm)


def _indexed_batch(batch: int | None, index: Any) -> int | None:
    """Where the batch dim lands after ``tensor[index]``: ints drop a dim, ``None``
    adds one, slices keep it; an index with ``...`` or tensors loses track."""
    if batch is None:
        return None
    index = index if isinstance(index, tuple) else (index,)
    out, src = 0, 0
    for i in index:
        if i is None:
            out += 1
        elif isinstance(i, int):
            if src == batch:
                return None
            src += 1
        elif isinstance(i, slice):
            if src == batch:
                return out
            src, out = src + 1, out + 1
        else:
            return None
    return out + (batch - src) if batch >= src else None


@rule(operator.getitem)
def _getitem(c: Call) -> Ruling:
    b = None
    if c.in_shapes and len(c.args) > 1 and c.args[0] is None:  # tensor[index]
        b = _indexed_batch(c.in_batch[0], c.args[1])
    elif len(c.args) > 1 and isinstance(c.args[0], (tuple, list)) and isinstance(c.args[1], int):
        # one output of a multi-output op (split, chunk, LSTM): its batch dim as it was
        i = c.args[1]
        b = c.in_batch[i] if -len(c.in_batch) <= i < len(c.in_batch) else None
    return Ruling("view", ParallelDims(output=_dims(c.out_shape, b)), b)


@rule("split", "chunk", torch.split, torch.chunk, "unbind", torch.unbind, "select",
      aten.split, aten.chunk, aten.slice, aten.select, aten.split_with_sizes, aten.unbind)
def _select(c: Call) -> Ruling:
    """A part of a tensor along one dim: split, chunk, slice (the dims kept, the one
    whose size changed is the split one) or unbind, select (that dim dropped: ``dim``,
    the first argument after the tensor, else 0). Along the batch, the batch is lost;
    along another dim it stays, one lower after a dropped dim before it."""
    shape, out = (c.in_shapes[0] if c.in_shapes else ()), c.out_shape
    b = c.in_batch[0] if c.in_batch else None
    if b is None or out is None or not shape:
        return Ruling("view", ParallelDims(output=_dims(out, None)), None)
    if len(out) == len(shape):
        split = [i for i, (x, y) in enumerate(zip(shape, out, strict=True)) if x != y]
        b = None if split and split[0] == b else b
    elif len(out) == len(shape) - 1:
        args = _arguments(c)
        dim = c.kwargs.get("dim", args[0] if args and isinstance(args[0], int) else 0) % len(shape)
        b = None if dim == b else b - (dim < b)
    else:
        b = None
    return Ruling("view", ParallelDims(output=_dims(out, b)), b)


@rule(torch.cat, torch.concat, torch.stack, aten.cat, aten.stack)
def _cat(c: Call) -> Ruling:
    dim = c.arg(1, "dim", 0)
    n = len(c.out_shape or ())
    b = _follow_batch(c)
    if b is not None and dim % max(n, 1) == b:
        b = None
    return Ruling("view", ParallelDims(output=_dims(c.out_shape, b, skip=(dim,))), b)


@rule(torch.arange, torch.zeros, torch.ones, torch.full, torch.empty, torch.zeros_like,
      torch.ones_like, torch.full_like, "new_zeros", "new_ones", "new_full", "new_empty",
      aten.arange, aten.zeros, aten.ones, aten.full, aten.empty, aten.zeros_like, aten.ones_like)
def _factory(c: Call) -> Ruling:
    b = _follow_batch(c)
    return Ruling("view", ParallelDims(output=_dims(c.out_shape, b)), b)
