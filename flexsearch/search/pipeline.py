"""Pipeline and hybrid plans: the search for stages, a schedule and microbatches.

Cut points and stage costs are the simulator's (:mod:`flexsearch.sim.stages`: node
costs from the op-level cost model, summed into stages); this module searches over
them.

**Emittable plans** (what ``torch.distributed.pipelining`` runs): ``p`` stages of
``d * t`` devices each (``p * d * t = N``, stage ``k`` on devices ``k d t ..``),
data parallel over ``d`` replicas and, for transformers, Megatron tensor parallel over
``t`` devices inside a node; kind ``pipeline`` for ``t = 1``, ``hybrid`` otherwise. For
each ``(t, p, m, schedule)`` the partitioner (:mod:`.partition`, straight pipeline of
``p`` stages, memory-aware: under the interleaved schedule each of a rank's ``v``
chunks within ``1 / v`` of its memory) places the cuts. Per layout it takes the
lightest activation checkpointing (:data:`RECOMPUTE_ORDER`) that fits with the
optimizer state replicated and, where sharding that state over the stage's replicas
lets a lighter one fit, that too (``zero1``: the state ``k P / d``, for an all-gather of
the parameters after the update, which itself shrinks ``d``-fold; ``zero2``, FSDP2
stages where the emitter runs them: ``(g + 1 + g' + (1 + k) / d) P``, ``g`` the gathered
bytes per stored byte, ``g'`` the same under mixed precision, else 0,
:data:`~flexsearch.strategy.kinds.PIPELINE_SHARDINGS`). The best candidates
by the partitioner's estimate ``(m v + p - 1) / v * bottleneck`` (FSDP2 stages: plus
``p`` all-gathers of the largest stage's parameters, which lie on the fill) are simulated
(:mod:`flexsearch.sim.pipeline`), more while none of them fits, each first checked by
the simulation's own memory model, which needs no scheduling (the partitioner's memory
rule leaves out what a stage rebuilds under checkpointing, the backward's buffers and
the loss: on GPT 1T over 3,072 A100s it passes layouts that need 900 GB); one that
does not fit is passed over, and the same layout with the next checkpointing mode the
partitioner fits joins the queue; then the :data:`ALIGN_TOP` fastest layouts cut at block
boundaries (:func:`block_bounds`) and the fastest with each other sharding it takes;
the fastest that fits wins. A sharded layout's simulation (ZeRO-1 or FSDP2 stages)
stops once it is sure to end after the :data:`ALIGN_TOP`-th fastest layout shape that
fits of those simulated before its batch (:func:`flexsearch.sim.tasks.run_tasks`'s
cutoff): it can be neither the plan nor one of the layouts cut at block boundaries, and
it is left out of the results. A plain layout always runs to its end: its time is what
the plan's note says sharding gains (on GPT 1T over 3,072 A100s, 128 FSDP2 stages of 24
ranks, 2.7x slower than the plan, took 5.1 of the search's 9.3 s of simulation).

PipeDream's own plan, a baseline, is :mod:`.pipedream`'s.
"""

from __future__ import annotations

import functools
import heapq
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from flexsearch.cost.hardware import Cluster
from flexsearch.graph.microbatch import batch_size, microbatch_graph
from flexsearch.graph.opgraph import OpGraph
from flexsearch.search.clock import past
from flexsearch.search.partition import Chain, Level, Memory, partition
from flexsearch.sim.accounting import param_copies
from flexsearch.sim.context import CostContext
from flexsearch.sim.pipeline_layout import fsdp_grad_copies
from flexsearch.sim.predict import fsdp_graph
from flexsearch.sim.result import Simulation
from flexsearch.sim.stages import (
    BoundaryCopies,
    NodeCost,
    cut_bytes,
    fsdp_stage_costs,
    kept_bytes,
    shared_within_rank,
    simulate_stages,
    stage_node_costs,
    stages_peak_memory,
)
from flexsearch.sim.tasks import PastCutoff
from flexsearch.strategy.config import Config
from flexsearch.strategy.kinds import (
    FSDP_SHARDINGS,
    PIPELINE_SHARDINGS,
    Pipelined,
    check_pipeline_shard,
)
from flexsearch.strategy.recipes import stage_configs
from flexsearch.strategy.recompute import Checkpointing, recompute_units
from flexsearch.strategy.schedules import in_flight, rank_actions
from flexsearch.workers import Helper

