"""Decentralized (D-PSGD) candidates and the centralized baselines they are judged against.

Pure functions of (graph, cluster, options):

- the replica cost (:func:`flexsearch.sim.stages.replica_cost`): one data-parallel
  replica's step on its ``B / n`` slice, costed exactly as the ``"data"`` baseline's
  one-bucket replica (:func:`flexsearch.sim.predict.predict`: the microbatch graph of
  ``B / n`` samples, every op whole on one device of the cluster's type, summed into one
  stage). The op-level data-parallel simulation gives the same per-device compute (a
  test checks it), but it all-reduces every layer's gradients separately, each paying
  the collective's full latency, which on a high-latency network costs seconds per
  iteration; the stage-level form does one all-reduce after the backward (DDP with one
  bucket, what DDP does for a model under its 25 MB bucket size) and is the stronger
  all-reduce baseline, so D-PSGD is judged against it.
- :func:`decentralized_candidates`: D-PSGD on every applicable topology
  (:data:`DEFAULT_TOPOLOGIES`), each simulated by
  :func:`~flexsearch.sim.decentralized.simulate_gossip`, with its
  :func:`~flexsearch.strategy.topology.iterations_factor` and its **effective time**::

      effective_time_s = iteration_time_s                      (objective "iteration")
      effective_time_s = iteration_time_s * iterations_factor  (objective "time_to_accuracy")

  i.e. the time per iteration of synchronous SGD that reaches the same accuracy, so it
  compares directly with a synchronous plan's iteration time (whose factor is 1).
- :func:`centralized_baselines`: parameter server with one server (``"ps"``) and
  sharded over every worker (``"ps-sharded"``, up to :data:`PS_SHARDED_MAX_DEVICES`:
  its exchange is ``n (n - 1)`` transfers, 9.4 million on 3,072 devices, a minute to
  cost), optionally all-reduce (``"all-reduce"``, the ``"data"`` baseline's number), on
  the same replica cost.
- :func:`explain`: one line saying why the best decentralized candidate wins or loses
  against the best synchronous plan.
- :func:`with_decentralized`: the planner's last stage, the best synchronous plan
  against all of these, replaced by the best candidate when it wins by more than
  :data:`DECENTRALIZED_MARGIN`.

**Topologies tried** (:func:`candidate_topologies`): ring; torus when ``n`` has a
factorisation (not prime); the static exponential graph (any ``n``: offsets ``2^k < n``);
the one-peer exponential graph when ``n`` is a power of two; the complete graph up to
:data:`COMPLETE_MAX_RANKS` ranks. Beyond that the complete graph is skipped: every rank
sends ``n - 1`` whole models per iteration and keeps ``n - 1`` receive buffers, for the
exact average an all-reduce computes with ``2 (n-1)/n`` model sizes of traffic, so
all-reduce dominates it (and its ``n (n-1)`` transfers only slow the simulation). A rank
count of 1 has no decentralized plan (nothing to exchange).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from flexsearch.errors import PlanKindError, TopologyError
from flexsearch.graph.opgraph import OpGraph
from flexsearch.plan import Plan
from flexsearch.report import fmt_bytes
from flexsearch.search.clock import past
from flexsearch.search.reasons import unsplit_fix
from flexsearch.search.results import plan_from
from flexsearch.search.variants import unsplit_reason
from flexsearch.sim.context import CostContext
from flexsearch.sim.decentralized import (
    simulate_all_reduce,
    simulate_gossip,
    simulate_parameter_server,
)
from flexsearch.sim.pipeline_layout import StageCost
from flexsearch.sim.result import Simulation
from flexsearch.sim.stages import replica_cost
from flexsearch.strategy.convergence import DEFAULT_CONSTANTS, Constants
from flexsearch.strategy.kinds import Decentralized
from flexsearch.strategy.topology import Topology, build, iterations_factor

DEFAULT_TOPOLOGIES = ("ring", "torus", "exponential", "one_peer_exponential", "complete")
COMPLETE_MAX_RANKS = 64
PS_SHARDED_MAX_DEVICES = 1024
"""Largest cluster the sharded parameter server is simulated on (module docstring)."""
"""Largest rank count the complete graph is tried on (module docstring)."""
OBJECTIVES = ("iteration", "time_to_accuracy")


@dataclass(frozen=True)
class DecentralizedResult:
    """One simulated D-PSGD candidate."""

    topology: Topology
    simulation: Simulation
    iterations_factor: float
    """Iterations to the same accuracy relative to synchronous SGD (>= 1)."""
    effective_time_s: float
    """The objective's time (module docstring)."""
    objective: str = "iteration"

    @property
    def name(self) -> str:
        return self.topology.name

    @property
    def spectral_gap(self) -> float:
        return self.topology.spectral_gap

    @property
    def iteration_time_s(self) -> float:
        return self.simulation.iteration_time_s

    @property
    def strategy(self) -> Decentralized:
        return Decentralized(self.topology)


