"""Dense gradients at the seams of an emitted model.

Backward kernels hand on gradients in whatever layout they computed them (an LSTM's
input gradient, a transpose of a head-split attention output as a DTensor shard).
Two consumers need them dense: point-to-point receives into pre-allocated buffers
(``torch.distributed.pipelining`` sizes a stage's gradient buffers from the strides
its shape inference saw), and kernels that view their gradient (the embedding
backward). :func:`dense_grad` is an identity whose backward makes the gradient
contiguous (no copy when it already is).
"""

from __future__ import annotations

from typing import Any

import torch


class _DenseGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad.contiguous()


def dense_grad(x: Any) -> Any:
    """``x`` unchanged forward; its gradient contiguous backward (non-tensors and
    tensors without gradient pass through)."""
    return _DenseGrad.apply(x) if isinstance(x, torch.Tensor) and x.requires_grad else x
