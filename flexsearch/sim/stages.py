"""Stage-level costs: a graph's nodes summed into pipeline stages and replicas.

**Node costs** come from the op-level cost model: the microbatch graph
(:mod:`flexsearch.graph.microbatch`) under a stage's own configuration on its
tensor-parallel group (whole ops on one device, or Megatron's layout:
:func:`flexsearch.strategy.recipes.stage_configs`), one
:class:`~flexsearch.sim.taskgraph.Fragment` per node; a node's forward (backward) time
is the longest chain of its fragment's forward (backward) tasks, weight-gradient
all-reduces excluded (a pipeline synchronises once per stage). Identical layers are
costed once.

**Cut points.** The graph's nodes in topological (program) order; a cut at position
``x`` sends every tensor produced before ``x`` and read at or after it (so branchy
graphs cut between blocks naturally, and a cut inside a residual block pays for both
tensors). A weight used on both sides (a tied embedding) is held by both stages and its
gradients are all-reduced between them (:func:`tied_weights`).

**Stages** (:func:`stage_cost`) sum their nodes; with activation checkpointing
(:mod:`flexsearch.strategy.recompute`) the dropped ops keep
nothing per microbatch and rerun their forward in the backward, each unit keeps its
input (:func:`kept_bytes`), and one unit's activations are rebuilt at a time. A stage
also keeps, per microbatch, its copies of received tensors that its ops save and the
tensors it sends that no op saves (:class:`BoundaryCopies`).
:func:`simulate_stages` lays a uniform pipeline out on the cluster and simulates it
(:func:`flexsearch.sim.pipeline.simulate_pipeline`); :func:`replica_cost` is one
data-parallel replica's step as one stage (decentralized plans and their baselines).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from flexsearch.cost.hardware import Cluster
from flexsearch.graph.microbatch import microbatch_graph
from flexsearch.graph.opgraph import OpGraph, OpNode, in_place_op
from flexsearch.sim.context import CostContext
from flexsearch.sim.footprint import (
    aliases,
    backward_working,
    grad_bytes,
    loss_copy_bytes,
    loss_held_bytes,
    loss_operands,
    rebuilt_peaks,
)
from flexsearch.sim.gradients import merged_reductions
from flexsearch.sim.pipeline import simulate_pipeline
from flexsearch.sim.pipeline_layout import PipelineLayout, StageCost
from flexsearch.sim.pipeline_memory import peak_memory
from flexsearch.sim.result import Simulation
from flexsearch.sim.simulator import Simulator
from flexsearch.sim.taskgraph import activation_split
from flexsearch.strategy.config import Config
from flexsearch.strategy.recipes import stage_configs
from flexsearch.strategy.recompute import Checkpointing


@dataclass(frozen=True)
class NodeCost:
    """Per microbatch on one device of a stage replica: times (s) and bytes."""

    forward_s: float
    backward_s: float
    param_bytes: float
    stash_bytes: float
    tensors: int = 0
    """Parameter tensors (whole or a shard each) the node places on the device."""
    largest_param_bytes: float = 0.0
    """The largest of them."""
    cast_bytes: float = 0.0
    """Autocast's low-precision copy of the weights it reads (once per step, however many
    microbatches: the cast cache lives for the whole autocast region)."""
    output_bytes: float = 0.0
    """Its output share (what checkpointing keeps of a dropped node read outside its
    unit)."""
    loss_bytes: float = 0.0
    """What a loss over its output share holds, for a node whose output the model
    returns (:func:`~flexsearch.sim.footprint.loss_held_bytes`)."""
    grad_bytes: float = 0.0
    """The gradient buffer of its output share in the backward
    (:func:`~flexsearch.sim.footprint.grad_bytes`)."""
    loss_copy_bytes: float = 0.0
    """The part of ``loss_bytes`` the loss saves per microbatch
    (:func:`~flexsearch.sim.footprint.loss_copy_bytes`)."""
    view: bool = False
    """Its output is a view of its input (:func:`~flexsearch.sim.footprint.aliases`)."""
    trained_bytes: float | None = None
    """Of ``param_bytes``, those that train (None: all of them; frozen ones have no
    gradient, optimizer state or synchronisation)."""
    comm_s: float = 0.0
    """Of ``forward_s``, what is not its compute: a tensor-parallel op's transfers and
    collectives, which a cached op (selective checkpointing) runs again with its unit."""

    def rerun_s(self, i: int, cp: Checkpointing) -> float:
        """What node ``i`` runs again in the backward under ``cp``: all its forward when
        dropped, its transfers and collectives when cached."""
        return self.forward_s if cp.dropped[i] else self.comm_s if cp.cached[i] else 0.0

    @property
    def trains(self) -> float:
        return self.param_bytes if self.trained_bytes is None else self.trained_bytes


def _span(tasks) -> float:
    """Longest chain of one node's tasks (its dependencies on other nodes count as met)."""
    end: dict = {}
    for t in tasks:
        stop = max([end.get(k, 0.0) for k in t.deps], default=0.0) + t.duration
        for k in t.defines:
            end[k] = max(end.get(k, 0.0), stop)
    return max(end.values(), default=0.0)


