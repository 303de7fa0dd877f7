"""Pipeline and hybrid plans: from an operator graph to stages, a schedule and a time.

**Cut points.** The graph's nodes in topological (program) order; a cut at position
``x`` sends every tensor produced before ``x`` and read at or after it (so branchy
graphs cut between blocks naturally, and a cut inside a residual block pays for both
tensors). A weight used on both sides (a tied embedding) is held by both stages and its
gradients are all-reduced between them.

**Stage costs** come from the SOAP cost model: the microbatch graph
(:mod:`flexsearch.graph.microbatch`) under the stage's own configuration on its
tensor-parallel group, one :class:`~flexsearch.sim.taskgraph.Fragment` per node; a
node's forward (backward) time is the makespan of its fragment's forward (backward)
tasks, weight-gradient all-reduces excluded (the pipeline syncs once per stage).

**Emittable plans** (what ``torch.distributed.pipelining`` runs): ``p`` stages of
``d * t`` devices each (``p * d * t = N``, stage ``k`` on devices ``k d t ..``),
data parallel over ``d`` replicas and, for transformers, Megatron tensor parallel over
``t`` devices inside a node; kind ``pipeline`` for ``t = 1``, ``hybrid`` otherwise. For
each ``(t, p, m, schedule)`` the partitioner (:mod:`.partition`, straight pipeline of
``p`` stages, memory-aware) places the cuts; the best candidates by the partitioner's
estimate ``(m v + p - 1) / v * bottleneck`` are simulated
(:mod:`flexsearch.sim.pipeline`) and the fastest that fits wins.

**PipeDream's plan** (a baseline, simulated, not emitted): the hierarchical partitioner
with a replication factor per stage over the cluster's levels (devices in a node,
nodes), minibatches of ``B / N`` samples, asynchronous 1F1B with weight stashing.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from flexsearch.cost.hardware import Cluster
from flexsearch.graph.microbatch import batch_size, microbatch_graph
from flexsearch.graph.opgraph import OpGraph
from flexsearch.search.partition import Chain, Level, Memory, partition
from flexsearch.sim.pipeline import PipelineLayout, StageCost, simulate_pipeline
from flexsearch.sim.simulator import OPTIMIZER_STATE, Simulation, Simulator
from flexsearch.sim.taskgraph import CostContext
from flexsearch.strategy.config import Config
from flexsearch.strategy.recipes import stage_configs
from flexsearch.strategy.schedules import in_flight, rank_actions
from flexsearch.strategy.space import Space

SYNC_SCHEDULES = ("1f1b", "gpipe", "interleaved")


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


def _span(tasks) -> float:
    """Longest chain of one node's tasks (its dependencies on other nodes count as met)."""
    end: dict = {}
    for t in tasks:
        stop = max([end.get(k, 0.0) for k in t.deps], default=0.0) + t.duration
        for k in t.defines:
            end[k] = max(end.get(k, 0.0), stop)
    return max(end.values(), default=0.0)


def node_costs(graph: OpGraph, configs: dict[str, Config], cluster: Cluster, *,
               measured=None) -> dict[str, NodeCost]:
    """Each node's :class:`NodeCost` under ``configs`` on ``cluster`` (device 0's share).
    Identical layers (same signature, configuration and producers) are costed once."""
    sim = Simulator(graph, cluster, measured=measured)
    memo: dict[tuple, NodeCost] = {}
    out: dict[str, NodeCost] = {}
    for node in graph.nodes:
        key = (node.signature or node.name, node.kind, node.outputs, configs[node.name],
               tuple((graph.node(i).signature or i, graph.node(i).outputs, configs[i]) for i in node.inputs))
        hit = memo.get(key)
        if hit is None:
            frag = sim.fragment(node.name, configs)
            fw = frag.forward
            bw = [t for t in frag.backward if not any(k[0] == "s" for k in t.defines)]
            hit = memo[key] = NodeCost(_span(fw), _span(bw), frag.params.get(0, 0.0), frag.activations.get(0, 0.0),
                                       frag.tensors.get(0, 0), frag.largest.get(0, 0.0))
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
    """Bytes crossing each position of the node order (``L + 1`` entries)."""
    index = {n.name: i for i, n in enumerate(graph.nodes)}
    edges = ((index[i], k) for k, n in enumerate(graph.nodes) for i in n.inputs)
    return crossing_bytes([n.output_bytes for n in graph.nodes], edges)


