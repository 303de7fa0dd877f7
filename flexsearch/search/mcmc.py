"""FlexFlow's MCMC search over SOAP decisions (Metropolis-Hastings).

State: a configuration per decision unit (:class:`~flexsearch.strategy.space.Space`).
Cost: the simulated iteration time, as a SOAP plan runs (on DTensor: never priced as
DDP, even where every op is data parallel); a plan that does not fit in memory costs
``time * (1 + OVERFLOW_PENALTY * overflow)`` with ``overflow = peak / capacity - 1``, so
the chain can cross infeasible states but the best kept is always the best *feasible*
one (``exclude``: states never kept as the best, e.g. plain data parallelism when the
caller wants the best other plan).

One step: pick a unit uniformly at random and draw one of its candidate configurations
uniformly; if the draw is the unit's current configuration, the next candidate in the
unit's (sorted) list is taken instead, so every step moves. With probability ``span_p``
the next 1 to :data:`MAX_SPAN` units in program order also move, each to a random
candidate on the same device mesh (same ``s``, ``t`` and first device; e.g. a
column-parallel layer and the row-parallel one after it): one-op moves cannot cross the
resharding valley between two layouts. Then simulate (delta simulation: only the
changed fragments are rebuilt),
accept with probability ``min(1, exp(-beta * (cost* - cost) / cost))`` (FlexFlow's
``exp(beta (cost(S) - cost(S*)))`` with the difference taken relative to the current
cost, so ``beta`` does not depend on the model's time scale; an improvement is always
accepted). Every ``restart`` steps without a new best the chain restarts from the best.
It stops after ``max_iters`` steps, after ``budget_s`` seconds, or, FlexFlow's rule,
when no better plan was found in the last half of the search, once it has run
``min_iters`` steps or :data:`MIN_WORK` simulated op-device tasks (steps times the
graph's ops times the devices), whichever comes first, and at least
:data:`MIN_STEPS` steps: a chain on a large graph is judged converged after the same
amount of simulation as a small one, not the same count of steps. Steps and ops are
counted, not seconds, so the stop is reproducible.

All randomness comes from ``random.Random(seed)``: with ``max_iters`` (and no
``budget_s``) a run is reproducible.

**Rejections cut short.** Before a proposal is simulated, the uniform number ``u`` its
acceptance test would draw is read ahead (the generator's state is put back, so the
test draws the same number and the chain is the one it would be without this). The
test rejects a proposal costing ``c > cost`` iff ``u >= exp(-beta (c - cost) / cost)``,
that is iff ``c >= cost (1 - ln(u) / beta)``; and a proposal is kept as the best only
when its time is under the best's. The proposal's time is at most its cost, so once its
simulation is sure to end after the larger of the two (:func:`rejection_cutoff`, with a
relative margin of ``1e-9`` against rounding) it is rejected, and not kept, whatever the
rest of its schedule holds: the simulator stops there
(:class:`~flexsearch.sim.tasks.PastCutoff`, a lower bound on the iteration's end per
device) and the step goes on as the test would have it, its draw consumed. Without a
best plan yet (nothing feasible seen), any proposal that fits could become the best,
and none is cut. ``cutoff=False`` simulates every proposal in full: the same chain.

**Interrupts.** A ``KeyboardInterrupt`` (Ctrl-C, or raised by the ``progress``
callback) during the chain ends it like a budget does: the best feasible state so far
is returned with ``interrupted=True``. One that arrives before any feasible state was
seen propagates. Native solvers may take SIGINT over (CP-SAT catches it during a solve
and leaves the default handler, which kills the process): run them under
:func:`sigint_restored`.
"""

from __future__ import annotations

import contextlib
import math
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from flexsearch.sim.result import Simulation
from flexsearch.sim.simulator import Simulator
from flexsearch.strategy.config import Config
from flexsearch.strategy.space import Space

OVERFLOW_PENALTY = 10.0
"""Cost factor per unit of memory overflow: a plan 10% over capacity costs twice its
time, steep enough that the chain leaves infeasible regions within a few steps, mild
enough that it can cross a narrow one to a feasible plan beyond."""
MIN_WORK = 1_000_000
"""Simulated op-device tasks after which the chain may stop early (module docstring):
200 steps of a graph of 5,000 op-devices (GPT-2 small on 16 devices), 58 steps of
GPT 1.7B on 32."""
MIN_STEPS = 20
"""Steps the chain runs at least before it may stop early, however large the graph."""
MAX_SPAN = 3
"""Most units a spanning move carries along: a Megatron-style block alternates two or
three layouts (column-, row-parallel, replicated), so three neighbours suffice to move
a whole block's pattern at once."""


