"""Pipeline simulation: a pipeline plan's iteration as tasks for the shared list scheduler.

A pipeline of ``S`` stages runs on ``p`` pipeline ranks (``S = p v``: an interleaved
schedule gives each rank ``v`` chunks, stage ``s`` on rank ``s mod p``). Each rank is
replicated: a tuple of replicas, each a group of devices running the stage in lockstep
(tensor parallel inside; one device for a plain stage). Per stage the caller gives a
:class:`StageCost`: forward and backward time of one microbatch on one replica, the
parameter and stashed-activation bytes per device, and the activation bytes one replica
sends to the next stage per microbatch.

**Tasks.** For every action of the schedule (:mod:`flexsearch.strategy.schedules`) a
forward or backward task on the replica's devices; after a forward, the activations go
to the next stage's replica, after a backward the gradient comes back: one transfer
over the real links of the path per tensor-parallel rank (run in parallel: one task
holding all their links for the longest). Tasks are handed to
:func:`~flexsearch.sim.simulator.run_tasks` in an order that respects every rank's
schedule and every dependency, so devices run their actions in schedule order and
transfers queue on shared links.

**Synchronous schedules** (``gpipe``, ``1f1b``, ``interleaved``): every replica runs the
whole schedule on its share of the batch; after a stage's last backward its weight
gradients are all-reduced over its replicas (one all-reduce per tensor-parallel rank),
weights shared by two stages (tied embeddings) are all-reduced between them, then each
device runs one optimizer update. The iteration time is the makespan.

**PipeDream** (``pipedream``): asynchronous 1F1B with weight stashing over a window of
minibatches (no flush); replica ``j mod r`` of a stage with ``r`` replicas takes
minibatch ``j``; each replica runs ``NOAM_k = ceil(replicas of stages >= k / r_k)``
warm-up forwards, then alternates; after every round of ``r`` minibatches the stage's
replicas all-reduce their gradients and update (each replica waits for it). The time
per minibatch is measured in steady state, over the window's second half.

**Memory** per device: ``P (2 + optimizer state) + A q + R`` for each stage it hosts,
with ``P`` its parameter bytes, ``A`` the activations stashed per microbatch, ``q`` the
peak number of microbatches in flight on it under the schedule and ``R`` the working
bytes (activation recomputation keeps only each microbatch's stage input, ``A``, and
rebuilds one microbatch's activations, ``R``, during its backward); PipeDream adds one
weight version per extra minibatch in flight, ``P (q - 1)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from flexsearch.cost.compute import Work, roofline_time
from flexsearch.sim.simulator import (
    _UPDATE_TRAFFIC,
    OPTIMIZER_STATE,
    Simulation,
    busy_compute,
    run_tasks,
)
from flexsearch.sim.taskgraph import CostContext, Task
from flexsearch.strategy.schedules import Action, in_flight, rank_actions, warmup_then_alternate


@dataclass(frozen=True)
class StageCost:
    """One stage's costs (module docstring); times in seconds, sizes in bytes per device."""

    forward_s: float
    backward_s: float
    param_bytes: float
    stash_bytes: float
    send_bytes: float
    working_bytes: float = 0.0
    """Bytes needed once, whatever the microbatches in flight (with activation
    recomputation: one microbatch's activations, rebuilt during its backward)."""
    tensors: int = 0
    """Parameter tensors per device (a calibrated update pays a fixed cost per tensor)."""
    largest_param_bytes: float = 0.0
    """The largest parameter tensor per device (a calibrated update's temporaries)."""


@dataclass(frozen=True)
class PipelineLayout:
    """Where a pipeline runs: ``ranks[r][i]`` = the devices of replica ``i`` of pipeline
    rank ``r``; ``units`` = how many schedule microbatches make one iteration (the
    microbatch count for a synchronous schedule; the minibatches per global batch for
    PipeDream, whose window is ``microbatches`` long)."""

    schedule: str
    microbatches: int
    ranks: tuple[tuple[tuple[int, ...], ...], ...]
    chunks: int = 1
    units: int | None = None
    tied: tuple[tuple[int, int, float], ...] = ()
    """(stage a, stage b, gradient bytes per device) of weights both stages hold."""

    @property
    def stages(self) -> int:
        return len(self.ranks) * self.chunks

    def rank_of(self, stage: int) -> int:
        return stage % len(self.ranks)


def _lanes(layout: PipelineLayout) -> dict[tuple[int, int], tuple[Action, ...]]:
    """(rank, replica) -> the actions that replica runs."""
    p, m = len(layout.ranks), layout.microbatches
    out: dict[tuple[int, int], tuple[Action, ...]] = {}
    if layout.schedule != "pipedream":
        per_rank = rank_actions(layout.schedule, p, m, chunks=layout.chunks)
        for r, reps in enumerate(layout.ranks):
            for i in range(len(reps)):
                out[(r, i)] = per_rank[r]
        return out
    if layout.chunks != 1:
        raise ValueError("the pipedream schedule has one chunk per rank")
    sizes = [len(reps) for reps in layout.ranks]
    for r, n in enumerate(sizes):
        noam = math.ceil(sum(sizes[r:]) / n)
        for i in range(n):
            mine = [j for j in range(m) if j % n == i]
            fw = [Action(r, "F", j) for j in mine]
            bw = [Action(r, "B", j) for j in mine]
            out[(r, i)] = warmup_then_alternate(fw, bw, min(noam, len(mine)))
    return out