def _order(r: DecentralizedResult) -> tuple[bool, float]:
    return (not r.simulation.feasible, r.effective_time_s)


def best_candidate(results: Sequence[DecentralizedResult]) -> DecentralizedResult | None:
    """The fastest candidate under its objective, feasible ones first (None for none)."""
    return min(results, key=_order, default=None)


def _check_objective(objective: str) -> str:
    if objective not in OBJECTIVES:
        raise ValueError(f"unknown objective {objective!r}; use one of {', '.join(OBJECTIVES)}")
    return objective


def effective_time(iteration_time_s: float, factor: float, objective: str = "iteration") -> float:
    """``iteration_time_s`` for objective ``"iteration"``, times ``factor`` for
    ``"time_to_accuracy"``."""
    return iteration_time_s * (factor if _check_objective(objective) == "time_to_accuracy" else 1.0)


def candidate_topologies(n: int, names: Iterable[str | Topology] = DEFAULT_TOPOLOGIES
                         ) -> tuple[list[Topology], dict[str, str]]:
    """The topologies to simulate on ``n`` ranks, and why each other one is skipped
    (name -> one-line reason). ``names`` may mix names and built :class:`Topology`
    values (a custom graph)."""
    out: list[Topology] = []
    skipped: dict[str, str] = {}
    if n < 2:
        return out, {str(getattr(x, "name", x)): "one rank: nothing to exchange" for x in names}
    for x in names:
        if isinstance(x, Topology):
            if x.n != n:
                skipped[x.name] = f"built for {x.n} ranks, not {n}"
            else:
                out.append(x)
            continue
        if x == "complete" and n > COMPLETE_MAX_RANKS:
            skipped[x] = (f"n = {n} > {COMPLETE_MAX_RANKS}: n-1 models sent and buffered per rank "
                          "for the exact average all-reduce gives with 2 models of traffic")
            continue
        try:
            out.append(build(x, n))
        except TopologyError as e:
            skipped[x] = str(e)
    return out, skipped


def decentralized_candidates(
    graph: OpGraph,
    ctx: CostContext,
    *,
    optimizer: str = "adam",
    objective: str = "iteration",
    topologies: Iterable[str | Topology] = DEFAULT_TOPOLOGIES,
    cost: StageCost | None = None,
    timeline: bool = False,
    noise_ratio: float = 100.0,
    heterogeneity_ratio: float = 0.0,
    deadline: float | None = None,
) -> list[DecentralizedResult]:
    """Every applicable topology's D-PSGD iteration on ``ctx``'s cluster (module docstring),
    sorted feasible first, then by ``effective_time_s``. ``cost`` (default
    :func:`replica_cost` of ``graph``; ``graph`` is not read when it is given) lets a
    caller cost the replica once for several calls;
    ``noise_ratio`` and ``heterogeneity_ratio`` go to
    :func:`~flexsearch.strategy.topology.iterations_factor`. Past ``deadline`` (a
    ``time.perf_counter()`` time) no more topologies are simulated after the first.
    Raises ValueError when the batch does not split over the devices."""
    _check_objective(objective)
    tops, _ = candidate_topologies(ctx.cluster.devices, topologies)
    if not tops:
        return []
    if cost is None:
        cost = replica_cost(graph, ctx)
    out = []
    for top in tops:
        if out and past(deadline):  # at least one, so that a decentralized plan exists to compare
            break
        sim = simulate_gossip(ctx, cost, top, optimizer=optimizer, timeline=timeline)
        factor = iterations_factor(top, noise_ratio=noise_ratio, heterogeneity_ratio=heterogeneity_ratio)
        out.append(DecentralizedResult(top, sim, factor, effective_time(sim.iteration_time_s, factor, objective),
                                       objective))
    out.sort(key=_order)
    return out


def centralized_baselines(
    graph: OpGraph,
    ctx: CostContext,
    *,
    optimizer: str = "adam",
    cost: StageCost | None = None,
    all_reduce: bool = False,
    timeline: bool = False,
) -> dict[str, Simulation]:
    """``{"ps": one server (device 0), "ps-sharded": a shard on every device}`` (the
    latter up to :data:`PS_SHARDED_MAX_DEVICES`), plus ``"all-reduce"`` (the ``"data"``
    baseline's simulation) with ``all_reduce=True``, on the same replica cost as
    :func:`decentralized_candidates` (empty on one device)."""
    n = ctx.cluster.devices
    if n < 2:
        return {}
    if cost is None:
        cost = replica_cost(graph, ctx)
    out = {"ps": simulate_parameter_server(ctx, cost, servers=(0,), optimizer=optimizer, timeline=timeline)}
    if n <= PS_SHARDED_MAX_DEVICES:
        out["ps-sharded"] = simulate_parameter_server(ctx, cost, servers=range(n), optimizer=optimizer,
                                                      timeline=timeline)
    if all_reduce:
        out["all-reduce"] = simulate_all_reduce(ctx, cost, optimizer=optimizer, timeline=timeline)
    return out


