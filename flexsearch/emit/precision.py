"""A plan's training precision at run time (:mod:`flexsearch.precision`), for every
emitted module alike:

- ``bf16-mixed`` / ``fp16-mixed``: the forward and the loss run under
  ``torch.autocast(device, dtype)`` (:func:`autocast`; a pipeline stage is wrapped in
  :class:`Autocast`); the model stays fp32, so it is its own master copy and its
  gradients and optimizer state are fp32. FSDP2 plans also gather parameters in the low
  dtype and reduce-scatter gradients in fp32 (:func:`fsdp_policy`).
- ``fp16-mixed`` scales the loss by :data:`LOSS_SCALE` before the backward and divides
  the gradients by it after (static loss scaling: fp16's narrow exponent would flush
  small gradients to zero). Dynamic scaling (``torch.amp.GradScaler``) needs the
  optimizer step, which the caller owns; use ``bf16-mixed`` where the hardware has bf16.
- ``bf16``: the model (the emitter's copy) and the floating-point inputs are cast to
  bf16 (:func:`cast_model`, :func:`cast_inputs`): parameters, gradients and optimizer
  state are bf16.
- ``tf32``: TF32 matmuls on CUDA (``torch.backends.cuda.matmul.allow_tf32``; a CPU has
  none, so nothing changes there).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from flexsearch import precision as precision_mod
from flexsearch.errors import EmitError
from flexsearch.precision import Precision

LOSS_SCALE = 2.0 ** 10
"""fp16-mixed's static loss scale."""


def autocast(precision: Precision, device_type: str):
    """The context a forward runs in: autocast for mixed precision, else nothing."""
    if precision.autocast is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=getattr(torch, precision.autocast))


class Autocast(nn.Module):
    """A module whose forward runs under the precision's autocast (a pipeline stage)."""

    def __init__(self, inner: nn.Module, precision: Precision, device_type: str):
        super().__init__()
        self.inner = inner
        self._precision, self._device_type = precision, device_type

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with autocast(self._precision, self._device_type):
            return self.inner(*args, **kwargs)


def check_runs_here(model: nn.Module, precision: Precision, device_type: str) -> None:
    """EmitError when ``model`` cannot run in ``precision`` on this machine: CPU autocast
    runs an LSTM through oneDNN, which has no low-precision LSTM on a CPU without
    AVX512-BF16/AMX (it fails on the first forward)."""
    if precision.autocast is None or device_type != "cpu" or not any(isinstance(m, nn.LSTM) for m in model.modules()):
        return
    if not precision_mod.host_runs_bf16():
        raise EmitError(f"this CPU has no bf16 support, so the model's LSTM cannot run under {precision.name} "
                        "autocast here (oneDNN); plan it with --precision fp32 or bf16")


def cast_model(model: nn.Module, precision: Precision) -> nn.Module:
    """``model`` (the emitter's own copy) with its floating-point state in the
    precision's storage dtype (bf16 for ``bf16``; unchanged otherwise)."""
    if precision.tf32 and torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if precision.cast is not None:
        model.to(getattr(torch, precision.cast))
    return model


def cast_inputs(values: Iterable[Any], precision: Precision) -> tuple:
    """Floating-point tensors in the model's storage dtype (``bf16``); others unchanged."""
    if precision.cast is None:
        return tuple(values)
    dtype = getattr(torch, precision.cast)
    return tuple(v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v for v in values)


def loss_scale(precision: Precision) -> float:
    return LOSS_SCALE if precision.autocast == "float16" else 1.0


def backward(loss: torch.Tensor, precision: Precision, params: Callable[[], Iterable[torch.Tensor]],
             unscaled: bool = True) -> None:
    """``loss.backward()``, scaled and unscaled for fp16-mixed (module docstring);
    ``unscaled=False`` leaves the gradients scaled: a microbatch before the last of an
    accumulated step (the last one's unscales what they all accumulated, once)."""
    scale = loss_scale(precision)
    if scale == 1.0:
        loss.backward()
        return
    (loss * scale).backward()
    if unscaled:
        unscale(params(), scale)


def unscale(params: Iterable[torch.Tensor], scale: float) -> None:
    """Divide every gradient by ``scale`` (in place)."""
    if scale == 1.0:
        return
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                p.grad.div_(scale)


def fsdp_policy(precision: Precision):
    """FSDP2's mixed-precision policy for ``precision`` (None: gather in the storage
    dtype): parameters gathered in the low dtype, gradients reduce-scattered in fp32,
    the forward's inputs left to autocast."""
    if precision.autocast is None:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=getattr(torch, precision.autocast), reduce_dtype=torch.float32,
                                cast_forward_inputs=False)
