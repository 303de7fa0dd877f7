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
  overlap) among holders and readers. The all-reduces of partial sums that several
  readers of one tensor hold alike are one, and an integer or boolean input (token ids,
  masks) has no gradient (:mod:`flexsearch.sim.gradients`);
- a reduce split leaves partial sums: an **all-reduce** of the output over each group
  of ``t`` partitions follows the forward;
- **gradient synchronisation**: an all-reduce of the node's (owned, trained)
  parameter gradients over each group of devices holding the same parameter shard;
- an op on parameters alone (LoRA's ``A.t()``, a ViT's ``cls_token.expand``: no
  activation inputs, so a source, free to read) holds them on every device, replicated
  as every emitter places them, with their gradient synchronisation; its readers'
  backward delivers its gradient;
- memory terms: parameter shard, activations kept for the backward pass
  (:func:`~flexsearch.sim.footprint.kept_bytes`: what autograd saves, as traced, a recurrent layer's gates; and
  received inputs).

Dependencies are symbolic keys resolved when fragments are scheduled in program
order (forward in topological order, backward in reverse, then the optimizer update):
``("f", n, d)`` forward on device d, ``("F", n, d)`` output ready on d after a
partial-sum all-reduce, ``("b", n, d)`` backward, ``("G", n, d)`` the gradient of
``n``'s output has arrived on d (defined by several tasks: the latest counts).

A fragment depends only on the node's configuration and its producers', so a
simulator can keep fragments across changes (:mod:`flexsearch.sim.simulator`).

**One replica for all** (:class:`Replica`): when every configuration repeats with a
period of ``w`` devices (devices ``d`` and ``d + w`` do the same work on the same
kind of links), a fragment can be built for devices ``0 .. w-1`` only. Their compute
tasks, the transfers and collectives among them stand for the same tasks on every
replica (``Task.copies``); a collective over every replica (its group the same when
shifted by ``w``) is kept whole; the other replicas' own tasks are left out. A task
that couples replicas otherwise raises :class:`NotPeriodic`. The premise: a collective
over every replica loads each member's links alike (the ring, tree and hierarchical
algorithms of :mod:`flexsearch.cost.comm` send and receive on every member), so the
first replica's busy links stand for every replica's when it looks for idle time.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from flexsearch.graph.opgraph import OpNode, dtype_size
from flexsearch.graph.regions import (
    Region,
    TileIndex,
    input_region,
    intersect,
    split_interval,
    volume,
)
from flexsearch.sim.accounting import largest_tensor
from flexsearch.sim.context import CostContext, collective_task, link_resources, transfer_task
from flexsearch.sim.footprint import aliases, cast_copy_bytes, grad_bytes, kept_bytes
from flexsearch.sim.tasks import Key, Task
from flexsearch.strategy.config import SOURCE_KINDS, Config, is_source, sample_dim


class NotPeriodic(Exception):
    """A task couples the replicas of a :class:`Replica` quotient unevenly: the
    configuration does not repeat with that period (simulate every device instead)."""


@dataclass(frozen=True)
class Replica:
    """The devices ``0 .. width - 1`` simulated for all ``devices // width`` replicas
    (module docstring)."""

    width: int
    devices: int

    @property
    def copies(self) -> int:
        return self.devices // self.width

    def task(self, t: Task, members: Sequence[int]) -> Task | None:
        """``t`` (a transfer or collective among ``members``) as the quotient keeps it:
        within the first replica, standing for every replica's; None when it lies in
        the other replicas; whole when it is a collective over every replica evenly (its
        group the same shifted by ``width``)."""
        inside = [d < self.width for d in members]
        if all(inside):
            return t._replace(copies=self.copies)
        if not any(inside):
            return None
        group = set(members)
        if t.kind == "coll" and {(d + self.width) % self.devices for d in group} == group:
            return t
        raise NotPeriodic(f"{t.detail}: devices {sorted(group)} do not repeat every {self.width}")


def first_width(replica: Replica | None) -> int | None:
    """The devices of ``replica``'s first replica, the ones simulated (None: every device)."""
    return replica.width if replica is not None else None


def elsewhere(replica: Replica | None, members: Sequence[int]) -> bool:
    """Does a task among ``members`` lie in the other replicas alone (:meth:`Replica.task`
    drops it: its task need not be built)?"""
    return replica is not None and min(members) >= replica.width


