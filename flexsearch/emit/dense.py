"""Dense gradients at the seams of an emitted model.

Backward kernels hand on gradients in whatever layout they computed them (an LSTM's
input gradient, a transpose of a head-split attention output as a DTensor shard).
Two consumers need them dense: point-to-point receives into pre-allocated buffers
(``torch.distributed.pipelining`` sizes a stage's gradient buffers from the strides
its shape inference saw), and kernels that view their gradient (the embedding
backward).

- :func:`dense_grad` (an op's output inside the SOAP interpreter): a tensor hook that
  makes the gradient contiguous (no copy when it already is). A hook, not an autograd
  function: the output may be modified in place afterwards (``ReLU(inplace=True)``,
  ``out += x``), which autograd forbids on a custom function's view output.
- :func:`dense_input` (a pipeline stage's received input): a copy whose backward
  makes the gradient contiguous. The receive buffers are reused for every step, so a
  hook would pile up on them; the copy also lets the stage's first op work in place.
"""

from __future__ import annotations

from typing import Any

import torch


def _contiguous(grad: torch.Tensor) -> torch.Tensor:
    return grad.contiguous()


def dense_grad(x: Any) -> Any:
    """``x`` unchanged; its gradient made contiguous (tensors computed by an op only;
    anything else passes through)."""
    if isinstance(x, torch.Tensor) and x.requires_grad and x.grad_fn is not None:
        x.register_hook(_contiguous)
    return x


class _DenseCopy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad.contiguous()


def dense_input(x: Any) -> Any:
    """A copy of ``x`` whose gradient comes back contiguous (non-tensors and tensors
    without gradient pass through)."""
    return _DenseCopy.apply(x) if isinstance(x, torch.Tensor) and x.requires_grad else x
