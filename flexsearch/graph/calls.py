"""How to call one op of a traced graph again, alone: :class:`OpCall` (the module,
function or tensor method and its arguments) with :class:`ArgTensor` specs for its
tensor arguments. The tracer records one per op node
(:func:`flexsearch.graph.tracer.trace_calls`); the profiler partitions and times them
(:mod:`flexsearch.cost.profiler`, :mod:`flexsearch.cost.op_timing`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class ArgTensor:
    """A tensor argument of an op call: its shape, dtype, batch dim, the canonical
    name of the parameter or buffer it is (``None`` for activations), and whether it
    needs a gradient in the model (``grad``: computed from a parameter)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    batch: int | None
    state: str | None
    grad: bool = True


@dataclass(frozen=True)
class OpCall:
    """How to call one op node again: the module (``call_module``), the function, or
    the tensor method name, with its arguments as :class:`ArgTensor` specs."""

    op: str  # "call_module" | "call_function" | "call_method"
    target: Any
    module: nn.Module | None
    module_state: tuple[tuple[str, tuple[int, ...], torch.dtype, bool], ...]  # local name, shape, dtype, requires grad
    args: tuple
    kwargs: dict