def kept(replica: Replica | None, t: Task, members: Sequence[int]) -> list[Task]:
    """``t`` as a list, as ``replica`` keeps it (:meth:`Replica.task`; all of it without one)."""
    if replica is None:
        return [t]
    kept = replica.task(t, members)
    return [] if kept is None else [kept]


@dataclass
class Fragment:
    """The tasks and memory terms one node contributes (module docstring)."""

    forward: list[Task] = field(default_factory=list)
    backward: list[Task] = field(default_factory=list)
    grad_local: list[tuple[int, Key]] = field(default_factory=list)  # (d, G key) b on d defines
    params: dict[int, float] = field(default_factory=dict)  # device -> parameter bytes
    trained: dict[int, float] = field(default_factory=dict)  # device -> of those, bytes that train
    tensors: dict[int, int] = field(default_factory=dict)  # device -> parameter tensors
    largest: dict[int, float] = field(default_factory=dict)  # device -> bytes of its largest parameter tensor
    activations: dict[int, float] = field(default_factory=dict)  # device -> bytes kept
    sync: list[tuple[int, Key]] = field(default_factory=list)  # (device, task key) before update
    cast: dict[int, float] = field(default_factory=dict)  # device -> autocast's low-precision weight copies
    grads: dict[int, float] = field(default_factory=dict)  # device -> its output share's gradient buffer
    view: bool = False  # the node's output is a view of its input (footprint.aliases)
    reductions: list[Task] = field(default_factory=list)  # input gradients' partial-sum all-reduces
    """The all-reduces that make an input's gradient whole from this node's partial sums,
    kept apart from ``backward``: the consumers of one producer add their partial sums
    first and reduce once (:func:`~flexsearch.sim.gradients.merged_reductions`)."""


def activation_split(c: Config, node: OpNode | None = None) -> int:
    """Into how many pieces a node's activations are split under ``c`` (its sample
    split, times its attribute or parameter split, or its reduce split when ``node``
    reduces over the samples: a loss, whose saved log-probabilities and input gradient
    are its samples')."""
    over = c.kind == "r" and node is not None and node.dims.over_samples
    return c.s * (c.t if c.kind in ("a", "p") or over else 1)


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


@functools.lru_cache(maxsize=512)
def tasks_of(c: Config, width: int | None = None) -> tuple[tuple[int, int, int], ...]:
    """``(i_s, i_t, device)`` for every partition of ``c`` (on a device ``< width``: the
    first replica's, :class:`Replica`). Memoised: on 256 devices a configuration has 256
    partitions, and every fragment of it lists them (a search meets tens to hundreds of
    distinct configurations; 512 kept bound the memo at tens of MB on 1,024 devices)."""
    parts = ((i, j, c.device(i, j)) for i in range(c.s) for j in range(c.t))
    return tuple(p for p in parts if width is None or p[2] < width)


def tiles(node: OpNode, c: Config) -> dict[Region, list[int]]:
    """Distinct output regions of ``node`` under ``c`` and the devices holding each
    (after the partial-sum all-reduce, a reduce split holds full regions)."""
    out: dict[Region, list[int]] = {}
    for i, j, d in tasks_of(c):
        out.setdefault(out_region(node, c, i, j), []).append(d)
    return out


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


def geometry(ctx: CostContext, node: OpNode, c: Config, k: int, p: OpNode, pc: Config) -> EdgeGeometry:
    """Memoised :func:`edge_geometry` (keyed by shapes, kinds and configurations, so
    every copy of a repeated block shares one)."""
    key = (node.kind, node.target, node.outputs[0].shape, sample_dim(node), k, c,
           p.outputs[0].shape, sample_dim(p), pc)
    hit = ctx.geometry_cache.get(key)
    if hit is None:
        hit = ctx.geometry_cache[key] = edge_geometry(node, c, k, p, pc, ctx.node_of)
    return hit  # type: ignore[return-value]


