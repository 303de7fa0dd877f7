"""Data-parallel plans: ``DistributedDataParallel``, or FSDP2 ``fully_shard`` when the
plan shards parameters (``Plan.shard_params``).

Calling convention: ``module(x)`` is the wrapped model on *this rank's* shard of the
batch (as with DDP); :meth:`DataParallelModule.train_step` takes the global batch on
every rank, runs this rank's shard forward and backward (the wrapper averages the
gradients), and returns the global mean loss.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from flexsearch.emit.runtime import Runtime
from flexsearch.errors import EmitError


def batch_shard(x: Any, index: int, parts: int) -> Any:
    """Part ``index`` of ``parts`` equal slices of ``x`` along dim 0 (tensors only)."""
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        return x
    if x.shape[0] % parts:
        raise EmitError(f"the batch of {x.shape[0]} does not split evenly over {parts} data-parallel ranks; "
                        f"use a batch that is a multiple of {parts}")
    n = x.shape[0] // parts
    return x[index * n:(index + 1) * n]


def _shard_units(model: nn.Module) -> list[nn.Module]:
    """The top-level layers that hold parameters (containers are looked into)."""
    out = []
    for child in model.children():
        if not any(True for _ in child.parameters()):
            continue
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            out.extend(_shard_units(child))
        else:
            out.append(child)
    return out


def _untied(units: list[nn.Module]) -> list[nn.Module]:
    """The units sharing no parameter with another (tied weights stay in the root group)."""
    seen: dict[int, int] = {}
    for u in units:
        for q in u.parameters():
            seen[id(q)] = seen.get(id(q), 0) + 1
    return [u for u in units if all(seen[id(q)] == 1 for q in u.parameters())]


class DataParallelModule(nn.Module):
    """A data-parallel model: ``module`` is the DDP wrapper or the fully-sharded model."""

    def __init__(self, model: nn.Module, rt: Runtime, shard_params: bool):
        super().__init__()
        self._rt = rt
        self.sharded = shard_params
        if shard_params:
            from torch.distributed.fsdp import fully_shard

            mesh = rt.mesh(list(range(len(rt.ranks))), ("dp",))
            for unit in _untied(_shard_units(model)):  # one unit per top-level layer, then the root
                fully_shard(unit, mesh=mesh, reshard_after_forward=True)
            fully_shard(model, mesh=mesh, reshard_after_forward=True)
            self.module = model
        else:
            self.module = DistributedDataParallel(model, process_group=rt.group)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @property
    def model(self) -> nn.Module:
        """The model with the original parameter names (for state dicts)."""
        return self.module if self.sharded else self.module.module

    def named_original_parameters(self):
        return self.model.named_parameters()

    def train_step(self, inputs: tuple, target: Any, loss_fn: Callable[[Any, Any], torch.Tensor]) -> torch.Tensor:
        n, i = len(self._rt.ranks), self._rt.device
        out = self(*(batch_shard(x, i, n) for x in inputs))
        loss = loss_fn(out, batch_shard(target, i, n))
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total, group=self._rt.group)
        return total / n


def data_parallel(model: nn.Module, rt: Runtime, shard_params: bool) -> DataParallelModule:
    """A :class:`DataParallelModule` over a copy of ``model`` (the caller's model is kept)."""
    return DataParallelModule(copy.deepcopy(model), rt, shard_params)
