"""What costing needs besides the graph and the strategy: the :class:`CostContext`.

A context names everything a prediction depends on, explicitly: the cluster, measured
op costs (a profile, optional), the efficiency table of the roofline, the training
precision (:mod:`flexsearch.precision`; a graph traced under it carries its dtypes,
the context adds what dtypes cannot say: TF32 matmuls, the low-precision weight copies
autocast keeps, the dtype FSDP gathers in) and the device's calibration (:mod:`flexsearch.cost.calibration`). Nothing here reads
a file the caller did not ask for: a context without a calibration is uncalibrated,
whatever is on disk (:func:`flexsearch.cost.calibration.load_calibration` loads one).

It memoises op costs, collectives and point-to-point transfers, and builds the tasks
for communication (:func:`collective_task`, :func:`transfer_task`) that every
simulator schedules.

With a calibration, an op whose configuration spans several devices runs on DTensors
(the SOAP emitter) and pays the ``sharded`` per-op overhead, one on a single device the
``plain`` one; a context made with ``ddp=True`` (:meth:`CostContext.as_ddp`) costs a
plan the emitter runs with DDP (every op data parallel: plain ops, bucketed gradient
all-reduces).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from flexsearch.cost import comm
from flexsearch.cost.calibration import DeviceCalibration
from flexsearch.cost.compute import FREE_KINDS, MeasuredCosts, Partition, node_dtype, op_cost
from flexsearch.cost.efficiency import EfficiencyTable, load_efficiency
from flexsearch.cost.hardware import Cluster
from flexsearch.graph.opgraph import OpNode
from flexsearch.precision import FP32, Precision
from flexsearch.sim.tasks import Key, Task
from flexsearch.strategy.config import Config


def partition_of(c: Config) -> Partition:
    """The cost model's degrees for one task of configuration ``c``."""
    return Partition(
        sample=c.s,
        attribute=c.t if c.kind == "a" else 1,
        parameter=c.t if c.kind == "p" else 1,
        reduce=c.t if c.kind == "r" else 1,
    )


class CostContext:
    """Cluster, measured op costs, efficiency table (default: the built-in one),
    precision (default fp32) and calibration (default: none), with the memoised costs of
    one prediction or search (module docstring)."""

    def __init__(
        self,
        cluster: Cluster,
        measured: MeasuredCosts | None = None,
        efficiency: EfficiencyTable | None = None,
        precision: Precision = FP32,
        calibration: DeviceCalibration | None = None,
        ddp: bool = False,
    ):
        if calibration is not None and not isinstance(calibration, DeviceCalibration):
            raise TypeError(f"calibration must be a DeviceCalibration or None, not {type(calibration).__name__}")
        self.cluster = cluster
        self.measured = measured
        self.efficiency = efficiency if efficiency is not None else load_efficiency()
        self.precision = precision
        self.calibration = calibration
        self.ddp = ddp
        self.blocking = bool(calibration and calibration.communication_blocks_compute.value)
        self.links = {link.id: cluster.devices + i for i, link in enumerate(cluster.links)}
        self._ops: dict[tuple, tuple[float, float]] = {}
        self._colls: dict[tuple, comm.CommCost] = {}
        self._xfers: dict[tuple[int, int, float], tuple[float, tuple[int, ...]]] = {}
        self._held: dict[tuple, tuple[int, ...]] = {}  # resources tuples, one object per value
        self.node_of = [cluster.node_of(d) for d in range(cluster.devices)]
        self.geometry_cache: dict[tuple, object] = {}
        """Edge geometries of the op-level task graph (:mod:`flexsearch.sim.taskgraph`)."""
        self._ddp: CostContext | None = None

    def on(self, cluster: Cluster) -> CostContext:
        """The same costs (profile, efficiency, precision, calibration) on another
        cluster: a pipeline stage's tensor-parallel group, one replica's device."""
        if cluster is self.cluster:
            return self
        return CostContext(cluster, self.measured, self.efficiency, self.precision, self.calibration, self.ddp)

    def as_ddp(self) -> CostContext:
        """This context for a plan the emitter runs with DDP (module docstring); made once."""
        if self.ddp:
            return self
        if self._ddp is None:
            self._ddp = CostContext(self.cluster, self.measured, self.efficiency, self.precision, self.calibration,
                                    ddp=True)
        return self._ddp

    def transfer(self, src: int, dst: int, nbytes: float) -> tuple[float, tuple[int, ...]]:
        """(seconds, link resources) of one point-to-point transfer."""
        key = (src, dst, nbytes)
        hit = self._xfers.get(key)
        if hit is None:
            path = self.cluster.path(src, dst)
            hit = (comm.p2p_time(self.cluster, src, dst, nbytes), link_resources(self, path))
            self._xfers[key] = hit
        return hit

    def sharded(self, c: Config) -> bool:
        """Does an op under ``c`` run on DTensors (calibration: the sharded overhead)?"""
        return not self.ddp and c.n > 1

    def op_cost(self, node: OpNode, c: Config, first: bool = False) -> tuple[float, float]:
        """(forward, backward) seconds of one task of ``node`` under ``c`` (with the
        calibrated per-op overhead of its execution mode). ``first``: its inputs are the
        model's (no input gradient): measured as such when the profile has it."""
        key = (node.name, node.bytes_read, node.bytes_written, c.s, c.kind, c.t, first)  # the bytes: dtypes
        # differ between a graph and its low_param_graph (the same node names)
        hit = self._ops.get(key)
        if hit is None:
            if node.kind in FREE_KINDS:
                hit = (0.0, 0.0)
            else:
                cost = None
                dtype = self.compute_dtype(node)
                if first and self.measured is not None:
                    from flexsearch.cost.profiler import leaf_node

                    cost = op_cost(leaf_node(node), self.cluster.device, partition_of(c), dtype=dtype,
                                   efficiency=self.efficiency, measured=self.measured)
                if cost is None or cost.source != "measured":
                    cost = op_cost(node, self.cluster.device, partition_of(c), dtype=dtype,
                                   efficiency=self.efficiency, measured=self.measured)
                hit = (cost.forward_s, cost.backward_s)
                if self.calibration is not None:
                    cal = self.calibration
                    if cost.source == "measured":
                        pf, pb = cal.profiled_call.forward_s.value, cal.profiled_call.backward_s.value
                        hit = (max(0.0, hit[0] - pf), max(0.0, hit[1] - pb))
                    hit = (hit[0] * cal.concurrency["forward"].value, hit[1] * cal.concurrency["backward"].value)
                    fo, bo = cal.op_s("sharded" if self.sharded(c) else "plain")
                    hit = (hit[0] + fo, hit[1] + bo)
            self._ops[key] = hit
        return hit

    def compute_dtype(self, node: OpNode) -> str | None:
        """The dtype ``node`` is priced at when it is not its own: ``tf32`` for an fp32
        matmul-class op under TF32 (None: the node's dtype)."""
        dtype = node_dtype(node)
        priced = self.precision.priced_dtype(node.kind, dtype)
        return None if priced == dtype else priced

    def held(self, key: tuple, make: Callable[[], tuple[int, ...]]) -> tuple[int, ...]:
        """The resources a communication keyed ``key`` holds (``make()`` builds them), one
        tuple object per value: :class:`flexsearch.sim.tasks.LinkClasses` tells the
        tuples of a schedule apart by identity."""
        hit = self._held.get(key)
        if hit is None:
            res = make()
            hit = self._held[key] = self._held.setdefault(res, res)
        return hit

    def device_resources(self, devices) -> tuple[int, ...]:
        """The devices a communication among ``devices`` occupies: all of them when the
        calibration says communication blocks compute, else none (links only)."""
        return tuple(sorted(set(devices))) if self.blocking else ()

    def collective(self, op: str, group: tuple[int, ...], nbytes: float) -> comm.CommCost:
        """The collective's cost: the alpha-beta model's, its time replaced by the
        calibration's measured fit for ``op`` where there is one (same links loaded)."""
        key = (op, group, nbytes)
        hit = self._colls.get(key)
        if hit is None:
            hit = comm.collective(op, self.cluster, group, nbytes)
            fit = self.calibration.collectives.get(op) if self.calibration is not None else None
            if fit is not None and hit.time_s > 0:
                hit = replace(hit, time_s=fit.time_s(len(group), nbytes), algorithm=f"{hit.algorithm}+measured")
            self._colls[key] = hit
        return hit


