"""The execution simulator: list scheduling of one iteration's task graph.

**Schedule.** Tasks are taken in program order: the forward fragments in topological
order, the backward fragments in reverse, then one optimizer update per device. Each
task starts at ``max(end of its dependencies, free time of each of its resources)``
and holds all its resources (its device; every link a transfer or collective loads)
until it ends, so transfers queue on busy links and overlap with compute on the
devices. The iteration time is the end of the last task.

**Memory** (per device, bytes): parameters ``P`` (the shard each device holds),
gradients ``P``, optimizer state ``k P`` (Adam 2, momentum 1, SGD 0), activations kept
for the backward pass (outputs of non-view ops and the inputs received from other
devices). A plan whose peak on some device exceeds its memory is **infeasible**.
Calibrated (:mod:`flexsearch.cost.calibration`), the peak follows the measured
runtime: ``(1 + k) P + max(activations, P + the update's temporaries)`` (gradients,
freed by ``zero_grad``, are allocated as the backward frees the activations) plus
DDP's gradient buckets ``P`` and the runtime's own buffers.

**Delta simulation.** A :class:`Simulator` keeps each node's fragment keyed by the
node's configuration and its producers'; after a change only the fragments of changed
nodes and of their consumers are rebuilt (region intersections, costs, collectives),
and the cheap assembly and scheduling pass reruns.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Literal

from flexsearch.cost.calibration import DeviceCalibration
from flexsearch.cost.compute import MeasuredCosts, Work, roofline_time
from flexsearch.cost.efficiency import EfficiencyTable
from flexsearch.cost.hardware import Cluster
from flexsearch.graph.opgraph import OpGraph
from flexsearch.sim.taskgraph import CostContext, Fragment, Task, _collective, build_fragment
from flexsearch.strategy.config import Config

Optimizer = Literal["adam", "momentum", "sgd"]
OPTIMIZER_STATE = {"adam": 2, "momentum": 1, "sgd": 0}
_UPDATE_TRAFFIC = {"adam": 7, "momentum": 5, "sgd": 3}  # bytes moved per parameter byte


@dataclass(frozen=True)
class Scheduled:
    """A task with its start and end times (seconds)."""

    task: Task
    start: float
    end: float


@dataclass(frozen=True)
class Simulation:
    """Predicted iteration: time, per-device memory and busy time, the timeline."""

    iteration_time_s: float
    memory_bytes: tuple[float, ...]
    capacity_bytes: float
    compute_s: tuple[float, ...]
    timeline: tuple[Scheduled, ...]
    link_names: tuple[str, ...]
    critical_path_s: float
    """Longest chain of dependent tasks (durations only, no waiting for resources)."""
    serial_s: float
    """Sum of all task durations."""

    @property
    def peak_memory_bytes(self) -> float:
        return max(self.memory_bytes, default=0.0)

    @property
    def feasible(self) -> bool:
        return self.peak_memory_bytes <= self.capacity_bytes

    def to_chrome_trace(self, path: str | os.PathLike[str] | None = None) -> dict:
        """The timeline as Chrome trace JSON (Perfetto, chrome://tracing): returned, and
        written to ``path`` when given.

        One track per device (process "devices") and per link (process "links"); times
        in microseconds. A slice per task and resource, its category the task's kind:
        compute (``fwd``, ``bwd``, ``update``) on the device tracks, communication
        (``xfer``, ``coll``) on the tracks of every link it loads; and ``bubble`` slices:
        each idle gap on a device between the start of its first task and the end of its
        last one (pipeline bubbles, waits for communication). ``otherData`` holds the
        iteration's summary."""
        devices = len(self.memory_bytes)
        group = {"fwd": "compute", "bwd": "compute", "update": "compute",
                 "xfer": "communication", "coll": "communication"}
        colour = {"compute": "thread_state_running", "communication": "thread_state_iowait",
                  "bubble": "grey"}
        events: list[dict] = []
        for pid, name in enumerate(("devices", "links")):
            events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}})
            events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}})
        tracks = [(0, d, f"device {d}") for d in range(devices)]
        tracks += [(1, i, f"link {name}") for i, name in enumerate(self.link_names)]
        for pid, tid, name in tracks:
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}})
            events.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid,
                           "args": {"sort_index": tid}})
        slices: dict[tuple[int, int], list[tuple[float, float, dict]]] = {}
        for s in self.timeline:
            t = s.task
            kind = group.get(t.kind, "compute")
            start, end = s.start * 1e6, s.end * 1e6
            for r in t.resources:
                pid, tid = (0, r) if r < devices else (1, r - devices)
                slices.setdefault((pid, tid), []).append((start, end, {
                    "name": f"{t.kind} {t.name}", "cat": t.kind, "ph": "X", "pid": pid, "tid": tid,
                    "ts": start, "dur": end - start, "cname": colour[kind],
                    "args": {"kind": kind, "detail": t.detail, "bytes": t.nbytes},
                }))
        for (pid, tid), track in sorted(slices.items()):
            track.sort(key=lambda x: (x[0], x[1]))
            busy_until = None
            for start, end, e in track:
                if pid == 0 and busy_until is not None and start > busy_until:
                    events.append({"name": "bubble", "cat": "bubble", "ph": "X", "pid": 0, "tid": tid,
                                   "ts": busy_until, "dur": start - busy_until, "cname": colour["bubble"],
                                   "args": {"kind": "idle"}})
                events.append(e)
                busy_until = end if busy_until is None else max(busy_until, end)
        trace = {
            "traceEvents": events,
            "displayTimeUnit": "ms",
            "otherData": {
                "iteration_time_s": self.iteration_time_s,
                "memory_bytes": list(self.memory_bytes),
                "capacity_bytes": self.capacity_bytes,
            },
        }
        if path is not None:
            with open(path, "w") as f:
                json.dump(trace, f)
        return trace


