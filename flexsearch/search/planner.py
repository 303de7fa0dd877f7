"""The planner: runs every search over one graph and cluster and keeps the best plan
that fits in memory.

1. Baselines (:mod:`.baselines`, from :mod:`flexsearch.strategy.recipes`): data parallel, Megatron-style (best
   tensor degree), FlexFlow's expert plan, each simulated by the same simulator; data
   parallelism with each sharding (``fsdp``).
2. The lower bound (:mod:`.baselines`): the single-device iteration time (memory ignored) divided by N.
3. Pipeline and hybrid plans (:mod:`.pipeline`): the partitioner over every emittable
   (tensor degree, stages, microbatches, schedule), the best simulated; and PipeDream's
   own plan (per-stage replication, asynchronous 1F1B) as the ``pipedream`` baseline.
4. The exact ILP (:mod:`.assignment`) over all-device configurations, when the graph
   has at most ``ilp_max_units`` decision units after clustering repeated blocks.
5. MCMC (:mod:`.mcmc`) seeded with the baselines and the ILP solution; skipped when a
   plan of steps 1 and 3 is within :data:`BOUND_GAP` of the bound.
6. Decentralized plans (:mod:`.decentralized`): D-PSGD on every applicable topology
   and the parameter-server baselines, on the same replica cost, against the best
   synchronous plan under the objective (:func:`with_decentralized`); the plan's
   ``notes`` say why D-PSGD was chosen or rejected.
7. A plan that splits the batch (every kind but SOAP, which moves the samples an op
   reads) over a model that couples its samples (:mod:`flexsearch.graph.coupling`:
   CLIP's logits, a load-balancing loss) says so in its notes: it computes that per
   replica and microbatch, as DDP would.

Every candidate is a strategy value (:mod:`flexsearch.strategy.kinds`) predicted by
:func:`flexsearch.sim.predict.predict` under one explicit cost context (cluster,
measured op costs, calibration). The data-parallel baseline is what DDP runs.

**Choice.** The data plan or the best SOAP plan, whichever is faster; a pipeline or
hybrid plan replaces it when strictly faster (the other family's time is then a
baseline: ``pipeline``; or ``soap``, the best SOAP configuration as SOAP runs it, and
``fsdp``, the best sharded data-parallel plan; ``data`` is DDP's); decisions data
parallel in every op are a SOAP plan too (DTensor runs it; ``kinds=("soap",)`` returns
it when it is the fastest). A D-PSGD plan replaces the result when its effective time
under the objective is shorter by more than :data:`~flexsearch.search.decentralized.DECENTRALIZED_MARGIN`. The default
objective is ``time_to_accuracy``: a D-PSGD plan's iteration time times the iterations it needs
relative to synchronous SGD (1 for every synchronous kind), from the model family's
measured convergence (:mod:`flexsearch.strategy.convergence`) or conservative defaults;
``iteration`` compares iteration times alone. ``kinds`` restricts the choice to
some plan kinds (:data:`~flexsearch.strategy.kinds.KINDS`; ``fsdp`` is a data plan
sharded with FSDP2, and is only searched when named): the best plan of those kinds,
or :class:`~flexsearch.errors.PlanKindError` saying why there is none (a memory
message quotes the leanest run simulated; :class:`~flexsearch.errors.InfeasiblePlanError`
of the default search, the leanest of the baselines, data-parallel variants and
pipeline layouts).

Graphs too large for the op-level simulator (ops x devices > ``soap_max_tasks``, e.g.
GPT-3 on 1,024 devices: one op-level simulation takes about 30 s there) skip steps 3-4;
their data-parallel and Megatron baselines are simulated at stage level.

The returned plan is the best feasible candidate, so it is never slower than a
baseline of its kinds that fits. Nothing fitting raises
:class:`~flexsearch.errors.InfeasiblePlanError`.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future

from flexsearch.collector import cycles_paused
from flexsearch.cost.alignment import misaligned_note
from flexsearch.cost.calibration import DeviceCalibration
from flexsearch.cost.compute import MeasuredCosts
from flexsearch.cost.hardware import Cluster
from flexsearch.errors import PlanKindError, TraceError
from flexsearch.graph.coupling import coupling_note, sample_coupling
from flexsearch.graph.opgraph import OpGraph
from flexsearch.graph.tracer import AUTOCAST_FSDP
from flexsearch.plan import Plan, SearchInfo
from flexsearch.precision import precision as precision_of
from flexsearch.search.assignment import CUT_LATE, SKIPPED_LATE, ilp_seed
from flexsearch.search.baselines import BaselineRun, flat_baselines, lower_bound, run_baselines
from flexsearch.search.clock import past
from flexsearch.search.decentralized import (
    DecentralizedRuns,
    simulate_decentralized,
    with_decentralized,
)
from flexsearch.search.even_pipeline import even_pipeline
from flexsearch.search.mcmc import SearchResult, mcmc
from flexsearch.search.pipedream import pipedream_plan
from flexsearch.search.pipeline import (
    RECOMPUTE_ORDER,
    SYNC_SCHEDULES,
    PipelineResult,
    search_pipelines,
)
from flexsearch.search.reasons import (
    budget_error,
    data_label,
    infeasible_error,
    no_plan_reason,
    oplevel_notes,
    pipeline_label,
    sharding_note,
)
from flexsearch.search.results import graph_inputs, plan_from, predicted
from flexsearch.search.variants import fitting_variant, shardings, splits, unsplit_reason
from flexsearch.sim.context import CostContext
from flexsearch.sim.predict import predict, runtime_graph
from flexsearch.sim.result import Simulation
from flexsearch.sim.simulator import Simulator
from flexsearch.strategy import recipes as bl
from flexsearch.strategy.config import Config
from flexsearch.strategy.convergence import Constants, constants_for
from flexsearch.strategy.fsdp import fsdp_units
from flexsearch.strategy.kinds import FSDP_SHARDINGS, KINDS, DataParallel, Soap
from flexsearch.strategy.recompute import partial_unit_op
from flexsearch.strategy.space import Space
from flexsearch.workers import flag_raised, new_flag, submit, worker_count
from flexsearch.workers import pool as worker_pool

DEFAULT_MAX_ITERS = 2000
DEFAULT_KINDS = ("data", "fsdp", "soap", "pipeline", "hybrid", "decentralized")
"""What a plan without ``kinds`` may be."""
EXPORTED_NOTE = ("traced with torch.export: SOAP configurations use every device (no op placed on a subset "
                 "of them); the emitter runs the exported ATen graph")
"""Said in the plans of a model only ``torch.export`` traces that may use SOAP (see
:class:`~flexsearch.strategy.space.Space`)."""
FSDP_MAX_TASKS = 4_000_000
"""Ops x devices beyond which sharded data parallelism is not simulated (it is simulated
op by op): GPT-3 175B on 1,024 devices (2.4 M) is; GPT 1T on 3,072 (8.6 M) ran out of
this machine's memory after minutes."""
ILP_EARLY_MAX = 20_000
"""Ops x devices up to which the ILP is built before the pipelines are known (here,
after the baselines, while the worker searches the pipelines; in the worker when there
are none to search); a larger one is built only when the MCMC will run (no plan
within :data:`BOUND_GAP` of the bound): its build grows with ops x devices x candidate
pairs (137 s for GPT 18.4B on 256 devices)."""
OVERRUN = 0.10
"""An overrun of the budget the plan's budget note states: more than this share of it
([v2 4/6]: never past a budget by more than 10%, but each phase goes on past it while
nothing found fits)."""
BOUND_GAP = 0.05
"""The MCMC is skipped when a data, sharded or pipeline plan already found is within this
fraction of the lower bound (the single-device time over ``N``, which no plan beats): no
SOAP plan could be more than this much faster, a gain below the simulator's measured
error (:data:`~flexsearch.search.decentralized.DECENTRALIZED_MARGIN`). The SOAP baselines and the ILP's plan (a seed the
MCMC would start from) still compete."""


