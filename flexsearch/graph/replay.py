"""Replaying repeated calls while the tracer measures (:class:`flexsearch.graph.measure.Measure`).

A model's layers call the same ops on the same shapes again and again (GPT 1T: 128
blocks). A call identical to an earlier one up to names (:func:`replay_key`: the same
target and configuration, typed constants, input shapes, strides, dtypes, gradient
flags, storage sharing and kind, the module's classes and plain attributes) is not run
again: :func:`recorded` keeps what the first call left, and :class:`Replay` makes fresh
fakes of the recorded layout (views of stand-ins for the copies it ran on, where it
returned views) and maps its saved tensors onto the new call's inputs. The graph is the
one running every call gives (``tests/test_tracer.py`` compares them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_flatten, tree_unflatten

from flexsearch.graph.saved import SavedTensors, storage

PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout)
OPAQUE = object()


def plain(x: Any) -> Any:
    """``x`` as a replay key part, with its type (``1``, ``1.0`` and ``True`` differ),
    when it is a constant that names itself (a number, a string, a dtype, a slice or
    size of them), else :data:`OPAQUE`."""
    if isinstance(x, PLAIN) or x is Ellipsis:
        return type(x).__name__, x
    if isinstance(x, slice):
        parts = (x.start, x.stop, x.step)
        return ("slice", parts) if all(isinstance(v, PLAIN) for v in parts) else OPAQUE
    if isinstance(x, (tuple, list)):  # torch.Size and others pytree leaves
        parts = tuple(plain(v) for v in x)
        return (type(x).__name__, parts) if OPAQUE not in parts else OPAQUE
    return OPAQUE


def hooked(module: nn.Module) -> bool:
    """Does a hook run around ``module``'s call (its own, a submodule's, or a global
    one)? What a hook does is not in a replay key: such calls are run."""
    from torch.nn.modules import module as mod

    if mod._global_forward_hooks or mod._global_forward_pre_hooks or mod._global_backward_hooks \
            or mod._global_backward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
               or getattr(m, "parametrizations", None) for m in module.modules())


def span(shape: tuple[int, ...], stride: tuple[int, ...], offset: int = 0) -> int:
    """Elements from the start of a storage to the last element of a tensor of this
    layout in it."""
    if any(n == 0 for n in shape):
        return 0
    return offset + 1 + sum((n - 1) * st for n, st in zip(shape, stride, strict=True))


def meta_of(t: torch.Tensor) -> tuple:
    """A tensor's shape, stride, offset and gradient flag."""
    return tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.requires_grad



