"""A cross-entropy or NLL loss split by the samples, as the SOAP emitter runs it.

A loss reduced to a number may be split by its samples (a reduce split whose reduced
dim is the batch: :mod:`flexsearch.strategy.config`). DTensor would run it as a
``Partial`` average of the shards' means, which is the mean only when every shard
holds as many counted targets: with ignored targets (``ignore_index``, -100 by default:
a padded batch, Hugging Face's shifted labels) it is another number, and NaN when one
shard's targets are all ignored. So each of the ``t`` ranks computes the *sum* of its
samples' losses and the count of its targets not ignored (class probabilities as
targets: of its samples, times their positions); the loss is the sum of the sums
(``reduction="sum"``) or that over the sum of the counts (``"mean"``): what the whole
batch gives, label smoothing included (torch averages both of its terms over the same
count). Class weights are never split (the registry leaves them whole).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

_ATEN_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}
_ATEN = {  # op packet -> (names of its arguments after the input and target)
    torch.ops.aten.cross_entropy_loss: ("weight", "reduction", "ignore_index", "label_smoothing"),
    torch.ops.aten.nll_loss: ("weight", "reduction", "ignore_index"),
    torch.ops.aten.nll_loss_nd: ("weight", "reduction", "ignore_index"),
}


@dataclass(frozen=True)
class LossCall:
    """One loss call, normalised: its input and target, ``reduction`` (``"mean"`` or
    ``"sum"``), ``ignore_index`` and label smoothing (cross-entropy only)."""

    cross_entropy: bool
    input: Any
    target: Any
    reduction: str
    ignore_index: int
    label_smoothing: float = 0.0

    def summed(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The sum of the losses of samples ``x`` with targets ``y``."""
        if self.cross_entropy:
            return F.cross_entropy(x, y, reduction="sum", ignore_index=self.ignore_index,
                                   label_smoothing=self.label_smoothing)
        return F.nll_loss(x, y, reduction="sum", ignore_index=self.ignore_index)


def loss_call(target: Any, module: nn.Module | None, args: tuple, kwargs: dict) -> LossCall:
    """The :class:`LossCall` of a call of ``target`` (``F.cross_entropy``, ``F.nll_loss``,
    an ATen loss of an exported graph) or ``module`` (``nn.CrossEntropyLoss``,
    ``nn.NLLLoss``) with ``args`` and ``kwargs``."""
    if module is not None:
        ce = isinstance(module, nn.CrossEntropyLoss)
        named = dict(zip(("input", "target"), args, strict=False)) | kwargs
        return LossCall(ce, named["input"], named["target"], module.reduction, module.ignore_index,
                        module.label_smoothing if ce else 0.0)
    packet = getattr(target, "overloadpacket", target)
    if packet in _ATEN:
        named = dict(zip(_ATEN[packet], args[2:], strict=False)) | kwargs
        return LossCall(packet is torch.ops.aten.cross_entropy_loss, args[0], args[1],
                        _ATEN_REDUCTIONS[int(named.get("reduction", 1))], int(named.get("ignore_index", -100)),
                        float(named.get("label_smoothing", 0.0)))
    bound = inspect.signature(target).bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    reduction = a["reduction"]
    if a.get("size_average") is not None or a.get("reduce") is not None:  # the deprecated pair
        reduction = nn.modules.loss._Reduction.legacy_get_string(a["size_average"], a["reduce"])
    return LossCall(target is F.cross_entropy, a["input"], a["target"], reduction, a["ignore_index"],
                    a.get("label_smoothing", 0.0))


def loss_by_samples(call: LossCall, mesh) -> DTensor:
    """The loss of ``call``, its input and target ``(Replicate(), Shard(0))`` DTensors on
    the ``(s, t)`` ``mesh`` (module docstring): replicated on the mesh. Every rank of the
    mesh takes part (an exported graph's ops use every device)."""
    x, yl = call.input, call.target.to_local()
    whole = (Replicate(), Replicate())
    total = call.summed(x.to_local(grad_placements=(Replicate(), Shard(0))), yl)
    out = DTensor.from_local(total, mesh, (Replicate(), Partial("sum")), run_check=False).redistribute(mesh, whole)
    if call.reduction == "sum":
        return out
    if yl.is_floating_point():  # class probabilities: every sample (and position) counts
        counted = torch.tensor(yl.numel() // yl.shape[1] if yl.dim() > 1 else yl.numel(), dtype=total.dtype,
                               device=total.device)
    else:
        counted = (yl != call.ignore_index).sum().to(total.dtype)
    count = DTensor.from_local(counted, mesh, (Replicate(), Partial("sum")), run_check=False).redistribute(mesh, whole)
    return out / count