class Simulator:
    """Simulates configurations of one graph on one cluster, keeping fragments between
    calls (delta simulation). ``simulate(configs)`` takes a configuration for every
    node (:meth:`flexsearch.strategy.space.Space.expand`)."""

    def __init__(
        self,
        graph: OpGraph,
        cluster: Cluster,
        *,
        optimizer: Optimizer = "adam",
        measured: MeasuredCosts | None = None,
        efficiency: EfficiencyTable | None = None,
        dtype: str | None = None,
        calibration: DeviceCalibration | None | bool = None,
    ):
        if optimizer not in OPTIMIZER_STATE:
            raise ValueError(f"unknown optimizer {optimizer!r}; use one of {', '.join(OPTIMIZER_STATE)}")
        self.graph = graph
        self.cluster = cluster
        self.optimizer = optimizer
        self.ctx = CostContext(cluster, measured, efficiency, dtype, calibration)
        efficiency = self.ctx.efficiency
        self._ddp_ctx: CostContext | None = None
        self._cache: dict[str, tuple[tuple, Fragment]] = {}
        self._ddp_cache: dict[str, tuple[tuple, Fragment]] = {}
        self.rebuilt = 0  # fragments built so far (delta simulation statistics)
        self._links = tuple(link.id for link in cluster.links)

    def fragment(self, name: str, configs: Mapping[str, Config], *, ddp: bool = False) -> Fragment:
        node = self.graph.node(name)
        sig = (configs[name], tuple(configs[i] for i in node.inputs))
        cache, ctx = self._cache, self.ctx
        if ddp:
            if self._ddp_ctx is None:
                c = self.ctx
                self._ddp_ctx = CostContext(self.cluster, c.measured, c.efficiency, c.dtype,
                                            c.calibration or False, ddp=True)
            cache, ctx = self._ddp_cache, self._ddp_ctx
        hit = cache.get(name)
        if hit is not None and hit[0] == sig:
            return hit[1]
        producers = [(self.graph.node(i), configs[i]) for i in node.inputs]
        frag = build_fragment(node, configs[name], producers, ctx)
        cache[name] = (sig, frag)
        self.rebuilt += 1
        return frag

    def is_ddp(self, configs: Mapping[str, Config]) -> bool:
        """Would the emitter run these configurations with DDP? With a calibration: every
        op data parallel or replicated over all devices (a ``data`` plan)."""
        if self.ctx.calibration is None or self.cluster.devices < 2:
            return False
        n = self.cluster.devices
        return all(c.kind in ("", "x") and c.n == n and c.first == 0 for c in configs.values())

    def simulate(self, configs: Mapping[str, Config], *, timeline: bool = True,
                 ddp: bool | None = None, shard_params: bool = False,
                 fsdp_units: Mapping[str, str] | None = None) -> Simulation:
        """Simulate one iteration; ``timeline=False`` skips the per-task record and the
        critical path (what a search needs: time and memory). ``ddp``: the plan runs
        with DDP (default: :meth:`is_ddp`; a plan's kind says it: ``data``).
        ``shard_params``: a data-parallel plan run fully sharded (FSDP, :meth:`_fsdp`;
        ``fsdp_units``: node name -> its FSDP unit, default :meth:`fsdp_units`)."""
        if shard_params:
            return self._fsdp(configs, timeline, fsdp_units)
        ddp = self.is_ddp(configs) if ddp is None else ddp and self.ctx.calibration is not None
        frags = [self.fragment(n.name, configs, ddp=ddp) for n in self.graph.nodes]
        ordered: list[Task] = []
        for f in frags:
            ordered.extend(f.forward)
        buckets = self._buckets(frags) if ddp else {}
        for i in reversed(range(len(frags))):
            ordered.extend(frags[i].backward)
            if i in buckets:
                ordered.append(buckets[i])
        return self._schedule(frags, ordered, timeline, ddp, list(buckets.values()), configs=configs)

    def fsdp_units(self, given: Mapping[str, str] | None = None) -> dict[str, list[int]]:
        """FSDP's wrapping (the emitter's): one unit per top-level layer holding
        parameters (a layer list's items separately: guessed from a numeric second
        component of the module path, which a ``Sequential`` has too; pass ``given``,
        node name -> unit, to be exact); parameters shared by two layers stay with the
        root. Unit name -> indexes of its nodes that own parameters."""
        nodes = self.graph.nodes
        if given is not None:
            out: dict[str, list[int]] = {}
            for i, n in enumerate(nodes):
                if n.param_bytes:
                    out.setdefault(given.get(n.name, ""), []).append(i)
            return out
        users: dict[str, int] = {}
        for n in nodes:
            for q in n.params:
                users[q] = users.get(q, 0) + 1
        out = {}
        for i, n in enumerate(nodes):
            if not n.param_bytes:
                continue
            parts = n.module.split(".") if n.module else [n.name]
            unit = ".".join(parts[:2]) if len(parts) > 1 and parts[1].isdigit() else parts[0]
            if any(users.get(q, 0) > 1 for q in n.params):
                unit = ""
            out.setdefault(unit, []).append(i)
        return out

    def _fsdp(self, configs: Mapping[str, Config], keep_timeline: bool,
              given: Mapping[str, str] | None = None) -> Simulation:
        """A data-parallel plan with parameters, gradients and optimizer state sharded
        over the ``n`` devices (FSDP2, ``reshard_after_forward``). Per unit of
        :meth:`fsdp_units` (``P_u`` bytes): an all-gather of ``P_u`` before its first
        forward, another before its backward, a reduce-scatter of its gradients after it
        (each with a copy in and out of the flat buffer, ``2 P_u`` bytes at memory
        bandwidth, when calibrated). Memory: ``(2 + k) P / n`` + activations + the
        unsharded parameters of two units (one prefetched) and the gradients of one."""
        devices = list(range(self.cluster.devices))
        frags = [self.fragment(n.name, configs, ddp=True) for n in self.graph.nodes]
        ctx = self._ddp_ctx or self.ctx
        units = self.fsdp_units(given)
        unit_of = {i: u for u, idx in units.items() for i in idx}
        size = {u: sum(frags[i].params.get(0, 0.0) for i in idx) for u, idx in units.items()}
        cal = ctx.calibration
        copy_s = 2 / self.cluster.device.memory_bandwidth.value if cal is not None else 0.0
        fixed = cal.fsdp_collective_s.value if cal is not None else 0.0

        def coll(op: str, u: str, key: tuple, deps: tuple = ()) -> Task:
            t = _collective(ctx, op, devices, size[u], f"fsdp {u or 'root'}", deps, (key,), f"FSDP unit {u or 'root'}")
            return replace(t, duration=t.duration + copy_s * size[u] + fixed)

        def waiting(tasks: list[Task], key: tuple) -> list[Task]:
            return [replace(t, deps=t.deps + (key,)) if t.kind in ("fwd", "bwd") else t for t in tasks]

        ordered: list[Task] = []
        gathered: set[str] = set()
        for i, f in enumerate(frags):
            u = unit_of.get(i)
            if u is None:
                ordered.extend(f.forward)
                continue
            if u not in gathered:
                gathered.add(u)
                ordered.append(coll("all_gather", u, ("ag", u)))
            ordered.extend(waiting(f.forward, ("ag", u)))
        gathered.clear()
        reduced: list[Task] = []
        for i in reversed(range(len(frags))):
            u = unit_of.get(i)
            if u is None:
                ordered.extend(frags[i].backward)
                continue
            if u not in gathered:
                gathered.add(u)
                ordered.append(coll("all_gather", u, ("agb", u)))
            ordered.extend(waiting(frags[i].backward, ("agb", u)))
            if i == units[u][0]:
                deps = tuple(("b", self.graph.nodes[j].name, d) for j in units[u] for d in devices)
                reduced.append(coll("reduce_scatter", u, ("s", "fsdp", u), deps))
                ordered.append(reduced[-1])
        peak = sorted(size.values(), reverse=True)
        unsharded = sum(peak[:2]) + (peak[0] if peak else 0.0)
        return self._schedule(frags, ordered, keep_timeline, True, reduced, shards=len(devices),
                              unsharded=unsharded, configs=configs)

    def _buckets(self, frags: list[Fragment]) -> dict[int, Task]:
        """DDP's gradient buckets (calibration ``ddp_bucket_bytes``): parameters in the
        order their gradients become ready (the backward's), a bucket closed once it
        holds its cap (the first one smaller); one all-reduce over every device per
        bucket, after the backward of its last node. Key: the index of that node."""
        cal = self.ctx.calibration
        assert cal is not None and self._ddp_ctx is not None
        devices = list(range(self.cluster.devices))
        bandwidth = self.cluster.device.memory_bandwidth.value
        out: dict[int, Task] = {}
        members: list[str] = []
        size, tensors, cap = 0.0, 0, cal.ddp_first_bucket_bytes.value
        nodes = self.graph.nodes
        for i in reversed(range(len(frags))):
            b = frags[i].params.get(0, 0.0)
            if not b:
                continue
            members.append(nodes[i].name)
            size += b
            tensors += frags[i].tensors.get(0, 0)
            if size >= cap or not any(frags[j].params.get(0) for j in range(i)):
                k = len(out)
                deps = tuple(("b", m, d) for m in members for d in devices)
                task = _collective(self._ddp_ctx, "all_reduce", devices, size, f"bucket {k}", deps,
                                   (("s", "bucket", k),), f"DDP bucket {k} ({len(members)} ops)")
                extra = cal.ddp_per_tensor_s.value * tensors + 4 * size / bandwidth  # hooks, copies in and out
                out[i] = replace(task, duration=task.duration + extra)
                members, size, tensors, cap = [], 0.0, 0, cal.ddp_bucket_bytes.value
        return out

    def _output_grad(self, configs: Mapping[str, Config] | None) -> dict[int, float]:
        """Per device, the bytes of the gradient of the model's outputs it holds."""
        out: dict[int, float] = {}
        if configs is None:
            return out
        for n in self.graph.nodes:
            if n.kind != "output":
                continue
            for name in n.inputs:
                p, c = self.graph.node(name), configs.get(name)
                if c is None or not p.outputs:
                    continue
                share = p.outputs[0].nbytes / (c.s * (c.t if c.kind in ("a", "p") else 1))
                for d in c.devices:
                    out[d] = out.get(d, 0.0) + share
        return out

    def _schedule(self, frags: list[Fragment], ordered: list[Task], keep_timeline: bool, ddp: bool = False,
                  buckets: list[Task] = (), shards: int = 1, unsharded: float = 0.0,
                  configs: Mapping[str, Config] | None = None) -> Simulation:
        """List-schedule ``ordered``, then one optimizer update per device; memory.
        ``buckets``: gradient collectives every update waits for (DDP, FSDP); ``shards``:
        parameters, gradients and optimizer state divided over this many devices (FSDP),
        with ``unsharded`` bytes gathered at a time."""
        devices = self.cluster.devices
        run = run_tasks(ordered, devices, len(self._links), keep_timeline)
        free, end, timeline, compute, chain = run.free, run.end, run.timeline, run.compute, run.chain
        serial = run.serial
        cal = self.ctx.calibration

        # Optimizer update per device, after its gradient synchronisations.
        params = [0.0] * devices
        tensors = [0] * devices
        largest = [0.0] * devices
        acts = [0.0] * devices
        after: list[list] = [[] for _ in range(devices)]
        for f in frags:
            for d, b in f.params.items():
                params[d] += b
            for d, k in f.tensors.items():
                tensors[d] += k
            for d, b in f.largest.items():
                largest[d] = max(largest[d], b)
            for d, b in f.activations.items():
                acts[d] += b
            for d, key in f.sync:
                after[d].append(key)
        if shards > 1:
            params = [p / shards for p in params]
            largest = [b / shards for b in largest]
        for b in buckets:
            for d in range(devices):
                after[d].extend(b.defines)
        sharded = (not ddp and devices > 1) or shards > 1  # DTensor parameters
        mode = "fsdp" if shards > 1 else "sharded" if sharded else "ddp"
        dev = self.cluster.device
        for d in range(devices):
            if not params[d]:
                continue
            if cal is not None:
                dur = cal.update_s(self.optimizer, tensors[d], params[d], sharded)
                dur += cal.step(mode)
            else:
                dur = roofline_time(Work(0.0, _UPDATE_TRAFFIC[self.optimizer] * params[d]), dev,
                                    "float32", "elementwise", self.ctx.efficiency)
            start = max([free[d]] + [end.get(k, 0.0) for k in after[d]])
            cstart = max([chain.get(k, 0.0) for k in after[d]], default=0.0)
            t = Task("update", "optimizer", dur, (d,), tuple(after[d]), (("u", d),))
            free[d] = start + dur
            chain[("u", d)] = cstart + dur
            serial += dur
            compute[d] += dur
            if keep_timeline:
                timeline.append(Scheduled(t, start, start + dur))
        makespan = max(free[:devices] + free[devices:], default=0.0)
        state = 2 + OPTIMIZER_STATE[self.optimizer]
        if cal is None:
            memory = [state * params[d] + acts[d] + unsharded for d in range(devices)]
        else:  # calibrated: gradients live from the backward to the next zero_grad, not during the forward
            for d, b in self._output_grad(configs).items():  # the loss's gradient of the output
                acts[d] += b
            memory = [(state - 1) * params[d] + unsharded + cal.runtime(mode)
                      + max(acts[d], params[d] + cal.optimizer_working_tensors.value * largest[d])
                      + (params[d] if ddp and shards == 1 else 0.0)  # DDP's buckets: a flat copy of the gradients
                      for d in range(devices)]
        return Simulation(
            iteration_time_s=makespan,
            memory_bytes=tuple(memory),
            capacity_bytes=dev.memory_capacity.value,
            compute_s=tuple(compute),
            timeline=tuple(timeline),
            link_names=self._links,
            critical_path_s=max(chain.values(), default=0.0) if keep_timeline else float("nan"),
            serial_s=serial,
        )


