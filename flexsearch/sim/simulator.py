"""The op-level simulator: list scheduling of one iteration's task graph (SOAP and data plans).

**Schedule.** Tasks are taken in program order: the forward fragments
(:mod:`flexsearch.sim.taskgraph`) in topological order, the backward fragments in
reverse, then one optimizer update per device (:func:`flexsearch.sim.accounting.update_s`)
after its gradient synchronisations. Each task starts once its dependencies have
ended and its device is free, and holds the device until it ends; a transfer or
collective runs in the idle time its links have in common from then on, pausing over
the tasks listed before it (:func:`flexsearch.sim.tasks.run_tasks`), so transfers queue
on busy links and overlap with compute on the devices. The iteration time is the end of
the last task.

**Execution modes.** A plan the emitter runs on DTensors (SOAP) synchronises each
layer's gradients on its own, and returns the whole output to every device, where the
loss runs over all of it (:func:`~flexsearch.sim.taskgraph.output_gather`, calibrated);
one it runs with DDP (``ddp``, calibrated: the ``data``
plan) all-reduces them in DDP's buckets (:meth:`Simulator._buckets`); one it runs with
FSDP2 (``shard``: ``zero2``, ``zero3``, ``hsdp``) gathers and reduce-scatters each FSDP
unit (:meth:`Simulator._fsdp`); ZeRO-1 (``zero1``) runs DDP, then each device updates
its share of the parameters and all-gathers the result (:meth:`Simulator._schedule`).

**Memory** per device: :mod:`flexsearch.sim.accounting`, with the device's parameter
shard, the activations its fragments keep (plus, calibrated, the loss's gradient of the
output) and, sharded, FSDP's gathered units. A plan whose peak on some device exceeds
its memory is **infeasible**.

**Delta simulation.** A :class:`Simulator` keeps each node's fragments keyed by the
node's configuration and its producers' (the :data:`FRAGMENTS_KEPT` most recently
used); after a change only the fragments of changed nodes and of their consumers that
it does not hold are built (region intersections, costs, collectives), and the cheap
assembly and scheduling pass reruns.

**One replica for all.** Without a timeline, configurations that repeat every ``w``
devices (:meth:`Simulator.replica`: every op on all ``n`` devices, ``w`` the least
common multiple of their model-parallel degrees and of an HSDP shard group, the
replicas on links of their own) are simulated for devices ``0 .. w-1`` only
(:class:`~flexsearch.sim.taskgraph.Replica`): every replica runs the same tasks at the
same times, so the schedule of the first is the schedule of each, and its memory and
compute are every replica's. Data parallelism on 256 devices is then simulated on one,
Megatron's layouts on one tensor-parallel group. The result is the full simulation's
(``tests/test_simulator.py`` compares them); a task that couples replicas otherwise
(:class:`~flexsearch.sim.taskgraph.NotPeriodic`) falls back to every device.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

from flexsearch.cost.hardware import Cluster
from flexsearch.graph.opgraph import OpGraph
from flexsearch.sim.accounting import (
    OPTIMIZER_STATE,
    UPDATE_WORKING,
    DeviceMemory,
    check_optimizer,
    peak_bytes,
    update_s,
)
from flexsearch.sim.context import CostContext, collective_task, fsdp_collective_task
from flexsearch.sim.gradients import merged_reductions, without_gradient
from flexsearch.sim.op_memory import backward_working_per_device, loss_terms
from flexsearch.sim.result import Simulation
from flexsearch.sim.taskgraph import (
    Fragment,
    NotPeriodic,
    Replica,
    activation_split,
    build_fragment,
    kept,
)
from flexsearch.sim.tasks import PastCutoff, Scheduled, Task, run_tasks
from flexsearch.strategy.config import Config, is_source
from flexsearch.strategy.fsdp import ROOT, param_units
from flexsearch.strategy.kinds import FSDP_SHARDINGS
from flexsearch.strategy.recompute import Checkpointing

FRAGMENTS_KEPT = 4
"""Fragments kept per node, the most recently used (delta simulation): a search returns
to configurations it has left (an MCMC step it rejects, a unit's earlier choice), and
their fragments come back from the cache instead of being rebuilt."""


@dataclass(frozen=True)
class Rebuilt:
    """What activation checkpointing rebuilds (:meth:`Simulator._checkpoint`): per device
    the largest unit's bytes (``working``), per node its share per device
    (``per_node``) and per node its unit (``unit_of``, -1: none)."""

    working: dict[int, float]
    per_node: tuple[dict[int, float], ...]
    unit_of: tuple[int, ...]


class Simulator:
    """Simulates configurations of one graph under one cost context, keeping fragments
    between calls (delta simulation). ``simulate(configs)`` takes a configuration for
    every node (:meth:`flexsearch.strategy.space.Space.expand`). ``context`` is a
    :class:`~flexsearch.sim.context.CostContext`, or a cluster with the context's
    keyword arguments (``measured``, ``efficiency``, ``dtype``, ``calibration``)."""

    def __init__(self, graph: OpGraph, context: CostContext | Cluster, *, optimizer: str = "adam", **ctx_kw):
        self.graph = graph
        self.optimizer = check_optimizer(optimizer)
        self.ctx = context if isinstance(context, CostContext) else CostContext(context, **ctx_kw)
        self.cluster = self.ctx.cluster
        # (ddp, replica width) -> node -> its fragments by signature, the latest last
        self._caches: dict[tuple[bool, int], dict[str, dict[tuple, Fragment]]] = {}
        self.rebuilt = 0  # fragments built so far (delta simulation statistics)
        self._links = tuple(link.id for link in self.cluster.links)
        self._checkpointing: dict[str, Checkpointing] = {}
        self._no_grad = without_gradient(graph.nodes, graph.frozen_params)
        index = {n.name: i for i, n in enumerate(graph.nodes)}
        self._inputs = [[index[i] for i in n.inputs] for n in graph.nodes]
        # (ddp, replica width) -> the configurations and fragments of the last call
        self._last: dict[tuple[bool, int], tuple[list[Config], list[Fragment]]] = {}

    def fragment(self, name: str, configs: Mapping[str, Config], *, ddp: bool = False,
                 replica: Replica | None = None) -> Fragment:
        """``name``'s fragment under ``configs`` (cached; ``replica``: the first
        replica's, :class:`~flexsearch.sim.taskgraph.Replica`)."""
        node = self.graph.node(name)
        sig = (configs[name], tuple(configs[i] for i in node.inputs))
        cache = self._caches.setdefault((ddp, replica.width if replica is not None else 0), {})
        kept = cache.get(name)
        if kept is None:
            kept = cache[name] = {}
        frag = kept.get(sig)
        if frag is not None:
            if next(reversed(kept)) != sig:  # the latest last
                kept[sig] = kept.pop(sig)
            return frag
        producers = [(self.graph.node(i), configs[i]) for i in node.inputs]
        frag = build_fragment(node, configs[name], producers, self.ctx.as_ddp() if ddp else self.ctx, replica,
                              self._no_grad)
        if len(kept) >= FRAGMENTS_KEPT:
            del kept[next(iter(kept))]  # the least recently used
        kept[sig] = frag
        self.rebuilt += 1
        return frag

    def fragments(self, configs: Mapping[str, Config], *, ddp: bool = False,
                  replica: Replica | None = None) -> list[Fragment]:
        """Every node's :meth:`fragment` under ``configs``, in graph order. A node whose
        configuration and producers' configurations are those of the previous call (in
        the same mode; identical objects, or equal) keeps that call's fragment without
        a lookup: after a move, only the changed nodes and their consumers are looked
        up (and built when the cache does not hold them)."""
        mode = (ddp, replica.width if replica is not None else 0)
        nodes = self.graph.nodes
        now = [configs[n.name] for n in nodes]
        last = self._last.get(mode)
        if last is None:
            frags = [self.fragment(n.name, configs, ddp=ddp, replica=replica) for n in nodes]
        else:
            before, frags = last
            frags = list(frags)
            changed = [a is not b and a != b for a, b in zip(now, before, strict=True)]
            for i, n in enumerate(nodes):
                if changed[i] or any(changed[j] for j in self._inputs[i]):
                    frags[i] = self.fragment(n.name, configs, ddp=ddp, replica=replica)
        self._last[mode] = (now, frags)
        return frags

    def replica(self, configs: Mapping[str, Config], group: int = 0) -> Replica | None:
        """The replica quotient ``configs`` allow (module docstring), None when they do
        not repeat. Every op (sources have no tasks) on all ``n`` devices; the period
        ``w`` is the least common multiple of their model-parallel degrees ``t`` (an op
        replicated on every device is the same on each) and of ``group`` (an HSDP shard
        group), ``w < n`` dividing ``n``; for ``w > 1`` the replicas lie inside nodes
        (``w`` divides the devices per node) on links of their own (a switch, or a
        replica per node)."""
        n = self.cluster.devices
        w = group if 1 < group < n else 1
        for node in self.graph.nodes:
            if is_source(node):  # no tasks
                continue
            c = configs[node.name]
            if c.first or c.n != n:
                return None
            if c.kind != "x" or c.s > 1:  # an op replicated on every device is the same on each
                w = math.lcm(w, c.t)
        if w >= n or n % w:
            return None
        per_node = self.cluster.devices_per_node
        if w > 1 and (per_node % w or (w < per_node and self.cluster.spec.intra_node.topology != "switch")):
            return None
        return Replica(w, n)

    def is_ddp(self, configs: Mapping[str, Config]) -> bool:
        """Would the emitter run these configurations with DDP? With a calibration: every
        op data parallel or replicated over all devices (a ``data`` plan)."""
        if self.ctx.calibration is None or self.cluster.devices < 2:
            return False
        n = self.cluster.devices
        return all(c.kind in ("", "x") and c.n == n and c.first == 0 for c in configs.values())

    def simulate(self, configs: Mapping[str, Config], *, timeline: bool = True,
                 ddp: bool | None = None, shard: str = "none", shard_group: int = 0,
                 fsdp_units: tuple[str, ...] | None = None, recompute: str = "none",
                 cutoff: float = math.inf) -> Simulation | None:
        """Simulate one iteration; ``timeline=False`` skips the per-task record and the
        critical path (what a search needs: time and memory). ``cutoff``: None when
        the iteration is sure to take longer than this many seconds, found before its
        schedule is done (:class:`~flexsearch.sim.tasks.PastCutoff`). ``ddp``: the plan runs
        with DDP (default: :meth:`is_ddp`; a plan's kind says it: ``data``).
        ``shard``: how a data-parallel plan shards its state
        (:data:`~flexsearch.strategy.kinds.SHARDINGS`): ``zero1`` shards the optimizer
        update (:meth:`_schedule`), the FSDP shardings run in :meth:`_fsdp` over
        ``fsdp_units`` (default: the rule of :func:`flexsearch.strategy.fsdp.fsdp_units`
        on the graph's modules), HSDP's groups of ``shard_group`` devices.
        ``recompute``: activation checkpointing (:meth:`_checkpoint`)."""
        if shard not in ("none", "zero1", *FSDP_SHARDINGS):
            raise ValueError(f"unknown sharding {shard!r}")
        group = shard_group if shard == "hsdp" else 0
        replica = None if timeline else self.replica(configs, group)
        try:
            if replica is not None:
                try:
                    return self._simulate(configs, False, ddp, shard, group, fsdp_units, recompute, replica, cutoff)
                except NotPeriodic:
                    pass
            return self._simulate(configs, timeline, ddp, shard, group, fsdp_units, recompute, None, cutoff)
        except PastCutoff:
            return None

    def _simulate(self, configs: Mapping[str, Config], timeline: bool, ddp: bool | None, shard: str, group: int,
                  fsdp_units: tuple[str, ...] | None, recompute: str, replica: Replica | None,
                  cutoff: float) -> Simulation:
        if shard in FSDP_SHARDINGS:
            return self._fsdp(configs, timeline, fsdp_units, recompute, reshard=shard != "zero2", group=group,
                              replica=replica, cutoff=cutoff)
        ddp = self.is_ddp(configs) if ddp is None else ddp and self.ctx.calibration is not None
        frags, rebuilt = self._checkpoint(self.fragments(configs, ddp=ddp, replica=replica), configs, recompute)
        ordered: list[Task] = []
        for f in frags:
            ordered.extend(f.forward)
        buckets = self._buckets(frags) if ddp else {}
        reductions = merged_reductions(frags)
        for i in reversed(range(len(frags))):
            ordered.extend(frags[i].backward)
            ordered.extend(reductions[i])
            if i in buckets:
                ordered.append(buckets[i])
        return self._schedule(frags, ordered, timeline, ddp, list(buckets.values()), configs=configs,
                              rebuilt=rebuilt, zero1=shard == "zero1", replica=replica, cutoff=cutoff)

    def _checkpoint(self, frags: list[Fragment], configs: Mapping[str, Config],
                    mode: str, cast: bool = True) -> tuple[list[Fragment], Rebuilt | None]:
        """The fragments under activation checkpointing (:mod:`flexsearch.strategy.recompute`):
        a dropped node's backward task also reruns its forward; a dropped or cached node's
        forward transfers and collectives (a SOAP plan's redistributions) run again before
        its backward. A dropped node keeps neither what autograd saves (nor a SOAP plan's
        redistributed inputs) nor autocast's weight copies, but its whole output when a
        node outside its unit reads it (checkpointing keeps a unit's inputs); a cached one
        (selective) keeps its outputs
        (:meth:`~flexsearch.strategy.recompute.Checkpointing.cached_bytes`). Per device,
        the largest unit's dropped bytes are rebuilt at a time (the second result, with
        each node's share), autocast's weight copies with them unless ``cast`` is off
        (FSDP2 gathers low-precision weights: autocast copies none). Cached fragments
        are copied, not changed."""
        if mode == "none":
            return frags, None
        cp = self._checkpointing.get(mode)
        if cp is None:
            cp = self._checkpointing[mode] = Checkpointing.of(self.graph, mode)
        out: list[Fragment] = []
        rebuilt: dict[int, dict[int, float]] = {}  # unit -> device -> rebuilt so far (graph order)
        working: dict[int, float] = {}  # device -> the most a unit's recomputation holds at once
        per_node: list[dict[int, float]] = [{} for _ in frags]
        for i, f in enumerate(frags):
            if not (cp.dropped[i] or cp.cached[i]):
                out.append(f)
                continue
            node, c = self.graph.nodes[i], configs[self.graph.nodes[i].name]
            output = node.output_bytes / activation_split(c, node)
            again = {t.resources[0]: t.duration for t in f.forward if t.kind == "fwd"}
            acts = dict(f.activations)
            unit = rebuilt.setdefault(cp.unit_of[i], {})
            for d in set(again) | set(f.cast) | set(f.activations):
                copy = f.cast.get(d, 0.0) if cast else 0.0
                if cp.cached[i]:  # its outputs cached, the rest it saved rebuilt
                    acts[d], share = cp.cached_bytes(i, f.activations.get(d, 0.0), copy, output if d in again else 0.0)
                else:  # all it kept is rebuilt (what autograd saves, and a SOAP node's
                    # redistributed inputs); its whole output stays when another unit reads it
                    share = copy + f.activations.get(d, 0.0)
                    acts[d] = output if d in again and cp.boundary[i] else 0.0
                unit[d] = unit.get(d, 0.0) + share
                working[d] = max(working.get(d, 0.0), unit[d])  # footprint.rebuilt_peaks, per device
                per_node[i][d] = share
            # its forward transfers and collectives run again, once its output's gradient
            # is in, before its backward (a node without one has no backward to hold its
            # rerun, compute or transfers)
            grads_in = tuple(dict.fromkeys(k for t in f.backward if t.kind == "bwd" for k in t.deps if k[0] == "G"))
            redo = [t._replace(name=f"{t.name} again", deps=grads_in, defines=tuple(("again", *k) for k in t.defines))
                    for t in f.forward if t.kind in ("xfer", "coll")] if grads_in else []
            redone = tuple(k for t in redo for k in t.defines)
            rerun = {} if cp.cached[i] else again  # a cached node's compute does not run again
            out.append(replace(f, activations=acts, cast={}, backward=[*redo, *(
                t._replace(duration=t.duration + rerun.get(t.resources[0], 0.0), deps=t.deps + redone)
                if t.kind == "bwd" else t for t in f.backward)]))
        return out, Rebuilt(working, tuple(per_node), cp.unit_of)

    def _fsdp(self, configs: Mapping[str, Config], keep_timeline: bool,
              given: tuple[str, ...] | None = None, recompute: str = "none", *, reshard: bool = True,
              group: int = 0, replica: Replica | None = None, cutoff: float = math.inf) -> Simulation:
        """A data-parallel plan run by FSDP2, parameters, gradients and optimizer state
        sharded over groups of ``g`` devices (``group``, default all ``n``; HSDP when
        ``g < n``: the groups are replicas). Per unit of :func:`~flexsearch.strategy.fsdp.param_units` (``P_u``
        bytes), in each group: an all-gather of ``P_u`` before its first forward, another
        before its backward when ``reshard`` (``reshard_after_forward``: ZeRO-3; without
        it, ZeRO-2, the gathered parameters stay until the unit's backward), a
        reduce-scatter of its gradients after it; under HSDP then an all-reduce of the
        ``P_u / g`` shard across the ``n / g`` groups (each collective with a copy in and
        out of the flat buffer, ``2`` bytes moved per byte at memory bandwidth, and the
        fixed ``fsdp_collective_s``, when calibrated). Parameters are gathered in the
        precision's ``param_dtype`` (bf16 under bf16-mixed: half the bytes) and gradients
        reduced in their own dtype. Memory: ``(2 + k) P / g`` + activations + the gathered
        parameters (two units, one prefetched, under ZeRO-3; every unit at the start of
        the backward under ZeRO-2) and the unreduced gradients of one unit."""
        n = self.cluster.devices
        g = group if 1 < group < n else n
        if n % g:
            raise ValueError(f"{n} devices do not split into shard groups of {g}")
        groups = [list(range(k, k + g)) for k in range(0, n, g)]
        group_of = {d: k for k, members in enumerate(groups) for d in members}
        frags, rebuilt = self._checkpoint(self.fragments(configs, ddp=True, replica=replica), configs, recompute,
                                          cast=False)
        ctx = self.ctx.as_ddp()
        units = param_units(self.graph, given)
        unit_of = {i: u for u, idx in units.items() for i in idx}
        size = {u: sum(frags[i].params.get(0, 0.0) for i in idx) for u, idx in units.items()}
        grads = {u: sum(frags[i].trained.get(0, 0.0) for i in idx) for u, idx in units.items()}
        gather = ctx.precision.gather_factor(self.graph.param_dtype)

        def coll(op: str, u: str, members: list[int], nbytes: float, key: tuple, deps: tuple = ()) -> list[Task]:
            label = u if u != ROOT else "root"
            t = fsdp_collective_task(ctx, op, members, nbytes, f"fsdp {label}", deps, (key,), f"FSDP unit {label}")
            return kept(replica, t, members)

        def gathers(u: str, tag: str) -> list[Task]:
            return [t for k, members in enumerate(groups) for t in coll("all_gather", u, members, size[u] * gather,
                                                                          (tag, u, k))]

        def waiting(tasks: list[Task], tag: str, u: str) -> list[Task]:
            return [t._replace(deps=t.deps + ((tag, u, group_of[t.resources[0]]),)) if t.kind in ("fwd", "bwd")
                    else t for t in tasks]

        ordered: list[Task] = []
        gathered: set[str] = set()
        for i, f in enumerate(frags):
            u = unit_of.get(i)
            if u is None:
                ordered.extend(f.forward)
                continue
            if u not in gathered:
                gathered.add(u)
                ordered.extend(gathers(u, "ag"))
            ordered.extend(waiting(f.forward, "ag", u))
        gathered.clear()
        reduced: list[Task] = []
        partial = merged_reductions(frags)
        for i in reversed(range(len(frags))):
            u = unit_of.get(i)
            if u is None:
                ordered.extend(frags[i].backward)
                ordered.extend(partial[i])  # none on data-parallel configurations
                continue
            if reshard and u not in gathered:
                gathered.add(u)
                ordered.extend(gathers(u, "agb"))
            ordered.extend(waiting(frags[i].backward, "agb" if reshard else "ag", u))
            ordered.extend(partial[i])
            if i == units[u][0] and grads[u]:  # a frozen unit has no gradients to reduce
                scattered = []
                for k, members in enumerate(groups):
                    deps = tuple(("b", self.graph.nodes[j].name, d) for j in units[u] for d in members)
                    scattered += coll("reduce_scatter", u, members, grads[u], ("rs", u, k), deps)
                ordered.extend(scattered)
                if len(groups) == 1:
                    reduced.extend(scattered)
                    continue
                for j in range(g):  # HSDP: the shard's replicas, one device per group
                    across = [members[j] for members in groups]
                    deps = tuple(("rs", u, k) for k in range(len(groups)))
                    mine = coll("all_reduce", u, across, grads[u] / g, ("ar", u, j), deps)
                    reduced += mine
                    ordered += mine
        peak = sorted(size.values(), reverse=True)
        held = sum(peak[:2]) if reshard else sum(peak)
        unsharded = gather * held + max(grads.values(), default=0.0)  # and one unit's unreduced gradients
        return self._schedule(frags, ordered, keep_timeline, True, reduced, shards=g,
                              unsharded=unsharded, configs=configs, rebuilt=rebuilt, replica=replica, cutoff=cutoff)

    def _buckets(self, frags: list[Fragment]) -> dict[int, Task]:
        """DDP's gradient buckets (calibration ``ddp_bucket_bytes``): parameters in the
        order their gradients become ready (the backward's), a bucket closed once it
        holds its cap (the first one smaller); one all-reduce over every device per
        bucket, after the backward of its last node. Key: the index of that node."""
        cal = self.ctx.calibration
        assert cal is not None
        devices = list(range(self.cluster.devices))
        bandwidth = self.cluster.device.memory_bandwidth.value
        out: dict[int, Task] = {}
        members: list[str] = []
        size, tensors, cap = 0.0, 0, cal.ddp_first_bucket_bytes.value
        nodes = self.graph.nodes
        for i in reversed(range(len(frags))):
            b = frags[i].trained.get(0, 0.0)
            if not b:
                continue
            members.append(nodes[i].name)
            size += b
            tensors += frags[i].tensors.get(0, 0)
            if size >= cap or not any(frags[j].trained.get(0) for j in range(i)):
                k = len(out)
                deps = tuple(("b", m, d) for m in members for d in devices)
                task = collective_task(self.ctx.as_ddp(), "all_reduce", devices, size, f"bucket {k}", deps,
                                   (("s", "bucket", k),), f"DDP bucket {k} ({len(members)} ops)")
                extra = cal.ddp_per_tensor_s.value * tensors + 4 * size / bandwidth  # hooks, copies in and out
                out[i] = task._replace(duration=task.duration + extra)
                members, size, tensors, cap = [], 0.0, 0, cal.ddp_bucket_bytes.value
        return out

    def _schedule(self, frags: list[Fragment], ordered: list[Task], keep_timeline: bool, ddp: bool = False,
                  buckets: list[Task] = (), shards: int = 1, unsharded: float = 0.0,
                  configs: Mapping[str, Config] | None = None, rebuilt: Rebuilt | None = None,
                  zero1: bool = False, replica: Replica | None = None, cutoff: float = math.inf) -> Simulation:
        """List-schedule ``ordered``, then one optimizer update per device; memory.
        ``buckets``: gradient collectives every update waits for (DDP, FSDP); ``shards``:
        parameters, gradients and optimizer state divided over this many devices (FSDP),
        with ``unsharded`` bytes gathered at a time. ``zero1`` (ZeRO-1, replicated
        parameters and gradients): each device holds and updates ``1 / n`` of the
        optimizer state and parameters (``ZeroRedundancyOptimizer`` partitions whole
        tensors, by size), then the updated parameters are all-gathered over every
        device (torch broadcasts each rank's share: the same bytes on every link) before
        the iteration ends; calibrated, with ``ZeroRedundancyOptimizer``'s cost per
        parameter tensor and per step (``zero1_per_tensor_s``, ``step_s["zero1"]``).
        ``replica``: ``ordered`` holds the first replica's tasks; its devices' figures
        are every replica's (module docstring). ``cutoff``: as :func:`~flexsearch.sim.tasks.run_tasks` takes it."""
        devices = self.cluster.devices
        run = run_tasks(ordered, devices, len(self._links), keep_timeline, cutoff)
        free, end, timeline, compute, chain = run.free, run.end, run.timeline, run.compute, run.chain
        serial = run.serial
        cal = self.ctx.calibration

        # Optimizer update per device, after its gradient synchronisations.
        params = [0.0] * devices
        trained = [0.0] * devices
        tensors = [0] * devices
        largest = [0.0] * devices
        acts = [0.0] * devices
        after: list[list] = [[] for _ in range(devices)]
        for f in frags:
            for d, b in f.params.items():
                params[d] += b
            for d, b in f.trained.items():
                trained[d] += b
            for d, k in f.tensors.items():
                tensors[d] += k
            for d, b in f.largest.items():
                largest[d] = max(largest[d], b)
            for d, b in f.activations.items():
                acts[d] += b
            if shards == 1:  # autocast's weight copies (FSDP gathers low-precision weights instead)
                for d, b in f.cast.items():
                    acts[d] += b
            for d, key in f.sync:
                after[d].append(key)
        if shards > 1:
            params = [p / shards for p in params]
            trained = [p / shards for p in trained]
            largest = [b / shards for b in largest]
        for b in buckets:
            for d in range(devices):
                after[d].extend(b.defines)
        sharded = (not ddp and devices > 1) or shards > 1  # DTensor parameters
        mode = "fsdp" if shards > 1 else "sharded" if sharded else "ddp" if ddp else "plain"
        dev = self.cluster.device
        owned = [p / devices for p in trained] if zero1 else trained  # the share each device updates
        for d in range(devices):
            if not trained[d]:
                continue
            share = tensors[d] / devices if zero1 else tensors[d]
            dur = update_s(self.ctx, self.optimizer, owned[d], share, mode, sharded=sharded)
            start = max([free[d]] + [end.get(k, 0.0) for k in after[d]])
            cstart = max([chain.get(k, 0.0) for k in after[d]], default=0.0)
            t = Task("update", "optimizer", dur, (d,), tuple(after[d]), (("u", d),))
            free[d] = start + dur
            chain[("u", d)] = cstart + dur
            serial += dur * (replica.copies if replica is not None else 1)
            compute[d] += dur
            if keep_timeline:
                timeline.append(Scheduled(t, start, start + dur))
        if zero1 and devices > 1:  # after every update, the updated shares all-gathered over every device
            t = collective_task(self.ctx.as_ddp(), "all_gather", list(range(devices)), max(trained), "zero1 params",
                                tuple(("u", d) for d in range(devices) if trained[d]), (("zero1",),),
                                "ZeRO-1 parameter broadcast")
            if cal is not None and cal.zero1_per_tensor_s is not None:  # the optimizer's bookkeeping per tensor
                t = t._replace(duration=t.duration + cal.zero1_per_tensor_s.value * max(tensors) + cal.step("zero1"))
            start = max(free[r] for r in (*range(devices), *t.resources))
            for r in (*range(devices), *t.resources):
                free[r] = start + t.duration
            chain[("zero1",)] = max(chain.get(k, 0.0) for k in t.deps) + t.duration if t.deps else t.duration
            serial += t.duration
            if keep_timeline:
                timeline.append(Scheduled(t, start, start + t.duration))
        makespan = max(free[:devices] + free[devices:], default=0.0)
        loss_grad, loss_work = loss_terms(self.graph, configs, self.cluster.devices,
                                          whole=cal is not None and not ddp and shards == 1)
        buckets_held = ddp and shards == 1  # DDP keeps a flat copy of the gradients
        backward = backward_working_per_device(self.graph, frags, configs, rebuilt)
        working = rebuilt.working if rebuilt is not None else {}
        width = replica.width if replica is not None else devices
        terms = [DeviceMemory(params[d], trained[d], OPTIMIZER_STATE[self.optimizer] * owned[d], acts[d], largest[d],
                              unsharded, trained[d] if buckets_held else 0.0, loss_grad.get(d, 0.0),
                              working.get(d, 0.0),  # checkpointing: one unit's activations rebuilt at a time
                              backward.get(d, 0.0), update_working=UPDATE_WORKING[self.optimizer] * owned[d],
                              loss_working=loss_work.get(d, 0.0))
                 for d in range(width)]
        memory = [peak_bytes(m, cal, mode) for m in terms]
        if replica is not None:  # every replica's figures are the first's
            terms, memory, compute = ([xs[d % width] for d in range(devices)] for xs in (terms, memory, compute))
        return Simulation(
            iteration_time_s=makespan,
            memory_bytes=tuple(memory),
            capacity_bytes=dev.memory_capacity.value,
            compute_s=tuple(compute),
            timeline=tuple(timeline),
            link_names=self._links,
            critical_path_s=max(chain.values(), default=0.0) if keep_timeline else float("nan"),
            serial_s=serial,
            memory_terms=tuple(terms),
        )


def simulate_configs(graph: OpGraph, configs: Mapping[str, Config], context: CostContext | Cluster,
                     **kw) -> Simulation:
    """One full simulation (no cache kept)."""
    return Simulator(graph, context, **kw).simulate(configs)