@dataclass(frozen=True)
class Replay:
    """What a measured call left, to stand for a later call identical to it up to names
    (module docstring): its forward FLOPs; its output tree (``spec``) with, per leaf:
    ``("const", v)``; ``("same", j)``, the object of leaf ``j``; ``("fresh", g, shape,
    stride, offset)``, a tensor in fresh storage group ``g`` (``groups[g]``: elements,
    dtype, needs a gradient, and the shape and stride of its one tensor when that
    fills it: made at once); ``("view", i, shape, stride, offset)``, a view of what
    the op ran on for flat input ``i`` (the input's fresh copy, :meth:`~flexsearch.graph.measure.Measure._measured_call`,
    of layout ``copies[i]``; the input itself when not copied); ``("arg", i)``, that
    object itself. And what autograd packed, per storage: ``("in", i)`` (flat input
    ``i``), ``("out", g)`` (fresh group ``g``) or ``("internal", nbytes)``."""

    fwd: int
    spec: Any
    leaves: tuple
    groups: tuple[tuple[int, torch.dtype, bool, tuple | None], ...]
    copies: tuple[tuple[tuple[int, ...], tuple[int, ...]] | None, ...]
    packed: tuple[tuple[str, int], ...]

    def outputs(self, flat_in: list[torch.Tensor], saved: SavedTensors) -> tuple[Any, list[torch.Tensor], list]:
        """Outputs of the recorded layout (inside the fake mode) for a call on
        ``flat_in``: the output tree, the fresh groups' bases (stand-ins for what the
        call packed) and what it ran on (stand-ins for the copies its outputs view,
        registered with ``saved`` as copies of their inputs; only those: a real call returns
        every input's copy, which the alias test of :meth:`~flexsearch.graph.measure.Measure._op` reads alike)."""
        bases = [(torch.empty(n, dtype=dt) if whole is None else torch.empty_strided(*whole, dtype=dt)).requires_grad_(grad)
                 for n, dt, grad, whole in self.groups]
        ran_on: dict[int, torch.Tensor] = {}

        def arg(i: int) -> torch.Tensor:
            if i not in ran_on:
                x, copy = flat_in[i], self.copies[i]
                if copy is None:
                    ran_on[i] = x
                else:
                    stand_in = torch.empty_strided(*copy, dtype=x.dtype).requires_grad_(x.requires_grad)
                    saved.cloned(stand_in, x)
                    ran_on[i] = stand_in
            return ran_on[i]

        made: list[Any] = []
        for leaf in self.leaves:
            kind = leaf[0]
            if kind == "fresh":
                g = leaf[1]
                made.append(bases[g] if self.groups[g][3] is not None else bases[g].as_strided(*leaf[2:]))
            elif kind == "view":
                made.append(arg(leaf[1]).as_strided(*leaf[2:]))
            elif kind == "arg":
                made.append(arg(leaf[1]))
            elif kind == "same":
                made.append(made[leaf[1]])
            else:
                made.append(leaf[1])
        return tree_unflatten(made, self.spec), bases, list(ran_on.values())

    def stand_ins(self, flat_in: list[torch.Tensor], bases: list[torch.Tensor]) -> list[torch.Tensor]:
        """Tensors in the storages the recorded call packed, for a call on ``flat_in``
        whose fresh groups are ``bases`` (:meth:`outputs`): the input, the group's base,
        or a new byte tensor of the internal storage's size."""
        out = []
        for kind, v in self.packed:
            if kind == "in":
                out.append(flat_in[v])
            elif kind == "out":
                out.append(bases[v])
            else:  # "internal": v bytes
                out.append(torch.empty(v, dtype=torch.uint8))
        return out


def replay_key(saved: SavedTensors, sig: tuple, module: nn.Module | None, mod_params: dict[str, torch.Tensor], args, kwargs,
                flat_in: list[torch.Tensor]) -> tuple | None:
    """What makes a call identical to another up to names (module docstring): its
    :meth:`~flexsearch.graph.measure.Measure._signature`; its constants by type and value; per tensor input its shape,
    layout, dtype, gradient flag, which inputs share its storage and whether that is
    the model's state or a node's output; the module's class, its submodules'
    classes and plain attributes and its parameters' gradient flags. None (the call
    is run, never replayed) when a constant or attribute does not name itself, an
    input lives in a storage no node made (a constant), or a hook runs around the
    module."""
    consts = tuple(plain(x) for x in tree_flatten((args, kwargs))[0] if not isinstance(x, torch.Tensor))
    if OPAQUE in consts:
        return None
    first: dict[StorageWeakRef, int] = {}
    layout = []
    for t in flat_in:
        k = saved.key(t)
        kind = "state" if k in saved.state else "made" if k in saved.owner else None
        if kind is None:
            return None
        layout.append((tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype, t.requires_grad, kind,
                       first.setdefault(k, len(first))))
    attrs: tuple = ()
    if module is not None:
        if hooked(module):
            return None
        parts = []
        for path, m in module.named_modules():
            parts.append((path, type(m)))
            for k, v in vars(m).items():
                if k.startswith("_") or isinstance(v, (torch.Tensor, nn.Module)):
                    continue
                c = plain(v)
                if c is OPAQUE:
                    return None
                parts.append((path, k, c))
        attrs = (tuple(parts), tuple(p.requires_grad for p in mod_params.values()))
    return sig, consts, tuple(layout), attrs