@dataclass
class TaskRun:
    """The state list scheduling leaves: per resource its free time, per key its end
    time, per device its busy compute time, the timeline and the critical-path ends."""

    free: list[float]
    end: dict
    timeline: list[Scheduled]
    compute: list[float]
    chain: dict
    serial: float


def busy_compute(ordered: list[Task], devices: int) -> list[float]:
    """Per device, the summed duration of the compute tasks it runs (forward, backward,
    update): a stage-level simulation's ``compute_s``."""
    compute = [0.0] * devices
    for t in ordered:
        if t.kind in ("fwd", "bwd", "update"):
            for d in t.resources:
                compute[d] += t.duration
    return compute


def run_tasks(ordered: list[Task], devices: int, links: int, keep_timeline: bool = True) -> TaskRun:
    """List-schedule ``ordered`` (module docstring): each task starts at the latest end of
    its dependencies and of its resources' previous tasks and holds its resources until
    it ends. Every plan kind's simulator schedules its tasks through this function."""
    free = [0.0] * (devices + links)
    end: dict = {}
    timeline: list[Scheduled] = []
    compute = [0.0] * devices
    chain: dict = {}  # critical path: end times without resource waits
    serial = 0.0
    for t in ordered:
        start = 0.0
        for k in t.deps:
            v = end.get(k)
            if v is not None and v > start:
                start = v
        for r in t.resources:
            if free[r] > start:
                start = free[r]
        stop = start + t.duration
        for r in t.resources:
            free[r] = stop
        for k in t.defines:
            if k[0] != "G" or stop > end.get(k, 0.0):
                end[k] = stop
        if t.kind == "fwd" or t.kind == "bwd":
            compute[t.resources[0]] += t.duration
        serial += t.duration
        if keep_timeline:
            timeline.append(Scheduled(t, start, stop))
            cstop = max([chain.get(k, 0.0) for k in t.deps], default=0.0) + t.duration
            for k in t.defines:
                if k[0] != "G" or cstop > chain.get(k, 0.0):
                    chain[k] = cstop
    return TaskRun(free, end, timeline, compute, chain, serial)


def simulate_configs(graph: OpGraph, configs: Mapping[str, Config], cluster: Cluster, **kw) -> Simulation:
    """One full simulation (no cache kept)."""
    return Simulator(graph, cluster, **kw).simulate(configs)