def edge_geometry(node: OpNode, c: Config, k: int, p: OpNode, pc: Config, node_of: list[int]) -> EdgeGeometry:
    """Region intersections of edge ``p -> node`` (rules in the module docstring)."""
    parts = tasks_of(c)
    ptiles = tiles(p, pc)
    local: list[int] = []
    transfers: list[tuple[int, int, int]] = []
    readers: dict[Region, list[tuple[int, int, Region]]] = {}  # tile -> (reader device, volume, its output)
    index = TileIndex(ptiles)
    for idx, (i, j, d) in enumerate(parts):
        mine = out_region(node, c, i, j)
        need = input_region(node, k, p.outputs[0].shape, mine, (c.t, j) if c.kind == "r" else (1, 0))
        incoming: dict[int, int] = {}
        for region in index.overlapping(need):
            holders = ptiles[region]
            vol = volume(intersect(need, region))
            readers.setdefault(region, []).append((d, vol, (mine, j) if c.kind == "r" else mine))
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
        rdev = sorted({d for d, _, _ in rd})
        if len(holders) == 1:
            h = holders[0]
            for d in rdev:
                if d == h:
                    grad_local.append((d, h))
                else:
                    grad_transfers.append((d, h, sum(v for dd, v, _ in rd if dd == d)))
            continue
        if len({o for _, _, o in rd}) == 1 and set(holders) <= set(rdev):
            # replicas of one computation (a replicated op): every holder's own gradient
            # is the whole one; nothing to sum (DTensor: Replicate in, Replicate out)
            grad_local += [(h, h) for h in holders]
            continue
        group = sorted(set(holders) | set(rdev))
        if len(group) == 1:
            grad_local.append((group[0], group[0]))
            continue
        op = "all_gather" if sum(v for _, v, _ in rd) <= volume(region) else "all_reduce"
        grad_colls.append((op, tuple(group), volume(region), tuple(rdev), tuple(holders)))
    return EdgeGeometry(tuple(local), tuple(transfers), tuple(grad_local), tuple(grad_transfers),
                        tuple(grad_colls))


def soap_runtime(ctx: CostContext) -> bool:
    """Is ``ctx`` the SOAP emitter's runtime (calibrated, DTensor ops, not DDP), whose
    moves between device blocks (:func:`move_cost`) and whole outputs
    (:func:`output_gather`) the simulation follows?"""
    return ctx.calibration is not None and not ctx.ddp


def move_cost(ctx: CostContext, src: Sequence[int], members: Sequence[int], nbytes: float, *, split: bool,
              broadcast: bool = True, moved: bool = True) -> tuple[float, tuple[int, ...], str]:
    """Seconds, resources and collectives of the SOAP emitter's ``_Move`` of ``nbytes``
    (calibrated): an all-gather over ``src`` when the tensor is ``split`` there, a
    broadcast over ``members`` (``broadcast``), and the calibration's ``move_s`` for the
    emitter's own work (``moved``)."""
    costs = {}
    if split and len(src) > 1:
        costs["all_gather"] = ctx.collective("all_gather", tuple(src), nbytes)
    if broadcast:
        costs["broadcast"] = ctx.collective("broadcast", tuple(members), nbytes)
    seconds = sum(cost.time_s for cost in costs.values()) + (ctx.calibration.move() if moved else 0.0)
    links = [link for cost in costs.values() for link, _ in cost.loads]
    return seconds, ctx.device_resources(members) + link_resources(ctx, links), "+".join(costs) or "move"


def _mesh_move(
    node: OpNode, c: Config, k: int, p: OpNode, pc: Config, ctx: CostContext, frag: Fragment,
    replica: Replica | None = None, gradient: bool = True,
) -> tuple[list[Task], list[Task], dict[int, list[Key]]]:
    """Edge ``p -> node`` between ops on different device blocks as the SOAP emitter runs
    it (calibrated simulations): the producer's output gathered on its block (an
    all-gather when split), then broadcast whole to the consumer's block; the gradient
    comes back the same way. Each consumer device keeps the whole tensor. Each way
    also costs the calibration's ``move_s`` (the emitter's own work per move)."""
    n = node.name
    esize = dtype_size(p.outputs[0].dtype)
    nbytes = float(esize * math.prod(p.outputs[0].shape))
    ready = "F" if pc.kind == "r" else "f"
    src, dst = sorted(set(pc.devices)), sorted(set(c.devices))
    split = pc.kind in ("a", "p") or pc.s > 1
    members = sorted(set(src) | set(dst))
    seconds, res, how = move_cost(ctx, src, members, nbytes, split=split)  # the same each way

    def move(deps: tuple[Key, ...], defines: tuple[Key, ...], what: str) -> Task:
        return Task("coll", n, seconds, res, deps, defines, nbytes, f"{what} d{src}->d{dst} {how}")

    key = ("x", n, k, "move")
    forward = kept(replica, move(tuple((ready, p.name, h) for h in src), (key,), f"{p.name}->{n}"), members)
    mine = [d for d in dst if replica is None or d < replica.width]
    needs = {d: [key] for d in mine}
    for d in mine:
        frag.activations[d] = frag.activations.get(d, 0.0) + nbytes
    backward = kept(replica, move(tuple(("b", n, d) for d in dst), tuple(("G", p.name, h) for h in src),
                                   f"grad {n}->{p.name}"), members) if gradient else []
    return forward, backward, needs