@contextlib.contextmanager
def sigint_restored() -> Iterator[None]:
    """Put Python's Ctrl-C handler back after the block (module docstring)."""
    handler = signal.getsignal(signal.SIGINT)
    try:
        yield
    finally:
        if handler is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, handler)


def cost_of(sim: Simulation | None) -> float:
    """The search's objective: iteration time, penalised when memory overflows;
    infinite for a simulation cut short (None: sure to be rejected, module docstring)."""
    if sim is None:
        return math.inf
    overflow = sim.peak_memory_bytes / sim.capacity_bytes - 1
    if overflow <= 0:
        return sim.iteration_time_s
    return sim.iteration_time_s * (1 + OVERFLOW_PENALTY * overflow)


@dataclass(frozen=True)
class SearchResult:
    """Best feasible decisions found (None when nothing feasible was seen), their
    simulation, and search statistics."""

    decisions: dict[str, Config] | None
    simulation: Simulation | None
    iterations: int
    accepted: int
    improvements: tuple[tuple[int, float, float], ...]  # (iteration, seconds, best time)
    elapsed_s: float
    interrupted: bool = False
    """The chain was stopped by a KeyboardInterrupt (module docstring)."""


def mcmc(
    space: Space,
    simulator: Simulator,
    seeds: Sequence[Mapping[str, Config]],
    *,
    max_iters: int | None = None,
    budget_s: float | None = None,
    seed: int = 0,
    beta: float = 50.0,
    restart: int = 200,
    min_iters: int = 200,
    early_stop: bool = True,
    span_p: float = 0.3,
    progress: Callable[[int, float], None] | None = None,
    exclude: Sequence[Mapping[str, Config]] = (),
    timeline: bool = True,
    cutoff: bool = True,
    elsewhere: Callable[[], bool] | None = None,
) -> SearchResult:
    """Run the chain from the best of ``seeds`` (module docstring). ``beta`` (the
    acceptance's sharpness: a move 2% slower is accepted with probability e^-1),
    ``restart``, ``min_iters`` and ``span_p`` are FlexFlow-style tuning knobs. The best
    state is simulated again with its timeline; ``timeline=False`` returns its
    simulation as the chain made it (the same time, memory and compute: what a planner
    reads; the timeline of GPT 18.4B on 256 devices took seconds, past the budget).
    ``cutoff``: stop the simulation of a proposal once it is sure to be rejected
    (module docstring). Under ``budget_s`` the seeds are simulated while the next would
    end within it, judged by the last one's time, or while no plan that fits was seen,
    here or (``elsewhere()``, the caller's other searches) elsewhere."""
    if max_iters is None and budget_s is None:
        raise ValueError("give max_iters or budget_s")
    rng = random.Random(seed)
    t0 = time.perf_counter()
    size = len(space.graph.nodes) * space.devices
    min_iters = min(min_iters, max(MIN_STEPS, -(-MIN_WORK // max(1, size))))
    units = [u for u in space.units if len(space.candidates(u)) > 1]
    cands = {u.name: space.candidates(u) for u in units}
    by_mesh: dict[str, dict[tuple[int, int, int], list[Config]]] = {}
    for name, options in cands.items():
        for c in options:
            by_mesh.setdefault(name, {}).setdefault((c.s, c.t, c.first), []).append(c)

    def run(dec: Mapping[str, Config], past: float = math.inf) -> Simulation | None:
        # as a SOAP plan runs: on DTensor, never DDP; None: sure to take longer than ``past``
        return simulator.simulate(space.expand(dec), timeline=False, ddp=False, cutoff=past)

    excluded = [dict(e) for e in exclude]

    def keepable(dec: Mapping[str, Config], sim: Simulation | None) -> bool:
        return sim is not None and sim.feasible \
            and (best_sim is None or sim.iteration_time_s < best_sim.iteration_time_s) \
            and not any(_same(dec, e) for e in excluded)

    best_dec: dict[str, Config] | None = None
    best_sim: Simulation | None = None
    cur_dec: dict[str, Config] = {}
    cur_cost = math.inf
    improvements: list[tuple[int, float, float]] = []
    seed_s = 0.0  # the last seed's simulation
    for s in seeds:
        if budget_s is not None and (best_sim is not None or (elsewhere is not None and elsewhere())) \
                and time.perf_counter() - t0 + seed_s >= budget_s:
            break  # the seeds left not simulated (each a whole simulation: on GPT 18.4B over 256 devices, 0.3-1 s)
        t1 = time.perf_counter()
        sim = run(s)
        seed_s = time.perf_counter() - t1
        c = cost_of(sim)
        if c < cur_cost:
            cur_dec, cur_cost = dict(s), c
        if keepable(s, sim):
            best_dec, best_sim = dict(s), sim
    if best_sim is not None:
        improvements.append((0, time.perf_counter() - t0, best_sim.iteration_time_s))

    it = accepted = 0
    last_best = 0
    interrupted = False
    try:
        while units:
            if max_iters is not None and it >= max_iters:
                break
            if budget_s is not None and time.perf_counter() - t0 >= budget_s:
                break
            if early_stop and it >= min_iters and it - last_best > it / 2:
                break
            it += 1
            ui = rng.randrange(len(units))
            u = units[ui]
            options = cands[u.name]
            old = cur_dec.get(u.name, Config())
            new = options[rng.randrange(len(options))]
            if new == old:
                new = options[(options.index(new) + 1) % len(options)]
            prop = dict(cur_dec)
            prop[u.name] = new
            if rng.random() < span_p:
                for v in units[ui + 1: ui + 1 + rng.randint(1, MAX_SPAN)]:
                    same_mesh = by_mesh[v.name].get((new.s, new.t, new.first))
                    if same_mesh:
                        prop[v.name] = same_mesh[rng.randrange(len(same_mesh))]
            past = math.inf
            if cutoff and best_sim is not None:
                past = rejection_cutoff(cur_cost, best_sim.iteration_time_s, _peek(rng), beta)
            sim = run(prop, past)
            c = cost_of(sim)  # None: infinite, rejected as the test finds
            if c <= cur_cost or rng.random() < math.exp(-beta * (c - cur_cost) / cur_cost):
                cur_dec, cur_cost = prop, c
                accepted += 1
            if keepable(prop, sim):
                best_dec, best_sim = prop, sim
                last_best = it
                improvements.append((it, time.perf_counter() - t0, sim.iteration_time_s))
            elif restart and best_dec is not None and (it - last_best) % restart == 0:
                cur_dec, cur_cost = dict(best_dec), cost_of(best_sim)
            if progress is not None:
                progress(it, best_sim.iteration_time_s if best_sim else math.inf)
    except KeyboardInterrupt:
        if best_dec is None:
            raise
        interrupted = True
    if best_dec is not None and timeline:
        best_sim = simulator.simulate(space.expand(best_dec), ddp=False)  # with the timeline
    return SearchResult(best_dec, best_sim, it, accepted, tuple(improvements),
                        time.perf_counter() - t0, interrupted)


def rejection_cutoff(cost: float, best_s: float, u: float, beta: float) -> float:
    """The time past which a proposal is rejected and not kept as the best, from the
    current state's ``cost``, the best plan's time ``best_s`` and the number ``u`` the
    acceptance test will draw (module docstring): ``max(cost (1 - ln(u) / beta),
    best_s)``, raised by a relative ``1e-9``; infinite when ``u`` is 0 or ``cost``
    infinite."""
    if u <= 0.0 or not math.isfinite(cost):
        return math.inf
    return max(cost * (1 - math.log(u) / beta), best_s) * (1 + 1e-9)


def _peek(rng: random.Random) -> float:
    """The number ``rng.random()`` will return next, the generator left as it was."""
    state = rng.getstate()
    u = rng.random()
    rng.setstate(state)
    return u


def _same(a: Mapping[str, Config], b: Mapping[str, Config]) -> bool:
    """Equal decisions, a missing unit meaning ``Config()`` (as :meth:`Space.expand` reads it)."""
    return all(a.get(k, Config()) == b.get(k, Config()) for k in {*a, *b})
