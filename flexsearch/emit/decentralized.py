"""Decentralized plans: D-PSGD (Lian et al. 2017, REFERENCE section 3) on
torch.distributed point-to-point messages.

Every rank keeps its own copy ``x_i`` of the model (identical at the start: rank 0's
parameters and buffers are broadcast when the module is built). One iteration of
:meth:`DecentralizedModule.train_step`, for the mixing matrix ``W`` of the plan's gossip
topology (:mod:`flexsearch.strategy.topology`) at this iteration's step:

1. snapshot ``x_i``: the trainable parameters flattened into one contiguous buffer per
   (dtype, device);
2. post the exchange with ``dist.batch_isend_irecv``: send the snapshot to the ranks
   that mix it in (the topology's out-neighbours), receive the in-neighbours' ``x_j``;
3. meanwhile run forward and backward on this rank's slice of the batch: the gradient
   ``g_i`` is taken at the pre-averaging ``x_i``;
4. wait for the messages and set ``x_i <- W_ii x_i + sum_j W_ij x_j``;
5. the caller's ``optimizer.step()`` then applies ``g_i`` to the averaged parameters
   (for plain SGD: ``x_i <- sum_j W_ij x_j - lr g_i``, the paper's update).

torch.distributed does all communication (gloo on CPU, NCCL when the parameters are
on a GPU): one ``broadcast`` of rank 0's model at construction, point-to-point
messages for the gossip (no collective), and the mean loss that :meth:`~DecentralizedModule.train_step` returns costs one scalar
``all_reduce`` (overlapped with the exchange; ``global_loss=False`` drops it).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.utils._pytree import tree_map

from flexsearch.emit.data import batch_shard
from flexsearch.emit.inputs import shard, split, step_loss
from flexsearch.emit.precision import autocast, backward, cast_inputs, cast_model
from flexsearch.emit.runtime import Runtime
from flexsearch.errors import EmitError, FlexsearchError
from flexsearch.plan import Plan

if TYPE_CHECKING:
    from flexsearch.strategy.topology import Topology


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def topology_of(plan: Plan) -> Topology:
    """The gossip topology a decentralized plan names, over the plan's devices."""
    from flexsearch.strategy.topology import build

    if not plan.topology:
        raise EmitError("this plan names no gossip topology: the emitter cannot run 'decentralized' plans "
                        "without one; plan again with a topology (ring, torus, exponential, ...)")
    edges = [tuple(e) for e in plan.topology_edges] or None
    try:
        return build(plan.topology, plan.devices, edges=edges)
    except (FlexsearchError, ValueError, KeyError, TypeError) as e:
        raise EmitError(f"cannot build the plan's {plan.topology!r} topology on {plan.devices} devices: "
                        f"{_one_line(e)}") from None


def _by_dtype_device(named: list[tuple[str, nn.Parameter]]) -> list[list[tuple[str, nn.Parameter]]]:
    """``named`` split by (dtype, device), in a fixed order (every rank agrees on it)."""
    by_key: dict[tuple[torch.dtype, torch.device], list[tuple[str, nn.Parameter]]] = {}
    for name, p in named:
        by_key.setdefault((p.dtype, p.device), []).append((name, p))
    return [v for _k, v in sorted(by_key.items(), key=lambda kv: (str(kv[0][0]), str(kv[0][1])))]


class _Group:
    """The trainable parameters of one (dtype, device): exchanged as one flat buffer."""

    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        self.numel = sum(p.numel() for p in params)

    def flat(self) -> torch.Tensor:
        return _flatten_dense_tensors([p.detach() for p in self.params])

    def assign(self, flat: torch.Tensor) -> None:
        with torch.no_grad():
            torch._foreach_copy_([p.data for p in self.params], list(_unflatten_dense_tensors(flat, self.params)))