SYNC_SCHEDULES = ("1f1b", "gpipe", "interleaved")
RECOMPUTE_ORDER = ("none", "selective", "full")
"""Checkpointing modes tried per layout, cheapest in time first (:mod:`flexsearch.strategy.recompute`)."""
SAVINGS = tuple((mode, shard) for mode in RECOMPUTE_ORDER for shard in PIPELINE_SHARDINGS)
"""(checkpointing, sharding), cheapest in time first (the candidates' order at equal
estimates): sharding the optimizer state costs one all-gather of the stage's parameters
(and saves ``d - 1`` of ``d`` updates), FSDP2 stages an all-gather before the first
forward and a reduce-scatter for the all-reduce, checkpointing a forward pass per
microbatch."""
SIMULATE_TOP = 8
"""Candidates simulated per search: the partitioner's estimate ranks layouts well but
misses transfers queueing on shared links and the schedule's exact bubbles; eight covers
the usual close calls (two schedules x recomputation or not x FSDP2 stages or not, a
neighbouring microbatch count) at a few simulations' cost. With six, GPT 310B on 1,920
A100s (Megatron's table) left out its fastest plan, FSDP2 x TP x PP stages at 33.19 s,
ranked seventh by its estimate."""
SIMULATE_MAX = 4 * SIMULATE_TOP
"""Candidates simulated at most while none of the first fits in memory. Each is first
checked by the simulation's memory model (the partitioner's rule leaves out what the
simulation adds: the rebuilt activations, the backward's gradient buffers, the loss),
so those over memory are passed over unsimulated; one that fits by memory may still be
found infeasible only through a term the check shares, so this is a guard, not a budget
the search expects to spend."""
ALIGN_TOP = 2
"""The fastest feasible layouts also simulated cut at block boundaries
(:func:`block_bounds`): on GPT 1T over 3,072 A100s the fastest is already aligned, and
the second, aligned, is Megatron's own layout and the fastest."""
MICROBATCH_OPTIONS = 5
"""Microbatch counts tried per stage count (:func:`microbatch_options`): a geometric
sequence of five spans a 16x range of microbatch sizes, past the point where smaller
microbatches stop shrinking the bubble faster than their per-action cost grows."""
SMALLEST_EXPORTED = 2
"""Samples per microbatch at least, for a model only ``torch.export`` traces: the emitter
re-exports it at the microbatch's shapes, and at one sample export specialises
(size-1 dims: an ``expand`` to the same shape disappears), so the graph is not the one
planned."""
INTERLEAVED_MAX_ACTIONS = 4096
"""Interleaved schedules are enumerated action by action for their peak in flight;
beyond this many actions per rank (e.g. 64 stages x 64 microbatches) they are skipped:
enumerating costs more than the candidate is likely worth."""


@dataclass(frozen=True)
class PipelineResult:
    """A simulated pipeline plan."""

    kind: str
    schedule: str
    microbatches: int
    chunks: int
    recompute: str
    tensor: int
    replicas: int
    stages: tuple[tuple[int, int, tuple[int, ...]], ...]
    """(first node, end node, devices) per stage, in node-order positions."""
    configs: dict[str, Config]
    simulation: Simulation
    shard: str = "none"
    """``zero1``: the optimizer state sharded over each stage's replicas."""

    @property
    def strategy(self) -> Pipelined:
        """The plan as a strategy value (not for PipeDream's asynchronous baseline)."""
        if self.schedule == "pipedream":
            raise ValueError("PipeDream's asynchronous pipeline is a baseline, not a strategy the emitter runs")
        return Pipelined(tuple((a, b) for a, b, _ in self.stages), self.tensor, self.replicas, self.schedule,
                         self.microbatches, self.chunks, self.recompute, self.shard)