def _t(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "inf"
    if seconds >= 1.0:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds * 1e6:.0f} us"


def explain(best: DecentralizedResult | Sequence[DecentralizedResult] | None, sync_name: str,
            sync_time_s: float, *, objective: str = "iteration", reason: str = "",
            factor_source: str = "") -> str:
    """One line: why the best decentralized candidate wins or loses against the best
    synchronous plan (``sync_name`` at ``sync_time_s`` per iteration) under
    ``objective``, naming the objective and, when given, where the iterations factor
    comes from (``factor_source``). ``best`` may be the candidate list (its best feasible
    entry is used); ``reason`` says why there is no candidate when there is none. Pure."""
    _check_objective(objective)
    if best is not None and not isinstance(best, DecentralizedResult):
        best = best_candidate(best)
    line = _explain(best, sync_name, sync_time_s, objective, reason)
    source = f"; iterations factor: {factor_source}" if factor_source and best is not None else ""
    return f"objective {objective}: {line}{source}"


def _explain(best: DecentralizedResult | None, sync_name: str, sync_time_s: float, objective: str,
             reason: str) -> str:
    sync = f"{sync_name} {_t(sync_time_s)}/iter"
    if best is None:
        why = f" ({reason})" if reason else ""
        return f"no decentralized candidate{why}; {sync} is the plan"
    it = best.iteration_time_s
    head = f"{best.name} D-PSGD {_t(it)}/iter"
    if not best.simulation.feasible:
        sim = best.simulation
        return (f"{head} does not fit ({fmt_bytes(sim.peak_memory_bytes)} > "
                f"{fmt_bytes(sim.capacity_bytes)} per device: its receive buffers); {sync} wins")
    factor = best.iterations_factor
    if objective == "iteration":
        if it < sync_time_s:
            return (f"{head} beats {sync} ({sync_time_s / it:.2f}x per iteration; it needs "
                    f"{factor:.2f}x iterations to the same accuracy, which this objective ignores)")
        return f"{head} is no faster than {sync} ({it / sync_time_s:.2f}x its time); {sync_name} wins"
    eff = best.effective_time_s
    if eff < sync_time_s:
        return (f"{head} x {factor:.2f} iterations = {_t(eff)} per synchronous iteration beats {sync} "
                f"({sync_time_s / eff:.2f}x faster to the same accuracy)")
    if it < sync_time_s:
        return (f"{head} but needs {factor:.2f}x iterations ({_t(eff)} per synchronous iteration); "
                f"{sync} wins on time to accuracy")
    return f"{head} is no faster than {sync} even per iteration (and needs {factor:.2f}x iterations); {sync_name} wins"


DECENTRALIZED_MARGIN = 0.10
"""A D-PSGD plan replaces the synchronous plan only when its effective time is more than
this fraction shorter: it changes the algorithm (the ranks' models differ; a checkpoint
needs their average), and a predicted gain below the simulator's typical error is no
evidence. 10% is that error as measured: the median |time error| of predicted against
measured iterations in ``benchmarks/fidelity.py`` runs was 8.3%, 10.7%, 12.4%, 15.1% and
19.4% (benchmarks/README.md), and a measured iterations factor resolves 5%
(:data:`flexsearch.strategy.convergence.RESOLUTION`). Under ``iteration`` the extra
iterations are not counted at all."""


@dataclass(frozen=True)
class DecentralizedRuns:
    """What :func:`with_decentralized` simulates, none of which needs the synchronous
    plan (the planner runs it while its worker searches the pipelines): the D-PSGD
    candidates, the parameter-server baselines, and what the budget cut (``unsplit``:
    why the batch does not split over the devices, when it does not; then nothing was
    simulated)."""

    candidates: tuple[DecentralizedResult, ...] = ()
    central: tuple[tuple[str, Simulation], ...] = ()
    cut: tuple[str, ...] = ()
    unsplit: str | None = None


