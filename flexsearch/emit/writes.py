"""In-place writes in a SOAP plan's graph (``k[..., :d].copy_(q)``, ``x.detach_()``).

The SOAP emitter brings each op's inputs to its configuration's layout, and runs ops
DTensor has no rule for on local tensors. For a write into its first argument either
loses the write (it lands in a redistributed copy, or in a local tensor, while the
graph's later readers read the original) or autograd refuses it (a view made by
``to_local``). So a write runs on the tensor as it is laid out, its other inputs
brought to that layout, as DTensor's own in-place ops run (DeepSeek-V3's attention fills
``new_empty`` through slices); ``detach_``, which writes no values and which a view
refuses, gives the tensor's readers a detached one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import implicit_replication

from flexsearch.graph.opgraph import in_place_op

AS_PLANNED = object()
""":func:`write_in_place`'s answer for an op it does not run."""


def op_name(n: fx.Node) -> str:
    """``copy_`` of a method call ``copy_`` or of ATen's ``copy_.default``."""
    name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")
    return name.split(".")[0]


def write_in_place(n: fx.Node, env: dict[fx.Node, Any], opaque: bool,
                   relayout: Callable[[DTensor, Any, tuple], DTensor], call: Callable[[tuple, dict], Any],
                   rank: int) -> Any:
    """Run op ``n`` as the module docstring says, its inputs' values in ``env`` (the
    graph runner's, updated for ``detach_``); ``relayout(value, mesh, placements)``
    brings a DTensor to a layout, ``call(args, kwargs)`` runs the op. :data:`AS_PLANNED`
    when ``n`` is no such write, or DTensor has no rule for it."""
    target = env.get(n.args[0]) if n.args and isinstance(n.args[0], fx.Node) else None
    if op_name(n) == "detach_" and isinstance(target, torch.Tensor):
        env[n.args[0]] = out = target.detach()  # its readers, before and after, get a detached one
        return out
    if not (opaque and in_place_op(op_name(n)) and isinstance(target, DTensor)):
        return AS_PLANNED

    def onto(a: fx.Node) -> Any:
        v = env[a]
        return v if a is n.args[0] or not isinstance(v, DTensor) else relayout(v, target.device_mesh, target.placements)

    try:
        args, kwargs = fx.node.map_arg((n.args, n.kwargs), onto)
        with implicit_replication():
            return call(args, kwargs)
    except NotImplementedError:  # no DTensor rule for it: as other opaque ops
        return AS_PLANNED
    except Exception as e:
        e.add_note(f"flexsearch: while running op {n.name} in place on rank {rank}")
        raise