def edge_tasks(
    node: OpNode, c: Config, k: int, p: OpNode, pc: Config, ctx: CostContext, frag: Fragment,
    replica: Replica | None = None, gradient: bool = True,
) -> tuple[list[Task], list[Task], dict[int, list[Key]]]:
    """The tasks of edge ``p -> node`` (input ``k``): forward transfers, backward
    gradient tasks (none when ``p``'s output carries no ``gradient``), and per device of
    ``node`` the keys its forward waits for. Local gradient contributions, partial-sum
    reductions and received bytes are recorded on ``frag``. ``replica``: the first
    replica's tasks only (module docstring)."""
    forward: list[Task] = []
    backward: list[Task] = []
    needs: dict[int, list[Key]] = {}
    if is_source(p):
        if on_parameters(p):  # its gradient, summed where it is read
            frag.grad_local += [(d, ("G", p.name, d)) for _, _, d in tasks_of(c, first_width(replica))]
        return forward, backward, needs
    if soap_runtime(ctx) and (pc.first, pc.s, pc.t) != (c.first, c.s, c.t):
        return _mesh_move(node, c, k, p, pc, ctx, frag, replica, gradient)
    geo = geometry(ctx, node, c, k, p, pc)
    n = node.name
    esize = dtype_size(p.outputs[0].dtype)
    ready = "F" if pc.kind == "r" else "f"  # output ready: after the partial-sum all-reduce
    width = replica.width if replica is not None else ctx.cluster.devices
    for d in geo.local:
        if d < width:
            needs.setdefault(d, []).append((ready, p.name, d))
    for h, d, vol in geo.transfers:
        if elsewhere(replica, (h, d)):
            continue
        key = ("x", n, k, h, d)
        nbytes = vol * esize
        sent = kept(replica, transfer_task(ctx, h, d, nbytes, n, ((ready, p.name, h),), (key,), f"{p.name}->{n}"),
                    (h, d))
        if sent:
            forward += sent
            needs.setdefault(d, []).append(key)
            frag.activations[d] = frag.activations.get(d, 0.0) + nbytes
    if not gradient:  # p's output carries none (gradients.without_gradient)
        return forward, backward, needs
    for d, h in geo.grad_local:
        if d < width:
            frag.grad_local.append((d, ("G", p.name, h)))
    for d, h, vol in geo.grad_transfers:
        if elsewhere(replica, (d, h)):
            continue
        backward += kept(replica, transfer_task(ctx, d, h, vol * esize, n, (("b", n, d),),
                                                 (("G", p.name, h),), f"grad {n}->{p.name}"), (d, h))
    for op, group, vol, rdev, holders in geo.grad_collectives:
        if elsewhere(replica, group):
            continue
        tasks = kept(replica, collective_task(
            ctx, op, list(group), vol * esize, n, tuple(("b", n, d) for d in rdev),
            tuple(("G", p.name, h) for h in holders), f"grad {n}->{p.name}"), group)
        if op == "all_reduce":  # partial sums (the consumer read the input whole): merged across consumers
            frag.reductions += tasks
        else:
            backward += tasks
    return forward, backward, needs