def check_kinds(kinds: Iterable[str] | None) -> tuple[str, ...]:
    """The plan kinds to search, in :data:`KINDS` order (default :data:`DEFAULT_KINDS`);
    ValueError names an unknown one."""
    if kinds is None:
        return DEFAULT_KINDS
    kinds = tuple(kinds)
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise ValueError(f"unknown plan kind {bad[0] if bad else '(none)'!r}; use one or more of {', '.join(KINDS)}")
    return tuple(k for k in KINDS if k in kinds)


def soap_candidate(graph: OpGraph, space: Space, ctx: CostContext, optimizer: str, sim: Simulator,
                   result: SearchResult, seeds: Sequence[Mapping[str, Config]],
                   deadline: float | None = None) -> tuple[str, Soap, Simulation] | None:
    """The SOAP search's best configuration as a candidate (``result``: the best that fits
    as it is); when none fits, the fastest of the search's ``seeds`` (its baselines and
    the ILP's plan: every op on every device, what a SOAP plan recomputes) that fits
    with activation checkpointing, selective or full (full tried first: where it does
    not fit, selective, which keeps more, does not), which, as for data plans, is tried
    only then (it makes no iteration faster), the first that fits past ``deadline``;
    None when nothing fits."""
    if result.decisions is not None:
        return "soap", Soap(space.expand(result.decisions), result.decisions), result.simulation
    best = None
    for dec in seeds:
        configs = space.expand(dec)
        if partial_unit_op(graph, configs, ctx.cluster.devices) is not None:  # what the emitter recomputes
            continue
        fits = []
        for mode in reversed(RECOMPUTE_ORDER[1:]):  # full first: where it does not fit, selective does not
            if best is not None and past(deadline):
                return best
            checkpointed = Soap(configs, dec, mode)
            got = predict(graph, checkpointed, ctx, optimizer=optimizer, timeline=False, simulator=sim)
            if not got.feasible:
                break
            fits.append(("soap", checkpointed, got))
        for found in fits:
            if best is None or found[2].iteration_time_s < best[2].iteration_time_s:
                best = found
    return best