class DecentralizedModule(nn.Module):
    """D-PSGD over a gossip topology: every rank trains its own model copy and averages
    it with its neighbours' every iteration.

    Calling convention (as the other emitted modules): every rank calls
    ``train_step(inputs, target, loss_fn)`` with the *same global batch*; this rank runs
    forward and backward on its slice of it (``batch_shard``: dim 0 split evenly over the
    ranks), so the ranks see different data. The step leaves this rank's *local*
    gradient (not averaged, taken at the pre-averaging parameters) on the parameters and
    has already replaced the parameters by their gossip average; build any torch
    optimizer on ``module.parameters()`` and call ``optimizer.zero_grad()`` /
    ``optimizer.step()`` around ``train_step`` as usual::

        opt = torch.optim.SGD(module.parameters(), lr=0.1)
        for x, y in batches:
            opt.zero_grad()
            loss = module.train_step((x,), y, loss_fn)
            opt.step()

    What is averaged: the trainable parameters only (those with ``requires_grad``;
    frozen parameters stay as broadcast at the start). Buffers (e.g. BatchNorm running
    statistics), gradients and the optimizer's state (momentum, Adam moments) stay local
    to each rank; an optimizer's parameter-dependent terms (weight decay) see the
    averaged parameters. With momentum or Adam this is the usual "gossip the
    parameters, keep the state local" variant, not a result from the paper.

    ``train_step`` returns the mean over ranks of the local losses (each at that rank's
    own model), which costs one scalar ``all_reduce``; with ``global_loss=False`` it
    returns this rank's local loss and the iteration has no collective at all.

    ``iteration`` counts the steps taken; it selects the mixing matrix of time-varying
    topologies (one-peer exponential: step ``t`` uses ``W_t``). :meth:`average_parameters`
    and :meth:`consensus_distance` are collectives (every rank must call them) for
    evaluation and monitoring. ``module(x)`` runs this rank's model.

    Devices: the exchange runs where the parameters are. On NCCL a model still on the CPU
    is moved to the current CUDA device (``torch.cuda.set_device`` it first), and
    ``train_step`` moves its inputs and target to the parameters' device.
    """

    def __init__(self, model: nn.Module, topology: Topology, rt: Runtime, *, global_loss: bool = True):
        super().__init__()
        n = len(rt.ranks)
        if topology.n != n:
            raise EmitError(f"the {topology.name} topology has {topology.n} nodes but the process group has {n} "
                            f"ranks; build the topology for {n} devices (or launch {topology.n} ranks)")
        self.module = cast_model(model, rt.precision)
        self.topology = topology
        self.global_loss = global_loss
        self.iteration = 0
        self._rt = rt
        if rt.device_type == "cuda" and any(not p.is_cuda for p in model.parameters()):
            model.to(torch.device("cuda", torch.cuda.current_device()))
        self._groups = self._make_groups()
        self._broadcast_from_first()

    # -- set-up ---------------------------------------------------------------------

    def _make_groups(self) -> list[_Group]:
        trainable = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
        return [_Group([p for _n, p in group]) for group in _by_dtype_device(trainable)]

    def _broadcast_from_first(self) -> None:
        src = self._rt.ranks[0]
        with torch.no_grad():
            for t in list(self.module.parameters()) + list(self.module.buffers()):
                dist.broadcast(t.data, src=src, group=self._rt.group)

    # -- running --------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with autocast(self._rt.precision, self._rt.device_type):
            return self.module(*cast_inputs(args, self._rt.precision), **kwargs)

    @property
    def model(self) -> nn.Module:
        """This rank's model, with the original parameter names (for state dicts)."""
        return self.module

    def named_original_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return self.module.named_parameters()

    def mixing_weights(self, step: int | None = None) -> tuple[float, tuple[tuple[int, float], ...], tuple[int, ...]]:
        """This rank's row of ``W`` at ``step`` (default: the next one): its self weight,
        its in-neighbours with their weights, and its out-neighbours (plan device indices)."""
        t = self.iteration if step is None else step
        me, topo = self._rt.device, self.topology
        ins = tuple(sorted((j, float(w)) for j, w in topo.in_neighbours(me, t)))
        return float(topo.self_weight(me, t)), ins, tuple(sorted(topo.out_neighbours(me, t)))

    def _post_exchange(self, snaps: list[torch.Tensor], ins, outs) -> tuple[list, list]:
        ranks, group = self._rt.ranks, self._rt.group
        recv = [[torch.empty_like(s) for s in snaps] for _ in ins]
        ops = []
        for k, s in enumerate(snaps):
            for o in outs:
                ops.append(dist.P2POp(dist.isend, s, ranks[o], group=group, tag=k))
            for r, (j, _w) in enumerate(ins):
                ops.append(dist.P2POp(dist.irecv, recv[r][k], ranks[j], group=group, tag=k))
        return (dist.batch_isend_irecv(ops) if ops else []), recv

    def train_step(self, inputs: tuple, target: Any = None,
                   loss_fn: Callable[[Any, Any], torch.Tensor] | None = None) -> torch.Tensor:
        """One D-PSGD iteration without the optimizer step (see the class docstring);
        ``loss_fn`` None: the model's own loss (:mod:`flexsearch.emit.inputs`)."""
        n, i = len(self._rt.ranks), self._rt.device
        self_w, ins, outs = self.mixing_weights()
        snaps = [g.flat() for g in self._groups]
        works, recv = self._post_exchange(snaps, ins, outs)
        device = self._device()
        args, kwargs = split(tree_map(lambda x: self._to(x, device), shard(inputs, i, n)))
        out = self(*args, **kwargs)
        with autocast(self._rt.precision, self._rt.device_type):
            loss = step_loss(out, self._to(batch_shard(target, i, n), device), loss_fn)
        backward(loss, self._rt.precision, self.module.parameters)
        total = loss.detach().float().clone()
        loss_work = dist.all_reduce(total, group=self._rt.group, async_op=True) if self.global_loss else None
        for w in works:
            w.wait()
        for k, g in enumerate(self._groups):
            mixed = snaps[k].mul_(self_w)
            for r, (_j, w) in enumerate(ins):
                mixed.add_(recv[r][k], alpha=w)
            g.assign(mixed)
        self.iteration += 1
        if loss_work is None:
            return total
        loss_work.wait()
        return total / n

    @staticmethod
    def _to(x: Any, device: torch.device | None) -> Any:
        return x.to(device) if isinstance(x, torch.Tensor) and device is not None else x

    def _device(self) -> torch.device | None:
        p = next(iter(self.module.parameters()), None)
        return None if p is None else p.device

    # -- evaluation -----------------------------------------------------------------

    def average_parameters(self, *, inplace: bool = False) -> dict[str, torch.Tensor]:
        """The exact average over all ranks of every parameter (collective: one
        ``all_reduce`` per parameter group), by its name in the original model.

        With ``inplace=True`` every rank's model is set to it (the ranks agree
        afterwards); otherwise the models are untouched: evaluate the average with
        ``torch.func.functional_call(module.model, averaged, inputs)``."""
        n = len(self._rt.ranks)
        named = list(self.module.named_parameters())
        out: dict[str, torch.Tensor] = {}
        for group in _by_dtype_device(named):
            ps = [p.detach() for _n, p in group]
            flat = _flatten_dense_tensors(ps)
            dist.all_reduce(flat, group=self._rt.group)
            flat.div_(n)
            for (name, _p), t in zip(group, _unflatten_dense_tensors(flat, ps), strict=True):
                out[name] = t
        if inplace:
            with torch.no_grad():
                for name, p in named:
                    p.copy_(out[name])
        return out

    def consensus_distance(self) -> float:
        """``sqrt(mean_i ||x_i - mean_j x_j||^2)`` over the ranks' trainable parameters
        (collective; float64). Gossip with mixing matrix ``W`` shrinks it by at least
        ``beta = ||W - 11^T/n||_2`` per step when the gradients are zero."""
        n = len(self._rt.ranks)
        sq = torch.zeros((), dtype=torch.float64, device=self._device() or "cpu")
        for g in self._groups:
            x = g.flat().to(torch.float64)
            mean = x.clone()
            dist.all_reduce(mean, group=self._rt.group)
            mean.div_(n)
            sq += (x - mean).pow(2).sum()
        dist.all_reduce(sq, group=self._rt.group)
        return math.sqrt(float(sq) / n)


def decentralized(model: nn.Module, plan: Plan, rt: Runtime) -> DecentralizedModule:
    """A :class:`DecentralizedModule` over a copy of ``model`` (the caller's model is
    kept), gossiping over the plan's topology."""
    return DecentralizedModule(copy.deepcopy(model), topology_of(plan), rt)