def node_costs(graph: OpGraph, configs: Mapping[str, Config], ctx: CostContext) -> dict[str, NodeCost]:
    """Each node's :class:`NodeCost` under ``configs`` on ``ctx``'s cluster (device 0's
    share). Identical layers (same signature, configuration, producers and the earlier
    readers of those) are costed once. A node's backward includes the all-reduces of
    its inputs' partial-sum gradients unless an earlier reader of the same input runs
    the same one (:func:`~flexsearch.sim.gradients.merged_reductions`: one for all the
    readers that hold identical partial sums)."""
    sim = Simulator(graph, ctx)
    memo: dict[tuple, NodeCost] = {}
    out: dict[str, NodeCost] = {}
    returned = set(loss_operands(graph))
    index = {n.name: i for i, n in enumerate(graph.nodes)}
    readers: dict[str, list[str]] = {}
    for node in graph.nodes:
        for i in dict.fromkeys(node.inputs):
            readers.setdefault(i, []).append(node.name)
    for node in graph.nodes:
        before = tuple(tuple((graph.node(r).signature or r, configs[r]) for r in readers[i]
                             if index[r] < index[node.name]) for i in node.inputs)
        key = (node.signature or node.name, node.kind, node.outputs, configs[node.name], node.name in returned,
               tuple((graph.node(i).signature or i, graph.node(i).outputs, configs[i]) for i in node.inputs), before)
        hit = memo.get(key)
        if hit is None:
            frag = sim.fragment(node.name, configs)
            fw = frag.forward
            earlier = [sim.fragment(r, configs) for i in node.inputs for r in readers[i] if index[r] < index[node.name]]
            mine = merged_reductions([*earlier, frag])[-1]  # those an earlier reader does not run for it
            bw = [t for t in frag.backward if not any(k[0] == "s" for k in t.defines)] + mine
            split = activation_split(configs[node.name], node)
            share, grad = node.output_bytes / split, grad_bytes(node) / split
            span = _span(fw)
            compute = sum(t.duration for t in fw if t.kind == "fwd" and t.resources[0] == 0)
            hit = memo[key] = NodeCost(span, _span(bw), frag.params.get(0, 0.0), frag.activations.get(0, 0.0),
                                       frag.tensors.get(0, 0), frag.largest.get(0, 0.0), frag.cast.get(0, 0.0),
                                       share, loss_held_bytes(node, share) if node.name in returned else 0.0, grad,
                                       loss_copy_bytes(node, share) if node.name in returned else 0.0,
                                       aliases(node), frag.trained.get(0, 0.0), max(0.0, span - compute))
        out[node.name] = hit
    return out


def crossing_bytes(sizes: Sequence[float], edges: Iterable[tuple[int, int]]) -> tuple[float, ...]:
    """Bytes crossing each position of an order of ``L`` layers (``L + 1`` entries; the
    ends are 0): layer ``i``'s ``sizes[i]`` bytes cross every position after ``i`` up to
    its last consumer (``edges`` are (producer, consumer) positions)."""
    last = list(range(len(sizes)))
    for a, b in edges:
        last[a] = max(last[a], b)
    diff = [0.0] * (len(sizes) + 2)
    for i, u in enumerate(last):
        if u > i:
            diff[i + 1] += sizes[i]
            diff[u + 1] -= sizes[i]
    out = list(itertools.accumulate(diff[: len(sizes) + 1]))
    out[0] = out[-1] = 0.0
    return tuple(out)