def link_resources(ctx: CostContext, links) -> tuple[int, ...]:
    """The scheduler's resource indexes of ``links``."""
    return tuple(sorted({ctx.links[link.id] for link in links}))


def collective_task(ctx: CostContext, op: str, group: list[int] | tuple[int, ...], nbytes: float, name: str,
                    deps: tuple[Key, ...], defines: tuple[Key, ...], detail: str, calls: int = 1) -> Task:
    """One collective over ``group`` (``calls`` collectives of ``nbytes`` in all: one
    latency each), holding the links it loads (and the devices, when communication
    blocks compute)."""
    g = tuple(sorted(set(group)))
    cost = ctx.collective(op, g, nbytes)
    seconds = cost.time_s
    if calls > 1 and seconds > 0:
        seconds += (calls - 1) * ctx.collective(op, g, 1.0).time_s
    res = ctx.held(("coll", g, id(cost)),  # the cost is kept by the context: its id stays its own
                   lambda: ctx.device_resources(g) + link_resources(ctx, [link for link, _ in cost.loads]))
    return Task("coll", name, seconds, res, deps, defines, nbytes, f"{detail} {op}/{cost.algorithm}")


def fsdp_collective_task(ctx: CostContext, op: str, group: list[int] | tuple[int, ...], nbytes: float, name: str,
                         deps: tuple[Key, ...], defines: tuple[Key, ...], detail: str, calls: int = 1) -> Task:
    """One of FSDP2's collectives over ``group`` (an all-gather of a unit's parameters, a
    reduce-scatter or all-reduce of its gradients; ``calls`` units' of ``nbytes`` in all,
    one after the other): :func:`collective_task` under ``ctx``'s DDP-mode context,
    calibrated with the copies in and out of its flat buffer (two passes over ``nbytes``
    at the device's memory bandwidth) and the calibration's fixed cost per FSDP
    collective (``fsdp_collective_s``)."""
    ddp = ctx.as_ddp()
    t = collective_task(ddp, op, group, nbytes, name, deps, defines, detail, calls=calls)
    cal = ddp.calibration
    if cal is None:
        return t
    copy_s = 2 / ddp.cluster.device.memory_bandwidth.value
    return t._replace(duration=t.duration + copy_s * nbytes + cal.fsdp_collective_s.value * calls)


def transfer_task(ctx: CostContext, src: int, dst: int, nbytes: float, name: str,
                  deps: tuple[Key, ...], defines: tuple[Key, ...], detail: str) -> Task:
    """One point-to-point transfer over the links of the path."""
    seconds, links = ctx.transfer(src, dst, nbytes)
    res = ctx.held(("xfer", src, dst, links), lambda: ctx.device_resources((src, dst)) + links)
    return Task("xfer", name, seconds, res, deps, defines, nbytes, f"{detail} d{src}->d{dst}")
