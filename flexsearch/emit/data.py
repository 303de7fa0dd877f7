"""Data-parallel plans, by their sharding (``Plan.shard``,
:data:`flexsearch.strategy.kinds.SHARDINGS`): ``DistributedDataParallel`` (``none``;
``zero1`` adds ``ZeroRedundancyOptimizer`` from :meth:`DataParallelModule.make_optimizer`),
or FSDP2 ``fully_shard`` over the FSDP units the plan records
(:mod:`flexsearch.strategy.fsdp`; the same rule for plans that record none):
``reshard_after_forward=False`` for ``zero2``, ``True`` for ``zero3``, and on a 2-D
``(replicate, shard)`` mesh of the plan's shard groups for ``hsdp``.

Calling convention: ``module(x)`` is the wrapped model on *this rank's* shard of the
batch (as with DDP); :meth:`DataParallelModule.train_step` takes the global batch on
every rank, runs this rank's shard forward and backward (the wrapper averages the
gradients), and returns the global mean loss. Without accumulation a mean class loss
(cross-entropy, NLL) is the whole batch's, ignored targets counted over every rank
(:class:`flexsearch.emit.losses.GlobalMean`), as the single process computes it: with
padded labels each rank's own mean would weigh its samples by its own count. With
``microbatches > 1`` too, when the loss is one such call
(:class:`flexsearch.emit.losses.DeferredMean`: the gradients rescaled once the counts
are in); a loss that adds anything to it keeps the mean of the microbatches' means.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from flexsearch.emit.inputs import shard, split, step_loss
from flexsearch.emit.losses import DeferredMean, GlobalMean, settled_loss
from flexsearch.emit.precision import (
    autocast,
    backward,
    cast_inputs,
    cast_model,
    fsdp_policy,
    unscale,
)
from flexsearch.emit.recompute import checkpoint_modules
from flexsearch.emit.runtime import Runtime
from flexsearch.errors import EmitError
from flexsearch.graph.modules import module_facts
from flexsearch.graph.opgraph import OpGraph
from flexsearch.plan import Plan
from flexsearch.strategy.fsdp import fsdp_units
from flexsearch.strategy.kinds import FSDP_SHARDINGS


def has_batch_norm(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def batch_shard(x: Any, index: int, parts: int) -> Any:
    """Part ``index`` of ``parts`` equal slices of ``x`` along dim 0 (tensors only)."""
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        return x
    if x.shape[0] % parts:
        raise EmitError(f"the batch of {x.shape[0]} does not split evenly over {parts} data-parallel ranks; "
                        f"use a batch that is a multiple of {parts}")
    n = x.shape[0] // parts
    return x[index * n:(index + 1) * n]


def shard_units(model: nn.Module, units: tuple[str, ...] | None = None) -> list[nn.Module]:
    """The modules wrapped as FSDP units: ``units`` (module paths, as a plan records
    them), else the rule of :func:`flexsearch.strategy.fsdp.fsdp_units` applied to the
    model's facts (:func:`flexsearch.graph.modules.module_facts`)."""
    if units is None:
        units = fsdp_units(module_facts(model))
    try:
        return [model.get_submodule(u) for u in units]
    except AttributeError as e:
        raise EmitError(f"the plan's FSDP unit is not a module of this model ({e}); plan this model again") from None