class PipelineSearch(NamedTuple):
    """What :func:`search_pipelines` returns: the layouts simulated, fastest first,
    feasible ones first, and whether its deadline cut the search short."""

    results: list[PipelineResult]
    cut: bool


def replicated_configs(local: dict[str, Config], replicas: int) -> dict[str, Config]:
    """A stage layout on its tensor-parallel group, data parallel over ``replicas``."""
    return {k: Config(s=replicas, kind=c.kind, t=c.t, dim=c.dim) if c.s == 1 else c for k, c in local.items()}


def _link_between(cluster: Cluster, group: int) -> tuple[float, float]:
    """(bandwidth, latency) between consecutive stages of ``group`` devices each."""
    spec = cluster.spec
    if group >= cluster.devices_per_node and spec.inter_node is not None and cluster.num_nodes > 1:
        link = spec.inter_node
    else:
        link = spec.intra_node
    return link.bandwidth.value, link.latency.value


def tensor_degrees(cluster: Cluster) -> list[int]:
    """Tensor-parallel degrees a stage may use: powers of two within one node."""
    return [t for t in (1, 2, 4, 8, 16) if t <= cluster.devices_per_node and cluster.devices % t == 0]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@functools.lru_cache(maxsize=4096)
def peak_in_flight(schedule: str, p: int, m: int, v: int = 1) -> int | None:
    """Most microbatches any stage keeps in flight (None: the schedule does not take m).
    Closed forms for GPipe (``m``) and 1F1B (``min(p, m)``); interleaved schedules are
    enumerated, and skipped beyond :data:`INTERLEAVED_MAX_ACTIONS` actions per rank."""
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(p, m)
    if p * m * v > INTERLEAVED_MAX_ACTIONS:
        return None
    try:
        per_rank = rank_actions(schedule, p, m, chunks=v)
    except ValueError:
        return None
    return max(max(in_flight(a).values()) for a in per_rank)


