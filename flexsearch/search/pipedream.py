"""PipeDream's plan (a baseline, simulated, not emitted): the hierarchical partitioner
(:mod:`.partition`) with a replication factor per stage over the cluster's levels
(devices in a node, nodes), minibatches of ``B / N`` samples, asynchronous 1F1B with
weight stashing; on a traced graph (:func:`pipedream_plan`) or on a measured PipeDream
profile (:func:`plan_profile`), with the same stage costs and simulator as the
synchronous pipelines of :mod:`.pipeline`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from flexsearch.cost.hardware import Cluster
from flexsearch.graph.microbatch import batch_size, microbatch_graph
from flexsearch.graph.opgraph import OpGraph
from flexsearch.search.partition import Chain, Level, Memory, partition
from flexsearch.search.pipeline import PipelineResult, stage_chain
from flexsearch.sim.accounting import param_copies
from flexsearch.sim.context import CostContext
from flexsearch.sim.pipeline import simulate_pipeline
from flexsearch.sim.pipeline_layout import PipelineLayout
from flexsearch.sim.result import Simulation
from flexsearch.sim.stages import NodeCost, crossing_bytes, cut_bytes, stage_cost, stage_node_costs

PIPEDREAM_MAX_DEVICES = 256
"""PipeDream's partitioner is a baseline; beyond this many devices its hierarchical DP
(quadratic in devices per level) costs more search time than a reference is worth."""


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


def pipedream_plan(graph: OpGraph, ctx: CostContext, *, optimizer: str = "adam") -> PipelineResult | None:
    """PipeDream's own plan on ``ctx``'s cluster (module docstring), simulated; None
    when it does not apply (one device, more than :data:`PIPEDREAM_MAX_DEVICES`, a batch
    that does not split into ``N`` minibatches, nothing fits)."""
    n = ctx.cluster.devices
    try:
        batch = batch_size(graph)
    except ValueError:
        return None
    if n < 2 or batch % n or n > PIPEDREAM_MAX_DEVICES:
        return None
    mg = microbatch_graph(graph, n)
    costs = stage_node_costs(mg, ctx, 1)
    assert costs is not None  # whole ops on one device are always legal
    return pipedream_from_chain(ctx, pipedream_chain(costs, cut_bytes(mg)), costs, optimizer=optimizer, units=n)


def pipedream_window(stages: int, replicas: int) -> int:
    """Minibatches simulated for PipeDream's steady state: at least 8, four rounds of
    the most replicated stage, and two passes through the pipeline, so that the second
    half of the window (what is measured) is past the warm-up."""
    return max(8, 4 * replicas, 2 * stages)


def pipedream_from_chain(ctx: CostContext, chain: Chain, costs: Sequence[NodeCost], *,
                         optimizer: str = "adam", units: int = 1) -> PipelineResult | None:
    """Partition ``chain`` PipeDream's way on ``ctx``'s cluster and simulate
    asynchronous 1F1B."""
    cluster = ctx.cluster
    n = cluster.devices
    memory = Memory(cluster.device.memory_capacity.value, param_copies(optimizer),
                    in_flight=lambda r: math.ceil(n / r), weight_stashing=True)
    levels = cluster_levels(cluster)
    options = [levels]
    if len(levels) > 1:  # the flat DP over all devices at the slowest level's bandwidth, too
        options.append([Level(n, levels[-1].bandwidth, levels[-1].latency)])
    best = None
    for lv in options:
        part = partition(chain, lv, memory=memory)
        if part is None:
            continue
        flat = part.device_stages()
        stage_costs = [stage_cost(costs, s.start, s.end, chain.cut_bytes) for s in flat]
        window = pipedream_window(len(flat), max(s.replicas for s in flat))
        layout = PipelineLayout("pipedream", window, tuple(tuple((d,) for d in s.devices) for s in flat),
                                units=units)
        sim = simulate_pipeline(ctx, stage_costs, layout, optimizer=optimizer, timeline=False)
        stages = tuple((s.start, s.end, s.devices) for s in flat)
        res = PipelineResult("pipeline", "pipedream", window, 1, "none", 1, 1, stages, {}, sim)
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


def plan_profile(profile, ctx: CostContext, *, optimizer: str = "adam") -> tuple[PipelineResult, Simulation]:
    """PipeDream's plan for a measured profile on ``ctx``'s cluster (times are the
    profile's, one minibatch per unit) and, on the same simulator, data parallelism (one
    stage on every device, the same asynchronous schedule) for comparison."""
    from flexsearch.errors import InfeasiblePlanError

    cluster = ctx.cluster
    chain, costs, _ = profile_chain(profile)
    best = pipedream_from_chain(ctx, chain, costs, optimizer=optimizer)
    if best is None:
        raise InfeasiblePlanError(
            f"no pipeline of this profile fits in {cluster.device.memory_capacity.value / 2**30:.1f} GiB "
            f"per device on {cluster.devices} devices; use more devices or a smaller minibatch")
    one = stage_cost(costs, 0, len(costs), chain.cut_bytes)
    n = cluster.devices
    layout = PipelineLayout("pipedream", pipedream_window(1, n), (tuple((d,) for d in range(n)),), units=1)
    data = simulate_pipeline(ctx, [one], layout, optimizer=optimizer, timeline=False)
    return best, data