@cycles_paused()  # a search makes (almost) no reference cycles: the collector is overhead
def plan_graph(
    graph: OpGraph,
    cluster: Cluster,
    *,
    kinds: Iterable[str] | None = None,
    optimizer: str = "adam",
    objective: str = "time_to_accuracy",
    measured: MeasuredCosts | None = None,
    calibration: DeviceCalibration | None = None,
    decentralized: bool = True,
    batch_norm: str = "local",
    convergence: Constants | None = None,
    stated_budget_s: float | None = None,
    **kw,
) -> Plan:
    """The best plan for ``graph`` on ``cluster`` (module docstring) under the cost
    context of the graph's precision, ``measured`` op costs and ``calibration`` (none
    unless given): the
    synchronous search (:func:`plan_synchronous`, which takes the keyword arguments
    ``kw``), then the decentralized candidates against it (:func:`with_decentralized`;
    with ``decentralized=False`` they are reported, never returned), their iterations
    factors from ``convergence`` (default: the shipped measurement of the graph's model
    family, :func:`flexsearch.strategy.convergence.constants_for`;
    :func:`flexsearch.api.resolve_convergence` also reads this machine's).
    ``stated_budget_s``: the budget the caller was given, when it spent part of it before
    (tracing) and passes what is left as ``budget_s``: the notes and the plan's search
    record quote it (default ``budget_s``)."""
    t0 = time.perf_counter()
    kinds = check_kinds(kinds)
    default = kinds == DEFAULT_KINDS
    notes = list(graph.notes)  # what the tracer did to the model
    if graph.via == "export" and "soap" in kinds:
        notes.append(EXPORTED_NOTE)
    ctx = CostContext(cluster, measured, precision=precision_of(graph.precision), calibration=calibration)
    if ctx.precision.autocast is not None and not graph.low_param_nodes \
            and not any(n.endswith(AUTOCAST_FSDP) for n in notes):
        # a graph saved before the tracer's second pass, or built without it
        notes.append(f"the graph has no pass with {ctx.precision.autocast} parameters (FSDP2 under "
                     f"{ctx.precision.name}; saved by an older flexsearch?): trace the model again; {AUTOCAST_FSDP}")
    if measured is None and (aligned := misaligned_note(graph, ctx.precision, cluster)):
        notes.append(aligned)  # the roofline prices misaligned GEMMs as aligned
    sync_kinds = tuple(k for k in kinds if k != "decentralized")
    budget_s = kw.get("budget_s")
    deadline = None if budget_s is None else t0 + budget_s
    convergence = convergence or constants_for(graph.family or graph.model)
    early: list[DecentralizedRuns] = []

    def meanwhile() -> None:
        """D-PSGD's simulations, which need no synchronous plan: run while the worker
        searches the pipelines."""
        if ("decentralized" in kinds or default) and cluster.devices > 1:
            early.append(simulate_decentralized(graph, ctx, optimizer=optimizer, objective=objective,
                                                convergence=convergence, deadline=deadline))

    if not sync_kinds:  # D-PSGD alone: a synchronous plan to compare with, cheaply
        plan = plan_synchronous(graph, ctx, kinds=("data", "soap", "pipeline", "hybrid"), optimizer=optimizer,
                                objective=objective, **{**kw, "max_iters": 0, "budget_s": None})
    else:
        plan = plan_synchronous(graph, ctx, kinds=sync_kinds, optimizer=optimizer, objective=objective,
                                stated_budget_s=stated_budget_s, meanwhile=meanwhile, **kw)
    if plan.interrupted:
        return plan
    if budget_s is not None and time.perf_counter() - t0 >= budget_s and sync_kinds and not early:
        stated = stated_budget_s if stated_budget_s is not None else budget_s
        notes.append(f"budget {stated:g} s: spent before the decentralized candidates; D-PSGD not simulated")
    elif "decentralized" in kinds or default:
        plan = with_decentralized(plan, graph, ctx, allow=decentralized and "decentralized" in kinds,
                                  require=not sync_kinds, convergence=convergence, deadline=deadline,
                                  runs=early[0] if early else None)
    if batch_norm not in ("local", "sync"):
        raise ValueError(f"batch_norm is 'local' or 'sync', not {batch_norm!r}")
    if any("batch_norm" in n.target or "BatchNorm" in n.target for n in graph.nodes):
        plan = plan.model_copy(update={"batch_norm": batch_norm})
        notes.append("batch statistics per replica (and per microbatch), as DDP computes them; --batch-norm sync "
                     "uses SyncBatchNorm over the replicas (GPUs; its all-reduces are not simulated)"
                     if batch_norm == "local" else
                     "batch statistics synchronised over the replicas (SyncBatchNorm, GPUs only; its all-reduces "
                     "are not simulated)")
    if splits_batch(plan) and (coupled := coupling_note(sample_coupling(graph), plan.kind)):
        notes.append(coupled)  # the plan computes the loss over shares of the batch
    if notes:
        plan = plan.model_copy(update={"notes": (*notes, *plan.notes)})
    return plan.with_search_time(time.perf_counter() - t0)