def simulate_decentralized(graph: OpGraph, ctx: CostContext, *, optimizer: str, objective: str,
                           convergence: Constants = DEFAULT_CONSTANTS,
                           deadline: float | None = None) -> DecentralizedRuns:
    """The simulations of :func:`with_decentralized` (:class:`DecentralizedRuns`) on a
    cluster of two devices or more: every applicable topology's D-PSGD, then the
    parameter servers, on one replica cost. Past ``deadline`` (a ``time.perf_counter()``
    time) no more topologies are simulated after the first, nor the parameter servers."""
    try:
        cost = replica_cost(graph, ctx)
    except ValueError as e:  # the batch does not split over the devices (each rank's share)
        return DecentralizedRuns(unsplit=unsplit_reason(graph, ctx.cluster.devices) or str(e))
    cands = decentralized_candidates(graph, ctx, optimizer=optimizer, objective=objective, cost=cost,
                                     noise_ratio=convergence.noise_ratio,
                                     heterogeneity_ratio=convergence.heterogeneity_ratio, deadline=deadline)
    cut = []
    late = past(deadline)
    if late and len(cands) < (tops := len(candidate_topologies(ctx.cluster.devices)[0])):
        cut.append(f"{tops - len(cands)} of {tops} D-PSGD topologies")
    central = {} if late else centralized_baselines(graph, ctx, optimizer=optimizer, cost=cost)
    if late:
        cut.append("the parameter-server baselines")
    return DecentralizedRuns(tuple(cands), tuple(central.items()), tuple(cut))


def with_decentralized(plan: Plan, graph: OpGraph, ctx: CostContext, *, allow: bool = True,
                       require: bool = False, convergence: Constants = DEFAULT_CONSTANTS,
                       deadline: float | None = None, runs: DecentralizedRuns | None = None) -> Plan:
    """``plan`` (the best synchronous plan) against D-PSGD on every applicable topology
    and the parameter-server baselines, on the same replica
    cost. The best decentralized candidate replaces ``plan`` when ``allow`` and its
    effective time under the plan's objective (iteration time, times its iterations
    factor for ``time_to_accuracy``) is shorter, or whenever one fits with ``require``
    (``kinds=("decentralized",)``); the parameter servers join the baselines; the plan's
    ``notes`` say why D-PSGD was chosen or rejected, under which objective, and where the
    iterations factor's constants (``convergence``) come from. Past ``deadline`` (a
    ``time.perf_counter()`` time) no more topologies are simulated after the first, nor
    the parameter servers, and a note says so. ``runs``: the simulations made already
    (:func:`simulate_decentralized` with the plan's optimizer and objective), else made
    here."""
    if ctx.cluster.devices < 2:
        if require:
            raise PlanKindError("no decentralized plan on one device: there is nothing to exchange; "
                                "use --devices 2 or more")
        return plan
    if runs is None:
        runs = simulate_decentralized(graph, ctx, optimizer=plan.optimizer, objective=plan.objective,
                                      convergence=convergence, deadline=deadline)
    if runs.unsplit is not None:
        why = runs.unsplit
        if require:
            fix = f"; {unsplit_fix(why, ctx.cluster.devices)}" if "does not split evenly" in why else ""
            raise PlanKindError(f"no decentralized plan: {why}{fix}") from None
        note = explain(None, plan.kind, plan.predicted.iteration_time_s, objective=plan.objective, reason=why)
        return plan.model_copy(update={"notes": (*plan.notes, note)})
    cands, central, cut = list(runs.candidates), dict(runs.central), list(runs.cut)
    baselines = dict(plan.baselines)
    infeasible = list(plan.infeasible_baselines)
    for name, sim in central.items():
        if sim.feasible:
            baselines[name] = sim.iteration_time_s
        else:
            infeasible.append(name)
    note = explain(cands, plan.kind, plan.predicted.iteration_time_s, objective=plan.objective,
                      factor_source=convergence.origin)
    if cut:
        note += f"; the budget cut short: {', '.join(cut)} not simulated"
    best = best_candidate(cands)
    if best is not None and not best.simulation.feasible:
        best = None
    margin = DECENTRALIZED_MARGIN
    wins = best is not None and best.effective_time_s < plan.predicted.iteration_time_s
    if require:
        if best is None:
            why = "no topology fits in memory" if cands else "no topology applies to this device count"
            raise PlanKindError(f"no decentralized plan on {ctx.cluster.devices} devices: {why}")
        wins = True
    elif wins and best.effective_time_s * (1 + margin) >= plan.predicted.iteration_time_s:
        note += f"; not returned: less than {margin:.0%} faster, not worth changing the algorithm"
        wins = False
    elif wins and not allow:
        note += "; not returned: decentralized plans are switched off"
    update = {"baselines": baselines, "infeasible_baselines": tuple(infeasible), "notes": (*plan.notes, note)}
    if not (allow or require) or not wins:
        return plan.model_copy(update=update)
    baselines[plan.kind] = plan.predicted.iteration_time_s
    return plan_from(graph, ctx.cluster, best.strategy, best.simulation, like=plan, **update,
                     iterations_factor=best.iterations_factor)