def cut_bytes(graph: OpGraph) -> tuple[float, ...]:
    """Bytes crossing each position of the node order (``L + 1`` entries); infinite
    where no stage boundary may be (:func:`written_through_views`)."""
    index = {n.name: i for i, n in enumerate(graph.nodes)}
    edges = ((index[i], k) for k, n in enumerate(graph.nodes) for i in n.inputs)
    out = list(crossing_bytes([n.output_bytes for n in graph.nodes], edges))
    for lo, hi in written_through_views(graph):
        out[lo + 1:hi + 1] = [math.inf] * (hi - lo)
    return tuple(out)


def _aliases(n: OpNode) -> bool:
    """Is ``n`` a view of its first input (a view op that writes nothing, not a factory
    such as ``new_empty``)?"""
    return n.kind == "view" and n.bytes_written == 0 and bool(n.inputs)


def written_through_views(graph: OpGraph) -> list[tuple[int, int]]:
    """``(base, writer)`` positions of each in-place write into a view of another
    tensor (DeepSeek's attention: ``k = x.new_empty(...); k[..., :d].copy_(q)``): a
    stage boundary between them would send the base and the view as two tensors, and
    the write would reach the view's copy only."""
    index = {n.name: i for i, n in enumerate(graph.nodes)}
    out = []
    for w, n in enumerate(graph.nodes):
        parts = n.target.split(".")
        op = ".".join(parts[1:]) if parts[0] == "aten" else parts[-1]  # aten.add_.Tensor; Tensor.copy_
        if not in_place_op(op) or not n.inputs:
            continue
        base = graph.node(n.inputs[0])
        if not _aliases(base):
            continue
        while _aliases(base):  # back through the views to the tensor they view
            base = graph.node(base.inputs[0])
        out.append((index[base.name], w))
    return out


@dataclass(frozen=True)
class BoundaryCopies:
    """What a stage of the emitted pipeline keeps per microbatch at its edges, beyond
    what its own nodes' saved bytes count (``OpNode.saved_bytes`` is counted on the node
    that made the tensor, wherever the op that saves it runs). torch's ``PipelineStage``
    keeps a microbatch's stage outputs until that microbatch's backward, and the emitter
    runs a stage on a copy of each tensor it receives that needs a gradient
    (:func:`flexsearch.emit.dense.dense_input`), kept while an op of the stage saves it (or
    a view of it) or the stage sends it on. So stage ``[a, b)`` keeps, beyond its nodes'
    saved bytes:

    - each tensor crossing ``a`` (made before ``a``, read at or after it) that one of its
      ops saves (``OpNode.saves``) or that also crosses ``b`` (:meth:`received`);
    - each tensor it makes that crosses ``b`` and that its saved bytes do not count
      (:meth:`sent`: no op saves it; under checkpointing, the stage's own rule).

    Measured on torch's allocator (``tests/test_memory_tracker.py``): an interleaved
    pipeline's loss rank held the copy of the MLP activation its stage received, which
    its projection saves (0.13 of 3.06 MB; the model was 10.7% under). Tensors that need
    no gradient (the model's inputs, what is made from them and from buffers alone, and
    what is not floating point) are sent as they are: no copy, their receive buffers not
    counted. Empty for a graph whose nodes do not say what they save (``saves`` None:
    traced elsewhere) and for one stage.

    ``crossing[x]``: per tensor crossing position ``x`` that needs a gradient, its
    maker's position, bytes, the positions of the ops saving it (its maker's among them
    when it saves its own output), and the last position reading it."""

    crossing: tuple[tuple[tuple[int, float, tuple[int, ...], int], ...], ...] = ()

    @classmethod
    def of(cls, graph: OpGraph) -> BoundaryCopies:
        nodes = graph.nodes
        if any(n.saves is None for n in nodes if n.kind not in ("input", "output")):
            return cls()
        index = {n.name: i for i, n in enumerate(nodes)}
        grad = [False] * len(nodes)  # does the node's output need a gradient
        savers: dict[int, list[int]] = {}
        last: dict[int, int] = {}
        for c, n in enumerate(nodes):
            reads = [index[i] for i in dict.fromkeys(n.inputs) if i in index]
            grad[c] = n.kind not in ("input", "output") and any("float" in t.dtype for t in n.outputs) and (
                bool(n.params or n.used_param_bytes) or any(grad[p] for p in reads))
            for p in reads:
                last[p] = max(last.get(p, c), c)
            for o in n.saves or ():
                if o in index:
                    savers.setdefault(index[o], []).append(c)
            if n.kind == "output":  # returned: held for the loss
                for p in reads:
                    savers.setdefault(p, []).append(c)
        crossing: list[list] = [[] for _ in range(len(nodes) + 1)]
        for p, end in last.items():
            if not grad[p]:
                continue
            entry = (p, float(nodes[p].output_bytes), tuple(sorted(set(savers.get(p, ())))), end)
            for x in range(p + 1, end + 1):
                crossing[x].append(entry)
        return cls(tuple(map(tuple, crossing)))

    def received(self, a: int, b: int) -> float:
        """Bytes of stage ``[a, b)``'s copies of what it receives that it keeps per
        microbatch (class docstring)."""
        if not self.crossing or a == 0:
            return 0.0
        return sum(size for _p, size, savers, end in self.crossing[a]
                   if end >= b or any(a <= c < b for c in savers))

    def sent(self, a: int, b: int) -> list[tuple[int, float, bool]]:
        """The tensors stage ``[a, b)`` makes and sends: (maker's position, bytes, whether
        an op saves it)."""
        if not self.crossing or b >= len(self.crossing) - 1:
            return []
        return [(p, size, bool(savers)) for p, size, savers, _end in self.crossing[b] if p >= a]


