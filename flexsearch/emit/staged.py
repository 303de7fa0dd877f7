"""Pipeline and hybrid plans on ``torch.distributed.pipelining``.

The plan's layout (:class:`flexsearch.strategy.kinds.Pipelined`): ``p`` pipeline ranks x ``d``
data-parallel replicas x ``t`` tensor-parallel devices; pipeline rank ``r`` holds
devices ``r*d*t .. (r+1)*d*t - 1``, replica ``j`` of it devices ``r*d*t + j*t ..
+ t - 1``; stage ``k`` runs on pipeline rank ``k mod p`` (``chunks = stages / p``
stages per rank, interleaved).

This rank (pipeline rank ``r``, replica ``j``, tensor index ``i``) builds:

- its stage modules, cut from the model's graph by :func:`flexsearch.emit.stages.cut`
  (a model only ``torch.export`` traces: from the graph exported at one microbatch's
  shapes); each stage's input and output tensors are given to its ``PipelineStage``,
  found by running the stages on fake tensors; with
  ``t > 1`` each is a :class:`~flexsearch.emit.sharded.ShardedModule` running the
  stage's Megatron configurations on DTensor over its ``t`` devices; with
  ``recompute``, activation checkpointing: each checkpointed unit of a stage
  (:mod:`flexsearch.emit.recompute`; in a tensor-parallel stage, each unit's run of ops
  in the interpreter, with its redistributions, as a SOAP plan runs it);
- a :class:`PipelineStage` per stage on the pipeline group of (``j``, ``i``), and the
  schedule the plan names (``ScheduleGPipe``, ``Schedule1F1B``,
  ``ScheduleInterleaved1F1B``) with the plan's microbatch count;
- after each step: gradients all-reduced (averaged) over the ``d`` replicas of the
  stage, and tied weights held by two stages summed between them;
- under ``shard: zero1``, :meth:`PipelineModule.make_optimizer` shards the optimizer
  over the ``d`` replicas: ``ZeroRedundancyOptimizer`` on the replica group (each
  replica keeps the state of and updates its share of the weights, then broadcasts
  them), run on the weights' local tensors (:class:`LocalZero`);
- under ``shard: zero2``, each stage is an FSDP2 module over its ``d``
  replicas (``fully_shard`` on the replica mesh; a tensor-parallel stage's weights are
  DTensors on the ``(s, t)`` slice of a ``(dp, s, t)`` mesh, FSDP2 shards them over its
  ``dp`` slice: torchtitan's FSDP x TP;
  ``reshard_after_forward=False``, the precision's ``MixedPrecisionPolicy``): torch's
  schedule runs its microbatches' backwards without gradient sync and reduce-scatters
  (averaging over the replicas) after the last, so no all-reduce follows; the optimizer
  holds and updates each replica's shards.

:meth:`PipelineModule.train_step` takes the global batch on every rank; replica ``j``
runs slice ``j`` of it through the pipeline (split into microbatches by the schedule).
A loss that is one mean class-loss call (cross-entropy, NLL) is the whole batch's
mean, ignored targets counted over every microbatch and replica
(:class:`flexsearch.emit.losses.DeferredMean`), not the mean of their means.
``forward`` is not available: a pipeline runs forward and backward together.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.func import functional_call
from torch.utils._pytree import tree_unflatten

from flexsearch.emit.data import batch_shard
from flexsearch.emit.inputs import model_loss, split
from flexsearch.emit.losses import DeferredMean, settled_loss
from flexsearch.emit.precision import (
    Autocast,
    autocast,
    cast_inputs,
    cast_model,
    fsdp_policy,
    loss_scale,
    unscale,
)
from flexsearch.emit.recompute import checkpoint_stage
from flexsearch.emit.runtime import Runtime
from flexsearch.emit.sharded import ShardedModule
from flexsearch.emit.stages import cut
from flexsearch.emit.transport import build_layouts
from flexsearch.errors import EmitError
from flexsearch.graph.lift import flat_inputs, short_reason
from flexsearch.graph.opgraph import OpGraph
from flexsearch.plan import Plan
from flexsearch.strategy.kinds import check_pipeline_shard

SCHEDULE_CLASSES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}


def _layout(plan: Plan) -> tuple[int, int, int]:
    """(pipeline ranks p, replicas d, tensor degree t) of a pipeline plan."""
    chunks = plan.chunks or 1
    if not plan.stages or len(plan.stages) % chunks:
        raise EmitError(f"the plan's {len(plan.stages)} stages do not split into {chunks} chunks per rank; "
                        "it is damaged, plan again")
    p = len(plan.stages) // chunks
    d = plan.stages[0].replicas
    g = len(plan.stages[0].devices)
    if g % d or p * g != plan.devices:
        raise EmitError(f"the plan's stages ({p} x {g} devices) do not cover its {plan.devices} devices; "
                        "it is damaged, plan again")
    return p, d, g // d


class PipelineModule(nn.Module):
    """This rank's stages of a pipeline or hybrid plan (see the module docstring)."""

    def __init__(self, model: nn.Module, graph: OpGraph, plan: Plan, rt: Runtime, lift):
        super().__init__()
        if plan.schedule not in SCHEDULE_CLASSES:
            raise EmitError(f"the emitter runs the {', '.join(SCHEDULE_CLASSES)} schedules, not "
                            f"{plan.schedule!r}; plan again")
        self._rt, self._plan = rt, plan
        cast_model(model, rt.precision)
        p, d, t = _layout(plan)
        self.p, self.d, self.t = p, d, t
        g = d * t
        r, rem = divmod(rt.device, g)
        self.replica, self.tensor_index = divmod(rem, t)
        self.pipeline_rank = r
        nstages = len(plan.stages)
        mine = [k for k in range(nstages) if k % p == r]
        self._dp_group = None
        self.stage_indices = mine
        ids: dict[int, str] = {}
        for name, q in model.named_parameters(remove_duplicate=False):
            ids.setdefault(id(q), name)
        gm = lift(model)
        names = {n.name for n in gm.graph.nodes}
        absent = [n for s in plan.stages for n in s.nodes if n not in names]
        if absent:
            raise EmitError(f"the model's graph at the microbatch size differs from the one planned ({absent[0]} "
                            "is missing); plan it with a batch it runs at, or another plan kind")
        # placeholders of constant inputs (``return_loss=True``): no stage takes them
        from flexsearch.emit import example_inputs

        holders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        constants = {h: v for h, v in zip(holders, flat_inputs(gm, *split(example_inputs(plan))), strict=True)
                     if not isinstance(v, torch.Tensor)}
        self._flat = lambda args, kwargs: [v for h, v in zip(holders, flat_inputs(gm, args, kwargs), strict=True)
                                           if h not in constants]
        cuts = cut(gm, graph, [s.nodes for s in plan.stages], constants)
        # the structure of the last stage's flat outputs: an exported model's, or a dict the cut flattened
        self._out_spec = getattr(gm, "_out_spec", None) or getattr(cuts[-1], "out_spec", None)
        if t == 1:  # each checkpointed unit of a stage runs as one region (tensor-parallel: the interpreter's)
            cuts = [checkpoint_stage(c, graph, plan.recompute) for c in cuts]
        # the plan lays a stage out on its d x t devices (s = d: data parallel over the
        # replicas); each replica runs it on its own t devices, gradients synced below
        configs = {k: dataclasses.replace(c, s=1, first=0) if d > 1 and c.s == d else c
                   for k, c in plan.node_configs().items()}
        # every rank builds every stage's meshes and groups, in the same order (a stage's
        # forward runs on its ranks only, so nothing may be made lazily there)
        subs: dict[tuple[int, int], Runtime] = {}
        for rr in range(p):
            for jj in range(d):
                sub = rt.sub([rr * g + jj * t + ii for ii in range(t)])
                if t > 1:
                    build_layouts(sub, [configs[n.name] for k in range(rr, nstages, p)
                                        for n in cuts[k].graph.nodes if n.name in configs])
                subs[rr, jj] = sub
        self._pp_group = None
        for jj in range(d):
            for ii in range(t):
                grp = rt.subgroup(tuple(rt.ranks[rr * g + jj * t + ii] for rr in range(p)))
                if jj == self.replica and ii == self.tensor_index:
                    self._pp_group = grp
        for rr in range(p):
            for ii in range(t):
                grp = rt.subgroup(tuple(rt.ranks[rr * g + jj * t + ii] for jj in range(d)))
                if rr == r and ii == self.tensor_index:
                    self._dp_group = grp
        self._fsdp = plan.shard == "zero2"
        if self._fsdp:
            try:
                check_pipeline_shard(plan.shard, d, t, plan.schedule, len(mine))
            except ValueError as e:
                raise EmitError(f"{e}; plan again") from None
            for rr in range(p):  # on every rank alike, so none goes on to wait for the others
                held: dict[int, int] = {}
                for k in range(rr, nstages, p):
                    for q in cuts[k].parameters():
                        if q.requires_grad and held.setdefault(id(q), k) != k:
                            raise EmitError(f"FSDP2 stages of one rank cannot share a weight ({ids.get(id(q))}); "
                                            "plan again")
            # FSDP2 over each pipeline rank's replicas, every rank making every mesh in the
            # same order: plain stages one device each; tensor-parallel stages a (dp, s, t)
            # mesh whose (s, t) slice this replica's stage places its weights on (FSDP2
            # shards a DTensor weight over a mesh of the same root)
            if t == 1:
                meshes = [rt.mesh([rr * g + jj for jj in range(d)], ("dp",)) for rr in range(p)]
                self._fsdp_mesh = meshes[r]
            else:
                roots = [rt.mesh([[[rr * g + jj * t + ii for ii in range(t)]] for jj in range(d)], ("dp", "s", "t"))
                         for rr in range(p)]
                self._fsdp_mesh = roots[r]["dp"]
                subs[r, self.replica].adopt_block(0, 1, t, roots[r]["s", "t"])
        self._tied = self._tie_groups(cuts, ids, rt, p, g)

        def runnable(m: nn.Module) -> nn.Module:  # the precision's autocast, around the recomputed regions
            return Autocast(m, rt.precision, rt.device_type) if rt.precision.mixed else m

        # every stage's input and output tensors, given to torch (static metadata): found on
        # fake tensors, on the stages before any is sharded (a tensor-parallel stage takes
        # and returns whole tensors too); torch's own inference runs a stage on uninitialised
        # tensors, which index out of range when token ids cross a boundary
        # (FSDP2 stages compute with their parameters gathered in the policy's dtype)
        gathered = getattr(torch, rt.precision.autocast) if self._fsdp and rt.precision.autocast else None
        examples = _examples([runnable(c) for c in cuts], self._micro_inputs(plan), gathered)
        mods = []
        distributed: dict[int, torch.Tensor] = {}  # a weight two of this rank's stages hold: one DTensor
        for k in mine:
            m = cuts[k]
            if t > 1:  # each checkpointed unit's run of ops interpreted under checkpoint, as SOAP plans run
                m = ShardedModule(m, m, graph, {n.name: configs[n.name] for n in m.graph.nodes if n.name in configs},
                                  subs[r, self.replica], distributed, recompute=plan.recompute)
            mods.append(m)
        self.stages = nn.ModuleList(mods)
        device = rt.local_device
        m_count = plan.microbatches or 1
        self._pipe_stages = [ReusedBuffersStage(self._sharded(runnable(m)), k, nstages, device, group=self._pp_group,
                                                input_args=examples[k][0], output_args=examples[k][1],
                                                buffers=receive_buffers(plan.schedule, k, nstages, m_count))
                             for k, m in zip(mine, mods, strict=True)]
        self._schedule = None
        self._loss_fn = None
        self._means = DeferredMean()  # a mean class loss over the whole batch (emit/losses.py)

    def _sharded(self, stage: nn.Module) -> nn.Module:
        """``stage`` as an FSDP2 module over the replicas under ``zero2`` (module
        docstring), else itself."""
        if not self._fsdp:
            return stage
        from torch.distributed.fsdp import fully_shard

        kw = {"mp_policy": policy} if (policy := fsdp_policy(self._rt.precision)) is not None else {}
        try:
            return fully_shard(stage, mesh=self._fsdp_mesh, reshard_after_forward=False, **kw)
        except (AssertionError, NotImplementedError, RuntimeError, ValueError) as e:
            if self.t == 1:
                raise
            # FSDP2 over DTensor weights: torch 2.13 takes them on 2-D (s, t) meshes of
            # the same root as the dp mesh; an older one, or a weight on another mesh, not
            raise EmitError(f"FSDP2 could not shard this tensor-parallel stage ({short_reason(e)}); "
                            f"run torch 2.13, or plan again with --kind pipeline, data or fsdp") from None

    def _micro_inputs(self, plan: Plan) -> list:
        """Zero tensors of one microbatch's flat inputs, in the precision's dtypes."""
        from flexsearch.emit import example_inputs

        return list(cast_inputs(self._flat(*split(example_inputs(plan, _microbatch_parts(plan)))),
                                self._rt.precision))

    def _tie_groups(self, cuts, ids: dict[int, str], rt: Runtime, p: int, g: int) -> list[tuple[str, Any]]:
        """(parameter name in this rank's stages, group of ranks holding a copy) for every
        weight that several pipeline ranks hold; groups made by every rank in order."""
        ranks_of: dict[str, set[int]] = {}  # canonical name -> pipeline ranks holding it
        names_of: dict[str, set[str]] = {}
        for k, m in enumerate(cuts):
            for name, q in m.named_parameters():
                canon = ids.get(id(q), name)
                ranks_of.setdefault(canon, set()).add(k % p)
                names_of.setdefault(canon, set()).add(name)
        held = {n for k in self.stage_indices for n, _ in cuts[k].named_parameters()}
        out = []
        for canon in sorted(ranks_of):
            prs = sorted(ranks_of[canon])
            if len(prs) < 2:
                continue
            for off in range(g):
                grp = rt.subgroup(tuple(rt.ranks[pr * g + off] for pr in prs))
                if off == rt.device % g and self.pipeline_rank in prs:
                    # one all-reduce per weight: the names this rank holds it under share it
                    out.append((sorted(names_of[canon] & held)[0], grp))
        return out

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise EmitError("a pipelined module runs forward and backward together: call "
                        "module.train_step(inputs, target, loss_fn)")

    def stage_modules(self) -> list[nn.Module]:
        """This rank's stages; their state-dict keys are the original model's."""
        return [m.module if isinstance(m, ShardedModule) else m for m in self.stages]

    def named_original_parameters(self):
        for m in self.stages:
            inner = m.module if isinstance(m, ShardedModule) else m
            yield from inner.named_parameters()

    def _make_schedule(self, loss_fn: Callable | None) -> None:
        cls = SCHEDULE_CLASSES[self._plan.schedule]
        m = self._plan.microbatches or 1
        prec, device_type, scale = self._rt.precision, self._rt.device_type, loss_scale(self._rt.precision)

        spec = self._out_spec

        means = self._means

        def scaled(out: Any, target: Any) -> torch.Tensor:  # the precision's loss (fp16: scaled)
            if spec is not None:  # the exported last stage's flat tuple as the model returns it
                out = tree_unflatten(list(out) if isinstance(out, (tuple, list)) else [out], spec)
            if loss_fn is None:  # the model's own, computed in the last stage
                loss = model_loss(out)
            else:
                with autocast(prec, device_type):
                    loss = loss_fn(out, target)
            means.settle(loss)  # before the schedule runs its backward
            return loss * scale

        # the gradients are divided by m below, once per weight (the schedule would divide a
        # weight that two stages of this rank share twice)
        if cls is ScheduleInterleaved1F1B:
            self._schedule = cls(self._pipe_stages, m, loss_fn=scaled, scale_grads=False)
        else:
            self._schedule = cls(self._pipe_stages[0], m, loss_fn=scaled, scale_grads=False)
        self._loss_fn = loss_fn

    def train_step(self, inputs: tuple, target: Any = None,
                   loss_fn: Callable[[Any, Any], torch.Tensor] | None = None) -> torch.Tensor:
        """One step on the global batch ``inputs`` (positional, then an optional dict of
        keyword inputs); ``loss_fn`` None: the model's own loss."""
        if self._schedule is None or self._loss_fn is not loss_fn:
            self._make_schedule(loss_fn)
        j, d = self.replica, self.d
        first = 0 in self.stage_indices
        last = len(self._plan.stages) - 1 in self.stage_indices
        losses: list[torch.Tensor] = []
        flat = self._flat(*split(inputs))
        args = cast_inputs((batch_shard(x, j, d) for x in flat), self._rt.precision) if first else ()
        if target is None:  # the schedule splits a target per microbatch: a placeholder one
            batch = next(x.shape[0] for x in flat if isinstance(x, torch.Tensor) and x.dim())
            target = torch.zeros(batch)
        tgt = batch_shard(target, j, d) if last else None
        with self._means:
            self._schedule.step(*args, target=tgt, losses=losses, return_outputs=False)
        scale = loss_scale(self._rt.precision)
        device = self._rt.local_device  # where the group's collectives run (a GPU under NCCL)
        settled = self._means.finish(self._rt.group, counted=last and self.tensor_index == 0, device=device)
        if settled is not None:  # the whole batch's mean class loss: the settled sums' gradients times d N / C
            if settled.count:  # every target ignored: no gradient to weigh (each is zero)
                unscale(self._weights(), scale * settled.count / (d * settled.per_call))
        else:
            unscale(self._weights(), scale * (self._plan.microbatches or 1))  # the microbatches' mean
        self._sync_gradients()
        if settled is not None:
            return settled_loss(settled)
        mean = torch.stack([x.detach().float() for x in losses]).mean().to(device) / scale if last and losses \
            else torch.zeros((), device=device)
        dist.all_reduce(mean, group=self._rt.group)
        return mean / (d * self.t)

    def make_optimizer(self, cls: type[torch.optim.Optimizer], **kwargs: Any) -> torch.optim.Optimizer:
        """The optimizer the plan trains with: ``cls`` over this rank's weights, sharded
        over the stage's replicas under ``zero1`` (:class:`LocalZero`); under ``zero2``
        the weights are FSDP2's shards, so ``cls`` holds and updates this replica's."""
        weights = [q for q in self._weights() if q.requires_grad]
        if not weights:  # every weight of this rank's stages frozen: nothing to step (torch refuses no tensors)
            weights = [nn.Parameter(torch.empty(0, device=self._rt.device_type))]
        if self._plan.shard != "zero1":
            return cls(weights, **kwargs)
        return LocalZero(weights, cls, self._dp_group, **kwargs)

    def _weights(self) -> list[torch.Tensor]:
        """This rank's parameters, each once (a tied weight is held under several names)."""
        return list({id(q): q for _, q in self.named_original_parameters()}.values())

    def _sync_gradients(self) -> None:
        params = dict(self.named_original_parameters())
        if self.d > 1 and not self._fsdp:  # FSDP2 stages: reduce-scattered by the schedule
            for q in self._weights():
                if q.grad is None:
                    continue
                local = q.grad.to_local() if isinstance(q.grad, DTensor) else q.grad
                dist.all_reduce(local, group=self._dp_group)
                local /= self.d
        for name, grp in self._tied:
            q = params[name]
            if not q.requires_grad:  # a frozen tied weight (every rank's copy alike): nothing to sum
                continue
            if q.grad is None:
                q.grad = torch.zeros_like(q)
            g = q.grad
            whole = g.full_tensor() if isinstance(g, DTensor) else g
            whole = whole.contiguous()
            dist.all_reduce(whole, group=grp)
            q.grad = distribute_tensor(whole, g.device_mesh, g.placements, src_data_rank=None) \
                if isinstance(g, DTensor) else whole


