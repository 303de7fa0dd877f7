"""The public pipeline: model -> OpGraph -> searches -> Plan, and plan -> Simulation.

:func:`plan` traces the model (fake tensors, no real memory), loads the cluster
(``Cluster.preset(name, devices)`` or a cluster file) and runs the planner
(:mod:`flexsearch.search.planner`). :func:`simulate` re-predicts a saved plan.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Mapping
from typing import Literal

from torch import nn

from flexsearch.cost.compute import MeasuredCosts
from flexsearch.cost.hardware import Cluster
from flexsearch.errors import ClusterSpecError, FlexsearchError, PlanFileError
from flexsearch.graph.opgraph import OpGraph
from flexsearch.graph.tracer import trace
from flexsearch.plan import Plan
from flexsearch.sim.simulator import Simulation, Simulator
from flexsearch.strategy.config import legal

DEFAULT_CLUSTER = "dgx-h100"


def resolve_cluster(cluster: str | os.PathLike[str] | Cluster | None, devices: int) -> Cluster:
    """A :class:`Cluster` of ``devices`` devices from a preset name, a file, or a
    Cluster (default: the ``dgx-h100`` preset)."""
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ClusterSpecError(f"devices must be a positive integer (got {devices!r}); pass e.g. devices=8")
    if isinstance(cluster, Cluster):
        if cluster.devices != devices:
            return Cluster.from_spec(cluster.spec, devices)
        return cluster
    return Cluster.resolve(cluster if cluster is not None else DEFAULT_CLUSTER, devices)


def plan(
    model: nn.Module,
    example_inputs: tuple,
    *,
    devices: int,
    cluster: str | os.PathLike[str] | Cluster | None = None,
    budget_s: float | None = None,
    max_iters: int | None = None,
    seed: int = 0,
    objective: Literal["iteration", "time_to_accuracy"] = "iteration",
    optimizer: Literal["adam", "momentum", "sgd"] = "adam",
    progress: Callable[[int, float], None] | None = None,
    decentralized: bool = True,
) -> Plan:
    """Search every plan kind for ``model`` on ``devices`` devices of ``cluster`` and
    return the fastest that fits in memory.

    Budgets: ``max_iters`` (reproducible: same seed, same plan) or ``budget_s``
    (seconds); neither means the default iteration budget. ``objective`` is accepted
    for the decentralized plans; for synchronous plans (data, SOAP) iterations to
    accuracy equal plain SGD's, so both objectives rank them by iteration time.
    ``decentralized=False`` keeps synchronous training: D-PSGD plans are simulated for
    the notes but never returned."""
    if objective not in ("iteration", "time_to_accuracy"):
        raise FlexsearchError(f"unknown objective {objective!r}; use 'iteration' or 'time_to_accuracy'")
    if max_iters is not None and (isinstance(max_iters, bool) or max_iters < 0):
        raise FlexsearchError(f"max_iters must be >= 0 (got {max_iters!r})")
    if budget_s is not None and not budget_s > 0:
        raise FlexsearchError(f"budget_s must be > 0 seconds (got {budget_s!r})")
    from flexsearch.search.planner import plan_graph

    cl = resolve_cluster(cluster, devices)
    graph = trace(model, example_inputs)
    return plan_graph(graph, cl, budget_s=budget_s, max_iters=max_iters, seed=seed,
                      optimizer=optimizer, objective=objective, progress=progress, decentralized=decentralized)


def simulate(graph: OpGraph, plan: Plan, cluster: str | os.PathLike[str] | Cluster | None = None, *,
             measured: MeasuredCosts | None = None, fsdp_units: Mapping[str, str] | None = None) -> Simulation:
    """Predict one iteration of ``plan`` for ``graph`` (made for it: checked) on
    ``cluster`` (default: the cluster embedded in the plan), with ``measured`` op costs
    when given (as the plan was searched with them). ``fsdp_units``: node -> FSDP unit
    of a ``shard_params`` plan (default: the simulator's guess from module names)."""
    plan.check_graph(graph)
    if cluster is None:
        cl = Cluster.from_spec(plan.cluster, plan.devices)
    else:
        cl = resolve_cluster(cluster, plan.devices)
    if plan.kind in ("pipeline", "hybrid"):
        return _simulate_pipeline(graph, plan, cl, measured)
    if plan.kind == "decentralized":
        return _simulate_decentralized(graph, plan, cl, measured)
    configs = plan.node_configs()
    missing = [n.name for n in graph.nodes if n.name not in configs]
    missing += [k for k in plan.decisions if k not in configs]
    if missing:
        raise PlanFileError(f"the plan has no configuration for {missing[0]}; plan this model again")
    for n in graph.nodes:  # decisions and followers alike: the emitter must be able to run them
        if not legal(n, configs[n.name], cl.devices):
            raise PlanFileError(
                f"the plan's configuration {configs[n.name].text} for {n.name} is not legal on "
                f"{cl.devices} devices; the file is damaged or edited, plan again"
            )
    simulator = Simulator(graph, cl, optimizer=plan.optimizer, measured=measured)  # type: ignore[arg-type]
    if plan.kind == "data" and plan.shard_params:
        return simulator.simulate(configs, shard_params=True, fsdp_units=fsdp_units)
    sim = simulator.simulate(configs, ddp=plan.kind == "data")
    if plan.kind == "data":
        from flexsearch.search.planner import ddp_simulation

        return ddp_simulation(graph, cl, sim, timeline=True, calibrated=simulator.ctx.calibration is not None,
                              optimizer=plan.optimizer, measured=measured)
    return sim


def _simulate_decentralized(graph: OpGraph, plan: Plan, cl: Cluster, measured: MeasuredCosts | None) -> Simulation:
    """Re-simulate a D-PSGD plan on its topology."""
    from flexsearch.search.decentralized import replica_cost
    from flexsearch.sim.decentralized import simulate_gossip
    from flexsearch.sim.taskgraph import CostContext
    from flexsearch.strategy.topology import build

    if plan.topology is None:
        raise PlanFileError("the decentralized plan names no topology; the file is damaged, plan again")
    try:
        top = build(plan.topology, plan.devices, edges=plan.topology_edges or None)
        cost = replica_cost(graph, cl, measured=measured)
    except (FlexsearchError, ValueError) as e:
        raise PlanFileError(f"the decentralized plan cannot be simulated: {e}; plan again") from None
    return simulate_gossip(CostContext(cl, measured), cost, top, optimizer=plan.optimizer)


def _simulate_pipeline(graph: OpGraph, plan: Plan, cl: Cluster, measured: MeasuredCosts | None) -> Simulation:
    """Re-simulate a pipeline or hybrid plan from its stages, schedule and configurations."""
    from flexsearch.search.pipeline import simulate_stages

    if plan.schedule == "pipedream":
        raise PlanFileError("PipeDream's asynchronous plans are baselines, not plans flexsearch returns")
    flat = [n for st in plan.stages for n in st.nodes]
    if flat != [n.name for n in graph.nodes] or not plan.schedule or not plan.microbatches:
        raise PlanFileError("the plan's stages do not cover the model's nodes in order; plan again")
    ends = list(itertools.accumulate(len(st.nodes) for st in plan.stages))
    bounds = list(zip([0, *ends[:-1]], ends, strict=True))
    try:
        return simulate_stages(graph, cl, bounds=bounds, tensor=plan.tensor_degree, replicas=plan.stages[0].replicas,
                               schedule=plan.schedule, microbatches=plan.microbatches,
                               chunks=plan.chunks or 1, recompute=plan.recompute,
                               optimizer=plan.optimizer, measured=measured)
    except ValueError as e:
        raise PlanFileError(f"the plan's pipeline cannot be simulated: {e}; plan again") from None