def splits_batch(plan: Plan) -> bool:
    """Does ``plan`` run the model on shares of the batch (replicas or microbatches)? A
    SOAP plan moves the samples an op reads, whatever it splits."""
    if plan.kind == "soap":
        return False
    replicas = plan.stages[0].replicas if plan.stages else plan.devices
    return replicas > 1 or (plan.microbatches or 1) > 1


def plan_synchronous(
    graph: OpGraph,
    ctx: CostContext,
    *,
    kinds: Sequence[str] = ("data", "soap", "pipeline", "hybrid"),
    budget_s: float | None = None,
    max_iters: int | None = None,
    seed: int = 0,
    optimizer: str = "adam",
    objective: str = "time_to_accuracy",
    ilp_max_units: int = 64,
    ilp_time_limit_s: float = 10.0,
    progress: Callable[[int, float], None] | None = None,
    pipelines: bool = True,
    soap_max_tasks: int = 400_000,
    schedules: Sequence[str] = SYNC_SCHEDULES,
    workers: int | None = None,
    stated_budget_s: float | None = None,
    meanwhile: Callable[[], None] | None = None,
) -> Plan:
    """The best synchronous plan of ``kinds`` for ``graph`` on ``ctx``'s cluster
    (module docstring, steps 1-5; pipelines before the SOAP search, which they may make
    unnecessary). ``pipelines=False`` skips step 3; ``schedules`` restricts the pipeline
    schedules tried. ``workers``: processes to use (default: the CPUs this process may
    run on); with two or more, step 3 runs in a forked worker (simulating its layouts
    two at a time with a helper process of its own) while steps 1 and 2, then an early
    ILP (:data:`ILP_EARLY_MAX`) and ``meanwhile`` (the caller's work that needs no
    synchronous plan), run here. Each step is deterministic, so the plan does not depend on
    ``workers``. Past the ``budget_s`` deadline every step stops at what it has, and
    the ones after it run only while nothing found fits, here or by the worker (a step
    is not started when it would end past the deadline by what similar ones took: the
    pipeline search's simulations); a budget spent before the search
    (``stated_budget_s``, the budget the notes quote, less tracing) gets the lower
    bound and the fastest baseline. A graph with no op that takes time is a
    :class:`~flexsearch.errors.TraceError`."""
    t0 = time.perf_counter()
    cluster = ctx.cluster
    if max_iters is None and budget_s is None:
        max_iters = DEFAULT_MAX_ITERS
    space = Space(graph, cluster.devices)
    want_pipes = pipelines and bool({"pipeline", "hybrid"} & set(kinds))
    large = want_pipes and len(graph.nodes) * cluster.devices > soap_max_tasks
    result = SearchResult(None, None, 0, 0, (), 0.0)
    data_strategy = DataParallel(space.expand(bl.data_parallel(space)), bl.data_parallel(space))
    deadline = None if budget_s is None else t0 + budget_s
    cut: list[str] = []  # phases the budget cut short
    want_ilp = "soap" in kinds and not large and len(space.units) <= ilp_max_units
    # a large ILP is built only when the SOAP search is worth running (decided after the pipelines)
    ilp_early = want_ilp and len(graph.nodes) * cluster.devices <= ILP_EARLY_MAX
    ilp_limit = ilp_time_limit_s if budget_s is None else min(ilp_time_limit_s, budget_s / 4)
    pool = pending = ilp_pending = found_flag = None
    stated = stated_budget_s if budget_s is not None and stated_budget_s is not None else budget_s
    # the pipeline search and the ILP on another core (not when the budget is spent already)
    if (want_pipes or ilp_early) and not past(deadline) and worker_count(workers) > 1:
        found_flag = new_flag()  # raised once a plan that fits is found here: then the worker's pipelines
        # stop at the deadline with what they have (else they go on until one fits)
        pool = worker_pool()
        if want_pipes:
            # in a worker that forks a helper of its own for the simulations: the longest phase on large models
            pending = submit(pool, pipeline_candidates, graph, ctx, tuple(kinds), optimizer, tuple(schedules),
                              deadline, True, flag_raised)
        if ilp_early and not want_pipes:  # else it runs here, after the baselines, while the worker searches
            ilp_pending = submit(pool, ilp_seed, space, ctx, optimizer, ilp_limit, seed, budget_s is None, deadline)
    try:
        bound = lower_bound(graph, ctx, optimizer)
        if not bound > 0:
            raise TraceError(f"the model {graph.model!r} has no operations to parallelize: its forward only returns "
                             "its inputs (or views of them); pass a model whose forward computes something")
        sim = None
        if large:
            base = flat_baselines(graph, ctx, optimizer, deadline)
            ilp_status = f"skipped: {len(graph.nodes)} ops x {cluster.devices} devices > {soap_max_tasks}"
        else:
            sim = Simulator(graph, ctx, optimizer=optimizer)
            base = run_baselines(space, sim, cluster.devices_per_node, deadline)
            ilp_status = "skipped: no SOAP plan asked for"
        # the op-level candidates: data parallel as DDP (or FSDP) runs it, then the best SOAP plan
        candidates: list[tuple[str, object, Simulation]] = []
        data_runs: list[tuple[DataParallel, Simulation]] = []  # every data-parallel run simulated, for the errors
        data_ok = splits(graph, cluster.devices)  # DDP's premise: the batch splits evenly over the devices
        notes: list[str] = []
        if "data" in kinds and not data_ok:
            notes.append(f"no data-parallel plan: {unsplit_reason(graph, cluster.devices)}; use a batch that is a "
                         f"multiple of {cluster.devices} for one (its figure stays the baseline to compare with)")
        pipes: list[PipelineResult] = []

        def fits_here_found() -> bool:
            """Has a plan that fits been found here (not by the worker)?"""
            return any(c[2].feasible for c in candidates)

        def settled() -> bool:
            """Past the deadline with a plan that fits: here, or in the worker's pipeline
            search when it is done (each phase here otherwise goes on past the deadline
            until one fits)."""
            if not past(deadline):
                return False
            if fits_here_found():
                return True
            if pending is not None and pending.done() and pending.exception() is None:
                return any(r.simulation.feasible for r in pending.result()[0])
            return any(r.simulation.feasible for r in pipes)

        if "data" in kinds and "data" in base and data_ok:
            data_runs.append((data_strategy, base["data"].simulation))
            if base["data"].simulation.feasible:
                candidates.append(("data", data_strategy, base["data"].simulation))
            elif settled():
                cut.append("data-parallel variants")
            elif (fit := fitting_variant(graph, data_strategy, ctx, optimizer, sim, deadline, data_runs)) is not None:
                candidates.append(("data", *fit))
        if "fsdp" in kinds and len(graph.nodes) * cluster.devices > FSDP_MAX_TASKS:
            notes.append(f"sharded data parallelism not simulated: {len(graph.nodes)} ops x {cluster.devices} devices "
                         f"> {FSDP_MAX_TASKS}, beyond what the op-level simulator that costs it holds in memory")
        elif "fsdp" in kinds and splits(graph, cluster.devices):
            simulators = {id(graph): sim} if sim is not None else {}  # per runtime graph (predict.runtime_graph)
            units = fsdp_units(graph.modules)
            for shard, group in shardings(cluster):
                if settled():
                    cut.append("sharded data parallelism")
                    break
                sharded = dataclasses.replace(data_strategy, shard=shard, shard_group=group,
                                              fsdp_units=units if shard in FSDP_SHARDINGS else ())
                runs = runtime_graph(graph, sharded, ctx)
                shared = simulators.get(id(runs))
                if shared is None:
                    shared = simulators[id(runs)] = Simulator(runs, ctx, optimizer=optimizer)
                fsdp_sim = predict(graph, sharded, ctx, optimizer=optimizer, timeline=False, simulator=shared)
                data_runs.append((sharded, fsdp_sim))
                if fsdp_sim.feasible:
                    candidates.append(("fsdp", sharded, fsdp_sim))
                elif settled():
                    cut.append("sharded data parallelism")
                    break
                elif (fit := fitting_variant(graph, sharded, ctx, optimizer, shared, deadline, data_runs)) is not None:
                    candidates.append(("fsdp", *fit))
        if found_flag is not None and fits_here_found():
            found_flag.set()
        if ilp_early and pending is not None and not past(deadline):
            # here, while the worker searches the pipelines (queued behind them there, it waited)
            ilp_pending = Future()
            ilp_pending.set_result(ilp_seed(space, ctx, optimizer, ilp_limit, seed, budget_s is None, deadline))
        if meanwhile is not None and pending is not None and not pending.done():
            meanwhile()
        dream = None
        interrupted = False
        if want_pipes and pending is None and settled():
            cut.append("pipeline layouts")  # past the budget with a plan that fits: none searched
        elif want_pipes:
            try:
                pipes, dream, pipes_cut = pending.result() if pending is not None else \
                    pipeline_candidates(graph, ctx, tuple(kinds), optimizer, tuple(schedules), deadline,
                                        elsewhere=fits_here_found)
                if pipes_cut:
                    cut.append("pipeline layouts")
            except KeyboardInterrupt:
                if not candidates:
                    raise
                pipes, dream, interrupted = [], None, True
        if "soap" in kinds and sim is not None and not interrupted:
            seeds = [b.decisions for b in base.values()]
            found = [c[2].iteration_time_s for c in candidates if c[2].feasible]
            found += [r.simulation.iteration_time_s for r in pipes if r.simulation.feasible]
            close = bool(found) and min(found) <= (1 + BOUND_GAP) * bound  # little left for SOAP to gain
            ilp_status = f"skipped: {len(space.units)} decision units > {ilp_max_units}"
            if ilp_pending is not None or (want_ilp and (ilp_early or not close)):
                if ilp_pending is not None:
                    dec, ilp_status = ilp_pending.result()
                elif past(deadline):
                    dec, ilp_status = None, SKIPPED_LATE
                else:
                    left = ilp_limit if deadline is None else min(ilp_limit, (deadline - time.perf_counter()) / 4)
                    dec, ilp_status = ilp_seed(space, ctx, optimizer, left, seed, budget_s is None, deadline)
                if ilp_status in (SKIPPED_LATE, CUT_LATE):
                    cut.append("ILP")
                if dec is not None:
                    seeds.append(dec)
            elif want_ilp:
                ilp_status = (f"skipped: {len(graph.nodes)} ops x {cluster.devices} devices, and a plan within the "
                              "lower bound's gap was found")
            remaining = None if budget_s is None else max(0.0, budget_s - (time.perf_counter() - t0))
            if past(deadline):  # no time to simulate the seeds again: the best baseline as simulated
                # the data baseline is simulated as DDP runs it; a SOAP plan of its decisions runs on DTensor
                runs = [b for k, b in base.items() if b.simulation.feasible and k != "data"]
                if not runs and "data" not in kinds and "data" in base:  # the one SOAP configuration to simulate
                    dec = base["data"].decisions
                    runs = [BaselineRun("data", dec, predict(graph, Soap(space.expand(dec), dec), ctx,
                                                             optimizer=optimizer, timeline=False, simulator=sim))]
                    runs = [b for b in runs if b.simulation.feasible]
                top = min(runs, key=lambda b: b.simulation.iteration_time_s, default=None)
                result = SearchResult(None if top is None else top.decisions, None if top is None else top.simulation,
                                      0, 0, (), 0.0)
            else:
                result = mcmc(space, sim, seeds, max_iters=0 if close else max_iters,
                              budget_s=None if close else remaining, seed=seed, progress=progress, timeline=False,
                              elsewhere=lambda: bool(found))
            interrupted = result.interrupted  # Ctrl-C: keep the best so far
            if not close and past(deadline) and result.iterations < (max_iters or math.inf):
                cut.append(f"MCMC after {result.iterations} steps")
            if close:
                margin = min(found) / bound - 1
                notes.append(f"MCMC skipped: the best plan before it is {margin:.1%} over the lower bound "
                             f"({bound * 1e3:.3f} ms; skipped within {BOUND_GAP:.0%}), so no SOAP plan could be more "
                             f"than {margin:.1%} faster; the SOAP baselines and the ILP's plan compete")
            if result.decisions is None and settled():  # the seeds checkpointed not simulated
                cut.append("checkpointed SOAP plans")
            elif not (result.decisions is not None and result.decisions == base["data"].decisions and "data" in kinds
                      and data_ok) and not interrupted and (found_soap := soap_candidate(
                        graph, space, ctx, optimizer, sim, result, seeds, deadline)) is not None:
                candidates.insert(0, found_soap)
        pipe = next((r for r in pipes if r.simulation.feasible), None)
        oplevel = min(candidates, key=lambda c: (not c[2].feasible, c[2].iteration_time_s, c[2].peak_memory_bytes),
                      default=None)
        if oplevel is None and pipe is None:
            runs = [(data_label(st), s) for st, s in data_runs]
            tried = [*((f"the {k} baseline", b.simulation) for k, b in base.items()), *runs,
                     *((pipeline_label(r), r.simulation) for r in pipes)]
            if cut:  # not "no plan fits": the budget stopped the search before one that fits was simulated
                raise budget_error(stated, cut, tried)
            if set(kinds) >= {"data", "soap", "pipeline", "hybrid"}:
                raise infeasible_error(tried, cluster)
            raise PlanKindError(no_plan_reason(kinds, base, pipes, cluster, data_runs=runs,
                                               unsplit=unsplit_reason(graph, cluster.devices)))
        baselines = {k: b.simulation.iteration_time_s for k, b in base.items() if b.simulation.feasible}
        infeasible = [k for k, b in base.items() if not b.simulation.feasible]
        if dream is not None:
            if dream.simulation.feasible:
                baselines["pipedream"] = dream.simulation.iteration_time_s
            else:
                infeasible.append("pipedream")
        if cut:
            late = time.perf_counter() - deadline if deadline is not None else 0.0
            past_note = f"; it ended {late:.1f} s past the budget" if late > OVERRUN * stated else ""
            notes.append(f"budget {stated:g} s: cut short: {', '.join(cut)} (the best plan found so far{past_note})")
        search = SearchInfo(seed=seed, max_iters=max_iters, budget_s=stated, iterations=result.iterations,
                            ilp=ilp_status, curve=tuple((it, t) for it, _, t in result.improvements))
        spread = ctx.calibration.step_spread if ctx.calibration is not None else None
        common = dict(lower_bound_s=bound, search=search, optimizer=optimizer, objective=objective,
                      infeasible_baselines=tuple(infeasible), noise=spread.value if spread is not None else None)
        if pipe is not None and (oplevel is None or pipe.simulation.iteration_time_s < oplevel[2].iteration_time_s):
            # the best SOAP configuration (data parallel in every op is one too) and the best sharded
            # data-parallel plan; the data baseline is DDP's
            if result.simulation is not None and result.simulation.feasible:
                baselines["soap"] = result.simulation.iteration_time_s
            if (fsdp := min((c[2] for c in candidates if c[0] == "fsdp" and c[2].feasible), default=None,
                            key=lambda f: f.iteration_time_s)) is not None:
                baselines["fsdp"] = fsdp.iteration_time_s
            plan = plan_from(graph, cluster, pipe.strategy, pipe.simulation, baselines=baselines,
                             configs=pipe.configs, **common)
            if pipe.shard != "none":
                notes.append(sharding_note(pipe, pipes))
            if notes:
                plan = plan.model_copy(update={"notes": (*plan.notes, *notes)})
            return plan.with_search_time(time.perf_counter() - t0)
        if pipe is not None:
            baselines["pipeline"] = pipe.simulation.iteration_time_s
        assert oplevel is not None
        _, strategy, s = oplevel
        plan = plan_from(graph, cluster, strategy, s, baselines=baselines, **common)
        notes += oplevel_notes(strategy, s, candidates, data_strategy, baselines)
        if notes:
            plan = plan.model_copy(update={"notes": (*plan.notes, *notes)})
        if interrupted:
            plan = plan.model_copy(update={"notes": (*plan.notes, (
                f"search interrupted (Ctrl-C) after {result.iterations} MCMC steps: the best plan found so far, "
                "the phases after the interrupted one (MCMC after pipelines, decentralized plans) not searched"),)})
            plan = plan.with_interrupted()
        return plan.with_search_time(time.perf_counter() - t0)
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)


