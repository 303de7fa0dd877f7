"""Decentralized (D-PSGD) and centralized (parameter server, all-reduce) data-parallel
iterations as tasks for the shared list scheduler.

Every rank ``i`` of ``n`` (device ``i``) holds a whole model replica and trains on its
slice of the global batch. The caller gives one :class:`~flexsearch.sim.pipeline_layout.StageCost`
for that replica: forward and backward time of the ``B / n`` slice, the parameter bytes
``P`` and the activation bytes kept for the backward (``stash_bytes``); the search
(:func:`flexsearch.sim.stages.replica_cost`) costs it exactly as the
data-parallel baseline costs its replica, so all of these plans compare on one scale.
Tasks go to :func:`~flexsearch.sim.tasks.run_tasks`: a task starts when its
dependencies have ended and its device is free, a transfer runs in the idle time its
links have in common, so communication overlaps compute and queues on shared links.

**D-PSGD** (Lian et al. 2017, REFERENCE section 3), one gossip step ``t`` of the
topology (:mod:`flexsearch.strategy.topology`):

- per rank, first: the **snapshot**, its model flattened into one buffer (``2 P`` bytes
  moved at the device's elementwise bandwidth);
- then forward, backward (the gradient at the rank's current model ``x_i``);
- at the same time, the **exchange**: every rank sends its ``P``-byte snapshot to each
  of its out-neighbours at step ``t``. All of the step's transfers form one
  :func:`~flexsearch.cost.comm.exchange` task, ``max path latency + max_l bytes(l) /
  B(l)`` over the real links (concurrent sends share their NIC: ``alpha + d P / B`` for
  out-degree ``d`` on a switch, independent of ``n``); it holds every link it loads
  (posted asynchronously, like a pipeline's sends: not the devices);
- per rank, after the exchange and the backward: the **averaging** ``x_i <- sum_j W_ij
  x_j`` as the emitter does it, in the snapshot buffer (scaled in place, then one
  fused add per in-neighbour) and copied back into the parameters: ``(4 + 3 d_in) P``
  bytes at the elementwise bandwidth;
- per rank, after the averaging: the optimizer update ``x_i <- x_i - lr g_i`` (the
  gradient taken before averaging, so the exchange hides behind the compute):
  ``snapshot + max(fwd + bwd, exchange) + average + update`` when nothing queues. With
  a calibration (:mod:`flexsearch.cost.calibration`) the update is the calibrated one
  (per tensor and per byte) plus the ``decentralized`` mode's fixed cost per step.

A time-varying topology (``period > 1``, the one-peer exponential graph) is simulated
for the ``period`` steps of one period in a row (step ``t + 1`` starts from step ``t``'s
models: its compute waits for the rank's update, its exchange for every sender's);
``iteration_time_s``, ``compute_s``, ``serial_s`` and ``critical_path_s`` are means per
iteration, the timeline covers the whole period.

**Parameter server** (``servers``: one device, or every device for the sharded form,
each holding a ``P / s`` shard): after the backward every worker pushes its gradient
shards to the servers, each server applies the optimizer to its shard, then every worker
pulls the new parameters. Push and pull are one :func:`~flexsearch.cost.comm.exchange`
each (the two phases of :func:`~flexsearch.cost.comm.parameter_server`; their sum is
its time); a worker that is also a server keeps its own shard local.

**All-reduce**: the data-parallel baseline itself, one pipeline stage on every device
(:func:`~flexsearch.sim.pipeline.simulate_pipeline`, the code path of
:func:`flexsearch.sim.predict.predict` of an uncalibrated ``data`` plan): forward, backward, one all-reduce of
the gradients, the update.

**Memory** per device (:mod:`flexsearch.sim.accounting`):

- D-PSGD: a replica (parameters, gradients, optimizer state, activations) with buffers
  of ``(1 + d_in) P``, ``d_in`` the rank's largest in-degree over the period: the
  snapshot of its own model it sends while the backward runs, and a receive buffer per
  in-neighbour's model (as :mod:`flexsearch.emit.decentralized` allocates them);
- parameter server: parameters, gradients and activations on a worker (no optimizer
  state), plus the shard's optimizer state and one ``P / s`` buffer into which it
  accumulates the pushed gradients on a server; the emitter does not run parameter
  servers, so no calibration applies to them (update and memory are the uncalibrated
  rules);
- all-reduce: a replica.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from flexsearch.cost import comm
from flexsearch.sim.accounting import (
    OPTIMIZER_STATE,
    UPDATE_WORKING,
    DeviceMemory,
    check_optimizer,
    elementwise_s,
    peak_bytes,
    roofline_update_s,
    stage_largest,
    update_s,
)
from flexsearch.sim.context import CostContext
from flexsearch.sim.pipeline import simulate_pipeline
from flexsearch.sim.pipeline_layout import PipelineLayout, StageCost
from flexsearch.sim.result import Simulation
from flexsearch.sim.tasks import Task, busy_compute, run_tasks
from flexsearch.strategy.topology import Topology


def _check(ctx: CostContext, optimizer: str) -> int:
    check_optimizer(optimizer)
    return ctx.cluster.devices


def snapshot_time(ctx: CostContext, param_bytes: float) -> float:
    """Seconds of flattening the model into the buffer the exchange sends."""
    return elementwise_s(ctx, 2 * param_bytes)


def average_time(ctx: CostContext, param_bytes: float, in_degree: int) -> float:
    """Seconds of the gossip average as the emitter runs it: scale the snapshot in place
    (read, write), add each in-neighbour's model (read two, write one), copy the result
    back into the parameters (read, write)."""
    return elementwise_s(ctx, (4 + 3 * in_degree) * param_bytes)


def exchange_task(ctx: CostContext, name: str, transfers: Sequence[tuple[int, int, float]],
                  deps: tuple, defines: tuple, detail: str) -> Task:
    """One task for concurrent point-to-point transfers ``(src, dst, bytes)``
    (:func:`~flexsearch.cost.comm.exchange`), holding every link they load."""
    cost = comm.exchange(ctx.cluster, transfers)
    res = tuple(sorted({ctx.links[link.id] for link in cost.links}))
    total = sum(b for s, d, b in transfers if s != d)
    return Task("coll", name, cost.time_s, res, deps, defines, total, detail)


def _others(pairs: Iterable, rank: int) -> list[int]:
    """Neighbour ranks other than ``rank`` (``pairs``: ranks or ``(rank, weight)``)."""
    out = []
    for p in pairs:
        j = p[0] if isinstance(p, tuple) else p
        if j != rank:
            out.append(int(j))
    return out


def _finish(ctx: CostContext, ordered: list[Task], terms: Sequence[DeviceMemory], iterations: int,
            timeline: bool, calibrated: bool = True) -> Simulation:
    """Schedule ``ordered`` (``iterations`` of them) and price the memory ``terms``
    (uncalibrated for plans the emitter does not run: ``calibrated`` False)."""
    n = ctx.cluster.devices
    memory = [peak_bytes(m, ctx.calibration if calibrated else None, "decentralized") for m in terms]
    run = run_tasks(ordered, n, len(ctx.cluster.links), timeline)
    compute = busy_compute(ordered, n)
    return Simulation(
        iteration_time_s=max(run.free, default=0.0) / iterations,
        memory_bytes=tuple(memory),
        capacity_bytes=ctx.cluster.device.memory_capacity.value,
        compute_s=tuple(c / iterations for c in compute),
        timeline=tuple(run.timeline) if timeline else (),
        link_names=tuple(link.id for link in ctx.cluster.links),
        critical_path_s=max(run.chain.values(), default=0.0) / iterations if timeline else float("nan"),
        serial_s=run.serial / iterations,
        memory_terms=tuple(terms),
    )


def simulate_gossip(ctx: CostContext, cost: StageCost, topology: Topology, *, optimizer: str = "adam",
                    timeline: bool = True) -> Simulation:
    """One D-PSGD iteration on ``topology`` (module docstring; a period's mean for a
    time-varying topology). Rank ``i`` runs on device ``i``."""
    n = _check(ctx, optimizer)
    if topology.n != n:
        raise ValueError(f"topology {topology.name!r} has {topology.n} ranks, the cluster {n} devices")
    p = cost.trains  # the emitter averages the parameters that train
    period = max(1, int(topology.period))
    upd = update_s(ctx, optimizer, p, cost.tensors, "decentralized")
    snap = snapshot_time(ctx, p)
    ordered: list[Task] = []
    in_max = [0] * n
    for t in range(period):
        for i in range(n):
            prev = (("u", t - 1, i),) if t else ()
            ordered.append(Task("update", "snapshot", snap, (i,), prev, (("s", t, i),)))
        sends = [(i, k, p) for i in range(n) for k in _others(topology.out_neighbours(i, t), i)]
        ordered.append(exchange_task(
            ctx, f"gossip {t}", sends, tuple(("s", t, i) for i in range(n)), (("x", t),),
            f"{topology.name} step {t}: {len(sends)} models of {p:.0f} bytes"))
        for i in range(n):
            d_in = len(_others(topology.in_neighbours(i, t), i))
            in_max[i] = max(in_max[i], d_in)
            ordered.append(Task("fwd", f"forward {t}", cost.forward_s, (i,), (("s", t, i),), (("f", t, i),)))
            ordered.append(Task("bwd", f"backward {t}", cost.backward_s, (i,), (("f", t, i),), (("b", t, i),)))
            ordered.append(Task("update", "average", average_time(ctx, p, d_in), (i,), (("x", t), ("b", t, i)),
                                (("a", t, i),), detail=f"{1 + d_in} models"))
            ordered.append(Task("update", "optimizer", upd, (i,), (("a", t, i),), (("u", t, i),)))
    largest = stage_largest(cost.largest_param_bytes, cost.param_bytes)
    terms = [DeviceMemory(cost.param_bytes, p, OPTIMIZER_STATE[optimizer] * p, cost.stash_bytes, largest,
                          (1 + in_max[i]) * p,
                          loss_grad=cost.loss_bytes, rebuilt=cost.working_bytes,
                          grad_working=cost.grad_working_bytes, update_working=UPDATE_WORKING[optimizer] * p,
                          loss_working=cost.loss_working_bytes)
             for i in range(n)]
    return _finish(ctx, ordered, terms, period, timeline)


def simulate_parameter_server(ctx: CostContext, cost: StageCost, *, servers: Sequence[int] = (0,),
                              optimizer: str = "adam", timeline: bool = True) -> Simulation:
    """One synchronous parameter-server iteration (module docstring): ``servers=(0,)``
    is one server (device 0, also a worker), ``range(n)`` the sharded form."""
    n = _check(ctx, optimizer)
    srv = tuple(sorted(set(servers)))
    if not srv or any(not 0 <= s < n for s in srv):
        raise ValueError(f"servers {tuple(servers)} must be devices of the {n}-device cluster")
    p = cost.trains  # gradients pushed, updated parameters pulled: those that train
    shard = p / len(srv)
    ordered: list[Task] = []
    for i in range(n):
        ordered.append(Task("fwd", "forward", cost.forward_s, (i,), (), (("f", i),)))
        ordered.append(Task("bwd", "backward", cost.backward_s, (i,), (("f", i),), (("b", i),)))
    push = [(w, s, shard) for w in range(n) for s in srv if w != s]
    ordered.append(exchange_task(ctx, "push gradients", push, tuple(("b", i) for i in range(n)), (("push",),),
                                 f"{len(srv)} server(s), {len(push)} shards of {shard:.0f} bytes"))
    upd = roofline_update_s(ctx, optimizer, shard)  # not run by the emitter: uncalibrated
    for s in srv:
        ordered.append(Task("update", "optimizer", upd, (s,), (("push",), ("b", s)), (("u", s),),
                            detail=f"server shard of {shard:.0f} bytes"))
    pull = [(s, w, b) for w, s, b in push]
    ordered.append(exchange_task(ctx, "pull parameters", pull, tuple(("u", s) for s in srv), (("pull",),),
                                 f"{len(srv)} server(s), {len(pull)} shards of {shard:.0f} bytes"))
    k = OPTIMIZER_STATE[optimizer]
    terms = [DeviceMemory(cost.param_bytes, p, k * shard if i in srv else 0.0, cost.stash_bytes, buffers=shard if i in srv else 0.0,
                          loss_grad=cost.loss_bytes, rebuilt=cost.working_bytes, grad_working=cost.grad_working_bytes,
                          update_working=UPDATE_WORKING[optimizer] * shard if i in srv else 0.0,
                          loss_working=cost.loss_working_bytes) for i in range(n)]
    return _finish(ctx, ordered, terms, 1, timeline, calibrated=False)


def simulate_all_reduce(ctx: CostContext, cost: StageCost, *, optimizer: str = "adam",
                        timeline: bool = True) -> Simulation:
    """The data-parallel baseline: one stage replicated on every device, gradients
    all-reduced after the backward (exactly the one-bucket ``data`` prediction of
    :func:`flexsearch.sim.predict.predict` for the same replica cost)."""
    n = _check(ctx, optimizer)
    layout = PipelineLayout("1f1b", 1, (tuple((d,) for d in range(n)),))
    return simulate_pipeline(ctx, [cost], layout, optimizer=optimizer, timeline=timeline)
