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
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.overrides import TorchFunctionMode

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
    weight: Any = None

    def summed(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The sum of the losses of samples ``x`` with targets ``y`` (each weighted by its
        class's weight, if any)."""
        if self.cross_entropy:
            return F.cross_entropy(x, y, weight=self.weight, reduction="sum", ignore_index=self.ignore_index,
                                   label_smoothing=self.label_smoothing)
        return F.nll_loss(x, y, weight=self.weight, reduction="sum", ignore_index=self.ignore_index)

    def counted(self, y: torch.Tensor) -> torch.Tensor:
        """What the mean of targets ``y`` (class indices) divides the sum by: the number
        of targets not ignored, or with class weights their weights' sum (torch's mean,
        label smoothing's term included)."""
        kept = y != self.ignore_index
        if self.weight is None:
            return kept.sum()
        return torch.where(kept, self.weight[y.masked_fill(~kept, 0)], 0).sum()


def loss_call(target: Any, module: nn.Module | None, args: tuple, kwargs: dict) -> LossCall:
    """The :class:`LossCall` of a call of ``target`` (``F.cross_entropy``, ``F.nll_loss``,
    an ATen loss of an exported graph) or ``module`` (``nn.CrossEntropyLoss``,
    ``nn.NLLLoss``) with ``args`` and ``kwargs``."""
    if module is not None:
        ce = isinstance(module, nn.CrossEntropyLoss)
        named = dict(zip(("input", "target"), args, strict=False)) | kwargs
        return LossCall(ce, named["input"], named["target"], module.reduction, module.ignore_index,
                        module.label_smoothing if ce else 0.0, module.weight)
    packet = getattr(target, "overloadpacket", target)
    if packet in _ATEN:
        named = dict(zip(_ATEN[packet], args[2:], strict=False)) | kwargs
        return LossCall(packet is torch.ops.aten.cross_entropy_loss, args[0], args[1],
                        _ATEN_REDUCTIONS[int(named.get("reduction", 1))], int(named.get("ignore_index", -100)),
                        float(named.get("label_smoothing", 0.0)), named.get("weight"))
    bound = inspect.signature(target).bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    reduction = a["reduction"]
    if a.get("size_average") is not None or a.get("reduce") is not None:  # the deprecated pair
        reduction = nn.modules.loss._Reduction.legacy_get_string(a["size_average"], a["reduce"])
    return LossCall(target is F.cross_entropy, a["input"], a["target"], reduction, a["ignore_index"],
                    a.get("label_smoothing", 0.0), a.get("weight"))


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
        counted = call.counted(yl).to(total.dtype)
    count = DTensor.from_local(counted, mesh, (Replicate(), Partial("sum")), run_check=False).redistribute(mesh, whole)
    return out / count


class GlobalMean(TorchFunctionMode):
    """While active on every rank of a data-parallel ``group`` of ``ranks`` ranks: each
    call of a mean cross-entropy or NLL loss over class indices on plain tensors
    (``F.cross_entropy``, ``F.nll_loss``, ``nn.CrossEntropyLoss``, an ATen loss of an
    exported graph) returns ``sum * ranks / C``, ``sum`` the call's losses summed and
    ``C`` its targets not ignored (their class weights' sum, if any), summed over the
    group (one all-reduce of a number per call, every rank making the same calls in the
    same order). The ranks' average, what
    DDP's and FSDP's gradients and the step's reported loss take, is the mean over the
    whole batch, ``sum of sums / C``, where each rank's own mean gives the mean of the
    ranks' means (module docstring). Other calls run as they are: a sum, class
    probabilities (every sample counts, as many on every rank)."""

    def __init__(self, group, ranks: int):
        super().__init__()
        self._group, self._ranks = group, ranks

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        call = _plain_mean(func, args, kwargs)
        if call is None:
            return func(*args, **kwargs)
        total = call.summed(call.input, call.target)
        count = call.counted(call.target).to(torch.float64)
        dist.all_reduce(count, group=self._group)
        return total * (self._ranks / count).to(total.dtype)


_LOSSES = (F.cross_entropy, F.nll_loss)


def _plain_mean(func, args: tuple, kwargs: dict) -> LossCall | None:
    """The :class:`LossCall` of ``func(*args, **kwargs)`` when :class:`GlobalMean` takes
    it (its docstring), else None."""
    if func not in _LOSSES and getattr(func, "overloadpacket", None) not in _ATEN:
        return None
    if any(isinstance(a, DTensor) for a in (*args, *kwargs.values())):
        return None
    call = loss_call(func, None, args, kwargs)
    if call.reduction != "mean" or call.target.is_floating_point():
        return None
    return call