def output_gather(producers: list[tuple[OpNode, Config]], ctx: CostContext, frag: Fragment,
                  replica: Replica | None = None) -> Fragment:
    """The model's outputs brought whole to every device, as the SOAP emitter returns
    them (calibrated simulations; :mod:`flexsearch.emit.sharded`: every rank gets the
    whole output and computes the loss over all of it): per output not already whole on
    every device, an all-gather over its producer's block when split, then a broadcast
    to the devices outside the block. The loss's gradient of the output is ready when
    the gather ends (the loss runs on the gathered tensor), and every device keeps the
    whole output (the loss saves it; :func:`flexsearch.sim.op_memory.loss_terms` counts the loss's
    own hold over the whole output too). From a block other than the whole runtime's
    mesh the emitter moves it (``_Move``): the calibration's ``move_s`` more.

    The measurement behind it: ``torch.profiler`` on the GPT SOAP row of
    ``benchmarks/fidelity.py`` (2 ranks): the output's ``_Move`` took 10.7 ms per
    step on both ranks, which the simulated timeline did not have. The loss's own
    compute (``mse_loss`` over the whole 16 x 64 x 2048 logits: 3.4-3.7 ms forward on
    each rank) is not costed: no simulator costs the loss, the caller's function.
    A tensor-parallel pipeline stage (also a ``ShardedModule``) gathers its output
    the same way; in stage costs this counts for the stage that returns the model's
    output."""
    world = list(range(ctx.cluster.devices))
    for p, pc in producers:
        if is_source(p) or not p.outputs:
            continue
        src = sorted(set(pc.devices))
        split = pc.kind in ("a", "p") or pc.s > 1
        outside = [d for d in world if d not in src]
        moved = (pc.first, pc.s, pc.t) != (0, len(world), 1)  # not on the whole runtime's mesh: a _Move
        if not (split or outside or moved):
            continue  # whole on every device already
        nbytes = float(p.outputs[0].nbytes)
        seconds, res, how = move_cost(ctx, src, world, nbytes, split=split, broadcast=bool(outside), moved=moved)
        ready = "F" if pc.kind == "r" else "f"
        task = Task("coll", p.name, seconds, res, tuple((ready, p.name, h) for h in src),
                    tuple(("G", p.name, h) for h in src), nbytes, f"output {p.name} d{src}->every device {how}")
        frag.forward += kept(replica, task, world)
        if split or outside:  # a new whole tensor on every device (a replicated one is the same tensor)
            for d in world:
                if replica is None or d < replica.width:
                    frag.activations[d] = frag.activations.get(d, 0.0) + nbytes
    return frag


def on_parameters(node: OpNode) -> bool:
    """Is ``node`` an op on parameters alone (a source owning parameters, module docstring)?"""
    return bool(node.param_bytes) and node.kind not in SOURCE_KINDS and is_source(node)


def build_fragment(
    node: OpNode,
    c: Config,
    producers: list[tuple[OpNode, Config]],
    ctx: CostContext,
    replica: Replica | None = None,
    no_grad: frozenset[str] = frozenset(),
) -> Fragment:
    """The fragment of ``node`` under ``c``, given its inputs' nodes and configurations
    (in ``node.inputs`` order); of the first replica only with ``replica`` (module
    docstring); ``no_grad``: the graph's
    :func:`~flexsearch.sim.gradients.without_gradient`."""
    frag = Fragment(view=aliases(node))
    if node.kind == "output" and soap_runtime(ctx):
        return output_gather(producers, ctx, frag, replica)
    if is_source(node):
        if on_parameters(node):
            n = ctx.cluster.devices
            node_tasks(node, Config(1, "x", n) if n > 1 else Config(), ctx, frag, replica=replica,
                       backward=node.name not in no_grad)
        return frag
    needs: dict[int, list[Key]] = {d: [] for _, _, d in tasks_of(c, first_width(replica))}
    grad_edges: list[Task] = []
    for k, (p, pc) in enumerate(producers):
        fwd, bwd, wait = edge_tasks(node, c, k, p, pc, ctx, frag, replica, gradient=p.name not in no_grad)
        frag.forward += fwd
        grad_edges += bwd
        for d, keys in wait.items():
            needs[d] += keys
    first = bool(node.param_bytes) and all(is_source(p) or p.name in no_grad for p, _ in producers)
    node_tasks(node, c, ctx, frag, needs, grad_edges, first, replica, backward=node.name not in no_grad)
    return frag


