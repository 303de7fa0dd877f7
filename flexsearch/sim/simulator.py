"""The op-level simulator: list scheduling of one iteration's task graph (SOAP and data plans).

**Schedule.** Tasks are taken in program order: the forward fragments
(:mod:`flexsearch.sim.taskgraph`) in topological order, the backward fragments in
reverse, then one optimizer update per device (:func:`flexsearch.sim.accounting.update_s`)
after its gradient synchronisations. Each task starts at ``max(end of its
dependencies, free time of each of its resources)`` and holds all its resources (its
device; every link a transfer or collective loads) until it ends
(:func:`flexsearch.sim.tasks.run_tasks`), so transfers queue on busy links and overlap
with compute on the devices. The iteration time is the end of the last task.

**Execution modes.** A plan the emitter runs on DTensors (SOAP) synchronises each
layer's gradients on its own; one it runs with DDP (``ddp``, calibrated: the ``data``
plan) all-reduces them in DDP's buckets (:meth:`Simulator._buckets`); one it runs with
FSDP2 (``shard_params``) gathers and reduce-scatters each FSDP unit
(:meth:`Simulator._fsdp`).

**Memory** per device: :mod:`flexsearch.sim.accounting`, with the device's parameter
shard, the activations its fragments keep (plus, calibrated, the loss's gradient of the
output) and, sharded, FSDP's gathered units. A plan whose peak on some device exceeds
its memory is **infeasible**.

**Delta simulation.** A :class:`Simulator` keeps each node's fragment keyed by the
node's configuration and its producers'; after a change only the fragments of changed
nodes and of their consumers are rebuilt (region intersections, costs, collectives),
and the cheap assembly and scheduling pass reruns.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from flexsearch.cost.hardware import Cluster
from flexsearch.graph.opgraph import OpGraph
from flexsearch.sim.accounting import DeviceMemory, check_optimizer, peak_bytes, update_s
from flexsearch.sim.context import CostContext, collective_task
from flexsearch.sim.result import Simulation
from flexsearch.sim.taskgraph import Fragment, build_fragment, kept_bytes
from flexsearch.sim.tasks import Scheduled, Task, run_tasks
from flexsearch.strategy.config import Config
from flexsearch.strategy.fsdp import ROOT, fsdp_units, node_units
from flexsearch.strategy.recompute import Checkpointing


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
        self._cache: dict[str, tuple[tuple, Fragment]] = {}
        self._ddp_cache: dict[str, tuple[tuple, Fragment]] = {}
        self.rebuilt = 0  # fragments built so far (delta simulation statistics)
        self._links = tuple(link.id for link in self.cluster.links)
        self._checkpointing: dict[str, Checkpointing] = {}

    def fragment(self, name: str, configs: Mapping[str, Config], *, ddp: bool = False) -> Fragment:
        node = self.graph.node(name)
        sig = (configs[name], tuple(configs[i] for i in node.inputs))
        cache, ctx = (self._ddp_cache, self.ctx.as_ddp()) if ddp else (self._cache, self.ctx)
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
                 fsdp_units: tuple[str, ...] | None = None, recompute: str = "none") -> Simulation:
        """Simulate one iteration; ``timeline=False`` skips the per-task record and the
        critical path (what a search needs: time and memory). ``ddp``: the plan runs
        with DDP (default: :meth:`is_ddp`; a plan's kind says it: ``data``).
        ``shard_params``: a data-parallel plan run fully sharded (FSDP, :meth:`_fsdp`),
        ``fsdp_units`` the paths of its units (default: the rule of
        :func:`flexsearch.strategy.fsdp.fsdp_units` on the graph's modules).
        ``recompute``: activation checkpointing (:meth:`_checkpoint`)."""
        if shard_params:
            return self._fsdp(configs, timeline, fsdp_units, recompute)
        ddp = self.is_ddp(configs) if ddp is None else ddp and self.ctx.calibration is not None
        frags, working = self._checkpoint([self.fragment(n.name, configs, ddp=ddp) for n in self.graph.nodes],
                                          configs, recompute)
        ordered: list[Task] = []
        for f in frags:
            ordered.extend(f.forward)
        buckets = self._buckets(frags) if ddp else {}
        for i in reversed(range(len(frags))):
            ordered.extend(frags[i].backward)
            if i in buckets:
                ordered.append(buckets[i])
        return self._schedule(frags, ordered, timeline, ddp, list(buckets.values()), configs=configs,
                              working=working)

    def _checkpoint(self, frags: list[Fragment], configs: Mapping[str, Config],
                    mode: str) -> tuple[list[Fragment], dict[int, float]]:
        """The fragments under activation checkpointing (:mod:`flexsearch.strategy.recompute`):
        a dropped node's backward task also reruns its forward, it keeps neither its
        output share (unless a node outside its unit reads it) nor autocast's weight
        copies; per device, the largest unit's dropped bytes are rebuilt at a time (the
        second result). Cached fragments are copied, not changed."""
        if mode == "none":
            return frags, {}
        cp = self._checkpointing.get(mode)
        if cp is None:
            cp = self._checkpointing[mode] = Checkpointing.of(self.graph, mode)
        out: list[Fragment] = []
        rebuilt: dict[int, dict[int, float]] = {}
        for i, f in enumerate(frags):
            if not cp.dropped[i]:
                out.append(f)
                continue
            node, c = self.graph.nodes[i], configs[self.graph.nodes[i].name]
            again = {t.resources[0]: t.duration for t in f.forward if t.kind == "fwd"}
            own = kept_bytes(node) / (c.s * (c.t if c.kind in ("a", "p") else 1))
            acts = dict(f.activations)
            unit = rebuilt.setdefault(cp.unit_of[i], {})
            for d in set(again) | set(f.cast):
                share = f.cast.get(d, 0.0)
                if not cp.boundary[i] and d in again:
                    acts[d] = max(0.0, acts.get(d, 0.0) - own)
                    share += own
                unit[d] = unit.get(d, 0.0) + share
            out.append(replace(f, activations=acts, cast={}, backward=[
                replace(t, duration=t.duration + again.get(t.resources[0], 0.0)) if t.kind == "bwd" else t
                for t in f.backward]))
        working: dict[int, float] = {}
        for unit in rebuilt.values():
            for d, b in unit.items():
                working[d] = max(working.get(d, 0.0), b)
        return out, working

    def unit_nodes(self, units: tuple[str, ...] | None = None) -> dict[str, list[int]]:
        """FSDP unit -> indexes of its nodes that own parameters (``units``: the unit
        paths, default :func:`~flexsearch.strategy.fsdp.fsdp_units` of the graph)."""
        units = fsdp_units(self.graph.modules) if units is None else units
        of = node_units(self.graph, units)
        out: dict[str, list[int]] = {}
        for i, n in enumerate(self.graph.nodes):
            if n.param_bytes:
                out.setdefault(of[n.name], []).append(i)
        return out

    def _fsdp(self, configs: Mapping[str, Config], keep_timeline: bool,
              given: tuple[str, ...] | None = None, recompute: str = "none") -> Simulation:
        """A data-parallel plan with parameters, gradients and optimizer state sharded
        over the ``n`` devices (FSDP2, ``reshard_after_forward``). Per unit of
        :meth:`unit_nodes` (``P_u`` bytes): an all-gather of ``P_u`` before its first
        forward, another before its backward, a reduce-scatter of its gradients after it
        (each with a copy in and out of the flat buffer, ``2 P_u`` bytes at memory
        bandwidth, when calibrated). Parameters are gathered in the precision's
        ``param_dtype`` (bf16 under bf16-mixed: half the bytes) and gradients
        reduce-scattered in their own dtype. Memory: ``(2 + k) P / n`` + activations + the
        unsharded parameters of two units (one prefetched) and the gradients of one."""
        devices = list(range(self.cluster.devices))
        frags, working = self._checkpoint([self.fragment(n.name, configs, ddp=True) for n in self.graph.nodes],
                                          configs, recompute)
        ctx = self.ctx.as_ddp()
        units = self.unit_nodes(given)
        unit_of = {i: u for u, idx in units.items() for i in idx}
        size = {u: sum(frags[i].params.get(0, 0.0) for i in idx) for u, idx in units.items()}
        gather = ctx.precision.gather_factor(self._param_dtype())
        cal = ctx.calibration
        copy_s = 2 / self.cluster.device.memory_bandwidth.value if cal is not None else 0.0
        fixed = cal.fsdp_collective_s.value if cal is not None else 0.0

        def coll(op: str, u: str, key: tuple, deps: tuple = ()) -> Task:
            label = u if u != ROOT else "root"
            nbytes = size[u] * (gather if op == "all_gather" else 1.0)
            t = collective_task(ctx, op, devices, nbytes, f"fsdp {label}", deps, (key,), f"FSDP unit {label}")
            return replace(t, duration=t.duration + copy_s * nbytes + fixed)

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
        unsharded = gather * sum(peak[:2]) + (peak[0] if peak else 0.0)
        return self._schedule(frags, ordered, keep_timeline, True, reduced, shards=len(devices),
                              unsharded=unsharded, configs=configs, working=working)

    def _param_dtype(self) -> str:
        """The dtype the model's parameters are stored in (the first that has any)."""
        n = next((n for n in self.graph.nodes if n.num_params), None)
        return {2: "bfloat16", 8: "float64"}.get(n.param_bytes // n.num_params, "float32") if n else "float32"

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
            b = frags[i].params.get(0, 0.0)
            if not b:
                continue
            members.append(nodes[i].name)
            size += b
            tensors += frags[i].tensors.get(0, 0)
            if size >= cap or not any(frags[j].params.get(0) for j in range(i)):
                k = len(out)
                deps = tuple(("b", m, d) for m in members for d in devices)
                task = collective_task(self.ctx.as_ddp(), "all_reduce", devices, size, f"bucket {k}", deps,
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
                  configs: Mapping[str, Config] | None = None, working: Mapping[int, float] = {}) -> Simulation:
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
            if shards == 1:  # autocast's weight copies (FSDP gathers low-precision weights instead)
                for d, b in f.cast.items():
                    acts[d] += b
            for d, key in f.sync:
                after[d].append(key)
        for d, b in working.items():  # checkpointing: one unit's activations rebuilt at a time
            acts[d] += b
        if shards > 1:
            params = [p / shards for p in params]
            largest = [b / shards for b in largest]
        for b in buckets:
            for d in range(devices):
                after[d].extend(b.defines)
        sharded = (not ddp and devices > 1) or shards > 1  # DTensor parameters
        mode = "fsdp" if shards > 1 else "sharded" if sharded else "ddp" if ddp else "plain"
        dev = self.cluster.device
        for d in range(devices):
            if not params[d]:
                continue
            dur = update_s(self.ctx, self.optimizer, params[d], tensors[d], mode, sharded=sharded)
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
        loss_grad = self._output_grad(configs)
        buckets_held = ddp and shards == 1  # DDP keeps a flat copy of the gradients
        memory = [peak_bytes(DeviceMemory.replicated(params[d], acts[d], self.optimizer, largest=largest[d],
                                                     buffers=unsharded,
                                                     grad_buckets=params[d] if buckets_held else 0.0,
                                                     loss_grad=loss_grad.get(d, 0.0)), cal, mode)
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


def simulate_configs(graph: OpGraph, configs: Mapping[str, Config], context: CostContext | Cluster,
                     **kw) -> Simulation:
    """One full simulation (no cache kept)."""
    return Simulator(graph, context, **kw).simulate(configs)
