"""The planner: runs every search over one graph and cluster and keeps the best plan
that fits in memory.

1. Baselines (:mod:`.baselines`): data parallel, Megatron-style (best tensor degree),
   FlexFlow's expert plan, each simulated by the same simulator.
2. The lower bound: the single-device iteration time (memory ignored) divided by N.
3. The exact ILP (:mod:`.assignment`) over all-device configurations, when the graph
   has at most ``ilp_max_units`` decision units after clustering repeated blocks.
4. MCMC (:mod:`.mcmc`) seeded with the baselines and the ILP solution.
5. Pipeline and hybrid plans (:mod:`.pipeline`): the partitioner over every emittable
   (tensor degree, stages, microbatches, schedule), the best simulated; and PipeDream's
   own plan (per-stage replication, asynchronous 1F1B) as the ``pipedream`` baseline.
   The fastest plan that fits wins; the best pipeline's time is the ``pipeline`` entry
   of the baselines when SOAP wins, and SOAP's the ``soap`` entry when a pipeline wins.
6. Decentralized plans (:mod:`.decentralized`): D-PSGD on every applicable topology
   and the parameter-server baselines, on the same replica cost, against the best
   synchronous plan under the objective (:func:`with_decentralized`); the plan's
   ``notes`` say why D-PSGD was chosen or rejected.

The data-parallel baseline is what DDP runs (:func:`ddp_simulation`): the faster of the
op-level simulation and one all-reduce after the backward.

Graphs too large for the op-level simulator (ops x devices > ``soap_max_tasks``, e.g.
GPT-3 on 1,024 devices: one op-level simulation takes about 30 s there) skip steps 3-4;
their data-parallel and Megatron baselines are simulated at stage level
(:func:`flat_baselines`) and the plan is the best pipeline or hybrid that fits.

The returned plan is the best feasible state seen, so it is never slower than a
baseline that fits. Nothing fitting raises :class:`~flexsearch.errors.InfeasiblePlanError`.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from flexsearch.cost.compute import MeasuredCosts
from flexsearch.cost.hardware import Cluster
from flexsearch.errors import InfeasiblePlanError
from flexsearch.graph.opgraph import OpGraph
from flexsearch.plan import Plan, Predicted, SearchInfo, Stage
from flexsearch.search import decentralized as dz
from flexsearch.search.assignment import AssignmentBuilder
from flexsearch.search.mcmc import SearchResult, mcmc, sigint_restored
from flexsearch.search.pipeline import (
    PipelineResult,
    pipedream_plan,
    search_pipelines,
    simulate_stages,
    tensor_degrees,
)
from flexsearch.sim.simulator import Simulation, Simulator
from flexsearch.strategy import recipes as bl
from flexsearch.strategy.config import Config
from flexsearch.strategy.space import Space

DEFAULT_MAX_ITERS = 2000
REFERENCE_BASELINES = ("pipedream", "ps", "ps-sharded")
"""Baselines the emitter does not run (PipeDream's asynchronous pipeline changes the
training semantics with stale weights; parameter servers): reported for comparison,
not a bound the returned plan must beat."""
DECENTRALIZED_MARGIN = 0.05
"""Under the ``iteration`` objective a D-PSGD plan replaces the synchronous plan only
when it is more than this fraction faster per iteration: it changes the algorithm (the
ranks' models differ; it needs more iterations, which this objective does not count),
and a gain below the simulator's accuracy is not worth that. ``time_to_accuracy``
counts the extra iterations and needs no margin."""


@dataclass(frozen=True)
class BaselineRun:
    name: str
    decisions: dict[str, Config]
    simulation: Simulation


def lower_bound(graph: OpGraph, cluster: Cluster, **sim_kw) -> float:
    """Single-device iteration time (memory ignored) divided by the device count."""
    one = Cluster.from_spec(cluster.spec, 1)
    space = Space(graph, 1)
    sim = Simulator(graph, one, **sim_kw).simulate(space.expand({}), timeline=False)
    return sim.iteration_time_s / cluster.devices


def run_baselines(space: Space, sim: Simulator, devices_per_node: int) -> dict[str, BaselineRun]:
    """Simulate every baseline; Megatron degrees collapse into the best one."""
    out: dict[str, BaselineRun] = {}
    for name, dec in bl.baselines(space, devices_per_node).items():
        run = BaselineRun(name, dec, sim.simulate(space.expand(dec), timeline=False, ddp=name == "data"))
        key = "megatron" if name.startswith("megatron") else name
        prev = out.get(key)
        if prev is None or _better(run.simulation, prev.simulation):
            out[key] = BaselineRun(key, dec, run.simulation)
    return out


def ddp_simulation(graph: OpGraph, cluster: Cluster, oplevel: Simulation, *, timeline: bool = False,
                   calibrated: bool = False, **kw) -> Simulation:
    """The data-parallel plan as DDP runs it: the faster of ``oplevel`` (the op-level
    simulation of the all-sample configuration: each layer's gradients all-reduced as
    the backward produces them, every collective paying its latency) and the
    stage-level one (one replica's step, then all gradients all-reduced in one
    collective, DDP's single bucket for a model under its 25 MB bucket size). DDP's
    bucketing (25 MB buckets launched as they fill) is closest to the first for large
    models and to the second for small ones. On a device with a calibration
    (``calibrated``) the op-level simulation already models DDP's buckets as measured
    and is the prediction."""
    if calibrated:
        return oplevel
    try:
        flat = simulate_stages(graph, cluster, bounds=[(0, len(graph.nodes))], tensor=1, replicas=cluster.devices,
                               schedule="1f1b", microbatches=1, timeline=timeline, **kw)
    except ValueError:  # the batch does not split over the devices
        return oplevel
    return flat if _better(flat, oplevel) else oplevel


def flat_baselines(graph: OpGraph, cluster: Cluster, **kw) -> dict[str, BaselineRun]:
    """Data parallel and Megatron (best tensor degree within a node) simulated as one
    pipeline stage on every device (one replica stands for all): the baselines of a
    graph too large for the op-level simulator."""
    out: dict[str, BaselineRun] = {}
    for t in tensor_degrees(cluster):
        try:
            sim = simulate_stages(graph, cluster, bounds=[(0, len(graph.nodes))], tensor=t,
                                  replicas=cluster.devices // t, schedule="1f1b", microbatches=1,
                                  timeline=False, **kw)
        except ValueError:
            continue
        key = "data" if t == 1 else "megatron"
        prev = out.get(key)
        if prev is None or _better(sim, prev.simulation):
            out[key] = BaselineRun(key, {}, sim)
    return out


def _better(a: Simulation, b: Simulation) -> bool:
    return (a.feasible, -a.iteration_time_s) > (b.feasible, -b.iteration_time_s)


def plan_graph(
    graph: OpGraph,
    cluster: Cluster,
    *,
    optimizer: str = "adam",
    objective: str = "iteration",
    measured: MeasuredCosts | None = None,
    decentralized: bool = True,
    **kw,
) -> Plan:
    """The best plan for ``graph`` on ``cluster`` (module docstring): the synchronous
    search (:func:`plan_synchronous`, which takes the keyword arguments ``kw``), then
    the decentralized candidates against it (:func:`with_decentralized`; with
    ``decentralized=False`` they are reported, never returned)."""
    t0 = time.perf_counter()
    plan = plan_synchronous(graph, cluster, optimizer=optimizer, objective=objective, measured=measured, **kw)
    if plan.interrupted:
        return plan
    plan = with_decentralized(plan, graph, cluster, measured=measured, allow=decentralized)
    return plan.with_search_time(time.perf_counter() - t0)


def with_decentralized(plan: Plan, graph: OpGraph, cluster: Cluster, *, measured: MeasuredCosts | None = None,
                       allow: bool = True) -> Plan:
    """``plan`` (the best synchronous plan) against D-PSGD on every applicable topology
    and the parameter-server baselines (:mod:`.decentralized`), on the same replica
    cost. The best decentralized candidate replaces ``plan`` when ``allow`` and its
    effective time under the plan's objective (iteration time, times its iterations
    factor for ``time_to_accuracy``) is shorter; the parameter servers join the
    baselines; the plan's ``notes`` say why D-PSGD was chosen or rejected."""
    if cluster.devices < 2:
        return plan
    try:
        cost = dz.replica_cost(graph, cluster, measured=measured)
    except ValueError as e:
        note = dz.explain(None, plan.kind, plan.predicted.iteration_time_s, objective=plan.objective,
                          reason=str(e))
        return plan.model_copy(update={"notes": (*plan.notes, note)})
    cands = dz.decentralized_candidates(graph, cluster, optimizer=plan.optimizer, measured=measured,
                                        objective=plan.objective, cost=cost)
    central = dz.centralized_baselines(graph, cluster, optimizer=plan.optimizer, measured=measured, cost=cost)
    baselines = dict(plan.baselines)
    infeasible = list(plan.infeasible_baselines)
    for name, sim in central.items():
        if sim.feasible:
            baselines[name] = sim.iteration_time_s
        else:
            infeasible.append(name)
    note = dz.explain(cands, plan.kind, plan.predicted.iteration_time_s, objective=plan.objective)
    best = dz.best_candidate(cands)
    if best is not None and not best.simulation.feasible:
        best = None
    margin = DECENTRALIZED_MARGIN if plan.objective == "iteration" else 0.0
    wins = best is not None and best.effective_time_s < plan.predicted.iteration_time_s
    if wins and best.effective_time_s * (1 + margin) >= plan.predicted.iteration_time_s:
        note += f"; not returned: less than {margin:.0%} faster, not worth changing the algorithm"
        wins = False
    elif wins and not allow:
        note += "; not returned: decentralized plans are switched off"
    update = {"baselines": baselines, "infeasible_baselines": tuple(infeasible), "notes": (*plan.notes, note)}
    if not allow or not wins:
        return plan.model_copy(update=update)
    baselines[plan.kind] = plan.predicted.iteration_time_s
    return Plan(**{
        **{k: getattr(plan, k) for k in ("model", "graph_fingerprint", "devices", "cluster", "optimizer",
                                         "objective", "lower_bound_s", "inputs", "search")},
        **update,
        "kind": "decentralized",
        "predicted": _predicted(best.simulation),
        "topology": best.name,
        "topology_edges": best.topology.edges,
        "spectral_gap": best.spectral_gap,
        "iterations_factor": best.iterations_factor,
    })


def plan_synchronous(
    graph: OpGraph,
    cluster: Cluster,
    *,
    budget_s: float | None = None,
    max_iters: int | None = None,
    seed: int = 0,
    optimizer: str = "adam",
    objective: str = "iteration",
    measured: MeasuredCosts | None = None,
    ilp_max_units: int = 64,
    ilp_time_limit_s: float = 10.0,
    progress: Callable[[int, float], None] | None = None,
    pipelines: bool = True,
    soap_max_tasks: int = 400_000,
) -> Plan:
    """Search SOAP and pipeline plans for ``graph`` on ``cluster`` (module docstring,
    steps 1-5)."""
    t0 = time.perf_counter()
    if max_iters is None and budget_s is None:
        max_iters = DEFAULT_MAX_ITERS
    space = Space(graph, cluster.devices)
    large = pipelines and len(graph.nodes) * cluster.devices > soap_max_tasks
    if large:
        base = flat_baselines(graph, cluster, optimizer=optimizer, measured=measured)
        ilp_status = f"skipped: {len(graph.nodes)} ops x {cluster.devices} devices > {soap_max_tasks}"
        result = SearchResult(None, None, 0, 0, (), 0.0)
    else:
        sim = Simulator(graph, cluster, optimizer=optimizer, measured=measured)
        base = run_baselines(space, sim, cluster.devices_per_node)
        seeds = [b.decisions for b in base.values()]
        dp = base["data"]
        base["data"] = BaselineRun("data", dp.decisions, ddp_simulation(
            graph, cluster, dp.simulation, calibrated=sim.ctx.calibration is not None,
            optimizer=optimizer, measured=measured))

        ilp_status = f"skipped: {len(space.units)} decision units > {ilp_max_units}"
        if len(space.units) <= ilp_max_units:
            limit = ilp_time_limit_s if budget_s is None else min(ilp_time_limit_s, budget_s / 4)
            builder = AssignmentBuilder(space, sim.ctx, optimizer)
            # reproducible runs (no seconds budget) limit the solver by deterministic time
            with sigint_restored():  # CP-SAT would leave Ctrl-C killing the process
                dec, res = builder.solve(time_limit_s=limit, seed=seed, deterministic=budget_s is None)
            ilp_status = res.status
            if dec is not None:
                seeds.append(dec)

        remaining = None if budget_s is None else max(0.0, budget_s - (time.perf_counter() - t0))
        result = mcmc(space, sim, seeds, max_iters=max_iters, budget_s=remaining, seed=seed,
                      progress=progress)
        dp = base["data"]  # the search simulates data parallel op by op; DDP may be faster
        if dp.simulation.feasible and (result.simulation is None or result.decisions == dp.decisions
                                       or _better(dp.simulation, result.simulation)):
            result = dataclasses.replace(result, decisions=dp.decisions, simulation=dp.simulation)
    interrupted = result.interrupted  # Ctrl-C: skip the remaining searches, keep the best so far
    pipes, dream = [], None
    if pipelines and not interrupted:
        try:
            pipes = search_pipelines(graph, cluster, optimizer=optimizer, measured=measured)
            dream = pipedream_plan(graph, cluster, optimizer=optimizer, measured=measured)
        except KeyboardInterrupt:
            if result.decisions is None:
                raise
            pipes, dream, interrupted = [], None, True
    pipe = next((r for r in pipes if r.simulation.feasible), None)
    soap_time = result.simulation.iteration_time_s if result.simulation is not None else float("inf")
    if result.decisions is None and pipe is None:
        best = min(base.values(), key=lambda b: b.simulation.peak_memory_bytes)
        cap = best.simulation.capacity_bytes
        total = sum(best.simulation.memory_bytes)
        worth = math.ceil(total / cap)
        spread = (f"{total / 2**30:.1f} GiB in all, {worth} devices' worth" if worth > cluster.devices else
                  f"{total / 2**30:.1f} GiB in all, which {cluster.devices} devices could hold only if "
                  "it were spread evenly")
        raise InfeasiblePlanError(
            f"no plan fits in {cap / 2**30:.1f} GiB per device on {cluster.devices} x "
            f"{cluster.device.name} (the leanest baseline, {best.name}, needs "
            f"{best.simulation.peak_memory_bytes / 2**30:.1f} GiB on its fullest device and {spread}); "
            "use more devices, a smaller batch, or a cluster with more memory"
        )
    baselines = {k: b.simulation.iteration_time_s for k, b in base.items() if b.simulation.feasible}
    infeasible = [k for k, b in base.items() if not b.simulation.feasible]
    if dream is not None:
        if dream.simulation.feasible:
            baselines["pipedream"] = dream.simulation.iteration_time_s
        else:
            infeasible.append("pipedream")
    search = SearchInfo(seed=seed, max_iters=max_iters, budget_s=budget_s, iterations=result.iterations,
                        ilp=ilp_status, curve=tuple((it, t) for it, _, t in result.improvements))
    common = dict(model=graph.model, graph_fingerprint=graph.fingerprint, devices=cluster.devices,
                  inputs=graph_inputs(graph),
                  cluster=cluster.spec, optimizer=optimizer, objective=objective,
                  lower_bound_s=lower_bound(graph, cluster, optimizer=optimizer, measured=measured),
                  search=search)
    if pipe is not None and pipe.simulation.iteration_time_s < soap_time:
        if result.decisions is not None:
            baselines["soap"] = soap_time
        plan = pipeline_plan(graph, pipe, baselines=baselines, infeasible_baselines=tuple(infeasible), **common)
        return plan.with_search_time(time.perf_counter() - t0)
    if pipe is not None:
        baselines["pipeline"] = pipe.simulation.iteration_time_s
    assert result.decisions is not None and result.simulation is not None
    s = result.simulation
    configs = space.expand(result.decisions)
    kind = "data" if result.decisions == base["data"].decisions else "soap"
    plan = Plan(
        kind=kind,
        predicted=_predicted(s),
        baselines=baselines,
        infeasible_baselines=tuple(infeasible),
        decisions={k: v.text for k, v in result.decisions.items()},
        configs={k: v.text for k, v in configs.items()},
        **common,
    )
    if interrupted:
        plan = plan.model_copy(update={"notes": (*plan.notes, (
            f"search interrupted (Ctrl-C) after {result.iterations} MCMC steps: the best plan found so far, "
            "pipelines and decentralized plans not searched"),)})
        plan._interrupted = True  # a runtime flag like the search time (not saved)
    return plan.with_search_time(time.perf_counter() - t0)


def graph_inputs(graph: OpGraph) -> tuple:
    """The shapes and dtypes of the model's example inputs, in order."""
    return tuple(n.outputs[0] for n in graph.nodes if n.kind == "input" and n.outputs)


def _predicted(s: Simulation) -> Predicted:
    return Predicted(iteration_time_s=s.iteration_time_s, peak_memory_bytes=s.peak_memory_bytes,
                     memory_bytes=s.memory_bytes, compute_s=s.compute_s)


def pipeline_plan(graph: OpGraph, r: PipelineResult, **fields) -> Plan:
    """A :class:`Plan` for a simulated pipeline or hybrid candidate."""
    names = [n.name for n in graph.nodes]
    stages = tuple(Stage(nodes=tuple(names[a:b]), devices=devs, replicas=r.replicas)
                   for a, b, devs in r.stages)
    return Plan(kind=r.kind, predicted=_predicted(r.simulation), configs={k: c.text for k, c in r.configs.items()},
                stages=stages, schedule=r.schedule, microbatches=r.microbatches, chunks=r.chunks,
                recompute=r.recompute, **fields)
