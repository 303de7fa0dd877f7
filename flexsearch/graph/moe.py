"""Mixture-of-experts layers: routed (grouped) matmuls costed at their expected load.

A top-k router sends each of ``R / k`` tokens to ``k`` experts; the experts then run as
one grouped matmul over the ``R`` routed rows (``torch._grouped_mm``, or Hugging Face
``transformers``' ``grouped_mm_fallback`` custom op on machines without it): rows
``offs[e-1]:offs[e]`` times expert ``e``'s ``(K, N)`` weight. How many rows each
expert gets depends on the data; the total does not. So the op is costed as
``2 R K N`` forward FLOPs (and twice that for its input and weight gradients) whatever
the routing, and every expert is taken to receive ``R / E`` rows (balanced, the load a
load-balancing loss aims for): the **expected load**. The tracer says so in the
graph's notes when a model has such ops.

``torch.utils.flop_counter`` has no formula for these ops; :func:`register` adds them
(idempotent), and :data:`GROUPED_MM` names them for the op registry (kind ``matmul``).
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import flop_registry, register_flop_formula

NOTE = ("mixture-of-experts routing costed at its expected load: each token's top-k experts, "
        "the grouped matmul's rows balanced over the experts")


def _ops(name: str) -> list:
    ns, _, op = name.partition("::")
    packet = getattr(getattr(torch.ops, ns, None), op, None)
    return [packet] if packet is not None and hasattr(packet, "default") else []


def grouped_mm_ops() -> list:
    """The grouped-matmul op packets this torch (and transformers, when imported) has."""
    return _ops("aten::_grouped_mm") + _ops("transformers::grouped_mm_fallback")


def _rows_k_n(a_shape, b_shape) -> tuple[int, int, int]:
    """(rows, K, N) of a grouped matmul of a 2-D ``(R, K)`` input with a 3-D
    ``(E, K, N)`` weight (the routed case); other layouts: the plain product."""
    if len(a_shape) == 2 and len(b_shape) == 3:
        return a_shape[0], a_shape[1], b_shape[2]
    rows = 1
    for s in a_shape[:-1]:
        rows *= s
    return rows, a_shape[-1], b_shape[-1]


def _forward_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    r, k, n = _rows_k_n(a_shape, b_shape)
    return 2 * r * k * n


def _backward_flops(a_shape, b_shape, offs_shape=None, grad_shape=None, *args, out_shape=None, **kwargs) -> int:
    r, k, n = _rows_k_n(a_shape, b_shape)
    return 4 * r * k * n  # input and weight gradients


def register() -> tuple:
    """Register the FLOP formulas of the grouped-matmul ops present (once each, unless
    torch has its own); the op packets, for the op registry."""
    ops = grouped_mm_ops()
    for packets, formula in ((ops, _forward_flops),
                             (_ops("transformers::grouped_mm_fallback_backward"), _backward_flops)):
        for op in packets:
            if op not in flop_registry:
                register_flop_formula(op)(formula)
    return tuple(ops)


def is_grouped_mm(target) -> bool:
    """Is ``target`` (an FX node's target) a grouped matmul?"""
    name = str(target)
    return "grouped_mm" in name and "backward" not in name