def simulate_pipeline(ctx: CostContext, costs: Sequence[StageCost], layout: PipelineLayout, *,
                      optimizer: str = "adam", timeline: bool = True) -> Simulation:
    """Simulate one iteration of a pipeline plan (module docstring)."""
    if len(costs) != layout.stages:
        raise ValueError(f"{len(costs)} stage costs for {layout.stages} stages")
    devices = ctx.cluster.devices
    asynchronous = layout.schedule == "pipedream"
    lanes = _lanes(layout)
    last = layout.stages - 1

    def replica(stage: int, j: int, lane_rep: int) -> int:
        n = len(layout.ranks[layout.rank_of(stage)])
        return j % n if asynchronous else lane_rep

    def chain(j: int, lane_rep: int) -> int:
        return 0 if asynchronous else lane_rep

    def group(stage: int, rep: int) -> tuple[int, ...]:
        return layout.ranks[layout.rank_of(stage)][rep]

    cal = ctx.calibration
    action_s = cal.pipeline_action_s.value if cal is not None else 0.0
    tensor_parallel = len(layout.ranks[0][0]) > 1  # stages on DTensors

    def move(name: str, src: tuple[int, ...], dst: tuple[int, ...], nbytes: float, dep, key) -> Task:
        dur, links = 0.0, set()
        if src != dst and nbytes > 0:
            for a, b in zip(src, dst, strict=True):
                t, ls = ctx.transfer(a, b, nbytes)
                dur = max(dur, t)
                links.update(ls)
            # sends and receives are posted asynchronously: they hold the links, not the devices
        return Task("xfer", name, dur, tuple(sorted(links)), (dep,), (key,), nbytes * len(src))

    def sync(name: str, stage: int, deps: tuple, key) -> list[Task]:
        reps = layout.ranks[layout.rank_of(stage)]
        nbytes = costs[stage].param_bytes
        if len(reps) < 2 or nbytes <= 0:
            return [Task("coll", name, 0.0, (), deps, (key,))]
        out = []
        for q in range(len(reps[0])):
            group = tuple(sorted(r[q] for r in reps))
            cost = ctx.collective("all_reduce", group, nbytes)
            res = tuple(sorted({ctx.links[link.id] for link, _ in cost.loads} | set(ctx.device_resources(group))))
            out.append(Task("coll", name, cost.time_s, res, deps, (key,), nbytes, f"grad sync stage {stage}"))
        return out

    def update(devs: tuple[int, ...], nbytes: float, deps: tuple, key, tensors: float = 0) -> list[Task]:
        if cal is not None:
            dur = cal.update_s(optimizer, tensors, nbytes, sharded=tensor_parallel)
            dur += cal.step("pipeline")
        else:
            dur = roofline_time(Work(0.0, _UPDATE_TRAFFIC[optimizer] * nbytes), ctx.cluster.device,
                                "float32", "elementwise", ctx.efficiency)
        return [Task("update", "optimizer", dur, (d,), deps, (key,)) for d in devs]

    # Emit tasks lane by lane, each action once its inputs are emitted.
    ordered: list[Task] = []
    done: set[tuple] = set()
    pos = dict.fromkeys(lanes, 0)
    waits: dict[tuple[int, int], tuple] = {}  # lane -> sync key its next action waits for
    rounds: dict[tuple[int, int], int] = {}  # PipeDream: (stage, round) -> backwards emitted
    while True:
        progressed = False
        for lane, acts in lanes.items():
            r, i = lane
            while pos[lane] < len(acts):
                a = acts[pos[lane]]
                s, j = a.stage, a.microbatch
                c = chain(j, i)
                need = []
                if a.kind == "F" and s > 0:
                    need.append(("pa", s, j, c))
                if a.kind == "B":
                    need.append(("pf", s, j, c))
                    if s < last:
                        need.append(("pg", s, j, c))
                if lane in waits:
                    need.append(waits[lane])
                if not all(k in done for k in need):
                    break
                devs = group(s, i)
                c_s = costs[s]
                if a.kind == "F":
                    key = ("pf", s, j, c)
                    ordered.append(Task("fwd", a.text, c_s.forward_s + action_s, devs, tuple(need), (key,)))
                    done.add(key)
                    if s < last:
                        nxt = ("pa", s + 1, j, c)
                        ordered.append(move(f"act {a.text}", devs, group(s + 1, replica(s + 1, j, i)),
                                            c_s.send_bytes, key, nxt))
                        done.add(nxt)
                else:
                    key = ("pb", s, j, c)
                    ordered.append(Task("bwd", a.text, c_s.backward_s + action_s, devs, tuple(need), (key,)))
                    done.add(key)
                    waits.pop(lane, None)
                    if s > 0:
                        prev = ("pg", s - 1, j, c)
                        ordered.append(move(f"grad {a.text}", devs, group(s - 1, replica(s - 1, j, i)),
                                            costs[s - 1].send_bytes, key, prev))
                        done.add(prev)
                    if asynchronous:
                        n = len(layout.ranks[r])
                        q = j // n
                        rounds[(s, q)] = rounds.get((s, q), 0) + 1
                        members = range(q * n, min((q + 1) * n, layout.microbatches))
                        skey = ("ps", s, q)
                        if rounds[(s, q)] == len(members):
                            deps = tuple(("pb", s, jj, 0) for jj in members)
                            ordered.extend(sync(f"sync {s}/{q}", s, deps, skey))
                            reps = layout.ranks[r]
                            for jj in members:
                                ordered.extend(update(reps[jj % n], c_s.param_bytes, (skey,), ("pu", s, jj),
                                                      c_s.tensors))
                            done.add(skey)
                        waits[lane] = skey
                pos[lane] += 1
                progressed = True
        if all(pos[lane] == len(acts) for lane, acts in lanes.items()):
            break
        if not progressed:
            raise ValueError(f"schedule {layout.schedule!r} deadlocks on this layout")

    # Synchronous schedules: gradient all-reduce per stage, tied weights, one update per device.
    held = [0.0] * devices
    tensors = [0] * devices
    for s in range(layout.stages):
        for rep in layout.ranks[layout.rank_of(s)]:
            for d in rep:
                held[d] += costs[s].param_bytes
                tensors[d] += costs[s].tensors
    if not asynchronous:
        after: dict[int, list] = {}
        for s in range(layout.stages):
            r = layout.rank_of(s)
            deps = tuple(("pb", s, max(a.microbatch for a in lanes[(r, i)] if a.stage == s), i)
                         for i in range(len(layout.ranks[r])))
            ordered.extend(sync(f"sync stage {s}", s, deps, ("ps", s)))
            for rep in layout.ranks[r]:
                for d in rep:
                    after.setdefault(d, []).append(("ps", s))
        for a_st, b_st, nbytes in layout.tied:
            ga, gb = layout.ranks[layout.rank_of(a_st)], layout.ranks[layout.rank_of(b_st)]
            members = tuple(sorted({d for reps in (ga, gb) for rep in reps for d in rep}))
            cost = ctx.collective("all_reduce", members, nbytes)
            res = tuple(sorted({ctx.links[link.id] for link, _ in cost.loads}))
            key = ("pt", a_st, b_st)
            ordered.append(Task("coll", "tied weights", cost.time_s, res, (("ps", a_st), ("ps", b_st)),
                                (key,), nbytes, f"tied weights of stages {a_st} and {b_st}"))
            for d in members:
                after.setdefault(d, []).append(key)
        for d, deps in sorted(after.items()):
            if held[d]:
                ordered.extend(update((d,), held[d], tuple(deps), ("u", d), tensors[d]))

    run = run_tasks(ordered, devices, len(ctx.cluster.links), timeline)
    compute = busy_compute(ordered, devices)
    if asynchronous:
        m = layout.microbatches
        ends = [run.end[("pb", 0, j, 0)] for j in range(m)]
        h = m // 2
        per_unit = (ends[-1] - ends[h - 1]) / (m - h) if m >= 2 else ends[-1]
        time_s = per_unit * (layout.units or 1)
    else:
        time_s = max(run.free, default=0.0)

    state = 2 + OPTIMIZER_STATE[optimizer]
    memory = [0.0] * devices
    largest = [0.0] * devices
    stashed = [0.0] * devices
    for (r, i), acts in lanes.items():
        peaks = in_flight(acts)
        for s, q in peaks.items():
            c_s = costs[s]
            extra = c_s.param_bytes * (q - 1) if asynchronous else 0.0
            for d in layout.ranks[r][i]:
                memory[d] += c_s.param_bytes * state + c_s.stash_bytes * q + extra + c_s.working_bytes
                # without the stage's largest tensor: half its parameters (a stage of two or more layers)
                largest[d] = max(largest[d], c_s.largest_param_bytes or c_s.param_bytes / 2)
                stashed[d] += c_s.stash_bytes * q + c_s.working_bytes
    if cal is not None:  # gradients allocated as the activations go; the update's temporaries; the runtime's
        for d in range(devices):
            grads = held[d]
            memory[d] += (max(stashed[d], grads + cal.optimizer_working_tensors.value * largest[d]) - stashed[d] - grads
                          + cal.runtime("pipeline"))
    return Simulation(
        iteration_time_s=time_s,
        memory_bytes=tuple(memory),
        capacity_bytes=ctx.cluster.device.memory_capacity.value,
        compute_s=tuple(compute),
        timeline=tuple(run.timeline) if timeline else (),
        link_names=tuple(link.id for link in ctx.cluster.links),
        critical_path_s=max(run.chain.values(), default=0.0) if timeline else float("nan"),
        serial_s=run.serial,
    )
