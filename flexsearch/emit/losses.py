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
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.overrides import TorchFunctionMode

from flexsearch.errors import EmitError

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


class _ClassMeans(TorchFunctionMode):
    """A mode that runs every call :func:`_plain_mean` takes as its losses' sum and
    count, handed to :meth:`mean`; other calls run as they are."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        call = _plain_mean(func, args, kwargs)
        if call is None:
            return func(*args, **kwargs)
        total = call.summed(call.input, call.target)
        return self.mean(call, total, call.counted(call.target))

    def mean(self, call: LossCall, total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class GlobalMean(_ClassMeans):
    """While active on every rank of a data-parallel ``group`` of ``ranks`` ranks: each
    call of a mean cross-entropy or NLL loss over class indices on plain tensors
    (``F.cross_entropy``, ``F.nll_loss``, ``nn.CrossEntropyLoss``, an ATen loss of an
    exported graph) returns ``sum * ranks / C``, ``sum`` the call's losses summed and
    ``C`` its targets not ignored (their class weights' sum, if any), summed over the
    group (one all-reduce of a number per call, every rank making the same calls in the
    same order). The ranks' average, what DDP's and FSDP's gradients and the step's
    reported loss take, is the mean over the whole batch, ``sum of sums / C``, where each
    rank's own mean gives the mean of the ranks' means (module docstring). Other calls
    run as they are: a sum, class probabilities (every sample counts, as many on every
    rank)."""

    def __init__(self, group, ranks: int):
        super().__init__()
        self._group, self._ranks = group, ranks

    def mean(self, call: LossCall, total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        count = count.to(torch.float64)
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


class _Reweighted(torch.autograd.Function):
    """``total / count``, whose backward scales the gradient by ``box[0]`` as it stands
    when the backward runs (:class:`DeferredMean` sets it after the forward)."""

    @staticmethod
    def forward(ctx, total: torch.Tensor, count: torch.Tensor, box: list) -> torch.Tensor:  # type: ignore[override]
        ctx.box = box
        return total / count

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad * ctx.box[0], None, None


@dataclass(frozen=True)
class Settled:
    """A step's mean class losses over every rank and microbatch: the sum of their
    losses, their count and the targets per call (``per_call``; the same for all)."""

    total: float
    count: float
    per_call: int


class DeferredMean(_ClassMeans):
    """The whole batch's mean class loss for a step of several microbatches (gradient
    accumulation, a pipeline's schedule), where the count of a later microbatch is not
    known when an earlier one's backward runs. While active, a call :class:`GlobalMean`
    takes returns its own mean, ``sum / c``, with the gradient of ``sum / c`` (the
    user's loss as it was). :meth:`settle`, after a microbatch's loss and before its
    backward, turns that gradient into ``sum / N`` (``N`` the call's targets, ignored
    ones included: the same for every microbatch, and of the mean's size) when the loss
    *is* that one call's result; else it stays. :meth:`finish` then all-reduces the sums
    and counts: when every microbatch on every rank was settled, the gradients the step
    accumulated, times ``N / C`` and the step's averaging factor, are the whole batch's
    mean's (``C`` the count over everything), and its loss ``sum of sums / C``. A loss
    that combines a call with anything else (another loss, a regulariser) cannot be
    rescaled after the fact, so it keeps the mean of the microbatches' means: exact when
    each microbatch counts the same share of its targets, else :meth:`finish` warns
    (:data:`MEAN_OF_MEANS`)."""

    def __init__(self):
        super().__init__()
        self._calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, list]] = []
        self._settled: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        self._unsettled = 0
        self._shares: list[list[float]] = []  # per unsettled microbatch, each call's counted share of its targets

    def mean(self, call: LossCall, total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        count = count.to(total.dtype)
        box = [1.0 / float(count)] if float(count) else [0.0]
        out = _Reweighted.apply(total, count, box)
        if torch._C._current_graph_task_id() == -1:  # not a checkpointed region's recompute in the backward
            self._calls.append((out, total.detach(), count.detach(), call.target.numel(), box))
        return out

    def settle(self, loss: torch.Tensor) -> None:
        """Before ``loss``'s backward: the calls since the last settle are one
        microbatch's (class docstring)."""
        calls, self._calls = self._calls, []
        if len(calls) == 1 and calls[0][0] is loss:
            _, total, count, numel, box = calls[0]
            box[0] = 1.0 / numel
            self._settled.append((total, count, numel))
        else:
            self._unsettled += 1
            self._shares.append([float(count) / numel if numel else 1.0 for _, _, count, numel, _ in calls])

    def finish(self, group, counted: bool = True, device: torch.device | str = "cpu") -> Settled | None:
        """Every rank of ``group`` at the end of the step (``counted``: this rank's
        microbatches count, False for a copy of another rank's, such as a tensor-parallel
        rank's; ``device``: where the group's collectives run, a GPU under NCCL): the
        :class:`Settled` sums, or None when no rank settled any microbatch (the step's
        gradients are its means'). EmitError when some did and others did not (their
        gradients weigh the samples differently)."""
        mine = self._settled if counted else []
        sums = torch.tensor([sum(float(t) for t, _, _ in mine), sum(float(c) for _, c, _ in mine), len(mine),
                             self._unsettled if counted else 0], dtype=torch.float64, device=device)
        numels = [n for _, _, n in mine]
        shares = [[s[j] for s in self._shares if j < len(s)] for j in range(SHARED_CALLS)] if counted else []
        span = torch.tensor([max(numels), -min(numels)] if numels else [-1.0, -1e18], dtype=torch.float64,
                            device=device)
        spread = torch.tensor([v for j in range(SHARED_CALLS) for v in (
            (max(shares[j]), -min(shares[j])) if counted and shares[j] else (-1.0, -1e18))], dtype=torch.float64,
            device=device)
        both = torch.cat([span, spread])
        dist.all_reduce(sums, group=group)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
        span, spread = both[:2], both[2:]
        self._settled, self._unsettled, self._shares = [], 0, []
        total, count, settled, unsettled = (float(v) for v in sums)
        if not settled:
            if any(spread[2 * j] > -spread[2 * j + 1] + 1e-12 for j in range(SHARED_CALLS)):
                warnings.warn(MEAN_OF_MEANS, stacklevel=2)
            return None
        if unsettled or span[0] != -span[1]:
            raise EmitError("the step's microbatches computed their class losses differently (some a single "
                            "mean loss, others not, or over targets of different sizes), so their gradients "
                            "cannot be weighed as the whole batch's mean; give every microbatch the same loss")
        return Settled(total, count, int(span[0]))


SHARED_CALLS = 8
"""The class-loss calls per microbatch whose counted shares :meth:`DeferredMean.finish`
compares across microbatches (the first ones, in call order)."""

MEAN_OF_MEANS = (
    "the loss adds other terms to a mean class loss whose microbatches count different shares of their targets "
    "(ignored labels, class weights): this plan's microbatches (a pipeline's, or gradient accumulation) weigh "
    "each microbatch's mean the same, where the single process weighs each counted target the same, so its gradients differ from "
    "the model's; return the class loss alone (add the other terms outside the model's loss), or plan without "
    "microbatches (--kind data or soap)")
"""What :meth:`DeferredMean.finish` warns when a loss it cannot reweigh (a class loss
plus other terms) is a mean of unequal microbatch means."""


def settled_loss(settled: Settled) -> torch.Tensor:
    """The step's loss: the sum of the losses over their count (NaN when every target
    was ignored, as the single process's mean is)."""
    return torch.tensor(settled.total / settled.count if settled.count else float("nan"))