def shared_params(graph: OpGraph) -> dict[str, tuple[int, ...]]:
    """Parameter name -> positions of the nodes that use it, for weights used twice."""
    uses: dict[str, list[int]] = {}
    for i, n in enumerate(graph.nodes):
        for p in n.params:
            uses.setdefault(p, []).append(i)
    return {p: tuple(v) for p, v in uses.items() if len(v) > 1}


def fsdp_stage_costs(costs: Sequence[NodeCost]) -> Sequence[NodeCost]:
    """The node costs in an FSDP2 stage, which gathers its weights in the low precision:
    autocast makes no copies of them (``cast_bytes`` 0); ``costs`` themselves when they
    have none (already an FSDP2 stage's: the search passes them so)."""
    if not any(c.cast_bytes for c in costs):
        return costs
    return [replace(c, cast_bytes=0.0) for c in costs]


def kept_bytes(c: NodeCost, i: int, cp: Checkpointing) -> float:
    """Bytes node ``i`` keeps per microbatch under checkpointing ``cp``: what autograd
    saves and autocast's weight copies when it is not dropped; its outputs when it is
    cached (:meth:`~flexsearch.strategy.recompute.Checkpointing.cached_bytes`); its
    output when it is dropped but read outside its unit; else nothing."""
    if cp.cached[i]:
        return cp.cached_bytes(i, c.stash_bytes, c.cast_bytes, c.output_bytes)[0]
    if not cp.dropped[i]:
        return c.stash_bytes + c.cast_bytes
    return c.output_bytes if cp.boundary[i] else 0.0


def rebuilt_bytes(c: NodeCost, i: int, cp: Checkpointing) -> float:
    """Bytes a dropped node ``i`` rebuilds in the backward (0 if not dropped; a cached
    one's, :meth:`~flexsearch.strategy.recompute.Checkpointing.cached_bytes`, may be
    negative: it frees)."""
    if cp.cached[i]:
        return cp.cached_bytes(i, c.stash_bytes, c.cast_bytes, c.output_bytes)[1]
    if not cp.dropped[i]:
        return 0.0
    return c.cast_bytes + (max(0.0, c.stash_bytes - c.output_bytes) if cp.boundary[i] else c.stash_bytes)