def node_tasks(
    node: OpNode,
    c: Config,
    ctx: CostContext,
    frag: Fragment,
    needs: dict[int, list[Key]] | None = None,
    grad_edges: list[Task] = (),
    first: bool = False,
    replica: Replica | None = None,
    backward: bool = True,
) -> Fragment:
    """Add the node's own tasks to ``frag``: compute, partial-sum all-reduce, gradient
    synchronisation, and its memory terms (``first``: a first layer, no input gradient;
    ``replica``: of the first replica only, module docstring; ``backward=False``: an op
    without gradient, :func:`~flexsearch.sim.gradients.without_gradient`, whose
    backward task takes no time)."""
    n = node.name
    parts = tasks_of(c, first_width(replica))
    copies = replica.copies if replica is not None else 1
    needs = needs or {}
    fwd_time, bwd_time = ctx.op_cost(node, c, first)
    if not backward:
        bwd_time = 0.0
    out_bytes = kept_bytes(node) / activation_split(c, node)
    keeps = out_bytes > 0
    grad = grad_bytes(node) / activation_split(c, node)
    for _, _, d in parts:
        frag.forward.append(Task("fwd", n, fwd_time, (d,), tuple(needs.get(d, ())), (("f", n, d),),
                                 detail=c.text, copies=copies))
        if keeps:
            frag.activations[d] = frag.activations.get(d, 0.0) + out_bytes
        if grad:
            frag.grads[d] = max(frag.grads.get(d, 0.0), grad)

    # Partial sums: all-reduce over each group of t partitions.
    if c.kind == "r":
        for i in range(c.s):
            if replica is not None and c.device(i, 0) >= replica.width:  # the group's least device: elsewhere
                continue
            group = [c.device(i, j) for j in range(c.t)]
            frag.forward += kept(replica, collective_task(
                ctx, "all_reduce", group, node.output_bytes / c.s, n,
                tuple(("f", n, d) for d in group), tuple(("F", n, d) for d in group),
                "partial sums"), group)

    # Backward compute, input gradients, then gradient synchronisation of owned parameters.
    local: dict[int, list[Key]] = {}
    for d, key in frag.grad_local:  # inputs read on the same device: the backward delivers
        local.setdefault(d, []).append(key)
    frag.backward = [
        Task("bwd", n, bwd_time, (d,), (("f", n, d), ("G", n, d)), (("b", n, d), *local.get(d, ())),
             detail=c.text, copies=copies)
        for _, _, d in parts
    ]
    frag.backward += grad_edges  # input gradients first: they are on the critical path
    copy = cast_copy_bytes(node, ctx.precision)
    if copy:  # autocast casts the weights once per forward; autograd keeps the copy for the backward
        share = copy / (c.t if c.kind in ("p", "r") else 1)
        for _, _, d in parts:
            frag.cast[d] = frag.cast.get(d, 0.0) + share
    if node.param_bytes:
        sharded = c.kind in ("p", "r")
        shard = node.param_bytes / (c.t if sharded else 1)
        trained = node.trained_param_bytes / (c.t if sharded else 1)
        count = max(1, len(node.params))
        for _, _, d in parts:
            frag.params[d] = frag.params.get(d, 0.0) + shard
            frag.trained[d] = frag.trained.get(d, 0.0) + trained
            frag.tensors[d] = frag.tensors.get(d, 0) + count
            frag.largest[d] = max(frag.largest.get(d, 0.0), largest_tensor(shard, count))
        if not trained:  # frozen: no gradient to synchronise
            return frag
        groups = (
            [[c.device(i, j) for i in range(c.s)] for j in range(c.t)] if sharded else [list(c.devices)]
        )
        width = replica.width if replica is not None else ctx.cluster.devices
        for g_i, group in enumerate(groups):
            if len(group) == 1 or ctx.ddp:  # DDP: bucketed all-reduces (the simulator's)
                frag.sync.extend((d, ("b", n, d)) for d in group if d < width)
                continue
            key = ("s", n, g_i)
            # the DTensor emitter all-reduces each parameter's gradient on its own
            calls = count if ctx.calibration is not None else 1
            frag.backward += kept(replica, collective_task(
                ctx, "all_reduce", group, trained, n, tuple(("b", n, d) for d in group), (key,),
                "gradients", calls), group)
            frag.sync.extend((d, key) for d in group if d < width)
    return frag