class DataParallelModule(nn.Module):
    """A data-parallel model: ``module`` is the DDP wrapper or the fully-sharded model."""

    def __init__(self, model: nn.Module, rt: Runtime, shard: str = "none", units: tuple[str, ...] | None = None,
                 microbatches: int = 1, shard_group: int = 0, find_unused: bool = False):
        super().__init__()
        self._rt = rt
        self.shard = shard
        self.sharded = shard in FSDP_SHARDINGS
        self.microbatches = microbatches
        cast_model(model, rt.precision)
        if self.sharded:
            from torch.distributed.fsdp import fully_shard

            n = len(rt.ranks)
            if shard == "hsdp":
                if not 1 < shard_group < n or n % shard_group:
                    raise EmitError(f"the hsdp plan's shard groups of {shard_group} do not split {n} ranks into "
                                    "2 or more groups; plan again")
                mesh = rt.mesh([[k + j for j in range(shard_group)] for k in range(0, n, shard_group)],
                               ("replicate", "shard"))
            else:
                mesh = rt.mesh(list(range(n)), ("dp",))
            kw = {"mp_policy": policy} if (policy := fsdp_policy(rt.precision)) is not None else {}
            kw["reshard_after_forward"] = shard != "zero2"
            for unit in shard_units(model, units):  # the plan's units, then the root
                fully_shard(unit, mesh=mesh, **kw)
            fully_shard(model, mesh=mesh, **kw)
            self.module = model
        else:
            self.module = DistributedDataParallel(model, process_group=rt.group, find_unused_parameters=find_unused)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with autocast(self._rt.precision, self._rt.device_type):
            return self.module(*cast_inputs(args, self._rt.precision),
                               **dict(zip(kwargs, cast_inputs(kwargs.values(), self._rt.precision), strict=True)))

    @property
    def model(self) -> nn.Module:
        """The model with the original parameter names (for state dicts)."""
        return self.module if self.sharded else self.module.module

    def named_original_parameters(self):
        return self.model.named_parameters()

    def make_optimizer(self, cls: type[torch.optim.Optimizer], **kwargs: Any) -> torch.optim.Optimizer:
        """The optimizer the plan trains with: ``cls`` over the trainable parameters, as
        ``ZeroRedundancyOptimizer`` (each rank keeps and updates its share of the state,
        then broadcasts its parameters) under ``zero1``."""
        params = [p for p in self.parameters() if p.requires_grad]
        if self.shard != "zero1":
            return cls(params, **kwargs)
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, optimizer_class=cls, process_group=self._rt.group, **kwargs)

    def train_step(self, inputs: tuple, target: Any = None,
                   loss_fn: Callable[[Any, Any], torch.Tensor] | None = None) -> torch.Tensor:
        """This rank's shard of the batch, forward and backward, as ``microbatches``
        accumulated microbatches (the gradients synchronised once, after the last).
        ``loss_fn`` None: the model's own loss (:mod:`flexsearch.emit.inputs`)."""
        n, i, m = len(self._rt.ranks), self._rt.device, self.microbatches
        prec = self._rt.precision
        xs, ys = shard(inputs, i, n), batch_shard(target, i, n)
        total = torch.zeros(())
        means = DeferredMean() if m > 1 else GlobalMean(self._rt.group, n) if n > 1 else contextlib.nullcontext()
        for k in range(m):
            last = k == m - 1
            with self._sync(last):
                args, kwargs = split(shard(xs, k, m))
                with means:
                    out = self(*args, **kwargs)
                    with autocast(prec, self._rt.device_type):
                        loss = step_loss(out, batch_shard(ys, k, m), loss_fn)
                if m > 1:
                    means.settle(loss)
                loss = loss / m
                backward(loss, prec, self.parameters, unscaled=last)
            total = total + loss.detach().float()
        settled = means.finish(self._rt.group, device=self._rt.local_device) if m > 1 else None
        if settled is not None:  # the whole batch's mean: its gradients are the settled sums' times n m N / C
            if settled.count:  # every target ignored: no gradient to weigh (each is zero)
                unscale(self.parameters(), settled.count / (n * m * settled.per_call))
            return settled_loss(settled)
        dist.all_reduce(total, group=self._rt.group)
        return total / n

    def _sync(self, last: bool):
        """No gradient synchronisation before the last microbatch (DDP's ``no_sync``;
        FSDP2's ``set_requires_gradient_sync``, and ``set_reshard_after_backward``: the
        gathered parameters kept until the last microbatch's backward, as
        :data:`~flexsearch.strategy.kinds.ACCUMULATING_SHARDINGS` models it)."""
        if self.microbatches == 1:
            return contextlib.nullcontext()
        if self.sharded:
            self.module.set_requires_gradient_sync(last)
            self.module.set_reshard_after_backward(last)
            return contextlib.nullcontext()
        return contextlib.nullcontext() if last else self.module.no_sync()


def unused_frozen(model: nn.Module, graph: OpGraph) -> bool:
    """Stop the parameters no op of ``graph`` reads (a leftover layer) from requiring
    gradients, on the emitter's copy ``model``: DDP waits for every trained parameter's
    gradient and fails the next step without one, while the single process leaves their
    ``grad`` None and its optimizer skips them (the same training), and the simulation
    counts none of their bytes. False, changing nothing, when the parameters found by
    name are not the tracer's ``unused_params`` to the element."""
    if not graph.unused_params:
        return True
    used = {p for n in graph.nodes for p in n.params}
    names: dict[int, tuple[nn.Parameter, list[str]]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), (p, []))[1].append(name)
    idle = [p for p, ns in names.values() if not any(n in used for n in ns)]
    if sum(p.numel() for p in idle) != graph.unused_params:
        return False
    for p in idle:
        p.requires_grad_(False)
    return True


def data_parallel(model: nn.Module, rt: Runtime, plan: Plan, graph: OpGraph) -> DataParallelModule:
    """A :class:`DataParallelModule` over a copy of ``model`` (the caller's model is
    kept): the plan's FSDP units when it shards, its checkpointed units
    (:mod:`flexsearch.emit.recompute`) and its gradient accumulation; parameters no op
    reads do not train (:func:`unused_frozen`; DDP looks for them each step where they
    are not found by name)."""
    copied = checkpoint_modules(copy.deepcopy(model), graph, plan.recompute)
    unused_found = unused_frozen(copied, graph)
    if plan.batch_norm == "sync" and has_batch_norm(copied):
        if rt.device_type == "cpu":
            raise EmitError("SyncBatchNorm runs on GPUs only; on CPU plan with --batch-norm local")
        copied = nn.SyncBatchNorm.convert_sync_batchnorm(copied, process_group=rt.group)
    return DataParallelModule(copied, rt, plan.shard, plan.fsdp_units or None, plan.microbatches or 1,
                              plan.shard_group or 0, find_unused=not unused_found)