def stage_cost(costs: Sequence[NodeCost], a: int, b: int, cuts: Sequence[float],
               extra_params: tuple[float, float] = (0.0, 0.0), recompute: Checkpointing | None = None,
               edges: BoundaryCopies | None = None) -> StageCost:
    """A stage's cost (nodes ``[a, b)``), keeping ``edges``' copies at its edges
    (:class:`BoundaryCopies`; default none: a profile's chain). With checkpointing
    (:class:`~flexsearch.strategy.recompute.Checkpointing`), a dropped node reruns its
    forward in the backward and keeps nothing per microbatch unless its output leaves
    its unit (a unit's output is the next one's input, kept); a cached one (selective)
    keeps its outputs and reruns its transfers and collectives; a stage whose first node
    is in a unit keeps the input it received; one unit's dropped activations are rebuilt
    at a time (``working_bytes``, the largest unit's,
    :func:`~flexsearch.sim.footprint.rebuilt_peaks`). ``extra_params``: the bytes of tied
    weights another stage owns, and of those the bytes that train (:func:`tied_weights`).
    The model's outputs (of the nodes with a ``loss_bytes``) stay through their
    microbatch's backward (``held`` of :func:`~flexsearch.sim.footprint.backward_working`):
    a step's caller holds them, and so does torch's pipeline schedule, whose
    ``backward_one_chunk`` holds the stage's output while it runs the backward."""
    cp = recompute or Checkpointing.none(len(costs))
    seg = range(a, b)
    fwd = sum(costs[i].forward_s for i in seg)
    again = sum(costs[i].rerun_s(i, cp) for i in seg)
    per_node = [kept_bytes(costs[i], i, cp) for i in seg]
    kept = sum(per_node)
    if 0 < a < b and (cp.dropped[a] or cp.cached[a]):  # the received input, kept by its unit
        inputs = cuts[a]
    else:
        inputs = edges.received(a, b) if edges is not None else 0.0
    for p, size, saved in edges.sent(a, b) if edges is not None else ():
        # a sent tensor the stage's kept bytes leave out: PipelineStage holds it anyway
        if not (cp.boundary[p] if cp.dropped[p] else saved or cp.cached[p]):  # a cached output is kept
            inputs += size
    again_bytes = [rebuilt_bytes(costs[i], i, cp) for i in seg]
    rebuilt = rebuilt_peaks(again_bytes, [cp.unit_of[i] if cp.dropped[i] or cp.cached[i] else -1 for i in seg])
    return StageCost(
        forward_s=fwd,
        backward_s=sum(costs[i].backward_s for i in seg) + again,
        param_bytes=sum(costs[i].param_bytes for i in seg) + extra_params[0],
        trained_bytes=sum(costs[i].trains for i in seg) + extra_params[1],
        stash_bytes=kept + inputs,
        send_bytes=cuts[b] if b < len(costs) else 0.0,
        working_bytes=max(rebuilt.values(), default=0.0),
        tensors=sum(costs[i].tensors for i in seg),
        largest_param_bytes=max((costs[i].largest_param_bytes for i in seg), default=0.0),
        loss_bytes=sum(costs[i].loss_bytes for i in seg),
        loss_copy_bytes=sum(costs[i].loss_copy_bytes for i in seg),
        grad_working_bytes=backward_working(per_node, [costs[i].grad_bytes for i in seg], cuts[a] if a else 0.0,
                                            [costs[i].view for i in seg], again_bytes,
                                            [cp.unit_of[i] for i in seg],
                                            [min(k, costs[i].output_bytes) if costs[i].loss_bytes else 0.0
                                             for i, k in zip(seg, per_node, strict=True)]),
    )