def shared_params(graph: OpGraph) -> dict[str, tuple[int, ...]]:
    """Parameter name -> positions of the nodes that use it, for weights used twice."""
    uses: dict[str, list[int]] = {}
    for i, n in enumerate(graph.nodes):
        for p in n.params:
            uses.setdefault(p, []).append(i)
    return {p: tuple(v) for p, v in uses.items() if len(v) > 1}


@dataclass(frozen=True)
class PipelineResult:
    """A simulated pipeline plan."""

    kind: str
    schedule: str
    microbatches: int
    chunks: int
    recompute: bool
    tensor: int
    replicas: int
    stages: tuple[tuple[int, int, tuple[int, ...]], ...]
    """(first node, end node, devices) per stage, in node-order positions."""
    configs: dict[str, Config]
    simulation: Simulation


def stage_cost(costs: Sequence[NodeCost], a: int, b: int, cuts: Sequence[float], extra_params: float = 0.0,
               recompute: bool = False) -> StageCost:
    """A stage's cost; with ``recompute`` the backward reruns the forward first, and only
    the stage's input (its share, per tensor-parallel device) stays stashed per microbatch."""
    seg = costs[a:b]
    fwd = sum(c.forward_s for c in seg)
    stash = sum(c.stash_bytes for c in seg)
    return StageCost(
        forward_s=fwd,
        backward_s=sum(c.backward_s for c in seg) + (fwd if recompute else 0.0),
        param_bytes=sum(c.param_bytes for c in seg) + extra_params,
        stash_bytes=cuts[a] if recompute else stash,
        send_bytes=cuts[b] if b < len(costs) else 0.0,
        working_bytes=stash if recompute else 0.0,
        tensors=sum(c.tensors for c in seg),
        largest_param_bytes=max((c.largest_param_bytes for c in seg), default=0.0),
    )


def _tied(graph: OpGraph, costs: Sequence[NodeCost], bounds: Sequence[tuple[int, int]]):
    """Extra parameter bytes per stage for weights owned by another stage, and the
    (stage a, stage b, bytes) all-reduces of their gradients."""
    extra = [0.0] * len(bounds)
    tied = []
    stage_of = {}
    for k, (a, b) in enumerate(bounds):
        for i in range(a, b):
            stage_of[i] = k
    for _p, users in shared_params(graph).items():
        owner = next((i for i in users if graph.nodes[i].param_bytes), users[0])
        nbytes = costs[owner].param_bytes / max(1, len(graph.nodes[owner].params))
        stages = sorted({stage_of[i] for i in users})
        for k in stages:
            if k != stage_of[owner]:
                extra[k] += nbytes
                tied.append((min(k, stage_of[owner]), max(k, stage_of[owner]), nbytes))
    return extra, tuple(tied)


def _link_between(cluster: Cluster, group: int) -> tuple[float, float]:
    """(bandwidth, latency) between consecutive stages of ``group`` devices each."""
    spec = cluster.spec
    if group >= cluster.devices_per_node and spec.inter_node is not None and cluster.num_nodes > 1:
        link = spec.inter_node
    else:
        link = spec.intra_node
    return link.bandwidth.value, link.latency.value


def simulate_stages(graph: OpGraph, cluster: Cluster, *, bounds: Sequence[tuple[int, int]], tensor: int,
                    replicas: int, schedule: str, microbatches: int, chunks: int = 1,
                    recompute: bool = False, optimizer: str = "adam", measured=None, timeline: bool = True,
                    costs: Sequence[NodeCost] | None = None, ctx: CostContext | None = None) -> Simulation:
    """Simulate a uniform pipeline: stage ``k`` = nodes ``bounds[k]`` (positions), on
    ``replicas`` x ``tensor`` devices of pipeline rank ``k mod (len(bounds) / chunks)``."""
    p = len(bounds) // chunks
    g = replicas * tensor
    if p * chunks != len(bounds) or p * g != cluster.devices:
        raise ValueError(f"{len(bounds)} stages x {g} devices do not make {cluster.devices} devices")
    mg = microbatch_graph(graph, replicas * microbatches)
    if costs is None:
        configs = stage_configs(mg, tensor)
        if configs is None:
            raise ValueError(f"no tensor-parallel configuration of degree {tensor} for this model")
        got = node_costs(mg, configs, Cluster.from_spec(cluster.spec, tensor), measured=measured)
        costs = [got[n.name] for n in mg.nodes]
    cuts = cut_bytes(mg)
    extra, tied = _tied(graph, costs, bounds)
    stage_costs = [stage_cost(costs, a, b, cuts, extra[k], recompute)
                   for k, (a, b) in enumerate(bounds)]
    ranks = tuple(tuple(tuple(range(r * g + i * tensor, r * g + (i + 1) * tensor)) for i in range(replicas))
                  for r in range(p))
    layout = PipelineLayout(schedule, microbatches, ranks, chunks=chunks, tied=tied)
    ctx = ctx or CostContext(cluster, measured)
    return simulate_pipeline(ctx, stage_costs, layout, optimizer=optimizer, timeline=timeline)


