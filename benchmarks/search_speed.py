"""Search speed: full vs delta simulation throughput, and time to converge on GPT-2 XL.

1. Simulations per second, GPT-2 small (zoo batch 512) on 8 x ``dgx-h100``:

   - *full*: a fresh ``Simulator(graph, cluster)`` per simulation (no fragment cache) on
     random decisions (a random candidate for every decision unit, seeded);
   - *delta*: one ``Simulator``; each step gives one random unit a random other candidate
     and simulates, as an MCMC step does (only the changed fragments are rebuilt).

   Both include ``Space.expand`` and run as the search runs them: without the timeline
   and with Python's cyclic garbage collector paused
   (:func:`flexsearch.collector.cycles_paused`; with it running, full simulations
   lose a third to a half of their speed to it, delta ones a sixth to a third, and the ratio looks
   better than the planner sees it: ``paused_full_speedup=`` and
   ``paused_delta_speedup=``, the rates paused over the rates with it running, measured
   in rounds of their own after the paused ones). The
   two are measured back to back in the same process, ``--rounds`` times interleaved;
   the figures are the medians over the rounds. Target ([v2 4/6]): delta / full >= 10.
   ``delta_bound=``: a full simulation's time over the time a delta simulation spends
   building the fragments it changes (``delta_rebuilt=`` per move), measured apart
   (:func:`delta_build`): the most ``delta_over_full`` could reach if assembling and
   scheduling the tasks took no time. ``delta_retimed=``: the median share of the
   scheduled tasks a move retimes or rebuilds (:func:`retimed`), what an incremental
   schedule would still visit; ``delta_incremental_bound=``: a full simulation's time
   over the builds plus that share of the list schedule's time, the most such a
   schedule could reach with everything else free. ``delta_unscheduled_bound=``: a full
   simulation's time over a delta simulation's less its list schedule (measured in the
   same walk), the most a compiled list scheduler alone could reach; ``delta_fed_bound=``,
   the same with the time it takes to hand it each step's task list (:func:`task_arrays`).

   And MCMC iterations per second on the same graph and cluster, from the baselines'
   seeds, ``--mcmc-iters`` iterations (seeded) with one fragment kept per node against
   :data:`flexsearch.sim.simulator.FRAGMENTS_KEPT` (a rejected step returns to the
   configuration before it): ``mcmc_rebuilt_one=``, ``mcmc_rebuilt_kept=`` (fragments
   built per iteration) and ``mcmc_kept_speedup=`` (iterations per second, kept over
   one; the two chains are checked to end on the same plan). Then, on GPT-2 small at
   batch 64 (where plans fit, so that there is a best plan to reject against), the
   chain with every proposal simulated in full against the same chain with the
   proposals sure to be rejected cut short (:func:`flexsearch.search.mcmc.mcmc`'s
   ``cutoff``; ``--rounds`` times alternating, medians): ``mcmc_cutoff_speedup=``
   (iterations per second, cut over full) and ``mcmc_cut_share=`` (the proposals cut).
   The chains are checked to be the same. Then the list schedule of a large cluster's
   simulations: GPT 18.4B (Megatron's row; ``--quick``: 1.7B) on its A100s, the task
   lists of its baseline recipes scheduled with the links every task loads together
   merged and with each link apart (:func:`link_rates`, three rounds alternating;
   ``--quick`` one): ``links_merged_speedup=``, the schedules checked to be the same;
   and the same for a pipeline's: GPT 1T (``--quick``: 39.1B) in Megatron's layout at
   one sample per microbatch, ``pipeline_links_merged_speedup=``.
   Then the gossip topologies D-PSGD's candidates read on Megatron's largest row: ring,
   torus and exponential on 3,072 ranks (``--quick``: 1,024), built cold with every
   rank's neighbours read off their generators against their dense matrices
   (:func:`gossip_rates`): ``gossip_generator_speedup=``, the neighbours checked equal.

2. Time to converge of the search on GPT-2 XL over 8 and 64 x ``dgx-h100``: the
   planner's stages run directly (as ``plan_graph`` runs them: baselines, the ILP seed
   with its time limit ``min(10 s, budget / 4)``, then MCMC seeded with both for the rest
   of ``--budget-8`` / ``--budget-64`` seconds), so that the MCMC's ``improvements`` are
   at hand. *Converged* = the time, from the start of the search (tracing excluded, it is
   reported apart), of the last improvement of the best feasible plan. Targets: <= 30 s
   on 8 devices, <= 120 s on 64.

   Batch: at the zoo batch (512 x 1024 tokens) no plan of GPT-2 XL fits in 80 GB on 8
   devices (data parallel needs 618 GiB per device, Megatron more) nor on 64 (97.6 GiB),
   and the planner raises ``InfeasiblePlanError``. So by default the batch is
   ``--per-device-batch`` 4 samples per device (32 on 8 devices, 256 on 64), where data
   parallel fits (~60 GiB). With ``--per-device-batch 0`` the zoo batch is used and,
   when nothing feasible is found, convergence is the time of the last improvement of
   the best *penalised* cost (the MCMC objective, :func:`flexsearch.search.mcmc.cost_of`),
   recorded by wrapping the simulator.

3. Time to a plan, end to end (tracing included), on every case of [v2 4/6]'s table:
   :mod:`plan_time`'s cases (``xl8``, ``m1_7b``, ``m18_4b``, ``g175b``, ``m1t``; with
   ``--quick`` its GPT-2 small case only), each reported as ``<key>_s`` with
   ``<key>_over`` (the budget overrun) and ``<key>_ok`` (a plan came back).

    python benchmarks/search_speed.py                # full: budgets 60 s and 150 s, every plan_time case
    python benchmarks/search_speed.py --quick        # budgets 2 s and 3 s, one round (a smoke run)

Last line: ``full_sims_per_s=... delta_sims_per_s=... delta_over_full=... delta_rebuilt=...
delta_bound=... delta_retimed=... delta_incremental_bound=... delta_unscheduled_bound=...
delta_fed_bound=... mcmc_rebuilt_one=...
mcmc_rebuilt_kept=... mcmc_kept_speedup=... mcmc_cutoff_speedup=... mcmc_cut_share=...
links_merged_speedup=... pipeline_links_merged_speedup=... gossip_generator_speedup=... converge_xl8_s=... converge_xl64_s=...`` (plus tracing, seeding and speedup-over-data figures) and the
plan times of part 3.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from array import array
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import plan_time  # noqa: E402
from zoo import build, get  # noqa: E402

import flexsearch  # noqa: E402
from flexsearch.collector import cycles_paused  # noqa: E402
from flexsearch.cost.hardware import Cluster  # noqa: E402
from flexsearch.search.assignment import AssignmentBuilder  # noqa: E402
from flexsearch.search.baselines import lower_bound, run_baselines  # noqa: E402
from flexsearch.search.mcmc import cost_of, mcmc  # noqa: E402
from flexsearch.sim.context import CostContext  # noqa: E402
from flexsearch.sim.simulator import Simulator  # noqa: E402
from flexsearch.strategy.space import Space  # noqa: E402

CLUSTER = "dgx-h100"
CUTOFF_BATCH = 64
"""GPT-2 small's batch for :func:`cutoff_rates`: 8 samples per device, where plans fit
(at the zoo batch none does, and with no best plan no proposal is cut)."""


def trace(name: str, **kwargs):
    model, inputs = build(get(name), **kwargs)
    return flexsearch.trace(model, inputs)


# ------------------------------------------------------------------ 1. sims per second


def move(rng: random.Random, units: list, cands: dict, dec: dict) -> None:
    """One random unit of ``dec`` to a random other candidate (an MCMC step's move)."""
    u = units[rng.randrange(len(units))]
    options = [c for c in cands[u.name] if c != dec[u.name]]
    dec[u.name] = options[rng.randrange(len(options))]


def walk(graph, cluster: Cluster, seed: int) -> tuple[Space, list, dict, random.Random, dict]:
    """A random walk's start: the space, its units with a choice, their candidates, the
    walk's generator (seeded) and random decisions drawn from it."""
    space = Space(graph, cluster.devices)
    units = [u for u in space.units if len(space.candidates(u)) > 1]
    cands = {u.name: space.candidates(u) for u in units}
    rng = random.Random(seed)
    return space, units, cands, rng, {u.name: rng.choice(cands[u.name]) for u in units}


def sim_rates(
    graph, cluster: Cluster, rounds: int, seconds: float, seed: int = 0
) -> tuple[list[float], list[float]]:
    """Per round: full and delta simulations per second, each run for ~``seconds``."""
    space, units, cands, rng, dec = walk(graph, cluster, seed)

    def random_decisions() -> dict:
        return {u.name: rng.choice(cands[u.name]) for u in units}

    ctx = CostContext(cluster)
    delta_sim = Simulator(graph, ctx)
    delta_sim.simulate(space.expand(dec), timeline=False)  # warm the fragment cache
    full, delta = [], []
    for _ in range(rounds):
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            Simulator(graph, CostContext(cluster)).simulate(space.expand(random_decisions()), timeline=False)
            n += 1
        full.append(n / (time.perf_counter() - t0))
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            move(rng, units, cands, dec)
            delta_sim.simulate(space.expand(dec), timeline=False)
            n += 1
        delta.append(n / (time.perf_counter() - t0))
    return full, delta


def task_arrays(ordered) -> tuple:
    """The least Python work that hands a task list to a compiled list scheduler: each
    task's kind, duration, resources, and its dependency and defined keys as integers
    (each key interned on first sight), flattened into typed arrays with each task's
    offsets. What a compiled ``run_tasks`` fed today's task lists would cost on top of
    its own run (:func:`delta_build`)."""
    kinds = {"fwd": 0, "bwd": 1, "xfer": 2, "coll": 3, "update": 4}
    ids: dict = {}
    intern = ids.setdefault
    kind, dur, res, deps, defs = array("b"), array("d"), array("i"), array("i"), array("i")
    at_res, at_deps, at_defs = array("i"), array("i"), array("i")
    for t in ordered:
        kind.append(kinds[t.kind])
        dur.append(t.duration)
        at_res.append(len(res))
        res.extend(t.resources)
        at_deps.append(len(deps))
        for k in t.deps:
            deps.append(intern(k, len(ids)))
        at_defs.append(len(defs))
        for k in t.defines:
            defs.append(intern(k, len(ids)))
    return kind, dur, res, deps, defs, at_res, at_deps, at_defs


def delta_build(graph, cluster: Cluster, moves: int, seed: int = 0) -> tuple[float, float, float, float, float]:
    """Seconds per delta simulation spent building fragments, fragments built per move,
    seconds per delta simulation spent in the list schedule (``run_tasks``), and seconds
    per delta simulation in all (``Space.expand`` included, as :func:`sim_rates` times
    it), over ``moves`` random moves (as :func:`sim_rates`' delta rounds). A delta
    simulation cannot take less than its builds: a full simulation's time over this is
    the most ``delta_over_full`` could reach with assembly and scheduling free; over the
    whole less the schedule, the most it could reach with the schedule alone free (a
    compiled list scheduler, everything else as it is). Last, seconds per delta
    simulation that :func:`task_arrays` takes over the task lists the walk scheduled
    (timed after the walk): what such a scheduler would also cost, fed today's lists."""
    import flexsearch.sim.simulator as simulator

    space, units, cands, rng, dec = walk(graph, cluster, seed + 1)
    sim = Simulator(graph, CostContext(cluster))
    sim.simulate(space.expand(dec), timeline=False)
    build, schedule, spent = simulator.build_fragment, simulator.run_tasks, {"build": 0.0, "schedule": 0.0}

    def timed(fn, what):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[what] += time.perf_counter() - t0
        return run

    before, whole, lists = sim.rebuilt, 0.0, []
    timed_schedule = timed(schedule, "schedule")

    def scheduled(ordered, *args, **kwargs):
        lists.append(ordered)
        return timed_schedule(ordered, *args, **kwargs)

    simulator.build_fragment, simulator.run_tasks = timed(build, "build"), scheduled
    try:
        for _ in range(moves):
            move(rng, units, cands, dec)
            t0 = time.perf_counter()
            sim.simulate(space.expand(dec), timeline=False)
            whole += time.perf_counter() - t0
    finally:
        simulator.build_fragment, simulator.run_tasks = build, schedule
    t0 = time.perf_counter()
    for ordered in lists:
        task_arrays(ordered)
    feed = time.perf_counter() - t0
    return (spent["build"] / moves, (sim.rebuilt - before) / moves, spent["schedule"] / moves, whole / moves,
            feed / moves)


def retimed(graph, cluster: Cluster, moves: int, seed: int = 0) -> list[float]:
    """Per random move (as :func:`sim_rates`' delta rounds), the share of the scheduled
    tasks whose start or end time differs from the simulation before the move, or that
    the move rebuilt: what an incremental schedule, rescheduling only the tasks a move
    affects, would still have to visit."""
    space, units, cands, rng, dec = walk(graph, cluster, seed + 2)
    sim = Simulator(graph, CostContext(cluster))
    kept = sim.simulate(space.expand(dec)).timeline  # held: no task of it is freed and its id reused
    shares = []
    for _ in range(moves):
        move(rng, units, cands, dec)
        timeline = sim.simulate(space.expand(dec)).timeline  # the same tasks as without the timeline
        before = {id(s.task): (s.start, s.end) for s in kept}
        shares.append(sum(before.get(id(s.task)) != (s.start, s.end) for s in timeline) / len(timeline))
        kept = timeline
    return shares


def mcmc_rates(graph, cluster: Cluster, iters: int, seed: int = 0) -> dict[str, float]:
    """MCMC with one fragment kept per node, then with ``FRAGMENTS_KEPT`` (module
    docstring): fragments built per iteration and iterations per second of each."""
    import flexsearch.sim.simulator as simulator

    space = Space(graph, cluster.devices)
    kept = simulator.FRAGMENTS_KEPT
    out, best = {}, {}
    try:
        for name, keep in (("one", 1), ("kept", kept)):
            simulator.FRAGMENTS_KEPT = keep
            sim = Simulator(graph, CostContext(cluster))
            seeds = [b.decisions for b in run_baselines(space, sim, cluster.devices_per_node).values()]
            before, t0 = sim.rebuilt, time.perf_counter()
            r = mcmc(space, sim, seeds, max_iters=iters, seed=seed, early_stop=False)
            out[name] = (r.iterations / (time.perf_counter() - t0), (sim.rebuilt - before) / r.iterations)
            best[name] = (r.decisions, r.simulation.iteration_time_s if r.simulation else None)
    finally:
        simulator.FRAGMENTS_KEPT = kept
    if best["one"] != best["kept"]:
        raise AssertionError("keeping fragments changed the MCMC's result")
    return {"mcmc_rebuilt_one": out["one"][1], "mcmc_rebuilt_kept": out["kept"][1],
            "mcmc_kept_speedup": out["kept"][0] / out["one"][0]}


class CuttingSimulator(Simulator):
    """Counts the simulations a cutoff stopped (:func:`flexsearch.search.mcmc.mcmc`)."""

    cut = 0

    def simulate(self, configs, **kw):
        s = super().simulate(configs, **kw)
        self.cut += s is None
        return s


def cutoff_rates(graph, cluster: Cluster, iters: int, rounds: int, seed: int = 0) -> dict[str, float]:
    """MCMC from the baselines' seeds with every proposal simulated in full, then with
    rejected ones cut short (``cutoff``), ``rounds`` times alternating: the median
    iterations per second of each, their ratio (``mcmc_cutoff_speedup``) and the share
    of proposals cut (``mcmc_cut_share``). The chains are checked to be the same."""
    space = Space(graph, cluster.devices)
    rates: dict[bool, list[float]] = {False: [], True: []}
    chains, cut = set(), 0.0
    for _ in range(rounds):
        for on in (False, True):
            sim = CuttingSimulator(graph, CostContext(cluster))
            seeds = [b.decisions for b in run_baselines(space, sim, cluster.devices_per_node).values()]
            t0 = time.perf_counter()
            r = mcmc(space, sim, seeds, max_iters=iters, seed=seed, early_stop=False, timeline=False, cutoff=on)
            rates[on].append(r.iterations / (time.perf_counter() - t0))
            chains.add((tuple(sorted(r.decisions.items())) if r.decisions else None, r.accepted,
                        tuple((i, t) for i, _, t in r.improvements)))
            if on:
                cut = sim.cut / r.iterations
    if len(chains) != 1:
        raise AssertionError("cutting rejected proposals short changed the MCMC's chain")
    full, cutting = statistics.median(rates[False]), statistics.median(rates[True])
    return {"mcmc_cutoff_speedup": cutting / full, "mcmc_cut_share": cut, "mcmc_full_iters_per_s": full}


def link_rates(row: str, rounds: int, pipeline: bool = False) -> dict[str, float]:
    """A Megatron row's model (``megatron_table``) on the row's A100s: its baseline
    recipes simulated (their task lists captured; ``pipeline``: Megatron's own layout
    instead, ``megatron_table``'s row at one sample per microbatch, the stages' task
    list), then ``run_tasks`` on each list with the links loaded together merged and
    with each link scheduled (:data:`flexsearch.sim.tasks.MERGE_LINKS_FROM`),
    ``rounds`` times alternating: the ratio of the medians of the lists' summed times
    (``links_merged_speedup``) and the merged one (``links_merged_ms``). The results
    are checked to be the same."""
    import megatron_table

    import flexsearch.sim.pipeline as staged
    import flexsearch.sim.simulator as simulator
    import flexsearch.sim.tasks as tasks
    from flexsearch.api import resolve_precision
    from flexsearch.search.pipeline import block_bounds
    from flexsearch.sim.predict import predict
    from flexsearch.strategy import recipes
    from flexsearch.strategy.kinds import DataParallel, Pipelined, Soap

    spec = next(r for r in megatron_table.ROWS if r.name == row)
    model, inputs = megatron_table.build(spec)
    cluster = Cluster.preset("dgx-a100", spec.gpus)
    prec, _ = resolve_precision("auto", cluster)
    graph = flexsearch.trace(model, inputs, precision=prec)
    ctx = CostContext(cluster, precision=prec)
    where = staged if pipeline else simulator
    lists, real = [], where.run_tasks
    where.run_tasks = lambda ordered, *a, **k: lists.append((list(ordered), a)) or real(ordered, *a, **k)
    try:
        if pipeline:
            layout = Pipelined(block_bounds(graph, spec.p), tensor=spec.t, replicas=spec.d, schedule="1f1b",
                               microbatches=spec.batch // spec.d, recompute="full")
            predict(graph, layout, ctx, timeline=False)
        else:
            space = Space(graph, cluster.devices)
            for name, dec in recipes.baselines(space, cluster.devices_per_node).items():
                configs = space.expand(dec)
                kind = DataParallel(configs, dec) if name == "data" else Soap(configs, dec)
                predict(graph, kind, ctx, timeline=False, simulator=Simulator(graph, ctx))
    finally:
        where.run_tasks = real
    merge_from = tasks.MERGE_LINKS_FROM
    took: dict[bool, list[float]] = {True: [], False: []}
    free: dict[bool, list[list[float]]] = {}  # the first round's free times, merged and not
    try:
        for r in range(rounds):
            for merged in (True, False) if r % 2 == 0 else (False, True):
                tasks.MERGE_LINKS_FROM = merge_from if merged else 10**12
                t0 = time.perf_counter()
                runs = [real(ordered, devices, links, False) for ordered, (devices, links, *_) in lists]
                took[merged].append(time.perf_counter() - t0)
                free.setdefault(merged, [run.free for run in runs])
    finally:
        tasks.MERGE_LINKS_FROM = merge_from
    if free[True] != free[False]:
        raise AssertionError("merging the links changed the schedule")
    on, off = statistics.median(took[True]), statistics.median(took[False])
    return {"links_merged_speedup": off / on, "links_merged_ms": on * 1e3, "links_lists": len(lists),
            "links_tasks": sum(len(o) for o, _ in lists)}


def gossip_rates(n: int, rounds: int) -> dict[str, float]:
    """The built-in circulant topologies (ring, torus, exponential) on ``n`` ranks, cold
    (caches cleared), as D-PSGD's simulation reads them: built and checked, then every
    rank's in- and out-neighbours and the degree; as shipped (read off the generator)
    against the dense ``n x n`` matrix built, checked and read row by row and column by
    column (as before), ``rounds`` times alternating: ``gossip_generator_speedup`` (the
    medians' ratio) and ``gossip_generator_ms``. The neighbours are checked to be the
    same."""
    import numpy as np

    from flexsearch.strategy import topology as topo

    def cold() -> None:
        for cache in (topo._matrix, topo._generator, topo._generator_entries, topo._degree):
            cache.cache_clear()

    def shipped(name: str) -> list:
        t = topo.build(name, n)
        return [(t.in_neighbours(i), t.out_neighbours(i)) for i in range(n)] + [t.degree()]

    def dense(name: str) -> list:
        t = topo.build(name, n)
        m = t.matrix(0)
        out = [(tuple((int(j), float(m[i, j])) for j in np.flatnonzero(m[i] > 0) if j != i),
                tuple(int(k) for k in np.flatnonzero(m[:, i] > 0) if k != i)) for i in range(n)]
        support = m > 0
        np.fill_diagonal(support, False)
        return out + [int(support.sum(axis=0).max())]

    took: dict[str, list[float]] = {"shipped": [], "dense": []}
    got: dict[str, list] = {}
    for r in range(rounds):
        for way in ("shipped", "dense") if r % 2 == 0 else ("dense", "shipped"):
            fn = shipped if way == "shipped" else dense
            cold()
            t0 = time.perf_counter()
            got[way] = [fn(name) for name in ("ring", "torus", "exponential")]
            took[way].append(time.perf_counter() - t0)
    if got["shipped"] != got["dense"]:
        raise AssertionError("the generator's neighbours differ from the matrix's")
    on, off = statistics.median(took["shipped"]), statistics.median(took["dense"])
    return {"gossip_generator_speedup": off / on, "gossip_generator_ms": on * 1e3}


# ------------------------------------------------------------------ 2. convergence


class RecordingSimulator(Simulator):
    """A simulator that notes when the best penalised cost (any state) last improved."""

    def __init__(self, *args, t0: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.t0, self.best_cost, self.best_cost_at = t0, math.inf, math.nan

    def simulate(self, configs, **kw):
        s = super().simulate(configs, **kw)
        c = cost_of(s)
        if c < self.best_cost:
            self.best_cost, self.best_cost_at = c, time.perf_counter() - self.t0
        return s


def converge(graph, cluster: Cluster, budget_s: float, seed: int = 0) -> dict:
    """Run the planner's stages with ``budget_s`` seconds in all; return timings."""
    t0 = time.perf_counter()
    space = Space(graph, cluster.devices)
    ctx = CostContext(cluster)
    sim = RecordingSimulator(graph, ctx, t0=t0)
    base = run_baselines(space, sim, cluster.devices_per_node)
    t_base = time.perf_counter() - t0
    seeds = [b.decisions for b in base.values()]
    ilp = "skipped"
    if len(space.units) <= 64:  # plan_graph's default ilp_max_units
        dec, res = AssignmentBuilder(space, sim.ctx).solve(
            time_limit_s=min(10.0, budget_s / 4), seed=seed
        )
        ilp = res.status
        if dec is not None:
            seeds.append(dec)
    t_seed = time.perf_counter() - t0
    result = mcmc(space, sim, seeds, budget_s=max(0.0, budget_s - t_seed), seed=seed)
    total = time.perf_counter() - t0
    out = {
        "baselines_s": t_base,
        "seeded_s": t_seed,
        "total_s": total,
        "iterations": result.iterations,
        "ilp": ilp,
        "units": len(space.units),
        "mcmc_s": result.elapsed_s,
    }
    dp = base["data"].simulation
    out["data_s"] = dp.iteration_time_s if dp.feasible else None
    if result.improvements:  # mcmc's clock starts after seeding
        it, secs, best = result.improvements[-1]
        out.update(
            converged_s=t_seed + secs,
            converged_iter=it,
            best_s=best,
            feasible=True,
            lower_bound_s=lower_bound(graph, ctx),
        )
    else:
        out.update(
            converged_s=sim.best_cost_at,
            converged_iter=None,
            best_s=sim.best_cost,
            feasible=False,
            lower_bound_s=lower_bound(graph, ctx),
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="short budgets and fewer rounds (a smoke run)")
    ap.add_argument("--rounds", type=int, help="interleaved full/delta rounds (default 5, quick 1)")
    ap.add_argument(
        "--round-s", type=float, help="seconds per full or delta round (default 2, quick 0.5)"
    )
    ap.add_argument(
        "--budget-8", type=float, help="search budget on 8 devices, s (default 60, quick 2)"
    )
    ap.add_argument(
        "--budget-64", type=float, help="search budget on 64 devices, s (default 150, quick 3)"
    )
    ap.add_argument(
        "--per-device-batch", type=int, default=4, help="GPT-2 XL samples per device; 0: zoo batch"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mcmc-iters", type=int, help="MCMC iterations per chain of part 1 (default 400, quick 30)")
    args = ap.parse_args()
    q = args.quick
    rounds = args.rounds or (1 if q else 5)
    round_s = args.round_s or (0.5 if q else 2.0)
    budgets = {
        8: args.budget_8 or (2.0 if q else 60.0),
        64: args.budget_64 or (3.0 if q else 150.0),
    }

    graph = trace("gpt2_small")
    cluster = Cluster.preset(CLUSTER, 8)
    with cycles_paused():  # as plan_graph runs the search
        full, delta = sim_rates(graph, cluster, rounds, round_s, args.seed)
    full_gc, delta_gc = sim_rates(graph, cluster, rounds, round_s, args.seed)  # the collector running
    f, d = statistics.median(full), statistics.median(delta)
    fg, dg = statistics.median(full_gc), statistics.median(delta_gc)
    print(f"gpt2_small x 8 {CLUSTER}, {len(graph.nodes)} nodes, {rounds} rounds of {round_s:g} s")
    print(f"  full  sims/s per round: {' '.join(f'{x:.1f}' for x in full)}  median {f:.1f}")
    print(f"  delta sims/s per round: {' '.join(f'{x:.1f}' for x in delta)}  median {d:.1f}")
    print(f"  delta / full: {d / f:.1f}x (target >= 10x)")
    print(f"  with the cyclic collector running: full {fg:.1f}, delta {dg:.1f} sims/s ({dg / fg:.1f}x); the pause "
          f"gains {f / fg:.2f}x and {d / dg:.2f}x")
    with cycles_paused():
        build_s, rebuilt, schedule_s, whole_s, feed_s = delta_build(graph, cluster, 30 if q else 300, args.seed)
        shares = retimed(graph, cluster, 15 if q else 200, args.seed)
    share = statistics.median(shares)
    # the most delta / full could reach with, free: assembly and scheduling; all but the tasks an
    # incremental schedule retimes; the schedule alone; the schedule alone, fed today's task lists
    bound = 1 / (f * build_s)
    incremental = 1 / (f * (build_s + share * schedule_s))
    unscheduled = 1 / (f * (whole_s - schedule_s))
    fed = 1 / (f * (whole_s - schedule_s + feed_s))
    print(f"  a delta simulation builds {rebuilt:.1f} of {len(graph.nodes)} fragments in {build_s * 1e3:.2f} ms: "
          f"a full simulation ({1e3 / f:.2f} ms) over that, {bound:.1f}x, is the most delta / full "
          f"could reach with assembly and scheduling free")
    q1, _, q3 = statistics.quantiles(shares, n=4)
    print(f"  its list schedule takes {schedule_s * 1e3:.2f} ms; a move retimes or rebuilds {share:.1%} of the tasks "
          f"(median over {len(shares)} moves; quartiles {q1:.1%}, {q3:.1%}): an incremental schedule that visits "
          f"only those, with everything else but the builds free, would reach {incremental:.1f}x")
    print(f"  a delta simulation takes {whole_s * 1e3:.2f} ms in all, {(whole_s - schedule_s) * 1e3:.2f} ms of it "
          f"outside the list schedule (the builds, looking fragments up, assembling the task list, the memory "
          f"terms): with the schedule alone free (compiled), {unscheduled:.1f}x; handing "
          f"its task list to such a scheduler (keys interned, typed arrays) takes {feed_s * 1e3:.2f} ms, which "
          f"leaves {fed:.1f}x")
    figures = [
        f"full_sims_per_s={f:.1f}",
        f"delta_sims_per_s={d:.1f}",
        f"delta_over_full={d / f:.2f}",
        f"paused_full_speedup={f / fg:.2f}",
        f"paused_delta_speedup={d / dg:.2f}",
        f"delta_rebuilt={rebuilt:.1f}",
        f"delta_bound={bound:.2f}",
        f"delta_retimed={share:.3f}",
        f"delta_incremental_bound={incremental:.2f}",
        f"delta_unscheduled_bound={unscheduled:.2f}",
        f"delta_fed_bound={fed:.2f}",
    ]
    with cycles_paused():
        kept = mcmc_rates(graph, cluster, args.mcmc_iters or (30 if q else 400), args.seed)
    print(f"  MCMC fragments built per iteration: {kept['mcmc_rebuilt_one']:.1f} with one kept per node, "
          f"{kept['mcmc_rebuilt_kept']:.1f} with more; iterations/s {kept['mcmc_kept_speedup']:.2f}x")
    figures += [f"{k}={v:.2f}" for k, v in kept.items()]
    fits = trace("gpt2_small", batch_size=CUTOFF_BATCH)
    with cycles_paused():
        cuts = cutoff_rates(fits, cluster, args.mcmc_iters or (30 if q else 400), 1 if q else 3, args.seed)
    print(f"  MCMC at batch {CUTOFF_BATCH} (plans fit): {cuts['mcmc_cut_share']:.0%} of the proposals cut short once "
          f"sure to be rejected; iterations/s {cuts['mcmc_cutoff_speedup']:.2f}x those of the same chain simulating "
          f"every proposal in full ({cuts['mcmc_full_iters_per_s']:.1f}/s)")
    figures += [f"{k}={v:.2f}" for k, v in cuts.items() if k != "mcmc_full_iters_per_s"]
    row = "1.7B" if q else "18.4B"
    with cycles_paused():
        links = link_rates(row, 1 if q else 3)
    print(f"GPT {row} (Megatron's row) on A100s, its {links['links_lists']:.0f} baseline recipes' task lists: run_tasks "
          f"{links['links_merged_ms']:.0f} ms with the links loaded together merged, "
          f"{links['links_merged_speedup']:.2f}x faster than scheduling each link (the same schedules)")
    figures += [f"links_merged_speedup={links['links_merged_speedup']:.2f}"]
    row = "39.1B" if q else "1T"
    with cycles_paused():
        links = link_rates(row, 1 if q else 3, pipeline=True)
    print(f"GPT {row} in Megatron's layout on A100s, one sample per microbatch: run_tasks on its {links['links_tasks']:.0f} "
          f"pipeline tasks {links['links_merged_ms']:.0f} ms with the links loaded together merged, "
          f"{links['links_merged_speedup']:.2f}x faster than scheduling each link (the same schedule)")
    figures += [f"pipeline_links_merged_speedup={links['links_merged_speedup']:.2f}"]
    ranks = 1024 if q else 3072
    gossip = gossip_rates(ranks, 3)  # tens of ms a round: three rounds in --quick too (one gave 0.36 once)
    print(f"ring, torus and exponential topologies on {ranks} ranks, cold, every rank's neighbours: "
          f"{gossip['gossip_generator_ms']:.0f} ms read off their generators, "
          f"{gossip['gossip_generator_speedup']:.2f}x faster than from their dense matrices (the same neighbours)")
    figures += [f"gossip_generator_speedup={gossip['gossip_generator_speedup']:.2f}"]

    for n, target in ((8, 30),) if q else ((8, 30), (64, 120)):  # quick: a smoke run, 8 devices only
        batch = args.per_device_batch * n or get("gpt2_xl").batch
        t = time.perf_counter()
        g = trace("gpt2_xl", batch_size=batch)
        trace_s = time.perf_counter() - t
        with cycles_paused():  # as plan_graph runs its stages
            r = converge(g, Cluster.preset(CLUSTER, n), budgets[n], args.seed)
        what = "best plan" if r["feasible"] else "best penalised cost (nothing feasible)"
        vs = (
            f"{r['data_s'] / r['best_s']:.3f}x data parallel ({r['data_s']:.4f} s)"
            if r["data_s"] and r["feasible"]
            else "data parallel infeasible"
        )
        print(
            f"gpt2_xl x {n} {CLUSTER}, batch {batch}, budget {budgets[n]:g} s: traced in {trace_s:.1f} s, "
            f"{len(g.nodes)} nodes, {r['units']} units; baselines {r['baselines_s']:.1f} s, "
            f"+ ILP ({r['ilp']}) seeded at {r['seeded_s']:.1f} s; MCMC {r['iterations']} iterations in "
            f"{r['mcmc_s']:.1f} s; stopped at {r['total_s']:.1f} s"
        )
        print(
            f"  converged at {r['converged_s']:.1f} s (iteration {r['converged_iter']}, target <= {target} s); "
            f"{what} {r['best_s']:.4f} s = {vs}; lower bound {r['lower_bound_s']:.4f} s"
        )
        sp = r["data_s"] / r["best_s"] if r["data_s"] and r["feasible"] else float("nan")
        figures += [
            f"converge_xl{n}_s={r['converged_s']:.1f}",
            f"trace_xl{n}_s={trace_s:.1f}",
            f"seeded_xl{n}_s={r['seeded_s']:.1f}",
            f"speedup_over_data_xl{n}={sp:.3f}",
        ]
    for key, case in (plan_time.QUICK if q else plan_time.CASES).items():  # 3. time to a plan
        got = plan_time.run(key, *case, workers=None)
        figures += [f"{k}={v:.3g}" for k, v in got.items() if not k.endswith("_trace_s")]
    print(" ".join(figures))


if __name__ == "__main__":
    main()