def pipeline_candidates(graph: OpGraph, ctx: CostContext, kinds: tuple[str, ...], optimizer: str,
                        schedules: tuple[str, ...], deadline: float | None = None, helper: bool = False,
                        elsewhere: Callable[[], bool] | None = None,
                        ) -> tuple[list[PipelineResult], PipelineResult | None, bool]:
    """Step 3 (module docstring): the pipeline and hybrid layouts of ``kinds``, best
    first, PipeDream's own plan (None where it does not apply), and whether ``deadline``
    cut the search short. ``helper``: simulate the layouts two at a time; ``elsewhere()``:
    the planner has a plan that fits, so the deadline stops the search even before a
    layout that fits is found (:func:`~flexsearch.search.pipeline.search_pipelines`)."""
    found = search_pipelines(graph, ctx, optimizer=optimizer, schedules=schedules, deadline=deadline, helper=helper,
                             elsewhere=elsewhere)
    pipes = [r for r in found.results if r.kind in kinds]
    if found.cut or past(deadline):
        return pipes, None, True
    if not pipes and not {"data", "soap", "fsdp"} & set(kinds):  # a layout the emitter always runs
        pipes = [r for s in schedules for t in (1, 2)
                 if (r := even_pipeline(graph, ctx, s, t, optimizer=optimizer)) is not None and r.kind in kinds]
        pipes.sort(key=lambda r: (not r.simulation.feasible, r.simulation.iteration_time_s))
    return pipes, pipedream_plan(graph, ctx, optimizer=optimizer), False


__all__ = ["DEFAULT_KINDS", "DEFAULT_MAX_ITERS", "plan_graph", "graph_inputs", "predicted"]