def tensor_degrees(cluster: Cluster) -> list[int]:
    """Tensor-parallel degrees a stage may use: powers of two within one node."""
    return [t for t in (1, 2, 4, 8, 16) if t <= cluster.devices_per_node and cluster.devices % t == 0]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@functools.lru_cache(maxsize=4096)
def peak_in_flight(schedule: str, p: int, m: int, v: int = 1) -> int | None:
    """Most microbatches any stage keeps in flight (None: the schedule does not take m).
    Closed forms for GPipe (``m``) and 1F1B (``min(p, m)``); interleaved schedules are
    enumerated, and skipped beyond 4,096 actions per rank."""
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(p, m)
    if p * m * v > 4096:
        return None
    try:
        per_rank = rank_actions(schedule, p, m, chunks=v)
    except ValueError:
        return None
    return max(max(in_flight(a).values()) for a in per_rank)


def microbatch_options(per_replica: int, p: int, most: int = 5) -> list[int]:
    """Microbatch counts tried for ``p`` stages when each replica gets ``per_replica``
    samples: divisors of ``per_replica`` from ``p`` up (multiples of ``p``, and one sample
    per microbatch), thinned to a geometric sequence of at most ``most``; when the batch
    is smaller than ``p``, one sample per microbatch."""
    divs = [m for m in _divisors(per_replica) if m >= p and (m % p == 0 or m == per_replica)]
    if not divs:
        return [per_replica]
    kept = [divs[0]]
    for m in divs[1:]:
        if m >= 2 * kept[-1] or m == divs[-1]:
            kept.append(m)
    if len(kept) > most:  # keep the first few and the finest split
        kept = kept[: most - 1] + kept[-1:]
    return kept