def recorded(saved: SavedTensors, fwd: int, out: Any, packed: list[torch.Tensor], flat_in: list[torch.Tensor],
              ran_on: list[torch.Tensor], before: list[tuple]) -> Replay | None:
    """The :class:`Replay` of a call just measured on ``flat_in`` (``ran_on``: what it
    ran on in their place, :meth:`~flexsearch.graph.measure.Measure._measured_call`; ``before``: each input's shape,
    stride, offset and gradient flag before the call); None when the call changed an
    input it ran on itself (in place: an integer tensor is not copied), an output
    lives in a storage other than a fresh one or one of what it ran on (a
    parameter's), is a view or the copy of an input of another dtype or gradient flag
    (``detach``, ``view(dtype)``, ``requires_grad_``), is a copy of an input that does
    not fill its storage, or the call packed a storage that is neither its input's,
    its output's nor its own."""
    if any(x is t and meta_of(t) != was for x, t, was in zip(ran_on, flat_in, before, strict=True)):
        return None
    ins: dict[StorageWeakRef, int] = {}
    for i, t in enumerate(flat_in):
        ins.setdefault(saved.key(t), i)
    ran: dict[StorageWeakRef, int] = {}
    for i, t in enumerate(ran_on):
        ran.setdefault(storage(t), i)
    copies: list[tuple | None] = [None] * len(flat_in)
    made, spec = tree_flatten(out)
    leaves: list[tuple] = []
    groups: dict[StorageWeakRef, int] = {}
    layout: list[tuple[int, torch.dtype, bool]] = []
    seen: dict[int, int] = {}
    for j, t in enumerate(made):
        if not isinstance(t, torch.Tensor):
            if plain(t) is OPAQUE:
                return None
            leaves.append(("const", t))
            continue
        if id(t) in seen:
            leaves.append(("same", seen[id(t)]))
            continue
        seen[id(t)] = j
        k = storage(t)
        where = (tuple(t.shape), tuple(t.stride()), t.storage_offset())
        if k in ran:
            i = ran[k]
            x = ran_on[i]
            if (t.dtype, t.requires_grad) != (flat_in[i].dtype, flat_in[i].requires_grad):
                return None
            if x is not flat_in[i]:  # a fresh copy: made again as one
                if x.storage_offset() or x.untyped_storage().nbytes() != span(x.shape, x.stride()) * x.element_size():
                    return None
                copies[i] = (tuple(x.shape), tuple(x.stride()))
            elif k in saved.state:
                return None
            leaves.append(("arg", i) if t is x else ("view", i, *where))
            continue
        if k in ins or k in saved.state or k in saved.owner or k in saved.clone_of:
            return None
        if k not in groups:
            size = t.untyped_storage().nbytes()
            if size % t.element_size():
                return None
            groups[k] = len(layout)
            layout.append((size // t.element_size(), t.dtype, t.requires_grad))
        g = groups[k]
        if layout[g][1:] != (t.dtype, t.requires_grad):
            return None
        leaves.append(("fresh", g, *where))
    kinds: dict[StorageWeakRef, tuple[str, int]] = {}
    for t in packed:
        k = saved.key(t)
        if k in saved.state:
            continue
        if k in ins:
            kinds.setdefault(k, ("in", ins[k]))
        elif k in groups:
            kinds.setdefault(k, ("out", groups[k]))
        elif k in saved.owner:
            return None
        elif not saved.is_weight_cast(t):
            kinds[k] = ("internal", t.untyped_storage().nbytes())
    filled = [None] * len(layout)  # per group, the shape and stride of its one tensor that fills it
    count = [0] * len(layout)
    for leaf in leaves:
        if leaf[0] == "fresh":
            g, shape, stride, offset = leaf[1:]
            count[g] += 1
            if not offset and span(shape, stride) == layout[g][0]:
                filled[g] = (shape, stride)
    groups_ = tuple((*layout[g], filled[g] if count[g] == 1 else None) for g in range(len(layout)))
    return Replay(fwd, spec, tuple(leaves), groups_, tuple(copies), tuple(kinds.values()))