def tied_weights(graph: OpGraph, costs: Sequence[NodeCost], bounds: Sequence[tuple[int, int]],
                 ranks: int | None = None):
    """Extra parameter bytes per stage for weights owned by another pipeline rank's stage
    (and of those, the bytes that train), and the (stage a, stage b, bytes) all-reduces of
    their gradients (none for a frozen weight). Stage ``k`` runs on rank ``k mod ranks``
    (default: a rank per stage); a rank holds a weight its stages share once (the first
    of them that uses it), and its gradient is one tensor there."""
    p = ranks or len(bounds)
    extra = [(0.0, 0.0)] * len(bounds)
    tied = []
    stage_of = {}
    for k, (a, b) in enumerate(bounds):
        for i in range(a, b):
            stage_of[i] = k
    frozen = frozenset(graph.frozen_params)
    for name, users in shared_params(graph).items():
        owner = next((i for i in users if graph.nodes[i].param_bytes), users[0])
        nbytes = costs[owner].param_bytes / max(1, len(graph.nodes[owner].params))
        trains = 0.0 if name in frozen else nbytes
        held = {stage_of[owner] % p}
        for k in sorted({stage_of[i] for i in users}):
            if k % p not in held:
                held.add(k % p)
                extra[k] = (extra[k][0] + nbytes, extra[k][1] + trains)
                if trains:
                    tied.append((min(k, stage_of[owner]), max(k, stage_of[owner]), trains))
    return extra, tuple(tied)


def shared_within_rank(graph: OpGraph, bounds: Sequence[tuple[int, int]], ranks: int) -> tuple[str, ...]:
    """The trained weights two stages of one pipeline rank use (stage ``k`` on rank ``k mod
    ranks``): one tensor in two modules, which FSDP2 stages cannot each shard."""
    stage_of = {i: k for k, (a, b) in enumerate(bounds) for i in range(a, b)}
    frozen = frozenset(graph.frozen_params)
    out = []
    for name, users in shared_params(graph).items():
        stages = {stage_of[i] for i in users}
        if name not in frozen and len({k % ranks for k in stages}) < len(stages):
            out.append(name)
    return tuple(out)


def simulate_stages(graph: OpGraph, ctx: CostContext, *, bounds: Sequence[tuple[int, int]], tensor: int,
                    replicas: int, schedule: str, microbatches: int, chunks: int = 1,
                    recompute: str = "none", optimizer: str = "adam", timeline: bool = True,
                    costs: Sequence[NodeCost] | None = None, shard: str = "none",
                    cuts: Sequence[float] | None = None, runtime: str = "pipeline",
                    fsdp_calls: int = 1, fsdp_unit_share: float = 1.0,
                    edges: BoundaryCopies | None = None, cutoff: float = math.inf) -> Simulation:
    """Simulate a uniform pipeline on ``ctx``'s cluster: stage ``k`` = nodes
    ``bounds[k]`` (positions), on ``replicas`` x ``tensor`` devices of pipeline rank
    ``k mod (len(bounds) / chunks)``; ``shard``: ``zero1`` shards the optimizer state
    over the replicas, ``zero2`` runs FSDP2 stages over them (:mod:`flexsearch.sim.pipeline`);
    ``runtime``, ``fsdp_calls`` and ``fsdp_unit_share``: the runtime that runs the stages,
    the FSDP units of a stage and the largest one's share of its parameters
    (:class:`~flexsearch.sim.pipeline_layout.PipelineLayout`). ``costs``, ``cuts``,
    ``edges``: the node costs of the microbatch graph (default: :func:`stage_node_costs`),
    its cut bytes (:func:`cut_bytes`) and what its stages keep at their edges
    (:class:`BoundaryCopies`). Raises ValueError for a layout
    that does not fit the cluster or a model without that tensor-parallel degree, and
    :class:`~flexsearch.sim.tasks.PastCutoff` once the iteration is sure to end after
    ``cutoff`` (:func:`flexsearch.sim.pipeline.simulate_pipeline`)."""
    stage_costs, layout = stage_layout(graph, ctx, bounds=bounds, tensor=tensor, replicas=replicas,
                                       schedule=schedule, microbatches=microbatches, chunks=chunks,
                                       recompute=recompute, costs=costs, shard=shard, cuts=cuts, runtime=runtime,
                                       fsdp_calls=fsdp_calls, fsdp_unit_share=fsdp_unit_share, edges=edges)
    return simulate_pipeline(ctx, stage_costs, layout, optimizer=optimizer, timeline=timeline, cutoff=cutoff)