def even_pipeline(graph: OpGraph, cluster: Cluster, schedule: str, tensor: int = 1, microbatches: int = 2, *,
                  measured=None) -> PipelineResult | None:
    """Two pipeline ranks over the nodes split evenly (two chunks each for the
    interleaved schedule), every other dimension data parallel: a pipeline the emitter
    can always run, for tests and benchmarks that need one where the search finds none
    worth running. None when the devices or the batch do not split that way."""
    p, chunks = 2, 2 if schedule == "interleaved" else 1
    if cluster.devices % (p * tensor):
        return None
    d = cluster.devices // (p * tensor)
    m = microbatches
    if batch_size(graph) % (d * m):
        return None
    configs = stage_configs(microbatch_graph(graph, d * m), tensor)
    if configs is None:
        return None
    n, stages = len(graph.nodes), p * chunks
    bounds = [(n * k // stages, n * (k + 1) // stages) for k in range(stages)]
    sim = simulate_stages(graph, cluster, bounds=bounds, tensor=tensor, replicas=d, schedule=schedule,
                          microbatches=m, chunks=chunks, measured=measured)
    g = d * tensor
    placed = tuple((a, b, tuple(range((k % p) * g, (k % p + 1) * g))) for k, (a, b) in enumerate(bounds))
    return PipelineResult("hybrid" if tensor > 1 else "pipeline", schedule, m, chunks, False, tensor, d, placed,
                          configs, sim)


def search_pipelines(graph: OpGraph, cluster: Cluster, *, optimizer: str = "adam", measured=None,
                     simulate_top: int = 6, schedules: Sequence[str] = SYNC_SCHEDULES,
                     max_stages: int | None = None) -> list[PipelineResult]:
    """Every emittable pipeline and hybrid candidate (module docstring), the best
    ``simulate_top`` simulated; results sorted fastest first, feasible ones first."""
    n = cluster.devices
    try:
        batch = batch_size(graph)
    except ValueError:
        return []
    layers = len(graph.nodes)
    state = 2 + OPTIMIZER_STATE[optimizer]
    cap = cluster.device.memory_capacity.value
    ctx = CostContext(cluster, measured)
    cost_memo: dict[tuple[int, int], tuple[list[NodeCost], dict[str, Config]] | None] = {}
    cut_memo: dict[int, tuple[float, ...]] = {}

    def costs_for(k: int, t: int):
        """(node costs, stage configurations) of microbatches of B / k on t devices."""
        if (k, t) not in cost_memo:
            mg = microbatch_graph(graph, k)
            configs = stage_configs(mg, t)
            if configs is None:
                cost_memo[(k, t)] = None
            else:
                got = node_costs(mg, configs, Cluster.from_spec(cluster.spec, t), measured=measured)
                cost_memo[(k, t)] = ([got[x.name] for x in mg.nodes], configs)
            cut_memo[k] = cut_bytes(mg)
        return cost_memo[(k, t)]

    estimates = []
    for t in tensor_degrees(cluster):
        for p in range(2, min(n // t, max_stages or layers, layers) + 1):
            if (n // t) % p:
                continue
            d = n // (t * p)
            if batch % d:
                continue
            bw, lat = _link_between(cluster, d * t)
            for m in microbatch_options(batch // d, p):
                hit = costs_for(d * m, t)
                if hit is None:
                    continue
                costs = hit[0]
                cuts = cut_memo[d * m]
                chains = {rc: stage_chain(costs, cuts, rc) for rc in (False, True)}
                for schedule in schedules:
                    v = 2 if schedule == "interleaved" else 1
                    if v * p > layers:
                        continue
                    q = peak_in_flight(schedule, p, m, v)
                    if q is None:
                        continue
                    for recompute in (False, True):
                        # recomputation: one microbatch's activations at a time (the stage
                        # inputs kept per microbatch are left to the simulation's check)
                        memory = Memory(cap, float(state), in_flight=lambda r, q=1 if recompute else q: q)
                        part = partition(chains[recompute], [Level(p * v, bw, lat)], memory=memory, replicate=False)
                        if part is None or len(part.stages) != p * v:
                            continue
                        est = (m * v + p - 1) / v * part.bottleneck_s
                        estimates.append((est, t, p, d, m, schedule, v, recompute, part))
                        break
    estimates.sort(key=lambda e: (e[0], e[7]))
    results = []
    for _, t, p, d, m, schedule, v, recompute, part in estimates[:simulate_top]:
        bounds = [(s.start, s.end) for s in part.stages]
        costs, local = costs_for(d * m, t)
        sim = simulate_stages(graph, cluster, bounds=bounds, tensor=t, replicas=d, schedule=schedule,
                              microbatches=m, chunks=v, recompute=recompute, optimizer=optimizer,
                              measured=measured, timeline=False, costs=costs, ctx=ctx)
        # the stage's layout: the tensor-parallel configuration, data parallel over the replicas
        configs = {k: Config(s=d, kind=c.kind, t=c.t, dim=c.dim) if c.s == 1 else c for k, c in local.items()}
        stages = tuple((a, b, tuple(range((k % p) * d * t, (k % p + 1) * d * t)))
                       for k, (a, b) in enumerate(bounds))
        results.append(PipelineResult("hybrid" if t > 1 else "pipeline", schedule, m, v, recompute, t, d,
                                      stages, configs, sim))
    results.sort(key=lambda r: (not r.simulation.feasible, r.simulation.iteration_time_s))
    return results


def stage_chain(costs: Sequence[NodeCost], cuts: Sequence[float], recompute: bool = False) -> Chain:
    """Per microbatch: compute ``f + b`` (``2 f + b`` with activation recomputation)."""
    return Chain(compute=tuple(c.forward_s * (2 if recompute else 1) + c.backward_s for c in costs),
                 params=tuple(c.param_bytes for c in costs), cut_bytes=tuple(cuts),
                 stash=tuple(c.stash_bytes for c in costs))


def cluster_levels(cluster: Cluster) -> list[Level]:
    """The cluster's hierarchy for PipeDream's partitioner: devices in a node, nodes."""
    spec = cluster.spec
    dpn = min(cluster.devices_per_node, cluster.devices)
    intra = Level(dpn, spec.intra_node.bandwidth.value, spec.intra_node.latency.value)
    if cluster.devices <= dpn or spec.inter_node is None:
        return [intra]
    if cluster.devices % dpn:
        return [Level(cluster.devices, spec.inter_node.bandwidth.value, spec.inter_node.latency.value)]
    return [intra, Level(cluster.devices // dpn, spec.inter_node.bandwidth.value,
                         spec.inter_node.latency.value)]


def pipedream_chain(costs: Sequence[NodeCost], cuts: Sequence[float]) -> Chain:
    return stage_chain(costs, cuts)


def pipedream_plan(graph: OpGraph, cluster: Cluster, *, optimizer: str = "adam",
                   measured=None) -> PipelineResult | None:
    """PipeDream's own plan (module docstring), simulated; None when it does not apply
    (one device, a batch that does not split into ``N`` minibatches, nothing fits)."""
    n = cluster.devices
    try:
        batch = batch_size(graph)
    except ValueError:
        return None
    if n < 2 or batch % n or n > 256:
        return None
    mg = microbatch_graph(graph, n)
    costs_map = node_costs(mg, Space(mg, 1).expand({}), Cluster.from_spec(cluster.spec, 1), measured=measured)
    costs = [costs_map[x.name] for x in mg.nodes]
    return pipedream_from_chain(cluster, pipedream_chain(costs, cut_bytes(mg)), costs,
                                optimizer=optimizer, measured=measured, units=n)


def pipedream_from_chain(cluster: Cluster, chain: Chain, costs: Sequence[NodeCost], *,
                         optimizer: str = "adam", measured=None, units: int = 1) -> PipelineResult | None:
    """Partition ``chain`` PipeDream's way on ``cluster`` and simulate asynchronous 1F1B."""
    n = cluster.devices
    state = 2 + OPTIMIZER_STATE[optimizer]
    memory = Memory(cluster.device.memory_capacity.value, float(state),
                    in_flight=lambda r: math.ceil(n / r), weight_stashing=True)
    levels = cluster_levels(cluster)
    options = [levels]
    if len(levels) > 1:  # the flat DP over all devices at the slowest level's bandwidth, too
        options.append([Level(n, levels[-1].bandwidth, levels[-1].latency)])
    best = None
    ctx = CostContext(cluster, measured)
    for lv in options:
        part = partition(chain, lv, memory=memory)
        if part is None:
            continue
        flat = part.device_stages()
        stage_costs = [stage_cost(costs, s.start, s.end, chain.cut_bytes) for s in flat]
        window = max(8, 4 * max(s.replicas for s in flat), 2 * len(flat))
        layout = PipelineLayout("pipedream", window, tuple(tuple((d,) for d in s.devices) for s in flat),
                                units=units)
        sim = simulate_pipeline(ctx, stage_costs, layout, optimizer=optimizer, timeline=False)
        stages = tuple((s.start, s.end, s.devices) for s in flat)
        res = PipelineResult("pipeline", "pipedream", window, 1, False, 1, 1, stages, {}, sim)
        if best is None or (sim.feasible, -sim.iteration_time_s) > (best.simulation.feasible,
                                                                     -best.simulation.iteration_time_s):
            best = res
    return best


def profile_chain(profile) -> tuple[Chain, list[NodeCost], tuple[str, ...]]:
    """A PipeDream profile (:mod:`flexsearch.graph.pipedream_profile`) as a chain over its
    topological order: times from ms to s, the activation size as both the bytes a cut
    sends and the bytes kept for the backward pass."""
    order = profile.topological_order()
    nodes = {n.id: n for n in profile.nodes}
    index = {k: i for i, k in enumerate(order)}
    cuts = crossing_bytes([nodes[k].activation_bytes for k in order],
                          ((index[a], index[b]) for a, b in profile.edges))
    costs = [NodeCost(nodes[k].forward_ms / 1e3, nodes[k].backward_ms / 1e3, nodes[k].parameter_bytes,
                      nodes[k].activation_bytes) for k in order]
    return pipedream_chain(costs, cuts), costs, order


def plan_profile(profile, cluster: Cluster, *, optimizer: str = "adam") -> tuple[PipelineResult, Simulation]:
    """PipeDream's plan for a measured profile on ``cluster`` (times are the profile's,
    one minibatch per unit) and, on the same simulator, data parallelism (one stage on
    every device, the same asynchronous schedule) for comparison."""
    from flexsearch.errors import InfeasiblePlanError

    chain, costs, _ = profile_chain(profile)
    best = pipedream_from_chain(cluster, chain, costs, optimizer=optimizer)
    if best is None:
        raise InfeasiblePlanError(
            f"no pipeline of this profile fits in {cluster.device.memory_capacity.value / 2**30:.1f} GiB "
            f"per device on {cluster.devices} devices; use more devices or a smaller minibatch")
    one = stage_cost(costs, 0, len(costs), chain.cut_bytes)
    n = cluster.devices
    layout = PipelineLayout("pipedream", max(8, 4 * n), (tuple((d,) for d in range(n)),), units=1)
    data = simulate_pipeline(CostContext(cluster), [one], layout, optimizer=optimizer, timeline=False)
    return best, data