def receive_buffers(schedule: str, stage: int, stages: int, microbatches: int) -> tuple[int, int]:
    """(activation, gradient) receive buffers a stage needs under torch's schedule: one
    per microbatch whose buffer may still be in use when the next receive is posted.
    ``Schedule1F1B`` (``torch/distributed/pipelining/schedules.py``) posts stage ``s``'s
    receive for forward ``f`` after backward ``f - w`` has run (``w = min(m, S - s)``
    warm-up forwards) and each gradient receive right before its backward, after the
    previous backward; ``ScheduleGPipe`` receives every forward's input before the first
    backward, then each gradient right before its backward. The interleaved schedule
    posts its receives as actions of its own, ahead of the compute: one buffer per
    microbatch, as torch makes them."""
    if schedule == "1f1b":
        return min(microbatches, stages - stage), 1
    if schedule == "gpipe":
        return microbatches, 1
    return microbatches, microbatches


class ReusedBuffersStage(PipelineStage):
    """A ``PipelineStage`` that keeps ``buffers = (a, g)`` receive buffers for activations
    and for gradients, microbatch ``j`` receiving into buffer ``j mod a`` (``j mod g``),
    where torch 2.13's stage makes one per microbatch each way and keeps them: memory
    linear in the replica's batch (m = 512 on GPT 1T's 64 stages: 512 x 105 MB each way
    per device), which the simulator's memory model does not have
    (:func:`receive_buffers` says when a buffer is free again). A received activation's
    gradient is taken and cleared by the backward (``_backward.py``: ``val.grad = None``),
    so a reused buffer accumulates nothing."""

    def __init__(self, *args: Any, buffers: tuple[int, int], **kwargs: Any):
        self._buffers = buffers
        super().__init__(*args, **kwargs)

    def _setup_forward_recv_info(self, num_microbatches: int, has_backward: bool) -> None:
        keep = max(1, min(self._buffers[0], num_microbatches))
        super()._setup_forward_recv_info(keep, has_backward)
        for j in range(keep, num_microbatches):
            self.args_recv_info[j] = self.args_recv_info[j % keep]

    def _setup_backward_recv_info(self, num_microbatches: int) -> None:
        keep = max(1, min(self._buffers[1], num_microbatches))
        super()._setup_backward_recv_info(keep)
        self.chunks = num_microbatches
        for j in range(keep, num_microbatches):
            self.grad_recv_info[j] = self.grad_recv_info[j % keep]


