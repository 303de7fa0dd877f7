"""The task graph of one training iteration: (graph, configuration per node, cluster)
to tasks on devices and links.

Per node ``n`` with configuration ``c`` (:class:`~flexsearch.strategy.config.Config`) a
:class:`Fragment` holds:

- a forward and a backward **compute task** per partition, on its device, costed by
  :func:`~flexsearch.cost.compute.op_cost` for the partition's degrees;
- for every input edge ``p -> n`` and every partition, the region of ``p``'s output it
  needs (:func:`~flexsearch.graph.regions.input_region`), intersected with the
  *tiles* ``p`` produced (a tile = one distinct output region and the devices holding
  it). An overlap held on the partition's own device is a local dependency; otherwise
  one **transfer** per (source, destination) pair carries the overlap's bytes over the
  links of the path (the source: a holder on the same node if any, else spread over
  the holders). Backward mirrors it: a tile held once gets its gradient pieces sent
  back by every remote reader (the holder sums them); a tile replicated on several
  devices gets an all-gather (readers took disjoint pieces) or an all-reduce (they
  overlap) among holders and readers;
- a reduce split leaves partial sums: an **all-reduce** of the output over each group
  of ``t`` partitions follows the forward;
- **gradient synchronisation**: an all-reduce of the node's (owned) parameter
  gradients over each group of devices holding the same parameter shard;
- memory terms: parameter shard, activations kept for the backward pass
  (:func:`kept_bytes`: outputs of non-view ops, a recurrent layer's gates; and
  received inputs).

Dependencies are symbolic keys resolved when fragments are scheduled in program
order (forward in topological order, backward in reverse, then the optimizer update):
``("f", n, d)`` forward on device d, ``("F", n, d)`` output ready on d after a
partial-sum all-reduce, ``("b", n, d)`` backward, ``("G", n, d)`` the gradient of
``n``'s output has arrived on d (defined by several tasks: the latest counts).

A fragment depends only on the node's configuration and its producers', so a
simulator can keep fragments across changes (:mod:`flexsearch.sim.simulator`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from flexsearch.cost import comm
from flexsearch.cost.calibration import DeviceCalibration, calibration_for
from flexsearch.cost.compute import FREE_KINDS, MeasuredCosts, Partition, op_cost
from flexsearch.cost.efficiency import EfficiencyTable, load_efficiency
from flexsearch.cost.hardware import Cluster
from flexsearch.graph.opgraph import OpNode, dtype_size
from flexsearch.graph.regions import Region, input_region, intersect, split_interval, volume
from flexsearch.strategy.config import Config, is_source, sample_dim

Key = tuple


@dataclass(frozen=True, slots=True)
class Task:
    """One task: ``kind`` in fwd/bwd/xfer/coll/update; ``resources`` are device ids
    (``< devices``) and link indexes (``devices + i``); ``deps`` symbolic keys;
    ``defines`` the keys this task satisfies (``G`` keys accumulate)."""

    kind: str
    name: str
    duration: float
    resources: tuple[int, ...]
    deps: tuple[Key, ...]
    defines: tuple[Key, ...] = ()
    nbytes: float = 0.0
    detail: str = ""


@dataclass
class Fragment:
    """The tasks and memory terms one node contributes (module docstring)."""

    forward: list[Task] = field(default_factory=list)
    backward: list[Task] = field(default_factory=list)
    grad_local: list[tuple[int, Key]] = field(default_factory=list)  # (d, G key) b on d defines
    params: dict[int, float] = field(default_factory=dict)  # device -> parameter bytes
    tensors: dict[int, int] = field(default_factory=dict)  # device -> parameter tensors
    largest: dict[int, float] = field(default_factory=dict)  # device -> bytes of its largest parameter tensor
    activations: dict[int, float] = field(default_factory=dict)  # device -> bytes kept
    sync: list[tuple[int, Key]] = field(default_factory=list)  # (device, task key) before update


class CostContext:
    """What costing needs besides the graph: the cluster, measured op times (optional),
    efficiency table (default: :func:`~flexsearch.cost.efficiency.load_efficiency`), a
    dtype override (``"tf32"`` for TF32 matmuls) and the device's calibration (default:
    :func:`~flexsearch.cost.calibration.calibration_for` its name; ``False``: none).
    Memoises op and collective costs.

    With a calibration, an op whose configuration spans several devices runs on
    DTensors (the SOAP emitter) and pays the ``sharded`` per-op overhead, one on a single
    device the ``plain`` one; ``ddp=True`` marks a plan the emitter runs with DDP
    (every op data parallel: plain ops, bucketed gradient all-reduces)."""

    def __init__(
        self,
        cluster: Cluster,
        measured: MeasuredCosts | None = None,
        efficiency: EfficiencyTable | None = None,
        dtype: str | None = None,
        calibration: DeviceCalibration | None | bool = None,
        ddp: bool = False,
    ):
        self.cluster = cluster
        self.measured = measured
        self.efficiency = efficiency if efficiency is not None else load_efficiency()
        self.dtype = dtype
        if calibration is None or calibration is True:
            calibration = calibration_for(cluster.device.name)
        self.calibration: DeviceCalibration | None = calibration or None
        self.ddp = ddp
        self.blocking = bool(self.calibration and self.calibration.communication_blocks_compute.value)
        self.links = {link.id: cluster.devices + i for i, link in enumerate(cluster.links)}
        self._ops: dict[tuple[str, Config], tuple[float, float]] = {}
        self._colls: dict[tuple, comm.CommCost] = {}
        self._xfers: dict[tuple[int, int, float], tuple[float, tuple[int, ...]]] = {}
        self.node_of = [cluster.node_of(d) for d in range(cluster.devices)]
        self._geometry: dict[tuple, EdgeGeometry] = {}

    def geometry(self, node: OpNode, c: Config, k: int, p: OpNode, pc: Config) -> EdgeGeometry:
        """Memoised :func:`edge_geometry` (keyed by shapes, kinds and configurations)."""
        key = (node.kind, node.target, node.outputs[0].shape, sample_dim(node), k, c,
               p.outputs[0].shape, sample_dim(p), pc)
        hit = self._geometry.get(key)
        if hit is None:
            hit = self._geometry[key] = edge_geometry(node, c, k, p, pc, self.node_of)
        return hit

    def transfer(self, src: int, dst: int, nbytes: float) -> tuple[float, tuple[int, ...]]:
        """(seconds, link resources) of one point-to-point transfer."""
        key = (src, dst, nbytes)
        hit = self._xfers.get(key)
        if hit is None:
            path = self.cluster.path(src, dst)
            hit = (comm.p2p_time(self.cluster, src, dst, nbytes), _link_resources(self, path))
            self._xfers[key] = hit
        return hit

    def sharded(self, c: Config) -> bool:
        """Does an op under ``c`` run on DTensors (calibration: the sharded overhead)?"""
        return not self.ddp and c.n > 1

    def op_cost(self, node: OpNode, c: Config, first: bool = False) -> tuple[float, float]:
        """(forward, backward) seconds of one task of ``node`` under ``c`` (with the
        calibrated per-op overhead of its execution mode). ``first``: its inputs are the
        model's (no input gradient): measured as such when the profile has it."""
        key = (node.name, c.s, c.kind, c.t, first)
        hit = self._ops.get(key)
        if hit is None:
            if node.kind in FREE_KINDS:
                hit = (0.0, 0.0)
            else:
                cost = None
                if first and self.measured is not None:
                    from flexsearch.cost.profiler import leaf_node

                    cost = op_cost(leaf_node(node), self.cluster.device, partition_of(c), dtype=self.dtype,
                                   efficiency=self.efficiency, measured=self.measured)
                if cost is None or cost.source != "measured":
                    cost = op_cost(node, self.cluster.device, partition_of(c), dtype=self.dtype,
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


_COPYING_VIEWS = frozenset({"Tensor.repeat", "Tensor.contiguous", "torch.repeat_interleave",
                            "torch._VariableFunctionsClass.arange", "torch.arange", "torch.cat", "torch.stack"})
"""Ops the registry classes as views that write new memory (copies, factories)."""
_RNN_SAVED = {"LSTM": 6, "GRU": 5, "RNN": 2, "LSTMCell": 6, "GRUCell": 5, "RNNCell": 2}
"""Bytes a recurrent layer keeps for its backward per byte of its sequence output: per
step the gates (LSTM 4, GRU 3, RNN 1 times the hidden size), the cell state (LSTM) and
the hidden output itself."""


def kept_bytes(node: OpNode) -> float:
    """Bytes of activations ``node`` keeps for the backward pass (whole op): its
    outputs, none for a view (:func:`aliases`), a recurrent layer's gates too."""
    if node.bytes_written <= 0 or aliases(node):
        return 0.0
    if node.kind == "rnn" and node.outputs:
        factor = _RNN_SAVED.get(node.target.rsplit(".", 1)[-1])
        if factor is not None:
            return float(factor * node.outputs[0].nbytes + sum(t.nbytes for t in node.outputs[1:]))
    return float(node.output_bytes)


def aliases(node: OpNode) -> bool:
    """Does the node's output share its input's storage (a view: no new memory kept)?"""
    return node.kind == "view" and node.target not in _COPYING_VIEWS


def partition_of(c: Config) -> Partition:
    """The cost model's degrees for one task of configuration ``c``."""
    return Partition(
        sample=c.s,
        attribute=c.t if c.kind == "a" else 1,
        parameter=c.t if c.kind == "p" else 1,
        reduce=c.t if c.kind == "r" else 1,
    )


def out_region(node: OpNode, c: Config, i_s: int, i_t: int) -> Region:
    """The region of ``node``'s first output computed by partition ``(i_s, i_t)``."""
    shape = node.outputs[0].shape
    reg = [(0, s) for s in shape]
    if c.s > 1:
        sd = sample_dim(node)
        assert sd is not None
        reg[sd] = split_interval(shape[sd], c.s, i_s)
    if c.kind in ("a", "p"):
        reg[c.dim] = split_interval(shape[c.dim], c.t, i_t)
    return tuple(reg)


def tasks_of(c: Config) -> list[tuple[int, int, int]]:
    """``(i_s, i_t, device)`` for every partition of ``c``."""
    return [(i, j, c.device(i, j)) for i in range(c.s) for j in range(c.t)]


def tiles(node: OpNode, c: Config) -> dict[Region, list[int]]:
    """Distinct output regions of ``node`` under ``c`` and the devices holding each
    (after the partial-sum all-reduce, a reduce split holds full regions)."""
    out: dict[Region, list[int]] = {}
    for i, j, d in tasks_of(c):
        out.setdefault(out_region(node, c, i, j), []).append(d)
    return out


def _link_resources(ctx: CostContext, links) -> tuple[int, ...]:
    return tuple(sorted({ctx.links[link.id] for link in links}))


def _collective(ctx: CostContext, op: str, group: list[int], nbytes: float, name: str,
                deps: tuple[Key, ...], defines: tuple[Key, ...], detail: str, calls: int = 1) -> Task:
    """One collective (``calls`` collectives of ``nbytes`` in all: one latency each)."""
    g = tuple(sorted(set(group)))
    cost = ctx.collective(op, g, nbytes)
    seconds = cost.time_s
    if calls > 1 and seconds > 0:
        seconds += (calls - 1) * ctx.collective(op, g, 1.0).time_s
    res = ctx.device_resources(g) + _link_resources(ctx, [link for link, _ in cost.loads])
    return Task("coll", name, seconds, res, deps, defines, nbytes, f"{detail} {op}/{cost.algorithm}")


def _transfer(ctx: CostContext, src: int, dst: int, nbytes: float, name: str,
              deps: tuple[Key, ...], defines: tuple[Key, ...], detail: str) -> Task:
    seconds, links = ctx.transfer(src, dst, nbytes)
    res = ctx.device_resources((src, dst)) + links
    return Task("xfer", name, seconds, res, deps, defines, nbytes, f"{detail} d{src}->d{dst}")


@dataclass(frozen=True)
class EdgeGeometry:
    """Which data an edge moves, independent of node names (shared by every copy of a
    repeated block): per consumer device the local reads, the transfers
    ``(src, dst, elements)``, and the backward operations on the gradient."""

    local: tuple[int, ...]
    transfers: tuple[tuple[int, int, int], ...]
    grad_local: tuple[tuple[int, int], ...]  # (reader device, holder device): same device
    grad_transfers: tuple[tuple[int, int, int], ...]  # (reader, holder, elements)
    grad_collectives: tuple[tuple[str, tuple[int, ...], int, tuple[int, ...], tuple[int, ...]], ...]
    # (op, group, elements, reader devices, holder devices)


def edge_geometry(node: OpNode, c: Config, k: int, p: OpNode, pc: Config, node_of: list[int]) -> EdgeGeometry:
    """Region intersections of edge ``p -> node`` (rules in the module docstring)."""
    parts = tasks_of(c)
    ptiles = tiles(p, pc)
    local: list[int] = []
    transfers: list[tuple[int, int, int]] = []
    readers: dict[Region, list[tuple[int, int]]] = {}  # tile -> (reader device, volume)
    for idx, (i, j, d) in enumerate(parts):
        need = input_region(node, k, p.outputs[0].shape, out_region(node, c, i, j),
                            (c.t, j) if c.kind == "r" else (1, 0))
        incoming: dict[int, int] = {}
        for region, holders in ptiles.items():
            ov = intersect(need, region)
            if ov is None:
                continue
            vol = volume(ov)
            readers.setdefault(region, []).append((d, vol))
            if d in holders:
                local.append(d)
                continue
            same = [h for h in holders if node_of[h] == node_of[d]] or holders
            h = same[idx % len(same)]
            incoming[h] = incoming.get(h, 0) + vol
        transfers += [(h, d, vol) for h, vol in sorted(incoming.items())]
    grad_local: list[tuple[int, int]] = []
    grad_transfers: list[tuple[int, int, int]] = []
    grad_colls = []
    for region, rd in readers.items():
        holders = ptiles[region]
        rdev = sorted({d for d, _ in rd})
        if len(holders) == 1:
            h = holders[0]
            for d in rdev:
                if d == h:
                    grad_local.append((d, h))
                else:
                    grad_transfers.append((d, h, sum(v for dd, v in rd if dd == d)))
            continue
        group = sorted(set(holders) | set(rdev))
        if len(group) == 1:
            grad_local.append((group[0], group[0]))
            continue
        op = "all_gather" if sum(v for _, v in rd) <= volume(region) else "all_reduce"
        grad_colls.append((op, tuple(group), volume(region), tuple(rdev), tuple(holders)))
    return EdgeGeometry(tuple(local), tuple(transfers), tuple(grad_local), tuple(grad_transfers),
                        tuple(grad_colls))


def _mesh_move(
    node: OpNode, c: Config, k: int, p: OpNode, pc: Config, ctx: CostContext, frag: Fragment
) -> tuple[list[Task], list[Task], dict[int, list[Key]]]:
    """Edge ``p -> node`` between ops on different device blocks as the SOAP emitter runs
    it (calibrated simulations): the producer's output gathered on its block (an
    all-gather when split), then broadcast whole to the consumer's block; the gradient
    comes back the same way. Each consumer device keeps the whole tensor."""
    n = node.name
    esize = dtype_size(p.outputs[0].dtype)
    nbytes = float(esize * math.prod(p.outputs[0].shape))
    ready = "F" if pc.kind == "r" else "f"
    src, dst = sorted(set(pc.devices)), sorted(set(c.devices))
    split = pc.kind in ("a", "p") or pc.s > 1
    members = sorted(set(src) | set(dst))

    def move(deps: tuple[Key, ...], defines: tuple[Key, ...], what: str) -> Task:
        gather = ctx.collective("all_gather", tuple(src), nbytes) if split and len(src) > 1 else None
        bcast = ctx.collective("broadcast", tuple(members), nbytes)
        seconds = bcast.time_s + (gather.time_s if gather is not None else 0.0)
        links = [link for cost in (gather, bcast) if cost is not None for link, _ in cost.loads]
        res = ctx.device_resources(members) + _link_resources(ctx, links)
        return Task("coll", n, seconds, res, deps, defines, nbytes, f"{what} d{src}->d{dst} all_gather+broadcast")

    key = ("x", n, k, "move")
    forward = [move(tuple((ready, p.name, h) for h in src), (key,), f"{p.name}->{n}")]
    needs = {d: [key] for d in dst}
    for d in dst:
        frag.activations[d] = frag.activations.get(d, 0.0) + nbytes
    backward = [move(tuple(("b", n, d) for d in dst), tuple(("G", p.name, h) for h in src), f"grad {n}->{p.name}")]
    return forward, backward, needs


def edge_tasks(
    node: OpNode, c: Config, k: int, p: OpNode, pc: Config, ctx: CostContext, frag: Fragment
) -> tuple[list[Task], list[Task], dict[int, list[Key]]]:
    """The tasks of edge ``p -> node`` (input ``k``): forward transfers, backward
    gradient tasks, and per device of ``node`` the keys its forward waits for. Local
    gradient contributions and received bytes are recorded on ``frag``."""
    forward: list[Task] = []
    backward: list[Task] = []
    needs: dict[int, list[Key]] = {}
    if is_source(p):
        return forward, backward, needs
    if ctx.calibration is not None and not ctx.ddp and (pc.first, pc.s, pc.t) != (c.first, c.s, c.t):
        return _mesh_move(node, c, k, p, pc, ctx, frag)
    geo = ctx.geometry(node, c, k, p, pc)
    n = node.name
    esize = dtype_size(p.outputs[0].dtype)
    ready = "F" if pc.kind == "r" else "f"  # output ready: after the partial-sum all-reduce
    for d in geo.local:
        needs.setdefault(d, []).append((ready, p.name, d))
    for h, d, vol in geo.transfers:
        key = ("x", n, k, h, d)
        nbytes = vol * esize
        forward.append(_transfer(ctx, h, d, nbytes, n, ((ready, p.name, h),), (key,),
                                 f"{p.name}->{n}"))
        needs.setdefault(d, []).append(key)
        frag.activations[d] = frag.activations.get(d, 0.0) + nbytes
    for d, h in geo.grad_local:
        frag.grad_local.append((d, ("G", p.name, h)))
    for d, h, vol in geo.grad_transfers:
        backward.append(_transfer(ctx, d, h, vol * esize, n, (("b", n, d),),
                                  (("G", p.name, h),), f"grad {n}->{p.name}"))
    for op, group, vol, rdev, holders in geo.grad_collectives:
        backward.append(_collective(
            ctx, op, list(group), vol * esize, n, tuple(("b", n, d) for d in rdev),
            tuple(("G", p.name, h) for h in holders), f"grad {n}->{p.name}"))
    return forward, backward, needs


def build_fragment(
    node: OpNode,
    c: Config,
    producers: list[tuple[OpNode, Config]],
    ctx: CostContext,
) -> Fragment:
    """The fragment of ``node`` under ``c``, given its inputs' nodes and configurations
    (in ``node.inputs`` order)."""
    frag = Fragment()
    if is_source(node):
        return frag
    needs: dict[int, list[Key]] = {d: [] for _, _, d in tasks_of(c)}
    grad_edges: list[Task] = []
    for k, (p, pc) in enumerate(producers):
        fwd, bwd, wait = edge_tasks(node, c, k, p, pc, ctx, frag)
        frag.forward += fwd
        grad_edges += bwd
        for d, keys in wait.items():
            needs[d] += keys
    first = bool(node.param_bytes) and all(is_source(p) for p, _ in producers)
    node_tasks(node, c, ctx, frag, needs, grad_edges, first)
    return frag


def node_tasks(
    node: OpNode,
    c: Config,
    ctx: CostContext,
    frag: Fragment,
    needs: dict[int, list[Key]] | None = None,
    grad_edges: list[Task] = (),
    first: bool = False,
) -> Fragment:
    """Add the node's own tasks to ``frag``: compute, partial-sum all-reduce, gradient
    synchronisation, and its memory terms (``first``: a first layer, no input gradient)."""
    n = node.name
    parts = tasks_of(c)
    needs = needs or {}
    cost = ctx.op_cost(node, c, first)
    fwd_time, bwd_time = cost
    out_bytes = kept_bytes(node) / (c.s * (c.t if c.kind in ("a", "p") else 1))
    keeps = out_bytes > 0
    for _, _, d in parts:
        frag.forward.append(Task("fwd", n, fwd_time, (d,), tuple(needs.get(d, ())), (("f", n, d),),
                                 detail=c.text))
        if keeps:
            frag.activations[d] = frag.activations.get(d, 0.0) + out_bytes

    # Partial sums: all-reduce over each group of t partitions.
    if c.kind == "r":
        for i in range(c.s):
            group = [c.device(i, j) for j in range(c.t)]
            frag.forward.append(_collective(
                ctx, "all_reduce", group, node.output_bytes / c.s, n,
                tuple(("f", n, d) for d in group), tuple(("F", n, d) for d in group),
                "partial sums"))

    # Backward compute, input gradients, then gradient synchronisation of owned parameters.
    local: dict[int, list[Key]] = {}
    for d, key in frag.grad_local:  # inputs read on the same device: the backward delivers
        local.setdefault(d, []).append(key)
    frag.backward = [
        Task("bwd", n, bwd_time, (d,), (("f", n, d), ("G", n, d)), (("b", n, d), *local.get(d, ())),
             detail=c.text)
        for _, _, d in parts
    ]
    frag.backward += grad_edges  # input gradients first: they are on the critical path
    if node.param_bytes:
        sharded = c.kind in ("p", "r")
        shard = node.param_bytes / (c.t if sharded else 1)
        count = max(1, len(node.params))
        for _, _, d in parts:
            frag.params[d] = frag.params.get(d, 0.0) + shard
            frag.tensors[d] = frag.tensors.get(d, 0) + count
            # the largest tensor: the weight of a weight and a bias, one of two weights of four
            frag.largest[d] = max(frag.largest.get(d, 0.0), shard if count <= 2 else 2 * shard / count)
        groups = (
            [[c.device(i, j) for i in range(c.s)] for j in range(c.t)] if sharded else [list(c.devices)]
        )
        for g_i, group in enumerate(groups):
            if len(group) == 1 or ctx.ddp:  # DDP: bucketed all-reduces (the simulator's)
                frag.sync.extend((d, ("b", n, d)) for d in group)
                continue
            key = ("s", n, g_i)
            # the DTensor emitter all-reduces each parameter's gradient on its own
            calls = count if ctx.calibration is not None else 1
            frag.backward.append(_collective(
                ctx, "all_reduce", group, shard, n, tuple(("b", n, d) for d in group), (key,),
                "gradients", calls))
            frag.sync.extend((d, key) for d in group)
    return frag
