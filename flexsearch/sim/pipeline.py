"""Pipeline simulation: a pipeline plan's iteration as tasks for the shared list scheduler.

A pipeline of ``S`` stages runs on ``p`` pipeline ranks (``S = p v``: an interleaved
schedule gives each rank ``v`` chunks, stage ``s`` on rank ``s mod p``). Each rank is
replicated: a tuple of replicas, each a group of devices running the stage in lockstep
(tensor parallel inside; one device for a plain stage). Per stage the caller gives a
:class:`~flexsearch.sim.pipeline_layout.StageCost`: forward and backward time of one microbatch on one replica, the
parameter and stashed-activation bytes per device, and the activation bytes one replica
sends to the next stage per microbatch.

The simulation has three parts, each a function over the same inputs (the stage costs and
the :class:`~flexsearch.sim.pipeline_layout.PipelineLayout`):

- **compute and transfers** (:func:`action_tasks`): for every action of the schedule
  (:mod:`flexsearch.strategy.schedules`) a forward or backward task on the replica's
  devices; after a forward, the activations go to the next stage's replica, after a
  backward the gradient comes back: one transfer over the real links of the path per
  tensor-parallel rank (run in parallel: one task holding all their links for the
  longest). Tasks are emitted lane by lane in an order that respects every rank's
  schedule and every dependency, so devices run their actions in schedule order and
  transfers queue on shared links;
- **synchronisation and update** (:func:`sync_tasks`): after a stage's last backward
  its weight gradients are all-reduced over its replicas (one all-reduce per
  tensor-parallel rank), weights shared by two stages (tied embeddings) are
  all-reduced between them, then each device runs one optimizer update
  (:func:`flexsearch.sim.accounting.update_s`). With its optimizer state sharded
  (``shard="zero1"``, as ``ZeroRedundancyOptimizer`` over a stage's ``d`` replicas runs
  it) each device updates ``1 / d`` of its parameters (and holds ``1 / d`` of the
  optimizer state), then the replicas all-gather the updated parameters, one
  all-gather per tensor-parallel rank (calibrated: with ``ZeroRedundancyOptimizer``'s
  cost per parameter tensor and per step, the op-level ZeRO-1's terms). FSDP2 stages
  (``shard="zero2"``: :data:`~flexsearch.strategy.kinds.PIPELINE_SHARDINGS`)
  all-gather each stage's parameters over its replicas (in FSDP's ``param_dtype``,
  ``PipelineLayout.gather`` bytes per stored byte) once the replicas' first inputs are
  in (the interleaved schedule: at the step's start, the runtime's ``UNSHARD``), and its
  first forward waits for it (the runtime's pre-forward hook; the stage's later
  microbatches find them gathered), reduce-scatter its gradients in place of the
  all-reduce, and update ``1 / d`` of its parameters (a shard of every tensor), with
  nothing gathered after (the next step's first
  forward gathers); each collective as the op-level simulator's FSDP ones
  (:func:`~flexsearch.sim.context.fsdp_collective_task`);
- **memory** (:mod:`flexsearch.sim.pipeline_memory`), per device, from each lane's
  actions.

The iteration time of a **synchronous schedule** (``gpipe``, ``1f1b``,
``interleaved``: every replica runs the whole schedule on its share of the batch) is
the makespan.

**One replica for all** (synchronous schedules, :func:`mirror`): when every rank has
``d`` replicas and the transfers of different replicas cross links of their own, every
replica runs the same tasks at the same times. Only replica 0's lanes are simulated
(their tasks stand for ``d``, ``Task.copies``), with the synchronisations over the
replicas whole; the other replicas' devices take their counterparts' figures. The
result is the full simulation's (``tests/test_pipeline.py``).

**PipeDream** (``pipedream``): asynchronous 1F1B with weight stashing over a window of
minibatches (no flush); replica ``j mod r`` of a stage with ``r`` replicas takes
minibatch ``j``; each replica runs ``NOAM_k = ceil(replicas of stages >= k / r_k)``
warm-up forwards, then alternates; after every round of ``r`` minibatches the stage's
replicas all-reduce their gradients and update (each replica waits for it). The time
per minibatch is measured in steady state, over the window's second half.

Dependencies are typed keys (:class:`Step`, :class:`Synced`, :class:`TiedSynced`,
:class:`Updated`, :class:`Gathered`, :class:`Unsharded`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

from flexsearch.sim.accounting import (
    check_optimizer,
    peak_bytes,
    update_s,
)
from flexsearch.sim.context import CostContext, collective_task, fsdp_collective_task
from flexsearch.sim.pipeline_layout import PipelineLayout, StageCost, lanes
from flexsearch.sim.pipeline_memory import occupancy, pipeline_memory
from flexsearch.sim.result import Simulation
from flexsearch.sim.tasks import Task, busy_compute, run_tasks
from flexsearch.strategy.kinds import check_pipeline_shard
from flexsearch.strategy.schedules import Action

# ----------------------------------------------------------------------------- keys


class Step(NamedTuple):
    """A microbatch's progress through a stage: ``what`` is ``input`` (its activations
    arrived), ``forward`` (ran), ``grad`` (its output's gradient arrived) or
    ``backward`` (ran). ``chain`` is the replica lane of a synchronous schedule (0 for
    PipeDream, whose minibatches move between replicas). A named tuple, not a
    dataclass like the other keys: a 1T pipeline makes half a million of them, and a
    tuple hashes in C; ``what`` comes first, so no other key equals one."""

    what: Literal["input", "forward", "grad", "backward"]
    stage: int
    microbatch: int
    chain: int


@dataclass(frozen=True, slots=True)
class Synced:
    """A stage's gradients all-reduced over its replicas (``round``: PipeDream's
    round of minibatches; None for a synchronous schedule's one sync)."""

    stage: int
    round: int | None = None


@dataclass(frozen=True, slots=True)
class TiedSynced:
    """The gradients of weights stages ``a`` and ``b`` share, all-reduced."""

    a: int
    b: int


@dataclass(frozen=True, slots=True)
class Gathered:
    """ZeRO-1: the updated parameters of pipeline rank ``rank``'s tensor-parallel index
    ``index``, all-gathered over its replicas."""

    rank: int
    index: int


@dataclass(frozen=True, slots=True)
class Unsharded:
    """FSDP2 stages (``zero2``): ``stage``'s parameters all-gathered over its replicas."""

    stage: int


@dataclass(frozen=True, slots=True)
class Updated:
    """An optimizer update: of ``device`` (synchronous), or of the replica that ran
    PipeDream minibatch ``microbatch`` of ``stage``."""

    device: int = -1
    stage: int = -1
    microbatch: int = -1


# ----------------------------------------------------------------------------- tasks


def _route(ctx: CostContext, src: tuple[int, ...], dst: tuple[int, ...], nbytes: float) -> tuple[float, tuple[int, ...]]:
    """The time and links of moving ``nbytes`` from one replica's devices to another's,
    one transfer per tensor-parallel rank in parallel."""
    dur, links = 0.0, set()
    if src != dst and nbytes > 0:
        for a, b in zip(src, dst, strict=True):
            t, ls = ctx.transfer(a, b, nbytes)
            dur = max(dur, t)
            links.update(ls)
    return dur, tuple(sorted(links))


def mirror(ctx: CostContext, layout: PipelineLayout) -> dict[int, int] | None:
    """Device -> its counterpart in replica 0 when one replica may stand for all
    (module docstring): a synchronous schedule, every rank with the same ``d > 1``
    replicas of the same width, and the links each replica's stage-to-stage transfers
    cross used by no other replica. None otherwise."""
    d = len(layout.ranks[0])
    if layout.asynchronous or d < 2 or any(len(reps) != d for reps in layout.ranks) \
            or len({len(rep) for reps in layout.ranks for rep in reps}) != 1:
        return None
    p = len(layout.ranks)
    owner: dict[int, int] = {}  # link -> the replica whose transfers cross it
    for s in range(layout.stages - 1):
        src, dst = layout.ranks[s % p], layout.ranks[(s + 1) % p]
        for i in range(d):
            for a, b in zip(src[i], dst[i], strict=True):
                for way in ((a, b), (b, a)):
                    for link in ctx.transfer(*way, 1.0)[1]:
                        if owner.setdefault(link, i) != i:
                            return None
    return {dev: reps[0][q] for reps in layout.ranks for rep in reps for q, dev in enumerate(rep)}


def _stage_sync(ctx: CostContext, costs: Sequence[StageCost], layout: PipelineLayout, name: str, stage: int,
                deps: tuple, key) -> list[Task]:
    """The all-reduce of ``stage``'s gradients over its replicas (one per tensor-parallel
    rank; FSDP2 stages: a reduce-scatter); a no-op task when there is nothing to reduce."""
    reps = layout.replicas(stage)
    nbytes = costs[stage].trains
    if len(reps) < 2 or nbytes <= 0:
        return [Task("coll", name, 0.0, (), deps, (key,))]
    out = []
    for q in range(len(reps[0])):
        group = tuple(sorted(r[q] for r in reps))
        if layout.fsdp:  # FSDP2's reduce-scatter of the stage's gradients
            out.append(fsdp_collective_task(ctx, "reduce_scatter", group, nbytes, name, deps, (key,),
                                            f"FSDP gradients of stage {stage}", calls=layout.fsdp_calls))
            continue
        cost = ctx.collective("all_reduce", group, nbytes)
        res = tuple(sorted({ctx.links[link.id] for link, _ in cost.loads} | set(ctx.device_resources(group))))
        extra = 0.0
        cal = ctx.calibration
        if layout.runtime == "ddp" and cal is not None:  # DDP's hooks per tensor, its buckets' copies in and out
            extra = cal.ddp_per_tensor_s.value * costs[stage].tensors \
                + 4 * nbytes / ctx.cluster.device.memory_bandwidth.value
        out.append(Task("coll", name, cost.time_s + extra, res, deps, (key,), nbytes, f"grad sync stage {stage}"))
    return out


def _updates(ctx: CostContext, layout: PipelineLayout, optimizer: str, devs: tuple[int, ...], nbytes: float,
             tensors: float, deps: tuple, key, copies: int = 1) -> list[Task]:
    """One optimizer update on each of ``devs`` (stages on DTensors when tensor parallel or
    FSDP2's), with the runtime's fixed cost per step (:attr:`PipelineLayout.runtime`)."""
    sharded = len(layout.ranks[0][0]) > 1 or layout.fsdp
    dur = update_s(ctx, optimizer, nbytes, tensors, layout.runtime, sharded=sharded)
    return [Task("update", "optimizer", dur, (d,), deps, (key,), copies=copies) for d in devs]


def action_tasks(ctx: CostContext, costs: Sequence[StageCost], layout: PipelineLayout, optimizer: str,
                 by_lane: dict[tuple[int, int], tuple[Action, ...]], copies: int = 1) -> list[Task]:
    """The compute and transfer tasks of every lane's actions (module docstring), in an
    order the scheduler can take; PipeDream's per-round syncs and updates included.
    ``copies``: the replicas each task stands for (:func:`mirror`)."""
    asynchronous = layout.asynchronous
    last = layout.stages - 1
    cal = ctx.calibration
    action_s = cal.pipeline_action_s.value if cal is not None else 0.0

    groups = [layout.replicas(stage) for stage in range(layout.stages)]
    routes: dict[tuple, tuple[float, tuple[int, ...]]] = {}

    def hop(s: int, i: int, to: int, j: int) -> tuple[float, tuple[int, ...], float]:
        """(time, links, bytes) of moving microbatch ``j``'s activations (``to = s + 1``)
        or gradients (``to = s - 1``) from stage ``s``'s replica ``i`` to the replica of
        stage ``to`` that takes ``j`` (the lane's own in a synchronous schedule)."""
        nbytes = costs[min(s, to)].send_bytes
        dst = groups[to][j % len(groups[to]) if asynchronous else i]
        key = (groups[s][i], dst, nbytes)
        if key not in routes:
            routes[key] = (*_route(ctx, groups[s][i], dst, nbytes), nbytes * len(groups[s][i]))
        return routes[key]

    # per (stage, replica, direction) in a synchronous schedule, where the hop does not depend on j
    hops: dict[tuple[int, int, int], tuple[float, tuple[int, ...], float]] = {}
    forward_s = [c.forward_s + action_s for c in costs]
    backward_s = [c.backward_s + action_s for c in costs]
    ordered: list[Task] = []
    append = ordered.append
    done: set = set()
    chains = {r: [i for (rr, i) in by_lane if rr == r] for r in range(len(layout.ranks))}
    pos = dict.fromkeys(by_lane, 0)
    waits: dict[tuple[int, int], Synced] = {}  # lane -> the sync its next action waits for
    rounds: dict[tuple[int, int], int] = {}  # PipeDream: (stage, round) -> backwards emitted
    if layout.fsdp and layout.schedule == "interleaved":  # the runtime's UNSHARD actions, posted first
        for s in range(layout.stages):
            ordered.extend(_stage_gathers(ctx, costs, layout, s, ()))
            done.add(Unsharded(s))
    fsdp = layout.fsdp
    while True:
        progressed = False
        for lane, acts in by_lane.items():
            r, i = lane
            c = 0 if asynchronous else i
            at, n_acts = pos[lane], len(acts)
            while at < n_acts:
                a = acts[at]
                s, j = a.stage, a.microbatch
                forward = a.kind == "F"
                if forward:
                    need: tuple = (Step("input", s, j, c),) if s > 0 else ()
                    if fsdp:
                        need += (Unsharded(s),)
                        if Unsharded(s) not in done:  # the pre-forward hook's gather, once every replica's input is in
                            inputs = tuple(Step("input", s, j, cc) for cc in chains[r]) if s > 0 else ()
                            if done.issuperset(inputs):
                                ordered.extend(_stage_gathers(ctx, costs, layout, s, inputs))
                                done.add(Unsharded(s))
                elif s < last:
                    need = (Step("forward", s, j, c), Step("grad", s, j, c))
                else:
                    need = (Step("forward", s, j, c),)
                wait = waits.get(lane)
                if wait is not None:
                    need += (wait,)
                if not done.issuperset(need):
                    break
                devs = groups[s][i]
                text = f"{s}{a.kind}{j}"
                if forward:
                    key = Step("forward", s, j, c)
                    append(Task("fwd", text, forward_s[s], devs, need, (key,), 0.0, "", copies))
                    done.add(key)
                    if s < last:
                        nxt = Step("input", s + 1, j, c)
                        if asynchronous:
                            dur, links, nbytes = hop(s, i, s + 1, j)
                        elif (got := hops.get((s, i, 1))) is not None:
                            dur, links, nbytes = got
                        else:
                            dur, links, nbytes = hops[s, i, 1] = hop(s, i, s + 1, j)
                        append(Task("xfer", "act " + text, dur, links, (key,), (nxt,), nbytes, "", copies))
                        done.add(nxt)
                else:
                    key = Step("backward", s, j, c)
                    append(Task("bwd", text, backward_s[s], devs, need, (key,), 0.0, "", copies))
                    done.add(key)
                    if wait is not None:
                        del waits[lane]
                    if s > 0:
                        prev = Step("grad", s - 1, j, c)
                        if asynchronous:
                            dur, links, nbytes = hop(s, i, s - 1, j)
                        elif (got := hops.get((s, i, -1))) is not None:
                            dur, links, nbytes = got
                        else:
                            dur, links, nbytes = hops[s, i, -1] = hop(s, i, s - 1, j)
                        append(Task("xfer", "grad " + text, dur, links, (key,), (prev,), nbytes, "", copies))
                        done.add(prev)
                    if asynchronous:
                        n = len(layout.ranks[r])
                        q = j // n
                        rounds[(s, q)] = rounds.get((s, q), 0) + 1
                        members = range(q * n, min((q + 1) * n, layout.microbatches))
                        skey = Synced(s, q)
                        if rounds[(s, q)] == len(members):
                            deps = tuple(Step("backward", s, jj, 0) for jj in members)
                            ordered.extend(_stage_sync(ctx, costs, layout, f"sync {s}/{q}", s, deps, skey))
                            reps = layout.ranks[r]
                            for jj in members:
                                ordered.extend(_updates(ctx, layout, optimizer, reps[jj % n], costs[s].trains,
                                                        costs[s].tensors, (skey,), Updated(stage=s, microbatch=jj)))
                            done.add(skey)
                        waits[lane] = skey
                at += 1
                progressed = True
            pos[lane] = at
        if all(pos[lane] == len(acts) for lane, acts in by_lane.items()):
            return ordered
        if not progressed:
            raise ValueError(f"schedule {layout.schedule!r} deadlocks on this layout")


def _stage_gathers(ctx: CostContext, costs: Sequence[StageCost], layout: PipelineLayout, stage: int,
                   deps: tuple = ()) -> list[Task]:
    """FSDP2 stages: the all-gather of ``stage``'s parameters over its replicas (one per
    tensor-parallel index), in FSDP's ``param_dtype``, after ``deps`` (the replicas'
    first inputs: FSDP2 gathers in the stage's pre-forward hook)."""
    reps = layout.replicas(stage)
    nbytes = costs[stage].param_bytes * layout.gather
    key = Unsharded(stage)
    if len(reps) < 2 or nbytes <= 0:
        return [Task("coll", f"gather stage {stage}", 0.0, (), deps, (key,))]
    return [fsdp_collective_task(ctx, "all_gather", tuple(sorted(r[q] for r in reps)), nbytes,
                                 f"gather stage {stage}", deps, (key,), f"FSDP parameters of stage {stage}",
                                 calls=layout.fsdp_calls)
            for q in range(len(reps[0]))]


def trained_params(costs: Sequence[StageCost], layout: PipelineLayout, devices: int) -> tuple[list[float], list[int]]:
    """Per device, the bytes of the parameters that train (what it updates) and the
    parameter tensors of the stages it hosts."""
    held = [0.0] * devices
    tensors = [0] * devices
    for s in range(layout.stages):
        for rep in layout.replicas(s):
            for d in rep:
                held[d] += costs[s].trains
                tensors[d] += costs[s].tensors
    return held, tensors


def sync_tasks(ctx: CostContext, costs: Sequence[StageCost], layout: PipelineLayout, optimizer: str,
               by_lane: dict[tuple[int, int], tuple[Action, ...]], mirrored: dict[int, int] | None = None) -> list[Task]:
    """A synchronous schedule's end of iteration (module docstring): each stage's
    gradient all-reduce over its replicas after its last backward, the tied weights'
    all-reduces, one optimizer update per device after every sync it takes part in
    (``mirrored``: on replica 0's devices only, each standing for every replica's,
    :func:`mirror`)."""
    ordered: list[Task] = []
    held, tensors = trained_params(costs, layout, ctx.cluster.devices)
    after: dict[int, list] = {}
    for s in range(layout.stages):
        r = layout.rank_of(s)
        deps = tuple(Step("backward", s, max(a.microbatch for a in by_lane[(r, 0)] if a.stage == s), i)
                     for i in range(len(layout.ranks[r])))
        ordered.extend(_stage_sync(ctx, costs, layout, f"sync stage {s}", s, deps, Synced(s)))
        for rep in layout.ranks[r]:
            for d in rep:
                after.setdefault(d, []).append(Synced(s))
    for a_st, b_st, nbytes in layout.tied:
        members = tuple(sorted({d for st in (a_st, b_st) for rep in layout.replicas(st) for d in rep}))
        cost = ctx.collective("all_reduce", members, nbytes)
        res = tuple(sorted({ctx.links[link.id] for link, _ in cost.loads}))
        key = TiedSynced(a_st, b_st)
        ordered.append(Task("coll", "tied weights", cost.time_s, res, (Synced(a_st), Synced(b_st)),
                            (key,), nbytes, f"tied weights of stages {a_st} and {b_st}"))
        for d in members:
            after.setdefault(d, []).append(key)
    copies = len(layout.ranks[0]) if mirrored is not None else 1
    rank_of = {d: r for r, reps in enumerate(layout.ranks) for rep in reps for d in rep}
    for d, deps in sorted(after.items()):
        if held[d] and (mirrored is None or mirrored[d] == d):
            k = layout.shards(rank_of[d])
            owned = k if layout.shard == "zero1" else 1  # FSDP2: a shard of every tensor
            ordered.extend(_updates(ctx, layout, optimizer, (d,), held[d] / k, tensors[d] / owned, tuple(deps),
                                    Updated(d), copies))
    if layout.shard == "zero1":
        ordered.extend(_zero1_gathers(ctx, layout, held, tensors, mirrored))
    return ordered


def _zero1_gathers(ctx: CostContext, layout: PipelineLayout, held: Sequence[float], tensors: Sequence[int],
                   mirrored: dict[int, int] | None) -> list[Task]:
    """ZeRO-1's all-gather of the updated parameters over each rank's replicas, one per
    tensor-parallel index, after the updates of its members (module docstring)."""
    cal = ctx.calibration
    out: list[Task] = []
    for r, reps in enumerate(layout.ranks):
        for q in range(len(reps[0])):
            group = tuple(sorted(rep[q] for rep in reps))
            nbytes = held[group[0]]
            if len(group) < 2 or nbytes <= 0:
                continue
            deps = tuple(dict.fromkeys(Updated(mirrored[d] if mirrored is not None else d) for d in group))
            t = collective_task(ctx, "all_gather", group, nbytes, "zero1 params", deps, (Gathered(r, q),),
                                f"ZeRO-1 parameters of pipeline rank {r}")
            if cal is not None and cal.zero1_per_tensor_s is not None:  # the optimizer's bookkeeping per tensor
                t = t._replace(duration=t.duration + cal.zero1_per_tensor_s.value * tensors[group[0]]
                           + cal.step("zero1"))
            out.append(t)
    return out


def simulate_pipeline(ctx: CostContext, costs: Sequence[StageCost], layout: PipelineLayout, *,
                      optimizer: str = "adam", timeline: bool = True, cutoff: float = math.inf) -> Simulation:
    """Simulate one iteration of a pipeline plan (module docstring). Raises
    :class:`~flexsearch.sim.tasks.PastCutoff` once a synchronous schedule is sure to end
    after ``cutoff`` (:func:`~flexsearch.sim.tasks.run_tasks`; its iteration time is its
    last resource's free time)."""
    check_optimizer(optimizer)
    if layout.shard != "none" and layout.asynchronous:
        raise ValueError(f"only a synchronous pipeline shards its state (got {layout.shard!r} under "
                         f"{layout.schedule!r})")
    check_pipeline_shard(layout.shard, len(layout.ranks[0]), len(layout.ranks[0][0]), layout.schedule,
                         layout.chunks)
    if len(costs) != layout.stages:
        raise ValueError(f"{len(costs)} stage costs for {layout.stages} stages")
    devices = ctx.cluster.devices
    by_lane = lanes(layout)
    mirrored = None if timeline else mirror(ctx, layout)
    acting = by_lane if mirrored is None else {lane: acts for lane, acts in by_lane.items() if lane[1] == 0}
    ordered = action_tasks(ctx, costs, layout, optimizer, acting, len(layout.ranks[0]) if mirrored else 1)
    if not layout.asynchronous:
        ordered += sync_tasks(ctx, costs, layout, optimizer, by_lane, mirrored)
    run = run_tasks(ordered, devices, len(ctx.cluster.links), timeline,
                    cutoff if not layout.asynchronous else math.inf)
    if layout.asynchronous:
        m = layout.microbatches
        ends = [run.end[Step("backward", 0, j, 0)] for j in range(m)]
        h = m // 2
        per_unit = (ends[-1] - ends[h - 1]) / (m - h) if m >= 2 else ends[-1]
        time_s = per_unit * (layout.units or 1)
    else:
        time_s = max(run.free, default=0.0)
    terms = pipeline_memory(ctx, costs, layout, optimizer, occupancy(acting, costs, layout.grad_copies, layout.schedule))
    compute = busy_compute(ordered, devices)
    if mirrored is not None:  # every replica's figures are replica 0's
        terms = [terms[mirrored.get(d, d)] for d in range(devices)]
        compute = [compute[mirrored.get(d, d)] for d in range(devices)]
    return Simulation(
        iteration_time_s=time_s,
        memory_bytes=tuple(peak_bytes(m, ctx.calibration, layout.runtime) for m in terms),
        capacity_bytes=ctx.cluster.device.memory_capacity.value,
        compute_s=tuple(compute),
        timeline=tuple(run.timeline) if timeline else (),
        link_names=tuple(link.id for link in ctx.cluster.links),
        critical_path_s=max(run.chain.values(), default=0.0) if timeline else float("nan"),
        serial_s=run.serial,
        memory_terms=tuple(terms),
    )