class LocalZero(ZeroRedundancyOptimizer):
    """``ZeroRedundancyOptimizer`` over ``group`` for weights that may be DTensors (a
    tensor-parallel stage's, whose in-place broadcast DTensor does not implement): it
    optimizes each weight's local tensor (the same storage, so its updates and the
    owners' broadcasts land in the weight), given the local tensor of the weight's
    gradient at each :meth:`step`. Each member of ``group`` holds the same local shapes
    (the same tensor-parallel index of a stage's replicas), so the partition agrees."""

    def __init__(self, weights: list[torch.Tensor], cls: type[torch.optim.Optimizer], group, **kwargs: Any):
        self._full = weights
        self._local = [(q.to_local() if isinstance(q, DTensor) else q).detach().requires_grad_(True)
                       for q in weights]
        super().__init__(self._local, optimizer_class=cls, process_group=group, **kwargs)

    def step(self, closure: Callable[[], float] | None = None, **kwargs: Any) -> float | None:
        for q, a in zip(self._full, self._local, strict=True):
            g = q.grad
            a.grad = None if g is None else g.to_local() if isinstance(g, DTensor) else g
        return super().step(closure, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for q in self._full:
            if q.grad is not None:
                if set_to_none:
                    q.grad = None
                else:
                    q.grad.zero_()


def _examples(stages: list[nn.Module], inputs: list,
              param_dtype: torch.dtype | None = None) -> list[tuple[tuple, tuple]]:
    """Each stage's example inputs and outputs for one microbatch (empty tensors of the
    right shapes, dtypes and ``requires_grad``): the stages run in order on fake tensors,
    their parameters and buffers replaced by fake ones (nothing real is touched), the
    floating parameters in ``param_dtype`` when given (FSDP2's gathered dtype)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def real(t: torch.Tensor | Any) -> torch.Tensor | Any:  # a constant input (``return_loss=True``) as it is
        if not isinstance(t, torch.Tensor):
            return t
        return torch.empty(t.shape, dtype=t.dtype).requires_grad_(t.requires_grad and t.is_floating_point())

    out = []
    with mode:
        x = tuple(mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for v in inputs)
        for m in stages:
            state = {n: _fake_param(mode, q, param_dtype) if isinstance(q, nn.Parameter)
                     else mode.from_tensor(q, static_shapes=True)
                     for n, q in [*m.named_parameters(), *m.named_buffers()]}
            y = functional_call(m, state, x)
            y = y if isinstance(y, tuple) else (y,)
            out.append((x, y))
            x = tuple(v.detach().requires_grad_(v.requires_grad and v.is_floating_point()) for v in y)
    return [(tuple(real(v) for v in a), tuple(real(v) for v in b)) for a, b in out]


def _fake_param(mode: FakeTensorMode, q: nn.Parameter, dtype: torch.dtype | None) -> torch.Tensor:
    """A fake copy of parameter ``q`` (in ``dtype`` when given and ``q`` is floating)."""
    f = mode.from_tensor(q, static_shapes=True)
    if dtype is not None and f.is_floating_point():
        f = f.detach().to(dtype)
    return f.requires_grad_(q.requires_grad)


def pipeline(model: nn.Module, graph: OpGraph, plan: Plan, rt: Runtime) -> PipelineModule:
    """A :class:`PipelineModule` over a copy of ``model``: its graph re-lifted as the
    tracer did, by ``torch.fx``, or by ``torch.export`` at the size of one microbatch
    (an exported graph's shapes are fixed)."""
    from flexsearch.emit import lift, lift_exported

    relift = partial(lift_exported, plan=plan, parts=_microbatch_parts(plan)) if graph.via == "export" else lift
    return PipelineModule(copy.deepcopy(model), graph, plan, rt, relift)


def _microbatch_parts(plan: Plan) -> int:
    """Into how many microbatches a plan splits the global batch: replicas x microbatches."""
    return _layout(plan)[1] * (plan.microbatches or 1)