def microbatch_options(per_replica: int, p: int, most: int = MICROBATCH_OPTIONS, smallest: int = 1) -> list[int]:
    """Microbatch counts tried for ``p`` stages when each replica gets ``per_replica``
    samples: divisors of ``per_replica`` from ``p`` up (multiples of ``p``, and the finest
    split, ``smallest`` samples per microbatch), thinned to a geometric sequence of at
    most ``most``; when the batch is smaller than ``p``, the finest split."""
    finest = per_replica // smallest if per_replica % smallest == 0 else 0
    divs = [m for m in _divisors(per_replica) if m >= p and (m % p == 0 or m == finest)
            and per_replica // m >= smallest]
    if not divs:
        return [finest] if finest else []
    kept = [divs[0]]
    for m in divs[1:]:
        if m >= 2 * kept[-1] or m == divs[-1]:
            kept.append(m)
    if len(kept) > most:  # keep the first few and the finest split
        kept = kept[: most - 1] + kept[-1:]
    return kept


def search_pipelines(graph: OpGraph, ctx: CostContext, *, optimizer: str = "adam",
                     simulate_top: int = SIMULATE_TOP, schedules: Sequence[str] = SYNC_SCHEDULES,
                     max_stages: int | None = None, deadline: float | None = None,
                     helper: bool = False, elsewhere: Callable[[], bool] | None = None) -> PipelineSearch:
    """Every emittable pipeline and hybrid candidate on ``ctx``'s cluster (module
    docstring), the best ``simulate_top`` by the partitioner's estimate simulated
    (and, while none of those fits, the next ones until one does, up to
    :data:`SIMULATE_MAX`); results sorted fastest first, feasible ones first.
    ``deadline``, a ``time.perf_counter()`` time: past it no more layouts are
    estimated, and once one that fits is simulated no batch of simulations starts that
    would end past it by the batches timed so far (:func:`pace`): on GPT 1T over 3,072
    A100s one takes 0.5-2.5 s, so a batch started just before the deadline ran up to
    28% of a 20 s budget past it. Until one fits, the candidates go on past it, one
    simulation at a time, as the planner's other phases do, unless ``elsewhere()`` says
    the caller has a plan that fits: a tight budget used to end with no plan at all (GPT
    1T at 15 s, tracing 6.8 s of it). ``helper``: the
    candidates chosen for simulation are simulated in batches, half of each in a second
    process (:class:`~flexsearch.workers.Helper`); the results are the same."""
    cluster = ctx.cluster
    n = cluster.devices
    try:
        batch = batch_size(graph)
    except ValueError:
        return PipelineSearch([], False)
    layers = len(graph.nodes)
    copies = param_copies(optimizer)
    gather = ctx.precision.gather_factor(graph.param_dtype)
    grads = fsdp_grad_copies(gather)  # FSDP2 stages: gradient bytes per parameter byte
    cap = cluster.device.memory_capacity.value
    cost_memo: dict[tuple[int, int, bool], tuple[list[NodeCost], dict[str, Config]] | None] = {}
    # per (microbatches, FSDP): the microbatch graph, its cut bytes and stage edges (the same for every tensor degree)
    batch_memo: dict[tuple[int, bool], tuple[OpGraph, tuple[float, ...], BoundaryCopies]] = {}
    low = fsdp_graph(graph, ctx)  # what FSDP2 stages compute

    def graph_of(shard: str) -> OpGraph:
        return low if shard in FSDP_SHARDINGS else graph

    def microbatched(k: int, fsdp: bool) -> tuple[OpGraph, tuple[float, ...], BoundaryCopies]:
        if (k, fsdp) not in batch_memo:
            mg = microbatch_graph(low if fsdp else graph, k)
            batch_memo[k, fsdp] = mg, cut_bytes(mg), BoundaryCopies.of(mg)
        return batch_memo[k, fsdp]

    def costs_for(k: int, t: int, shard: str = "none"):
        """(node costs, stage configurations) of microbatches of B / k on t devices, as
        ``shard``'s stages compute them (:func:`flexsearch.sim.predict.runtime_graph`)."""
        key = (k, t, shard in FSDP_SHARDINGS)
        if key not in cost_memo:
            mg = microbatched(k, key[2])[0]
            configs = stage_configs(mg, t)
            costs = stage_node_costs(mg, ctx, t) if configs is not None else None
            if costs is not None and key[2]:  # as FSDP2 stages (zero2) compute them
                costs = fsdp_stage_costs(costs)
            cost_memo[key] = None if costs is None else (costs, configs)
        return cost_memo[key]

    cps = {mode: Checkpointing.of(graph, mode) for mode in RECOMPUTE_ORDER}
    chain_memo: dict[tuple[int, int, str, bool], Chain] = {}

    def chain_for(k: int, t: int, mode: str, fsdp: bool = False) -> Chain:
        """The partitioner's chain; ``fsdp``: of FSDP2 stages, whose bf16 weights autocast
        copies not (:func:`flexsearch.sim.stages.stage_layout`)."""
        if (k, t, mode, fsdp) not in chain_memo:
            costs = costs_for(k, t, "zero2" if fsdp else "none")[0]
            chain_memo[k, t, mode, fsdp] = stage_chain(costs, microbatched(k, fsdp)[1], cps[mode])
        return chain_memo[k, t, mode, fsdp]

    def estimate(t: int, p: int, d: int, m: int, schedule: str, v: int, q: int, shard: str,
                 modes: Sequence[str]) -> tuple | None:
        """The first of ``modes`` (lightest first) whose layout the partitioner fits:
        (estimate, layout..., partition, shard). After the lightest, the heaviest (full) is
        tried: where it does not fit, none between does (selective checkpointing keeps,
        per node, at least what full keeps, in the chain the partitioner sizes), and the
        partitioner is not run for them."""
        bw, lat = _link_between(cluster, d * t)
        # ZeRO-1: the optimizer state's copies over the replicas; FSDP2 stages: the gathered
        # parameters and the whole gradients, the rest over the replicas
        state = {"zero1": 2 + (copies - 2) / d, "zero2": gather + grads + (copies - 1) / d}.get(shard, copies)
        held = gather + 1 / d if shard == "zero2" else 1.0  # a frozen parameter's bytes per byte
        # a rank holds v chunks: each within its share of the memory
        memory = Memory(cap / v, state, in_flight=lambda r: q, frozen_factor=held)

        def fitted(recompute: str) -> tuple | None:
            part = partition(chain_for(d * m, t, recompute, shard == "zero2"), [Level(p * v, bw, lat)], memory=memory,
                             replicate=False)
            if part is None or len(part.stages) != p * v:
                return None
            est = (m * v + p - 1) / v * part.bottleneck_s
            if shard == "zero2":
                est += p * fsdp_gather_s(chain_for(d * m, t, recompute, True), part, t, d)
            return est, t, p, d, m, schedule, v, recompute, part, shard, q

        if not modes or (got := fitted(modes[0])) is not None or len(modes) == 1:
            return got if modes else None
        heaviest = fitted(modes[-1])
        if heaviest is None:
            return None
        return next((got for mode in modes[1:-1] if (got := fitted(mode)) is not None), heaviest)

    gather_memo: dict[tuple[int, int], float] = {}

    def fsdp_gather_s(chain: Chain, part, t: int, d: int) -> float:
        """FSDP2 stages gather their parameters when their first input arrives (under the
        interleaved schedule at the step's start: an upper bound there), so each
        stage's all-gather over its replicas lies on the pipeline's fill: the largest
        stage's (per device, in the gathered dtype), at the bandwidth of a 1 GB one (on
        thousands of devices a collective costs milliseconds to price)."""
        largest = max(sum(chain.params[s.start:s.end]) for s in part.stages) * gather
        if (t, d) not in gather_memo:
            gather_memo[t, d] = ctx.collective("all_gather", tuple(range(0, d * t, t)), 1e9).time_s / 1e9
        return gather_memo[t, d] * largest

    def grid():
        """(t, p, d, m) of every layout, tensor degree by tensor degree."""
        for t in tensor_degrees(cluster):
            # one stage: Megatron's tensor x data parallelism with accumulation (t = 1 is a data plan)
            for p in range(1 if t > 1 else 2, min(n // t, max_stages or layers, layers) + 1):
                if (n // t) % p or batch % (n // (t * p)):
                    continue
                d = n // (t * p)
                for m in microbatch_options(batch // d, p, smallest=SMALLEST_EXPORTED if graph.via == "export" else 1):
                    yield t, p, d, m

    estimates = []
    for t, p, d, m in grid():
        if estimates and past(deadline):  # each new microbatch size costs the stages again
            break
        if costs_for(d * m, t) is None:
            continue
        modes = RECOMPUTE_ORDER
        for schedule in schedules:
            v = 2 if schedule == "interleaved" else 1
            if v * p > layers:
                continue
            q = peak_in_flight(schedule, p, m, v)
            if q is None:
                continue
            plain = estimate(t, p, d, m, schedule, v, q, "none", modes)
            if plain is not None:
                estimates.append(plain)
            lighter = modes[:modes.index(plain[7])] if plain is not None else modes
            if d > 1 and lighter:  # sharding where it lets the layout checkpoint less
                for shard in pipeline_shardings(t, d, schedule, v)[1:]:
                    sharded = estimate(t, p, d, m, schedule, v, q, shard, lighter)
                    if sharded is not None:
                        estimates.append(sharded)
    # a heap by estimate (ties: cheaper savings, then the order found); a layout found over
    # memory comes back with the next checkpointing mode that the partitioner fits
    queue = [(e[0], SAVINGS.index((e[7], e[9])), i, e) for i, e in enumerate(estimates)]
    heapq.heapify(queue)

    def simulated(bounds, t: int, p: int, d: int, m: int, schedule: str, v: int, recompute: str,
                  shard: str, cutoff: float = math.inf) -> PipelineResult | None:
        """The layout simulated; None once it is sure to end after ``cutoff``."""
        costs, local = costs_for(d * m, t, shard)
        _, cuts, edges = microbatched(d * m, shard in FSDP_SHARDINGS)
        try:
            sim = simulate_stages(graph_of(shard), ctx, bounds=bounds, tensor=t, replicas=d, schedule=schedule,
                                  microbatches=m, chunks=v, recompute=recompute, optimizer=optimizer,
                                  timeline=False, costs=costs, shard=shard, cuts=cuts, edges=edges, cutoff=cutoff)
        except PastCutoff:
            return None
        stages = tuple((a, b, tuple(range((k % p) * d * t, (k % p + 1) * d * t)))
                       for k, (a, b) in enumerate(bounds))
        return PipelineResult("hybrid" if t > 1 else "pipeline", schedule, m, v, recompute, t, d,
                              stages, replicated_configs(local, d), sim, shard)

    def again(r: PipelineResult, bounds, shard: str) -> tuple:
        """The job (:func:`simulated`'s arguments) of ``r``'s layout cut at ``bounds``,
        sharded by ``shard``."""
        return (bounds, r.tensor, len(r.stages) // r.chunks, r.replicas, r.microbatches, r.schedule, r.chunks,
                r.recompute, shard)

    def runs(bounds, p: int, shard: str) -> bool:
        return shard != "zero2" or not shared_within_rank(graph_of(shard), bounds, p)

    def fits(bounds, t: int, p: int, d: int, m: int, schedule: str, v: int, recompute: str, shard: str) -> bool:
        """Does the layout fit by the simulation's own memory model (no scheduling)? False
        for one the emitter does not run (FSDP2 stages of one rank sharing a weight)."""
        if not runs(bounds, p, shard):
            return False
        costs, _ = costs_for(d * m, t, shard)
        _, cuts, edges = microbatched(d * m, shard in FSDP_SHARDINGS)
        return stages_peak_memory(graph_of(shard), ctx, optimizer=optimizer, bounds=bounds, tensor=t, replicas=d,
                                  schedule=schedule, microbatches=m, chunks=v, recompute=recompute, costs=costs,
                                  shard=shard, cuts=cuts, edges=edges) <= cap

    aligned_bounds = functools.cache(functools.partial(block_bounds, graph))  # per stage count

    results: list[PipelineResult] = []
    jobs: list[tuple] = []  # candidates to simulate, in order: a batch for the helper
    sims = Helper(simulated, enabled=helper)
    timed: list[tuple[float, float]] = []  # per batch simulated: its span in pace() units, its seconds
    cut = False  # a batch not started: it would have ended past the deadline
    stopped = 0  # sharded layouts whose simulation the cutoff stopped

    def seconds(span: float) -> float:
        """How long a batch of ``span`` (:func:`pace` units, :meth:`Helper.span`) takes at
        most, by the batches timed so far: a simulation's time grows with its pace, by
        less than in proportion (a part of it is fixed), so each timed batch bounds a
        smaller one by its own time and a larger one by its time scaled in proportion;
        the least of these bounds."""
        return min(t * max(1.0, span / u) for u, t in timed)

    def enough() -> bool:
        """May the deadline stop the search: a layout that fits was simulated, or one was
        tried and ``elsewhere()`` has a plan that fits?"""
        return any(r.simulation.feasible for r in results) or (
            elsewhere is not None and bool(results or skipped) and elsewhere())

    def shape(r: PipelineResult) -> tuple:
        return r.tensor, len(r.stages), r.replicas, r.microbatches, r.schedule, r.chunks, r.recompute, r.shard

    def cutoff() -> float:
        """A sharded layout's cutoff (module docstring): the :data:`ALIGN_TOP`-th fastest
        time of the shapes that fit simulated so far (each shape's fastest), else none."""
        fastest: dict[tuple, float] = {}
        for r in results:
            if r.simulation.feasible:
                k, time_s = shape(r), r.simulation.iteration_time_s
                fastest[k] = min(time_s, fastest.get(k, math.inf))
        ranked = sorted(fastest.values())
        return ranked[ALIGN_TOP - 1] if len(ranked) >= ALIGN_TOP else math.inf

    def simulate(batch: list[tuple]) -> list[PipelineResult]:
        """:func:`simulated` over ``batch``, sharded layouts under :func:`cutoff` (those it
        stops left out); under a deadline, once a layout that fits has been simulated,
        only its first jobs that end by the deadline by :func:`seconds` (the rest cut)."""
        nonlocal cut, stopped
        paces = [pace(j) for j in batch]
        if deadline is not None and timed and enough():
            left = deadline - time.perf_counter()
            k = len(batch)
            while k and seconds(sims.span(paces[:k])) > left:
                k -= 1
            cut = cut or k < len(batch)
            batch, paces = batch[:k], paces[:k]
        limit = cutoff()
        t0 = time.perf_counter()
        out = sims.map([(*job, math.inf if job[8] == "none" else limit) for job in batch])
        if batch and all(r is not None for r in out):  # a stopped simulation says little of its pace
            timed.append((sims.span(paces), time.perf_counter() - t0))
        stopped += sum(r is None for r in out)
        return [r for r in out if r is not None]

    skipped = None  # the first candidate left out as over memory (simulated when nothing fits)
    order = len(queue)
    while queue:
        count = len(results) + stopped + len(jobs)  # a stopped simulation counts as one
        if count >= simulate_top or past(deadline) or (deadline is not None and len(jobs) > 1):
            # the rule below needs their feasibility; under a deadline, two at a time
            results += simulate(jobs)
            jobs.clear()
        found = any(r.simulation.feasible for r in results)
        if enough() and (past(deadline) or cut) or count >= max(simulate_top, SIMULATE_MAX) \
                or (count >= simulate_top and found):
            break
        _, t, p, d, m, schedule, v, recompute, part, shard, q = heapq.heappop(queue)[3]
        bounds = [(s.start, s.end) for s in part.stages]
        if not runs(bounds, p, shard):
            continue
        if not fits(bounds, t, p, d, m, schedule, v, recompute, shard):
            # cut at block boundaries instead, where it fits (a cut inside a block sends
            # more: its stage keeps what it sends per microbatch in flight)
            aligned = aligned_bounds(len(bounds))
            if aligned is not None and aligned != tuple(bounds) and \
                    fits(aligned, t, p, d, m, schedule, v, recompute, shard):
                jobs.append((aligned, t, p, d, m, schedule, v, recompute, shard))
                continue
            skipped = skipped or (bounds, t, p, d, m, schedule, v, recompute, shard)
            modes = RECOMPUTE_ORDER
            heavier = estimate(t, p, d, m, schedule, v, q, shard, modes[modes.index(recompute) + 1:])
            if heavier is not None:
                heapq.heappush(queue, (heavier[0], SAVINGS.index((heavier[7], shard)), order, heavier))
                order += 1
            continue
        jobs.append((bounds, t, p, d, m, schedule, v, recompute, shard))
    results += simulate(jobs)
    if not results and skipped is not None:  # none fits: the first, for what it needs
        results.append(simulated(*skipped))

    def layout_estimate(r: PipelineResult, shard: str) -> float:
        """The partitioner's estimate of ``r``'s layout sharded by ``shard`` at its
        checkpointing (infinite where the partitioner does not fit it)."""
        p, v = len(r.stages) // r.chunks, r.chunks
        e = estimate(r.tensor, p, r.replicas, r.microbatches, r.schedule, v,
                     peak_in_flight(r.schedule, p, r.microbatches, v), shard, (r.recompute,))
        return math.inf if e is None else e[0]

    def fits_as(r: PipelineResult, bounds, shard: str) -> bool:
        return fits(bounds, r.tensor, len(r.stages) // r.chunks, r.replicas, r.microbatches, r.schedule, r.chunks,
                    r.recompute, shard)

    tops: dict[tuple, PipelineResult] = {}  # the fastest feasible layouts, each once
    for r in sorted((r for r in results if r.simulation.feasible), key=lambda r: r.simulation.iteration_time_s):
        tops.setdefault(shape(r), r)
    jobs = []
    for r in list(tops.values())[:ALIGN_TOP]:
        # cut at block boundaries, as Megatron and torchtitan cut (the partitioner
        # balances its estimate and may cut inside a block)
        aligned = aligned_bounds(len(r.stages))
        if aligned is not None and aligned != tuple((a, b) for a, b, _ in r.stages) and not past(deadline) \
                and fits_as(r, aligned, r.shard):
            jobs.append(again(r, aligned, r.shard))
    results += simulate(jobs)
    best = min((r for r in results if r.simulation.feasible), key=lambda r: r.simulation.iteration_time_s,
               default=None)
    if best is not None and best.replicas > 1 and not past(deadline):
        # each other sharding: ZeRO-1 or FSDP2 stages may be the faster (the update is d
        # times smaller) even where the state fits replicated; tensor-parallel FSDP2
        # stages not where their estimate, the fill's gathers in it, is above the
        # layout's own (on GPT 1T over 3,072 A100s: 64 stages' gathers, a 5 s simulation
        # that cannot win; the estimate leaves out the smaller update, so plain stages
        # are always simulated)
        bounds = tuple((a, b) for a, b, _ in best.stages)
        results += simulate([again(best, bounds, other)
                             for other in pipeline_shardings(best.tensor, best.replicas, best.schedule, best.chunks)
                             if other != best.shard and fits_as(best, bounds, other) and
                             (other != "zero2" or best.tensor == 1
                              or layout_estimate(best, other) <= layout_estimate(best, best.shard))])
    sims.close()
    results.sort(key=lambda r: (not r.simulation.feasible, r.simulation.iteration_time_s))
    return PipelineSearch(results, cut or past(deadline))


def pace(job: tuple) -> int:
    """What a pipeline simulation's time grows with: its stages times its microbatches
    (``job``: :func:`search_pipelines`' simulation arguments, its layout's bounds and
    microbatches first and fifth). On GPT 1T over 3,072 A100s batches of two took 0.99
    s at 8,192 (the larger job's), 1.07 s at 18,432, and one alone 1.68 s at 32,768.
    """
    return len(job[0]) * job[4]


def pipeline_shardings(tensor: int, replicas: int, schedule: str, chunks: int = 1) -> tuple[str, ...]:
    """The shardings (:data:`~flexsearch.strategy.kinds.PIPELINE_SHARDINGS`) a layout of
    ``replicas`` x ``tensor`` devices per stage under ``schedule``, ``chunks`` stages per
    rank, takes
    (:func:`~flexsearch.strategy.kinds.check_pipeline_shard`), ``none`` first."""
    out = []
    for shard in PIPELINE_SHARDINGS:
        try:
            check_pipeline_shard(shard, replicas, tensor, schedule, chunks)
        except ValueError:
            continue
        out.append(shard)
    return tuple(out)


def block_bounds(graph: OpGraph, stages: int) -> tuple[tuple[int, int], ...] | None:
    """``stages`` stages of equally many of the graph's repeated blocks (transformer
    layers: :func:`~flexsearch.strategy.recompute.recompute_units`), the nodes before the
    first block in the first stage and those after the last in the last; None when the
    graph has no repeated blocks or their count does not divide by ``stages``."""
    units = recompute_units(graph) if graph.blocks else ()
    if not units or len(units) % stages:
        return None
    per = len(units) // stages
    starts = [0] + [units[k * per].start for k in range(1, stages)]
    ends = starts[1:] + [len(graph.nodes)]
    return tuple(zip(starts, ends, strict=True))


def stage_chain(costs: Sequence[NodeCost], cuts: Sequence[float], recompute: Checkpointing | None = None) -> Chain:
    """Per microbatch and node: compute ``f + b`` (``2 f + b`` for a node checkpointing
    drops, plus its transfers and collectives for one it caches) and the bytes it keeps
    per microbatch (:func:`flexsearch.sim.stages.stage_cost`'s rule)."""
    params = tuple(c.trains for c in costs)
    frozen = tuple(c.param_bytes - c.trains for c in costs) if any(c.trains < c.param_bytes for c in costs) else ()
    cp = recompute or Checkpointing.none(len(costs))
    stash = [kept_bytes(c, i, cp) for i, c in enumerate(costs)]
    return Chain(compute=tuple(c.forward_s + c.rerun_s(i, cp) + c.backward_s for i, c in enumerate(costs)),
                 params=params, cut_bytes=tuple(cuts), stash=tuple(stash), frozen=frozen)