def stages_peak_memory(graph: OpGraph, ctx: CostContext, *, optimizer: str = "adam", **layout_kw) -> float:
    """The largest per-device peak memory :func:`simulate_stages` would predict for the
    same layout (``layout_kw``: its layout arguments), without scheduling the iteration
    (:func:`flexsearch.sim.pipeline_memory.peak_memory`)."""
    stage_costs, layout = stage_layout(graph, ctx, **layout_kw)
    return peak_memory(ctx, stage_costs, layout, optimizer)


def stage_layout(graph: OpGraph, ctx: CostContext, *, bounds: Sequence[tuple[int, int]], tensor: int,
                 replicas: int, schedule: str, microbatches: int, chunks: int = 1, recompute: str = "none",
                 costs: Sequence[NodeCost] | None = None, shard: str = "none",
                 cuts: Sequence[float] | None = None, runtime: str = "pipeline",
                 fsdp_calls: int = 1, fsdp_unit_share: float = 1.0,
                 edges: BoundaryCopies | None = None) -> tuple[list[StageCost], PipelineLayout]:
    """The stage costs and the device layout of :func:`simulate_stages`'s pipeline
    (``costs``, ``cuts`` and ``edges``: the microbatch graph's node costs, cut bytes and
    :class:`BoundaryCopies`, when the caller has them)."""
    cluster = ctx.cluster
    p = len(bounds) // chunks
    g = replicas * tensor
    if p * chunks != len(bounds) or p * g != cluster.devices:
        raise ValueError(f"{len(bounds)} stages x {g} devices do not make {cluster.devices} devices")
    if costs is None or cuts is None or edges is None:
        mg = microbatch_graph(graph, replicas * microbatches)
        costs = stage_node_costs(mg, ctx, tensor) if costs is None else costs
        if costs is None:
            raise ValueError(f"no tensor-parallel configuration of degree {tensor} for this model")
        cuts = cut_bytes(mg)
        if edges is None:
            edges = BoundaryCopies.of(mg) if len(bounds) > 1 else BoundaryCopies()
    if shard == "zero2":
        costs = fsdp_stage_costs(costs)
    if shard == "zero2" and (shared := shared_within_rank(graph, bounds, p)):
        raise ValueError(f"FSDP2 stages of one rank cannot share a weight ({shared[0]}): "
                         "shard zero1 or none, or give each stage a rank of its own")
    extra, tied = tied_weights(graph, costs, bounds, p)
    cp = Checkpointing.of(graph, recompute)
    stage_costs = [stage_cost(costs, a, b, cuts, extra[k], cp, edges) for k, (a, b) in enumerate(bounds)]
    ranks = tuple(tuple(tuple(range(r * g + i * tensor, r * g + (i + 1) * tensor)) for i in range(replicas))
                  for r in range(p))
    return stage_costs, PipelineLayout(schedule, microbatches, ranks, chunks=chunks, tied=tied, shard=shard,
                                       gather=ctx.precision.gather_factor(graph.param_dtype), runtime=runtime,
                                       fsdp_calls=fsdp_calls, fsdp_unit_share=fsdp_unit_share)


def stage_node_costs(mg: OpGraph, ctx: CostContext, tensor: int) -> list[NodeCost] | None:
    """The node costs of microbatch graph ``mg`` under a stage's layout on ``tensor``
    devices of ``ctx``'s kind (None: no tensor-parallel layout of that degree)."""
    configs = stage_configs(mg, tensor)
    if configs is None:
        return None
    got = node_costs(mg, configs, ctx.on(Cluster.from_spec(ctx.cluster.spec, tensor)))
    return [got[n.name] for n in mg.nodes]


def replica_cost(graph: OpGraph, ctx: CostContext, *, replicas: int | None = None) -> StageCost:
    """One data-parallel replica's step on ``B / replicas`` samples (default
    ``replicas`` = the cluster's devices; ``replicas=1`` for a graph whose batch already
    is one worker's), as one stage: forward, backward, parameter and activation bytes,
    every op whole on one device. Raises ValueError when the batch does not split
    ``replicas`` ways."""
    r = ctx.cluster.devices if replicas is None else replicas
    mg = microbatch_graph(graph, r)
    costs = stage_node_costs(mg, ctx, 1)
    assert costs is not None  # whole ops on one device are always legal
    return stage_cost(costs, 0, len(costs), cut_bytes(mg))
