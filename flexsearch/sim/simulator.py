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

**Delta simulation.** A :class:`Simulator` keeps each node's fragment keyed by the
node's configuration and its producers'; after a change only the fragments of changed
nodes and of their consumers are rebuilt (region intersections, costs, collectives),
and the cheap assembly and scheduling pass reruns.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from flexsearch.cost.compute import MeasuredCosts, Work, roofline_time
from flexsearch.cost.efficiency import EfficiencyTable
from flexsearch.cost.hardware import Cluster
from flexsearch.graph.opgraph import OpGraph
from flexsearch.search.space import Config
from flexsearch.sim.taskgraph import CostContext, Fragment, Task, build_fragment

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


    def to_chrome_trace(self, path: str | os.PathLike[str]) -> None:
        """Write the timeline as Chrome trace JSON (Perfetto, chrome://tracing): one
        track per device (process "devices") and per link (process "links")."""
        devices = len(self.memory_bytes)
        events: list[dict] = [
            {"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "devices"}},
            {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "links"}},
        ]
        for d in range(devices):
            events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": d,
                           "args": {"name": f"device {d}"}})
        for i, name in enumerate(self.link_names):
            events.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": i,
                           "args": {"name": name}})
        for s in self.timeline:
            t = s.task
            for r in t.resources:
                pid, tid = (0, r) if r < devices else (1, r - devices)
                events.append({
                    "name": f"{t.kind} {t.name}", "cat": t.kind, "ph": "X", "pid": pid,
                    "tid": tid, "ts": s.start * 1e6, "dur": (s.end - s.start) * 1e6,
                    "args": {"detail": t.detail, "bytes": t.nbytes},
                })
        with open(path, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)


class Simulator:
    """Simulates configurations of one graph on one cluster, keeping fragments between
    calls (delta simulation). ``simulate(configs)`` takes a configuration for every
    node (:meth:`flexsearch.search.space.Space.expand`)."""

    def __init__(
        self,
        graph: OpGraph,
        cluster: Cluster,
        *,
        optimizer: Optimizer = "adam",
        measured: MeasuredCosts | None = None,
        efficiency: EfficiencyTable | None = None,
        dtype: str | None = None,
    ):
        if optimizer not in OPTIMIZER_STATE:
            raise ValueError(f"unknown optimizer {optimizer!r}; use one of {', '.join(OPTIMIZER_STATE)}")
        self.graph = graph
        self.cluster = cluster
        self.optimizer = optimizer
        self.ctx = CostContext(cluster, measured, efficiency, dtype)
        efficiency = self.ctx.efficiency
        self._cache: dict[str, tuple[tuple, Fragment]] = {}
        self.rebuilt = 0  # fragments built so far (delta simulation statistics)
        self._links = tuple(link.id for link in cluster.links)

    def fragment(self, name: str, configs: Mapping[str, Config]) -> Fragment:
        node = self.graph.node(name)
        sig = (configs[name], tuple(configs[i] for i in node.inputs))
        hit = self._cache.get(name)
        if hit is not None and hit[0] == sig:
            return hit[1]
        producers = [(self.graph.node(i), configs[i]) for i in node.inputs]
        frag = build_fragment(node, configs[name], producers, self.ctx)
        self._cache[name] = (sig, frag)
        self.rebuilt += 1
        return frag

    def simulate(self, configs: Mapping[str, Config], *, timeline: bool = True) -> Simulation:
        """Simulate one iteration; ``timeline=False`` skips the per-task record and the
        critical path (what a search needs: time and memory)."""
        frags = [self.fragment(n.name, configs) for n in self.graph.nodes]
        ordered: list[Task] = []
        for f in frags:
            ordered.extend(f.forward)
        for f in reversed(frags):
            ordered.extend(f.backward)
        return self._schedule(frags, ordered, timeline)

    def _schedule(self, frags: list[Fragment], ordered: list[Task], keep_timeline: bool) -> Simulation:
        devices = self.cluster.devices
        run = run_tasks(ordered, devices, len(self._links), keep_timeline)
        free, end, timeline, compute, chain = run.free, run.end, run.timeline, run.compute, run.chain
        serial = run.serial

        # Optimizer update per device, after its gradient synchronisations.
        params = [0.0] * devices
        acts = [0.0] * devices
        after: list[list] = [[] for _ in range(devices)]
        for f in frags:
            for d, b in f.params.items():
                params[d] += b
            for d, b in f.activations.items():
                acts[d] += b
            for d, key in f.sync:
                after[d].append(key)
        dev = self.cluster.device
        for d in range(devices):
            if not params[d]:
                continue
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
        memory = tuple(state * params[d] + acts[d] for d in range(devices))
        return Simulation(
            iteration_time_s=makespan,
            memory_bytes=memory,
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
