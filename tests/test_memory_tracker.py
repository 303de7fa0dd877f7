"""The memory model against torch's own memory trackers, per category.

Every data-parallel sharding (DDP, ZeRO-1, ZeRO-2, ZeRO-3) x precision (fp32,
bf16-mixed) x recompute (none, full, selective) of the zoo's tiny GPT is emitted on 2 gloo ranks
and run for two steps under ``MemTracker`` (``FSDPMemTracker`` for FSDP2). Each term of
the simulator's :class:`~flexsearch.sim.accounting.DeviceMemory` for rank 0 is compared
with what the tracker saw on that rank:

- parameters (``PARAM``, FSDP's ``SHARDED_PARAM``), gradients (``GRAD``,
  ``SHARDED_GRAD``) and optimizer state (``OPT``, Adam's two moments and its step
  counters) after the optimizer step: the model's state terms, to 1%;
- activations: the tracker's ``ACT`` when the loss has been computed minus what stays
  allocated after the step (the batch, DDP's gradient buckets), against the model's
  kept activations ``A`` (what autograd saves, measured by the tracer) plus ``Y``, what
  the loss holds over the output (:func:`acts`), within :data:`ACTIVATION_RTOL`, with
  and without activation checkpointing.

Measured on this matrix: -0.4% to 0% in every case. Selective checkpointing was -10.3%
(fp32) and +16.6% (bf16-mixed) while a matmul kept what it saved unchecked (its input's
autocast copy, its weights' copy) instead of its outputs, which torch's policy caches
(:meth:`flexsearch.strategy.recompute.Checkpointing.cached_bytes`): now -0.3% to -0.4%. FSDP2 in bf16-mixed was +6.6% to
+6.8% while the model took the activations autocast keeps over fp32 parameters; FSDP2
gathers them in bf16, so the ops autocast leaves alone compute in bf16 too, and its
plans are now predicted on the graph traced so
(:func:`flexsearch.sim.predict.runtime_graph`): -0.4% and -0.0%.

D-PSGD (both precisions) is checked the same way on both ranks, its gossip buffers
counted with the activations: -0.2% (fp32) and -0.1% (bf16-mixed).

Pipelines, which ``MemTracker`` refuses (it raises ``NotImplementedError`` for a module
called more than once per iteration, which a stage is, once per microbatch), are checked
by their peak per device against torch's allocator instead, read from ``torch.profiler``'s
memory events (GPipe, 1F1B and interleaved 1F1B on 2 ranks, both precisions), less the
stages' receive buffers (which the model leaves out: :mod:`flexsearch.sim.pipeline_memory`; the
emitter keeps one per microbatch it may still need, checked here per stage,
:func:`flexsearch.emit.staged.receive_buffers`): -5.8% to +8.2% (:data:`PIPELINE_MISSES`:
none left); a 1F1B pipeline of 2 replicas on 4 ranks the same way, both
precisions, its state replicated, its optimizer state sharded over the replicas
(ZeRO-1) and its stages FSDP2 modules over them (``zero2``): -8.1% to +7.6%, and each
sharding's saving within 25% of the allocator's (bf16-mixed under the ``slow`` marker,
for the default suite's time). SOAP plans (``MemTracker`` registers a
post-accumulate-grad hook on every module parameter, and a tied weight the emitter
moves to another op's layout is not a leaf) are checked the same way on Megatron's
layout, and by category from the allocator's own allocations, each by what made it
(:func:`allocator_categories`): optimizer state -0.2%, the loss's hold 0%, activations
+4.4% (fp32) and +0.8% (bf16-mixed), the backward's rise -5.3% (fp32; the median over
the measured steps, :func:`allocator_categories`) and 0.0% (bf16-mixed); by the
peak, a known miss, the model 0-11% under the running total the profiler records,
which also counts what gloo's threads allocate
(:func:`test_tensor_parallel_peak_memory_against_torchs_allocator`). The uncalibrated
model, every GPU preset's, is checked against an H100's allocator on every
bf16-mixed row measured there, and by phase, the loss's and the backward's peaks
(:func:`test_uncalibrated_peak_memory_against_an_h100s_allocator`, from the recorded
measurements: no GPU here).

The default suite checks each plan kind in one precision: the data-parallel shardings in
bf16-mixed, D-PSGD, pipelines (plain, sharded 1F1B, selective, accumulated, checkpointed)
and tensor-parallel stages in fp32, Megatron's SOAP layout in both. The rest of the
matrix (the other precision, the sharded interleaved pipeline, Megatron's layout
checkpointed, two of the H100 rows) runs under the ``slow`` marker, for the default
suite's time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import statistics
import sys

import pytest
import torch
from conftest import ROOT
from emit_cases import FAMILIES, load, mse, with_target

from flexsearch.cost.hardware import Cluster
from flexsearch.emit.launch import run_ranks
from flexsearch.graph.tracer import trace
from flexsearch.precision import precision as precision_of
from flexsearch.search.planner import plan_graph
from flexsearch.search.results import plan_from
from flexsearch.sim.context import CostContext
from flexsearch.sim.predict import predict
from flexsearch.strategy.fsdp import fsdp_units
from flexsearch.strategy.kinds import FSDP_SHARDINGS

STATE_RTOL = 0.01
ACTIVATION_RTOL = 0.10
"""[v2 3/6]'s bound: the memory model within 10% of torch's trackers per category."""


def emitted(spec: str, plan, frozen: tuple[str, ...] = ()):
    """The model of ``spec`` (its parameters named ``frozen*`` frozen) emitted for
    ``plan``, its Adam optimizer, inputs and target."""
    from flexsearch.emit import make_optimizer, parallelize

    model, x, y = with_target(spec)
    freeze(model, frozen)
    module = parallelize(model, plan)
    return module, make_optimizer(module, torch.optim.Adam, lr=1e-3), x, y


def tracked_job(rank: int, world: int, spec: str, plans: list) -> list[dict[str, float]]:
    """On every rank: each plan emitted, two Adam steps under torch's tracker; per plan
    the tracked state after the step and the activations held when the loss is known."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    out = []
    for plan in plans:
        module, opt, x, y = emitted(spec, plan)
        tracker = FSDPMemTracker(module.module, opt) if plan.shard_params else MemTracker()
        if not plan.shard_params:
            tracker.track_external(module, opt)
        snaps: dict[str, dict[str, int]] = {}

        def loss_fn(out_, target, snaps=snaps, tracker=tracker):
            loss = mse(out_, target)
            snaps["loss"] = next(iter(tracker.get_tracker_snapshot("current").values()))
            return loss

        with tracker:
            for _ in range(2):
                opt.zero_grad(set_to_none=True)
                module.train_step(x, y, loss_fn)
                opt.step()
                snaps["step"] = next(iter(tracker.get_tracker_snapshot("current").values()))
                tracker.reset_mod_stats()

        def cat(snap, *names):
            return float(sum(v for k, v in snap.items() if str(k).rsplit(".", 1)[-1] in names))

        out.append({"params": cat(snaps["step"], "PARAM", "SHARDED_PARAM"),
                    "grads": cat(snaps["step"], "GRAD", "SHARDED_GRAD"),
                    "optimizer": cat(snaps["step"], "OPT"),
                    "activations": cat(snaps["loss"], "ACT") - cat(snaps["step"], "ACT")})
    return out


def freeze(model, prefixes: tuple[str, ...]) -> None:
    for name, p in model.named_parameters():
        if prefixes and name.startswith(prefixes):
            p.requires_grad_(False)


RECOMPUTES = ("none", "full", "selective")


def _matrix(precision: str, frozen: tuple[str, ...] = (), recomputes: tuple[str, ...] = RECOMPUTES):
    model, x = load(FAMILIES["gpt"])
    freeze(model, frozen)
    g = trace(model, x, precision=precision)
    cl = Cluster.resolve("cpu", 2)
    base = plan_graph(g, cl, kinds=("data",), max_iters=0).strategy(g)
    ctx = CostContext(cl, precision=precision_of(precision))
    plans, terms = [], []
    for shard in ("none", "zero1", "zero2", "zero3"):
        for recompute in recomputes:
            s = dataclasses.replace(base, shard=shard, recompute=recompute,
                                    fsdp_units=fsdp_units(g.modules) if shard in FSDP_SHARDINGS else ())
            sim = predict(g, s, ctx)
            plans.append(plan_from(g, cl, s, sim, baselines={}, lower_bound_s=0.0))
            terms.append(sim.memory_terms[0])
    return plans, terms


def acts(m) -> float:
    """The model's activation terms, as the tracker sees them when the loss is known:
    what the forward keeps and the output-sized tensor the loss holds."""
    return m.activations + m.loss_grad


_MEASURED: dict[str, tuple] = {}


def _measured(precision: str) -> list[tuple[str, object, dict[str, float]]]:
    """(case, model terms, tracker figures) per plan of the matrix, run once per precision."""
    if precision not in _MEASURED:
        plans, terms = _matrix(precision)
        got = run_ranks(tracked_job, 2, FAMILIES["gpt"], plans, timeout_s=600)[0]
        _MEASURED[precision] = tuple((f"{p.shard}/{p.recompute}/{precision}", m, g)
                                     for p, m, g in zip(plans, terms, got, strict=True))
    return list(_MEASURED[precision])


@pytest.mark.parametrize("precision", [pytest.param("fp32", marks=pytest.mark.slow), "bf16-mixed"])
def test_memory_terms_match_torchs_trackers(precision):
    rows = _measured(precision)
    for case, m, got in rows:
        for term in ("params", "grads", "optimizer"):
            assert getattr(m, term) == pytest.approx(got[term], rel=STATE_RTOL), (case, term)
        print(f"{case}: activations model {acts(m):.0f} B, tracker {got['activations']:.0f} B "
              f"({acts(m) / got['activations'] - 1:+.1%})")
    for case, m, got in rows:
        assert acts(m) == pytest.approx(got["activations"], rel=ACTIVATION_RTOL), case
    # checkpointing saves memory in the model where the tracker sees it save memory, full
    # more than selective
    k = len(RECOMPUTES)
    for (c1, m1, g1), (_, m2, g2), (_, m3, g3) in zip(rows[::k], rows[1::k], rows[2::k], strict=True):
        assert acts(m2) < acts(m3) < acts(m1) and g2["activations"] < g3["activations"] < g1["activations"], c1



def state_job(rank: int, world: int, spec: str, plans: list, frozen: tuple[str, ...]) -> list[dict[str, float]]:
    """On every rank: each plan emitted with the ``frozen`` parameters frozen, two Adam
    steps; per plan the bytes this rank holds of the parameters, their gradients and the
    optimizer's state after the step, read from the tensors themselves (``MemTracker``
    hooks every parameter's gradient and raises for a frozen one)."""
    from torch.distributed.tensor import DTensor

    def local(t) -> float:
        t = t.to_local() if isinstance(t, DTensor) else t
        return float(t.numel() * t.element_size())

    out = []
    for plan in plans:
        module, opt, x, y = emitted(spec, plan, frozen)
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            module.train_step(x, y, mse)
            opt.step()
        params = [p for o in ([module.module] if plan.shard_params else [module]) for p in o.parameters()]
        local_opt = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer: its shard's optimizer
        state = [v for st in local_opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
        out.append({"params": sum(local(p) for p in params),
                    "grads": sum(local(p.grad) for p in params if p.grad is not None),
                    "optimizer": sum(local(v) for v in state)})
    return out


def test_frozen_parameters_hold_no_gradient_or_optimizer_state():
    """Fine-tuning: the tiny GPT with its position table and first block frozen
    (``requires_grad=False``), under DDP and ZeRO-1/2/3 (fp32, 2 gloo ranks): the model's
    gradients and optimizer state are the trained parameters' only, as the tensors after
    the step hold them (the model counted every parameter's), its parameters all of them."""
    frozen = ("wpe.", "h.0.")
    plans, terms = _matrix("fp32", frozen, recomputes=("none",))
    ranks = run_ranks(state_job, 2, FAMILIES["gpt"], plans, frozen, timeout_s=600)
    # ZeroRedundancyOptimizer gives each rank whole tensors (here 54% and 46% of the
    # state): the model's 1/n share is their mean
    got = [{k: sum(r[i][k] for r in ranks) / len(ranks) for k in ranks[0][i]} for i in range(len(plans))]
    for plan, m, g in zip(plans, terms, got, strict=True):
        for term in ("params", "grads", "optimizer"):
            assert getattr(m, term) == pytest.approx(g[term], rel=STATE_RTOL), (plan.shard, term)
        assert m.grads < 0.9 * m.params, plan.shard  # a tenth of the parameters is frozen


@pytest.mark.parametrize("precision", ["fp32", pytest.param("bf16-mixed", marks=pytest.mark.slow)])
def test_decentralized_memory_matches_torchs_trackers(precision):
    """D-PSGD (the planner's best gossip topology on 2 ranks) against the same trackers,
    per device: the state terms to 1%; the activations with the gossip buffers (the
    parameter snapshot sent and the models received: allocated during the step as plain
    tensors, which the tracker files under ``ACT``) within :data:`ACTIVATION_RTOL`."""
    model, x = load(FAMILIES["gpt"])
    g = trace(model, x, precision=precision)
    cl = Cluster.resolve("cpu", 2)
    strategy = plan_graph(g, cl, kinds=("decentralized",), max_iters=0).strategy(g)
    sim = predict(g, strategy, CostContext(cl, precision=precision_of(precision)))
    plan = plan_from(g, cl, strategy, sim, baselines={}, lower_bound_s=0.0)
    got = run_ranks(tracked_job, 2, FAMILIES["gpt"], [plan], timeout_s=600)
    for rank, (m, (tracked,)) in enumerate(zip(sim.memory_terms, got, strict=True)):
        for term in ("params", "grads", "optimizer"):
            assert getattr(m, term) == pytest.approx(tracked[term], rel=STATE_RTOL), (rank, term)
        assert m.buffers > 0 and acts(m) + m.buffers == pytest.approx(tracked["activations"], rel=ACTIVATION_RTOL), \
            (rank, acts(m), m.buffers, tracked["activations"])


STEPS = "flexsearch::measured_steps"
PIPELINE_MISSES: dict[tuple[str, str, int], float] = {}
"""Known misses of the pipeline memory model, bounded looser: none. The last, the fp32
interleaved pipeline's loss rank at -10.7% (0.33 MB short), read from the live
allocations at the allocator's peak grouped by op: the last stage runs microbatch 1's
loss forward while microbatch 0's gradients are held, beside microbatch 1's copy of
the MLP activation the stage received (the emitter runs a stage on copies of what it
receives: :func:`flexsearch.emit.dense.dense_input`), which its projection saves; the
model counted a saved tensor only on the stage that made it. It now counts what a stage
keeps at its edges (:class:`flexsearch.sim.stages.BoundaryCopies`: received copies its
ops save or it sends on, and the tensors it sends that no op saves, which torch's
``PipelineStage`` keeps to the microbatch's backward): -4.3%, the other rank +2.1% ->
+4.6% (its first stage's attention projection, sent and held per microbatch). Before that,
``aten::mse_loss``'s CPU kernel's two output-sized fp32 buffers were counted as one
(``max(Y, W)``, -19.3%; now ``Y + T``), and under bf16-mixed (GPipe -15.4%, 1F1B -11.8%,
interleaved -10.9%) the loss's fp32 copy of the output (``out.float()``, saved by the
MSE) once where torch.distributed.pipelining keeps it once per microbatch in flight
(:func:`flexsearch.sim.footprint.loss_copy_bytes`)."""


@contextlib.contextmanager
def stderr_off():
    """File descriptor 2 to ``/dev/null`` meanwhile (Kineto announces every profiler start
    and stop there)."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    os.close(null)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


@contextlib.contextmanager
def memory_profile():
    """A running ``torch.profiler`` profile of the CPU allocator's allocations and frees."""
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with stderr_off():
        prof.start()
    try:
        yield prof
    finally:
        with stderr_off():
            prof.stop()


def allocator_peak(prof) -> float:
    """The most torch's allocator held during a :data:`STEPS` range of a ``profile_memory``
    profile above what it held when the profile began, from the running total the
    profiler records with each allocation and free (whose origin is not the profile's
    start: the count goes on from earlier profiles in the process): what it held when
    the first range began, plus the least rise of a range above its own start. That
    total drifts up from step to step when collectives run (frees it does not see: over
    20 steps of Megatron's layout on the tiny GPT its level at each step's start rose
    0.25 MB a step, while the processes' resident memory stayed within 6 MB over 300
    steps), and a gloo transfer's buffers can land in one step's peak or not; each
    step's rise counted from its own start is the same on most steps (3.018 MB on 13 of
    19 and 15 of 19, per rank, the others above)."""
    from torch._C._profiler import _EventType

    nodes, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        n = stack.pop()
        nodes.append(n)
        stack.extend(n.children)
    allocs = sorted((n.start_time_ns, n.extra_fields.total_allocated, n.extra_fields.alloc_size) for n in nodes
                    if n.tag == _EventType.Allocation)
    origin = allocs[0][1] - allocs[0][2]
    rises = []
    for n in sorted((n for n in nodes if n.name == STEPS), key=lambda n: n.start_time_ns):
        inside = [(total, size) for t, total, size in allocs if n.start_time_ns <= t <= n.end_time_ns]
        level = inside[0][0] - inside[0][1]  # held when the range began
        rises.append((level, max(total for total, _ in inside) - level))
    return float(rises[0][0] - origin + min(rise for _, rise in rises))


LOSS = "flexsearch::loss"
"""The profiler range the allocator checks compute their loss in (:func:`measured_loss`)."""


def measured_loss(out, target):
    """The checks' loss (:func:`emit_cases.mse`, its fp32 copy of the output included) in
    a profiler range of its own, so that :func:`allocator_categories` tells what it
    makes apart."""
    from torch.profiler import record_function

    with record_function(LOSS):
        return mse(out, target)


def counted_peak(prof) -> float:
    """The most torch's allocator held during a :data:`STEPS` range of a
    ``profile_memory`` profile, counted as :func:`allocator_categories` counts: the
    allocations replayed by address (an allocation at an address still held counts as
    that one's free), of what the range itself made and of the optimizer's state; the
    least over the ranges, just after an allocation. Parameters, made before the
    profile, are not in it. :func:`allocator_peak` reads the profiler's running total
    instead, which counts no free made on gloo's threads (ProfiledCPUMemoryReporter
    counts only on threads the profiler runs on): a collective's buffers that gloo frees
    stay in it, and in the level every later step starts from. On Megatron's layout
    (DTensor's redistributions: buffers made on the main thread, freed on gloo's) fully
    checkpointed in fp32 the running total's peak took 3.52-4.25 MB per rank over seven
    runs and this one 3.03-3.10 MB over three (the model's 2.88 MB; parameters
    included); the unchecked layout's, 4.043 MB in fp32 and 3.699 MB in bf16-mixed on
    every rank of three runs. Not for what a step keeps for the next (a pipeline stage's
    receive buffers, made in the first step): the tensor-parallel runtime keeps nothing
    but the optimizer's state and the parameters."""
    allocs = _allocations(prof)
    peaks = []
    for r in _step_ranges(prof):
        live: dict[int, int] = {}
        level, peak = 0, None
        for t, ptr, size, path in allocs:
            if t > r.end_time_ns:
                break
            level -= live.pop(ptr, 0)
            if size > 0 and (t >= r.start_time_ns or _made_by(path) == "optimizer"):
                live[ptr] = size
                level += size
                if t >= r.start_time_ns:
                    peak = level if peak is None else max(peak, level)
        if peak is not None:
            peaks.append(peak)
    return float(min(peaks))


def _allocations(prof) -> list[tuple[int, int, int, tuple[str, ...]]]:
    """The profile's allocations and frees (negative sizes) in time order: (time, address,
    bytes, the names of the events around it, outermost first)."""
    from torch._C._profiler import _EventType

    allocs = []
    stack = [(n, ()) for n in prof.profiler.kineto_results.experimental_event_tree()]
    while stack:
        n, path = stack.pop()
        if n.tag == _EventType.Allocation:
            allocs.append((n.start_time_ns, n.extra_fields.ptr, n.extra_fields.alloc_size, path))
            continue
        stack.extend((c, (*path, n.name)) for c in n.children)
    allocs.sort(key=lambda a: a[0])
    return allocs


def _made_by(path: tuple[str, ...]) -> str:
    """What made an allocation, by the events around it (:func:`_allocations`): the
    optimizer's step (``Optimizer.step``), the backward (``autograd::engine``), the loss
    (:data:`LOSS`), else the forward (``activations``)."""
    for name in path:
        if name.startswith("Optimizer.step"):
            return "optimizer"
    for name in path:
        if name.startswith("autograd::engine"):
            return "backward"
    return "loss" if LOSS in path else "activations"


def _step_ranges(prof) -> list:
    """The profile's :data:`STEPS` ranges in time order."""
    return sorted((n for n in prof.profiler.kineto_results.experimental_event_tree() if n.name == STEPS),
                  key=lambda n: n.start_time_ns)


def allocator_categories(prof) -> dict[str, float | list[float]]:
    """What the allocator holds, by what made it, from the allocations of each
    :data:`STEPS` range of a ``profile_memory`` profile replayed by address (an
    allocation at an address still held counts as that one's free, which the profiler
    misses for frees on gloo's threads): made by the optimizer step (``Optimizer.step``,
    in the first step: Adam's state), by the backward (``autograd::engine``), by the
    loss (:data:`LOSS`), else by the forward. Per range: ``optimizer``, ``activations``
    (the forward's) and ``loss``, what each holds when the backward makes its first
    allocation, and ``backward``, the most held above that level until the optimizer
    step's first allocation; counting what the range made and the optimizer's state,
    not what earlier ranges left that the profiler saw no free of (in some runs, gathered
    tensors and collective results of the step before: their frees run on gloo's
    threads). Parameters, made before the profile, are not in it. The least of each
    over the ranges, but the backward's rise: the median of the ranges' (and
    ``backward_ranges``, each range's). A free on gloo's threads is seen only when its
    address is used again, which moves one range's rise either way: a buffer gloo freed
    in the backward still counted (up), one left from the forward reused in the
    backward (down). Megatron's layout fully checkpointed in fp32 rose 0.854 MB in 10 of
    36 ranges (2 ranks, 2 builds, 3 runs) and 0.658-0.985 MB in the others, the median
    0.854 MB; the least per build, as taken until then, 0.623-0.922 MB."""
    allocs = _allocations(prof)
    per_range = []
    for r in _step_ranges(prof):
        live: dict[int, tuple[int, str, bool]] = {}
        held = dict.fromkeys(("optimizer", "activations", "loss", "backward"), 0)
        start = peak = None
        for t, ptr, size, path in allocs:
            if t > r.end_time_ns:
                break
            old = live.pop(ptr, None)
            if old is not None and old[2]:
                held[old[1]] -= old[0]
            if size > 0:
                what = _made_by(path)
                if t >= r.start_time_ns and what != "activations" and what != "loss":
                    if start is None and what == "backward":
                        start = dict(held)
                        peak = sum(held.values())
                    elif start is not None and what == "optimizer":  # the backward is over
                        break
                counted = t >= r.start_time_ns or what == "optimizer"  # not what earlier steps left
                live[ptr] = (size, what, counted)
                if counted:
                    held[what] += size
            if start is not None:
                peak = max(peak, sum(held.values()))
        if start is not None:
            per_range.append({**{k: start[k] for k in ("optimizer", "activations", "loss")},
                              "backward": peak - sum(start.values())})
    if not per_range:
        return {}
    rises = [float(r["backward"]) for r in per_range]
    return {**{k: float(min(r[k] for r in per_range)) for k in ("optimizer", "activations", "loss")},
            "backward": statistics.median(rises), "backward_ranges": rises}


def test_allocator_peak_is_the_most_held_in_the_steps_counted_from_the_profilers_start():
    from torch.profiler import record_function

    with memory_profile() as prof:
        held = torch.ones(1 << 19)  # 2 MB before the steps, held through them
        with record_function(STEPS):
            big = torch.ones(1 << 21)  # 8 MB, then freed
            del big
            small = torch.ones(1 << 18)  # 1 MB
    assert allocator_peak(prof) == (2 + 8) * 2**20
    assert counted_peak(prof) == 8 * 2**20  # what the steps made
    assert held.numel() + small.numel() > 0


def test_counted_peak_counts_what_the_steps_made_and_the_optimizer_s_state():
    """A profile whose first step made the optimizer's 3-byte state and an 8-byte buffer
    freed on another thread (no free recorded): the running total still counts the
    buffer in every step's level (:func:`allocator_peak`: 2 + 3 + 8 held, a rise of 5);
    the counted peak is the state and each step's own 4 + 1 bytes at most, and the 4
    bytes made at the buffer's address free it in the replay (:func:`counted_peak`)."""
    from types import SimpleNamespace

    from torch._C._profiler import _EventType

    total = 0

    def alloc(t: int, ptr: int, size: int):
        nonlocal total
        total += size
        return SimpleNamespace(tag=_EventType.Allocation, name="[memory]", start_time_ns=t, end_time_ns=t, children=[],
                               extra_fields=SimpleNamespace(ptr=ptr, alloc_size=size, total_allocated=total))

    def span(name: str, t0: int, t1: int, *events):
        return SimpleNamespace(tag=None, name=name, start_time_ns=t0, end_time_ns=t1, children=list(events))

    def steady(t: int):  # 4 bytes at the freed buffer's address, 1 byte made and freed, the 4 freed
        return span(STEPS, t, t + 9, alloc(t + 1, 200, 4), alloc(t + 2, 300, 1), alloc(t + 3, 300, -1),
                    alloc(t + 4, 200, -4))

    held = alloc(1, 100, 2)  # made first: the running total goes in time order
    first = span("first step", 3, 8, alloc(4, 200, 8), span("Optimizer.step#Adam.step", 5, 6, alloc(5, 400, 3)))
    tree = [held, first, steady(10), steady(20)]
    prof = SimpleNamespace(profiler=SimpleNamespace(kineto_results=SimpleNamespace(
        experimental_event_tree=lambda: tree)))
    assert allocator_peak(prof) == 2 + 3 + 8 + 5
    assert counted_peak(prof) == 3 + 4 + 1


def test_allocator_categories_tell_the_optimizer_the_forward_the_loss_and_the_backward_apart():
    """One Linear (256 x 256, no bias: 256 kB) and a ReLU under Adam, three steps: the
    optimizer's state is its two moments and its step counter, the forward keeps the
    ReLU's output (64 kB, the Linear's is freed once the ReLU has run), the loss its
    elementwise buffer (64 kB), and the backward's rise above that ends at the weight's
    gradient."""
    from torch.profiler import record_function

    lin = torch.nn.Linear(256, 256, bias=False)
    opt = torch.optim.Adam(lin.parameters())
    x, target = torch.randn(64, 256), torch.zeros(64, 256)
    with memory_profile() as prof:
        for k in range(3):
            with record_function(STEPS if k else "first step"):
                opt.zero_grad(set_to_none=True)
                measured_loss(torch.relu(lin(x)), target).backward()
                opt.step()
    got = allocator_categories(prof)
    assert got["optimizer"] == 2 * 256 * 256 * 4 + 4
    assert got["activations"] == pytest.approx(64 * 256 * 4, abs=16)
    assert got["loss"] == pytest.approx(64 * 256 * 4, abs=16)
    assert got["backward"] == 256 * 256 * 4


def allocated_job(rank: int, world: int, spec: str, plans: list, steps: int = 4) -> list[tuple]:
    """On every rank, per plan: the rank's parameter bytes plus torch's allocator's peak in
    its second to last of ``steps`` steps (:func:`allocator_peak`), counted from the end of the
    module's build (so the optimizer state and the stage's receive buffers, made in the
    first step, count; the first step's one-off work, the stage's shape inference, does
    not); the bytes of those receive buffers; per stage (index, first, last, the sets
    of activation and of gradient receive buffers it holds: one set per microbatch it can
    receive into at once); and what the allocator held by what made it
    (:func:`allocator_categories`); and the first figure with the allocator's peak
    counted by :func:`counted_peak` instead."""
    from torch.profiler import record_function

    from flexsearch.emit import make_optimizer, parallelize

    out = []
    for plan in plans:
        model, x, y = with_target(spec)
        module = parallelize(model, plan)
        del model
        opt = make_optimizer(module, torch.optim.Adam, lr=1e-3)
        with memory_profile() as prof:
            for k in range(steps):
                with record_function(STEPS if k else "first step"):
                    opt.zero_grad(set_to_none=True)
                    module.train_step(x, y, measured_loss)
                    opt.step()
        recv = {}  # the stages' receive buffers (not modelled: flexsearch.sim.pipeline)
        counts = []  # per stage of this rank: (activation, gradient) buffers
        for stage in getattr(module, "_pipe_stages", ()):
            mine = []
            for table in (stage.args_recv_info, stage.grad_recv_info):
                sets = set()  # one set of buffers per microbatch received into
                for infos in table.values():
                    ptrs = []
                    for info in infos:
                        if isinstance(getattr(info, "buffer", None), torch.Tensor):
                            ptrs.append(info.buffer.untyped_storage().data_ptr())
                            recv[ptrs[-1]] = info.buffer.untyped_storage().nbytes()
                    if ptrs:
                        sets.add(tuple(ptrs))
                mine.append(len(sets))
            counts.append((stage.stage_index, stage.is_first, stage.is_last, *mine))
        local = [getattr(p, "_local_tensor", p) for p in module.parameters()]  # FSDP2's shards: the local bytes
        params = sum(p.numel() * p.element_size() for p in local)
        out.append((allocator_peak(prof) + params, float(sum(recv.values())), counts, allocator_categories(prof),
                    counted_peak(prof) + params))
        del module, opt, prof  # the next plan's build and steps in a process holding none of this one
        gc.collect()
    return out


@pytest.mark.parametrize("precision", ["fp32", pytest.param("bf16-mixed", marks=pytest.mark.slow)])
def test_pipeline_peak_memory_matches_torchs_allocator(precision):
    """Pipelines (which ``MemTracker`` refuses: a stage runs once per microbatch) on 2 gloo
    ranks: the calibrated peak per device, less the runtime's own term, against torch's
    allocator's peak (``torch.profiler``'s memory events) less the stages' receive buffers
    (not modelled) within :data:`ACTIVATION_RTOL`.
    Gradients stay while later microbatches are in flight (``H``,
    :func:`flexsearch.sim.pipeline_memory.held_with_gradients`): without that term the fidelity
    benchmark's GPT was predicted at 30.9 MB on its first 1F1B stage, which allocated
    37.8 MB."""
    from flexsearch.cost.calibration import load_calibration_file
    from flexsearch.emit.staged import receive_buffers
    from flexsearch.sim.accounting import peak_bytes

    model, x = load(FAMILIES["gpt"])
    g = trace(model, x, precision=precision)
    cl = Cluster.resolve("cpu", 2)
    cal = load_calibration_file().devices[cl.device.name]
    ctx = CostContext(cl, calibration=cal, precision=precision_of(precision))
    plans, predicted = [], []
    for schedule in ("gpipe", "1f1b", "interleaved"):
        s = plan_graph(g, cl, kinds=("pipeline",), schedules=(schedule,), max_iters=0).strategy(g)
        sim = predict(g, s, ctx)
        plans.append(plan_from(g, cl, s, sim, baselines={}, lower_bound_s=0.0))
        predicted.append([peak_bytes(m, cal, "pipeline") - cal.runtime("pipeline") for m in sim.memory_terms])
    got = run_ranks(allocated_job, 2, FAMILIES["gpt"], plans, timeout_s=600)
    misses = []
    for i, plan in enumerate(plans):
        for rank in range(2):
            want, (peak, recv, counts, _, _) = predicted[i][rank], got[rank][i]
            have = peak - recv
            for stage, first, last, acts, grads in counts:  # the emitter's bounded receive buffers
                a, b = receive_buffers(plan.schedule, stage, len(plan.stages), plan.microbatches)
                assert (acts, grads) == (0 if first else a, 0 if last else b), (plan.schedule, stage, acts, grads)
            print(f"{plan.schedule} m{plan.microbatches} rank {rank}: model {want / 1e6:.2f} MB, "
                  f"allocator {peak / 1e6:.2f} MB less receive buffers {recv / 1e6:.2f} MB ({want / have - 1:+.1%})")
            bound = PIPELINE_MISSES.get((precision, plan.schedule, rank), ACTIVATION_RTOL)
            if want != pytest.approx(have, rel=bound):
                misses.append((plan.schedule, rank, want, have))
    assert not misses


@pytest.mark.parametrize("precision", ["fp32", pytest.param("bf16-mixed", marks=pytest.mark.slow)])
def test_selective_pipeline_memory_matches_torchs_allocator(precision):
    """The search's 1F1B pipeline on 2 gloo ranks with selective checkpointing: the peak
    per rank as :func:`test_pipeline_peak_memory_matches_torchs_allocator` checks it, and
    what the forward keeps against the allocations it made that are held when the
    backward starts (:func:`allocator_categories`), within :data:`ACTIVATION_RTOL`.
    Measured: peaks -3.1% and -1.2% (fp32), -5.6% and +8.6% (bf16-mixed); activations
    -3.1% and -1.7%, -3.1% and -1.6%. While a matmul kept what it saved unchecked, not the
    outputs torch's policy caches, the activations were -19.2% and -11.1% (fp32), +39.1%
    and +20.4% (bf16-mixed), and the last rank's peak +12.4% (bf16-mixed)."""
    from flexsearch.cost.calibration import load_calibration_file
    from flexsearch.sim.accounting import peak_bytes

    model, x = load(FAMILIES["gpt"])
    g = trace(model, x, precision=precision)
    cl = Cluster.resolve("cpu", 2)
    cal = load_calibration_file().devices[cl.device.name]
    ctx = CostContext(cl, calibration=cal, precision=precision_of(precision))
    base = plan_graph(g, cl, kinds=("pipeline",), schedules=("1f1b",), max_iters=0).strategy(g)
    s = dataclasses.replace(base, recompute="selective")
    sim = predict(g, s, ctx)
    plan = plan_from(g, cl, s, sim, baselines={}, lower_bound_s=0.0)
    got = run_ranks(allocated_job, 2, FAMILIES["gpt"], [plan], timeout_s=600)
    for rank in range(2):
        m = sim.memory_terms[rank]
        peak, recv, _, made, _ = got[rank][0]
        want = peak_bytes(m, cal, "pipeline") - cal.runtime("pipeline")
        print(f"selective 1f1b rank {rank}: peak model {want / 1e6:.3f} MB, allocator {(peak - recv) / 1e6:.3f} MB "
              f"({want / (peak - recv) - 1:+.1%}); activations {m.activations / 1e6:.3f} MB, "
              f"{made['activations'] / 1e6:.3f} MB ({m.activations / made['activations'] - 1:+.1%})")
        assert want == pytest.approx(peak - recv, rel=ACTIVATION_RTOL), rank
        assert m.activations == pytest.approx(made["activations"], rel=ACTIVATION_RTOL), rank


def test_checkpointed_tensor_parallel_stages_keep_what_torch_keeps():
    """A hybrid pipeline (2 stages x 2-way tensor parallelism, 1F1B, 2 microbatches) on 4
    gloo ranks, fp32, fully and selectively checkpointed, each block's ops in the
    interpreter: what the forward keeps against the allocations it made that are held
    when the backward starts (:func:`allocator_categories`), within
    :data:`ACTIVATION_RTOL`. Measured on the first and last stage: full -9.0% and +3.2%,
    selective -2.8% and +1.9% (unchecked +7.9% and +7.4%). While a tensor-parallel stage
    was checkpointed whole (keeping its received input alone), the last stage's was
    -88% (the model 0.03 MB, the allocator 0.27: what it sends, and the input of each
    block, which its region kept). The peaks are not checked here: on 4 ranks over 2
    cores the allocator's moved by up to 0.23 MB (12%) between runs of the same plan."""
    from flexsearch.strategy.kinds import Pipelined

    model, x = load(FAMILIES["gpt"])
    cl = Cluster.resolve("cpu", 4)
    g = trace(model, x)
    ctx = CostContext(cl)
    names = [n.name for n in g.nodes]
    cut = names.index("h_1_ln_1")
    plans, sims = [], []
    for rc in ("full", "selective"):
        s = Pipelined(((0, cut), (cut, len(names))), tensor=2, replicas=1, schedule="1f1b", microbatches=2,
                      recompute=rc)
        sims.append(predict(g, s, ctx))
        plans.append(plan_from(g, cl, s, sims[-1], baselines={}, lower_bound_s=0.0))
    assert [p.kind for p in plans] == ["hybrid", "hybrid"]
    got = run_ranks(allocated_job, 4, FAMILIES["gpt"], plans, timeout_s=600)
    for i, plan in enumerate(plans):
        for rank in (0, 2):  # a rank of each stage
            model_acts, made = sims[i].memory_terms[rank].activations, got[rank][i][3]["activations"]
            print(f"hybrid t=2 {plan.recompute} rank {rank}: activations model {model_acts / 1e6:.3f} MB, "
                  f"allocator {made / 1e6:.3f} MB ({model_acts / made - 1:+.1%})")
            assert model_acts == pytest.approx(made, rel=ACTIVATION_RTOL), (plan.recompute, rank)


SAVING_NOISE = 0.15e6
"""Bytes a sharded pipeline's measured saving may miss by (the allocator's two peaks,
:func:`test_sharded_pipeline_peak_memory_matches_torchs_allocator`)."""
@pytest.mark.parametrize(("precision", "schedule"), [("fp32", "1f1b"),
                                                    pytest.param("fp32", "interleaved", marks=pytest.mark.slow),
                                                    pytest.param("bf16-mixed", "1f1b", marks=pytest.mark.slow),
                                                    pytest.param("bf16-mixed", "interleaved", marks=pytest.mark.slow)])
def test_sharded_pipeline_peak_memory_matches_torchs_allocator(precision, schedule):
    """A 2-stage 1F1B pipeline of 2 replicas on 4 gloo ranks (oversubscribing CI's 2
    cores: slower, not different), and a 4-stage interleaved one (2 stages per rank),
    its state replicated, its optimizer state sharded
    over the replicas (ZeRO-1) and its stages FSDP2 modules over them (``zero2``): per
    device the calibrated peak against torch's allocator as in
    :func:`test_pipeline_peak_memory_matches_torchs_allocator`, and each sharding's
    saving against the allocator's. Measured: -1.0% / -1.6% (first / last stage)
    replicated, -2.7% to +0.2% / -3.6% to -0.3% ZeRO-1, -1.1% / -1.8% FSDP2 (its saving,
    0.17 MB a rank, the allocator's to the 10 kB) in fp32; in bf16-mixed +2.1% / +5.0%
    replicated, +4.3% / +7.6% ZeRO-1, +0.8% / +7.0% FSDP2, each within
    :data:`ACTIVATION_RTOL` (the last stage, which holds the loss, was bounded at 15%
    until 2026-11-27, for the miss below). FSDP2's last stage in bf16-mixed was +17.3%
    while the model
    held a microbatch's bf16 gradients beside the fp32 ones accumulated from the first
    backward on: FSDP2 adds them in at each unit's post-backward and frees them, so
    after the next forward only the fp32 ones are held
    (:func:`flexsearch.sim.pipeline_memory.held_with_gradients`, ``making``); it saved
    0.36 MB there by the model, 0.53 MB by the allocator, 0.52 MB now. Interleaved:
    -4.5% / -1.8% replicated, -3.7% / -2.2% ZeRO-1, +0.9% / -2.0% FSDP2 in fp32; +0.4% /
    +3.8%, +2.5% / +4.5%, -3.7% / +5.1% in bf16-mixed. Its FSDP2 first rank was -19.7%
    (fp32) and -16.1% before the model kept every send to the step's end, as that
    runtime does (:func:`flexsearch.sim.pipeline_memory.kept_sends`); replicated, the
    update's temporaries had hidden the same shortfall in the backward. Under FSDP2 the profiler's running total drifts: the level a step
    starts at (:func:`allocator_peak` counts the first step's) is 0.13-0.68 MB above the
    state the ranks hold in about a third of the builds, on either stage (per step, the
    rise above that level is the same in 34 of 36 steps; FSDP2 frees on gloo's threads
    what the profiler saw allocated), so the FSDP2 plan is built and measured three times
    and the least of its six peaks per stage (three builds x two replicas, the same
    program on shards of the same size) is compared, a saving within 25% or
    :data:`SAVING_NOISE`. Over 12 builds in 4 processes the least of three was the
    plain value every time; the other plans' ranks came out the same to the 10 kB in
    every run."""
    from flexsearch.cost.calibration import load_calibration_file
    from flexsearch.sim.accounting import peak_bytes
    from flexsearch.strategy.kinds import Pipelined

    model, x = load(FAMILIES["gpt"])
    g = trace(model, x, precision=precision)
    cl = Cluster.resolve("cpu", 4)
    cal = load_calibration_file().devices[cl.device.name]
    ctx = CostContext(cl, calibration=cal, precision=precision_of(precision))
    k = len(g.nodes)
    plans, predicted = [], []
    for shard in ("none", "zero1", "zero2"):
        v = 2 if schedule == "interleaved" else 1  # 2 stages per rank
        s = Pipelined(tuple((k * i // (2 * v), k * (i + 1) // (2 * v)) for i in range(2 * v)), tensor=1, replicas=2,
                      schedule=schedule, microbatches=2, chunks=v, shard=shard)
        sim = predict(g, s, ctx)
        plans.append(plan_from(g, cl, s, sim, baselines={}, lower_bound_s=0.0))
        predicted.append([peak_bytes(m, cal, "pipeline") - cal.runtime("pipeline") for m in sim.memory_terms])
    got = run_ranks(allocated_job, 4, FAMILIES["gpt"], plans + plans[2:] * 2, timeout_s=600)
    builds = {0: [0], 1: [1], 2: [2, 3, 4]}  # the FSDP2 plan's three builds
    have = [[min(got[q][b][0] - got[q][b][1] for q in (r - r % 2, r - r % 2 + 1) for b in builds[i])
             for r in range(4)] for i in range(3)]  # ranks (0, 1) and (2, 3): a stage's replicas
    misses = []
    for i, plan in enumerate(plans):
        for rank in range(4):
            print(f"{precision} {schedule} {plan.shard} rank {rank}: model {predicted[i][rank] / 1e6:.2f} MB, allocator less "
                  f"receive buffers {have[i][rank] / 1e6:.2f} MB ({predicted[i][rank] / have[i][rank] - 1:+.1%})")
            if predicted[i][rank] != pytest.approx(have[i][rank], rel=ACTIVATION_RTOL):
                misses.append((plan.shard, rank))
    for i in (1, 2):
        for rank in range(4):  # what sharding saves, model against allocator
            saved, freed = predicted[0][rank] - predicted[i][rank], have[0][rank] - have[i][rank]
            print(f"{precision} {schedule} {plans[i].shard} rank {rank}: saves {saved / 1e6:.2f} MB, the allocator "
                  f"{freed / 1e6:.2f} MB")
            if not (saved > 0 and abs(saved - freed) <= max(0.25 * freed, SAVING_NOISE)):
                misses.append((plans[i].shard, rank, "saving"))
    assert not misses


@pytest.mark.parametrize("precision", ["fp32", pytest.param("bf16-mixed", marks=pytest.mark.slow)])
def test_accumulation_peak_memory_matches_torchs_allocator(precision):
    """Data parallelism with 2 accumulated microbatches on 2 gloo ranks, replicated (DDP),
    ZeRO-1 and ZeRO-2 (FSDP2, gathered once and kept until the last microbatch, a stage
    of :func:`test_sharded_pipeline_peak_memory_matches_torchs_allocator` on every
    device): the calibrated peak per device, less the runtime's own term and DDP's
    gradient buckets (made with the module, before the profile starts; the fidelity
    benchmark's ``accum`` rows measure them), against torch's allocator's (``MemTracker``
    refuses a module run twice a step). Measured: -0.1% (DDP, ZeRO-1) and -0.1% or -4.5% (ZeRO-2, the
    allocator's two peaks)
    in fp32, +4.1% to +5.5% in bf16-mixed. ZeRO-2 in bf16-mixed was +18.7% while FSDP2
    plans were predicted on autocast's graph, +16.9% on the graph FSDP2 computes while
    the model held every microbatch's bf16 gradients beside the fp32 ones accumulated,
    where FSDP2 turns each unit's into fp32 at the unit's post-backward
    (:func:`flexsearch.sim.pipeline_layout.fsdp_grad_copies`: one unit's at a time),
    +9.7% while it held that unit's also after the next microbatch's forward, when they
    are gone (:func:`flexsearch.sim.pipeline_memory.held_with_gradients`). ZeRO-2's peak is the least of three builds on either rank (the profiler's
    drift under FSDP2: :func:`test_sharded_pipeline_peak_memory_matches_torchs_allocator`).
    bf16-mixed runs under the ``slow`` marker (the default suite's time)."""
    from flexsearch.cost.calibration import load_calibration_file
    from flexsearch.sim.accounting import peak_bytes

    model, x = load(FAMILIES["gpt"])
    g = trace(model, x, precision=precision)
    cl = Cluster.resolve("cpu", 2)
    cal = load_calibration_file().devices[cl.device.name]
    ctx = CostContext(cl, calibration=cal, precision=precision_of(precision))
    base = plan_graph(g, cl, kinds=("data",), max_iters=0).strategy(g)
    plans, predicted = [], []
    for shard in ("none", "zero1", "zero2"):
        units = fsdp_units(g.modules) if shard in FSDP_SHARDINGS else ()
        s = dataclasses.replace(base, shard=shard, fsdp_units=units, microbatches=2)
        sim = predict(g, s, ctx)
        plans.append(plan_from(g, cl, s, sim, baselines={}, lower_bound_s=0.0))
        # DDP's gradient buckets are allocated when it is built, before the profile
        # starts: the allocator's count leaves them out (the parameters it adds back)
        mode = "fsdp" if shard in FSDP_SHARDINGS else "ddp"
        predicted.append([peak_bytes(m, cal, mode) - cal.runtime(mode) - m.grad_buckets for m in sim.memory_terms])
    got = run_ranks(allocated_job, 2, FAMILIES["gpt"], plans + plans[2:] * 2, timeout_s=600)
    builds = {0: [0], 1: [1], 2: [2, 3, 4]}  # FSDP2: the least of three builds' peaks
    misses = []
    for i, plan in enumerate(plans):
        for rank in range(2):
            want, have = predicted[i][rank], min(got[q][b][0] for q in range(2) for b in builds[i])
            print(f"{precision} {plan.shard} m2 rank {rank}: model {want / 1e6:.2f} MB, allocator {have / 1e6:.2f} MB "
                  f"({want / have - 1:+.1%})")
            bound = ACTIVATION_RTOL
            if want != pytest.approx(have, rel=bound):
                misses.append((plan.shard, rank))
    assert not misses


@pytest.mark.parametrize("precision", ["fp32", pytest.param("bf16-mixed", marks=pytest.mark.slow)])
def test_checkpointed_peak_memory_matches_torchs_allocator(precision):
    """Data parallelism (DDP) on 2 gloo ranks without and with (full, selective) activation
    checkpointing, on the tiny GPT (a unit per block) and the tiny AlexNet at batch 128
    (one unit holding nearly every activation): the calibrated peak per device, less
    the runtime's own term and DDP's buckets, against torch's allocator's, within
    :data:`ACTIVATION_RTOL`. Measured: GPT -5.9% and +0.8% (fp32), +4.5% and -0.1%
    (bf16-mixed); AlexNet -7.0% and -7.6% (fp32), -5.6% and -4.9% (bf16-mixed),
    checkpointed and not. While the backward's gradient buffers were counted over the
    kept activations alone, on top of the rebuilt unit, and the rebuilt unit on top of
    the loss's working tensor (:mod:`flexsearch.sim.accounting`), checkpointed AlexNet
    was +37.2% (fp32) and GPT +14.1% (bf16-mixed). Selective checkpointing: GPT +0.6%
    (fp32) and -0.5% (bf16-mixed), AlexNet -7.0% and -6.3%; and what the forward keeps,
    against the allocations it made that are held when the backward starts
    (:func:`allocator_categories`), within :data:`ACTIVATION_RTOL`: GPT -1.4% and -2.2%,
    AlexNet -0.9% and -1.9%. While a matmul kept what it saved unchecked (its inputs'
    copies), not its outputs, which torch's policy caches
    (:meth:`flexsearch.strategy.recompute.Checkpointing.cached_bytes`), those were GPT
    -13.7% and +28.2%, AlexNet -98% (its convolutions' outputs, which no op saves: a
    ReLU saves its own) while its peaks held (-3.5%, +6.0%, -7.0%, -4.7%): the rebuilt
    unit made up for them. The recomputation frees a cached output no op saves; without
    that, AlexNet's peak was +40%."""
    from flexsearch.cost.calibration import load_calibration_file
    from flexsearch.sim.accounting import peak_bytes

    cl = Cluster.resolve("cpu", 2)
    cal = load_calibration_file().devices[cl.device.name]
    ctx = CostContext(cl, calibration=cal, precision=precision_of(precision))
    misses = []
    for spec in (FAMILIES["gpt"], "tests/data/alexnet_b128.py:alexnet_b128"):
        model, x = load(spec)
        g = trace(model, x, precision=precision)
        base = plan_graph(g, cl, kinds=("data",), max_iters=0).strategy(g)
        plans, predicted, kept = [], [], []
        for recompute in ("none", "full", "selective"):
            s = dataclasses.replace(base, recompute=recompute)
            sim = predict(g, s, ctx)
            plans.append(plan_from(g, cl, s, sim, baselines={}, lower_bound_s=0.0))
            predicted.append([peak_bytes(m, cal, "ddp") - cal.runtime("ddp") - m.grad_buckets
                              for m in sim.memory_terms])
            kept.append([m.activations for m in sim.memory_terms])
        got = run_ranks(allocated_job, 2, spec, plans, timeout_s=600)
        for i, plan in enumerate(plans):
            for rank in range(2):
                want, have = predicted[i][rank], got[rank][i][0]
                print(f"{spec} {precision} rc={plan.recompute} rank {rank}: model {want / 1e6:.2f} MB, "
                      f"allocator {have / 1e6:.2f} MB ({want / have - 1:+.1%})")
                if want != pytest.approx(have, rel=ACTIVATION_RTOL):
                    misses.append((spec, plan.recompute, rank))
        acts_model, acts_made = kept[2][0], got[0][2][3]["activations"]  # selective: what the forward keeps
        print(f"{spec} {precision} selective activations: model {acts_model / 1e6:.3f} MB, allocator "
              f"{acts_made / 1e6:.3f} MB ({acts_model / acts_made - 1:+.1%})")
        if acts_model != pytest.approx(acts_made, rel=ACTIVATION_RTOL):
            misses.append((spec, "selective activations"))
        # what checkpointing saves (or costs) in the model is what the allocator sees
        saved_model, saved_allocator = predicted[1][0] / predicted[0][0], got[0][1][0] / got[0][0][0]
        assert saved_model == pytest.approx(saved_allocator, rel=ACTIVATION_RTOL), spec
    assert not misses


CATEGORY_RTOL = {"optimizer": 0.01, "loss": 0.01}
"""The model's terms against :func:`allocator_categories` (else :data:`ACTIVATION_RTOL`):
the state and the loss's hold exactly, to the optimizer's step counters."""
TENSOR_PARALLEL_CATEGORY_MISSES: dict[tuple[str, str], float] = {}
"""Known misses by category on Megatron's layout
(:func:`test_tensor_parallel_peak_memory_against_torchs_allocator`): none. The last, in
fp32 the backward's rise above what the forward left, bounded at 15%: -5.3% on rank 0
and +12.5% on rank 1 (0.10 MB apart) in one run; the allocator's rise on rank 1 was
0.524, 0.557 or 0.623 MB from run to run, the model's 0.590 MB. The backward makes the
same allocations on both ranks (0.766 MB held at most: the gradients of the fused
``qkv`` split concatenated, 0.20 MB, a redistribution's 0.13 MB, ...); what differs is
when the forward's tensors are freed, which lowers the rise counted above them when
they go during the backward. In 11 later runs (2026-11-27; 22 rank-runs) only 0.557
(twice) and 0.623 MB came: -5.3% or +5.9%. The fp32 plan was then built and measured
twice and the larger rise of the two taken; now the rise is the median over both
builds' measured steps (:func:`allocator_categories`: 0.623 MB in 30 of 36 steps over
three runs, 0.524 or 0.557 MB in the others). The bf16-mixed
activations were a miss, -12.1%, while the emitter ran the sharded
``scaled_dot_product_attention`` on DTensors: on a CPU that is DTensor's math
decomposition (no rule for the CPU's fused kernel), which keeps the ``T x T``
probabilities in fp32; each rank now runs its heads with the model's kernel
(:meth:`flexsearch.emit.sharded.ShardedModule._call_local`): +0.8% (fp32 +1.0% to
+1.4% -> +4.4%)."""


TENSOR_PARALLEL_STEPS = 10
"""Steps per build of Megatron's layout (:func:`allocated_job`; the first not measured):
18 measured steps per rank over the fp32 plan's two builds. Its fully checkpointed
backward's rise, the median over them, took 0.854-0.887 MB per rank over four runs
(8 rank-runs); over 6 steps (3 per build) 0.789-0.920 MB, and the forward's activations,
the least over a build's 3 steps, once 0.965 MB where 0.834 MB came in every other
(2026-12-06)."""


def test_tensor_parallel_peak_memory_against_torchs_allocator():
    """Megatron's layout (t = 2, the emitter's DTensor runtime) on 2 gloo ranks, fp32 and
    bf16-mixed: the model's optimizer state, activations, the loss's hold and the
    backward's rise above them (``max(T, W)``) against what the allocator's allocations
    made by the optimizer step, the forward, the loss and the backward hold
    (:func:`allocator_categories`), within :data:`CATEGORY_RTOL` (:data:`ACTIVATION_RTOL`
    for the others) but for :data:`TENSOR_PARALLEL_CATEGORY_MISSES`; and the calibrated
    peak per device against torch's allocator, counted by :func:`counted_peak` (the
    redistributions' buffers gloo frees on its threads do not pile up), within
    :data:`ACTIVATION_RTOL`: +1.4% (fp32) and +0.2% (bf16-mixed) on both ranks in each of
    six runs (2026-12-06). Off the profiler's running total (:func:`allocator_peak`),
    until then, it was a known miss bounded at 25%: +1.4% to -9.4% over three runs of
    the same code, 0% to -11% over four runs before each rank ran its attention heads
    with the model's kernel, -6% to -20% over six runs of an earlier version (that total
    moved by up to 0.5 MB between runs of the same plan: what the first step left that
    the profiler saw no free of); -21% to -32% while the peak took ``max(Y, W)`` (the
    peak is at the loss: in the MSE's forward beside the whole output in bf16-mixed, at
    the head's backward in fp32, where the MSE's elementwise buffer, the gradient of the
    output and the output itself are all alive); -34% to -37% in fp32 before the emitter
    freed each value after its last reader (:func:`flexsearch.emit.sharded.last_uses`)."""
    plans, predicted, terms = _megatron_plans("none")
    got = run_ranks(allocated_job, 2, FAMILIES["gpt"], [*plans, plans[0]], TENSOR_PARALLEL_STEPS, timeout_s=600)
    for rank in range(2):  # fp32's backward: the median rise over both builds' ranges
        got[rank][0][3]["backward"] = statistics.median(got[rank][0][3]["backward_ranges"]
                                                        + got[rank][2][3]["backward_ranges"])
    _check_by_category(plans, predicted, terms, got, TENSOR_PARALLEL_CATEGORY_MISSES)


def _megatron_plans(recompute: str) -> tuple[list, list, list]:
    """Megatron's layout (t = 2) on the tiny GPT on 2 CPU devices, fp32 and bf16-mixed,
    with ``recompute``: the plans, the calibrated peak per rank less the runtime's own
    term, and the memory terms."""
    from flexsearch.cost.calibration import load_calibration_file
    from flexsearch.sim.accounting import peak_bytes
    from flexsearch.strategy.kinds import Soap
    from flexsearch.strategy.recipes import megatron
    from flexsearch.strategy.space import Space

    model, x = load(FAMILIES["gpt"])
    cl = Cluster.resolve("cpu", 2)
    cal = load_calibration_file().devices[cl.device.name]
    plans, predicted, terms = [], [], []
    for precision in ("fp32", "bf16-mixed"):
        g = trace(model, x, precision=precision)
        ctx = CostContext(cl, calibration=cal, precision=precision_of(precision))
        space = Space(g, 2)
        dec = megatron(space, 2)
        s = Soap(space.expand(dec), dec, recompute)
        sim = predict(g, s, ctx)
        plans.append(plan_from(g, cl, s, sim, baselines={}, lower_bound_s=0.0))
        predicted.append([peak_bytes(m, cal, "sharded") - cal.runtime("sharded") for m in sim.memory_terms])
        terms.append(sim.memory_terms)
    return plans, predicted, terms


def _check_by_category(plans: list, predicted: list, terms: list, got: list, misses: dict) -> None:
    """Each plan's peak per rank within :data:`ACTIVATION_RTOL` of the allocator's
    (:func:`counted_peak`), and its terms within :data:`CATEGORY_RTOL` (:data:`ACTIVATION_RTOL`) of what the
    allocator's allocations made, but for ``misses`` ((precision, category) -> bound)."""
    for i, plan in enumerate(plans):
        for rank in range(2):
            want, have = predicted[i][rank], got[rank][i][4]
            print(f"megatron t=2 {plan.recompute} {plan.precision} rank {rank}: model {want / 1e6:.2f} MB, "
                  f"allocator {have / 1e6:.2f} MB ({want / have - 1:+.1%})")
            assert want == pytest.approx(have, rel=ACTIVATION_RTOL), (plan.precision, rank)
            m, made = terms[i][rank], got[rank][i][3]
            model = {"optimizer": m.optimizer, "activations": m.activations, "loss": m.loss_grad,
                     "backward": max(m.loss_working, m.rebuilt + m.grad_working)}
            print("  by category, model / allocator: " + ", ".join(
                f"{k} {model[k] / 1e6:.3f} / {made[k] / 1e6:.3f} MB ({model[k] / made[k] - 1:+.1%})" for k in model))
            for k in model:
                bound = misses.get((plan.precision, k), CATEGORY_RTOL.get(k, ACTIVATION_RTOL))
                assert model[k] == pytest.approx(made[k], rel=bound), (plan.precision, rank, k)


CHECKPOINTED_TENSOR_PARALLEL_MISSES: dict[tuple[str, str], float] = {}
"""Known misses by category of Megatron's layout fully checkpointed
(:func:`test_checkpointed_tensor_parallel_memory_against_torchs_allocator`): none. The
last, in fp32 the backward's rise, where a unit's rebuilt activations and its gradients
meet, bounded at 25%: 0.846-0.922 MB in six rank-runs (the least per build of each
build's larger), the model's 0.758 MB, the largest unit's rebuilt activations alone
(``C``; its ``W`` 0). The live allocations at the allocator's peak (in the last
block's MLP backward) held, of the forward's, the whole logits the output's all-reduce
made (0.52 MB): the step's caller holds the model's output until the backward is over,
where the model freed it once the backward had passed the head and counted that room
for the unit's gradients. Held now (``held`` of
:func:`flexsearch.sim.footprint.backward_working`): the model's rise 0.821 MB
(``W`` 0.063 MB), the allocator's, the median over both builds' 18 steps
(:data:`TENSOR_PARALLEL_STEPS`), 0.854-0.857 MB on every rank of three runs (-3.9% to
-4.1%)."""


@pytest.mark.slow
@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_checkpointed_tensor_parallel_memory_against_torchs_allocator(recompute):
    """Megatron's layout (t = 2) fully and selectively checkpointed on 2 gloo ranks, fp32
    and bf16-mixed, by category as
    :func:`test_tensor_parallel_peak_memory_against_torchs_allocator`. Full: what a unit
    keeps (its input) and what it rebuilds now count a SOAP node's redistributed inputs
    among its activations; the model kept them, 18-20% over (measured: -5.5% and -6.4%
    in fp32, +0.7% in bf16-mixed). Selective (each matmul's outputs cached,
    :meth:`flexsearch.strategy.recompute.Checkpointing.cached_bytes`): activations -3.1%
    (fp32) and 0.0% (bf16-mixed), the backward's rise -5.3% and 0.0% (fp32's the median
    over both builds' steps, as unchecked: one build's least was 0.524, 0.557 or 0.623 MB
    from run to run, the model's 0.590 MB). The peaks (:func:`counted_peak`) over six
    runs: full -4.7% to -6.9% (fp32; -2.6% on every rank of three runs since the model's
    output is held through the backward), +0.1% to -1.0% (bf16-mixed); selective -2.3%
    and -0.1% to -0.3%; off the profiler's running total the fp32 peaks had taken -11% to
    -32% and failed the 25% bound then allowed in four runs of seven."""
    plans, predicted, terms = _megatron_plans(recompute)
    assert [p.recompute for p in plans] == [recompute, recompute]
    got = run_ranks(allocated_job, 2, FAMILIES["gpt"], [*plans, plans[0]], TENSOR_PARALLEL_STEPS, timeout_s=600)
    for rank in range(2):  # fp32's backward: the median rise over both builds' ranges (as unchecked)
        got[rank][0][3]["backward"] = statistics.median(got[rank][0][3]["backward_ranges"]
                                                        + got[rank][2][3]["backward_ranges"])
    _check_by_category(plans, predicted, terms, got,
                       CHECKPOINTED_TENSOR_PARALLEL_MISSES if recompute == "full" else TENSOR_PARALLEL_CATEGORY_MISSES)


GPU_STEPS = ROOT / "costmodels/measurements/gpu-step-h100.json"
GPU_MEMORY_RTOL = 0.10
GPU_PHASE_RTOL = 0.05
"""The loss's and the backward's peaks (``benchmarks/gpu_step.py``'s ``phase_bytes``)
against the model's branches: measured within 2.2% on every bf16-mixed zoo row."""


@pytest.mark.parametrize("key", ["gpt2_small:b8:bf16-mixed", "gpt2_medium:b8:bf16-mixed",
                                 pytest.param("gpt2_xl:b4:bf16-mixed", marks=pytest.mark.slow),
                                 "gpt2_xl:b1:bf16-mixed", "hf_gpt2:b8:bf16-mixed",
                                 pytest.param("hf_llama:b4:bf16-mixed", marks=pytest.mark.slow)])
def test_uncalibrated_peak_memory_against_an_h100s_allocator(key):
    """The uncalibrated model (the GPU presets') against ``torch.cuda.max_memory_allocated``
    over 20 training steps measured on one H100 (``benchmarks/gpu_step.py measure``, kept
    in ``costmodels/measurements``), a cross-entropy over the logits (a Llama's own
    loss); and, for the zoo's GPTs, by phase (one step more): ``P + O + A + Y`` against
    the allocator's peak in the loss, ``P + O + A + Y + max(T, W)`` against its peak in
    the backward (:func:`gpu_step.phase_terms`). XL at batch 1 puts its peak at the
    update (parameters, Adam's state, gradients and its temporaries: ``5 P``). Before
    the gradients shared the peak with the activations: XL b4 +13.2%, b1 -1.5%, Llama
    +23.5%; before the loss's hold lasted into the backward (``max(Y, W)``): GPT-2 small
    -16.8%, medium -9.5%, XL b4 -3.8%; before a view's gradient and the fused
    cross-entropy's were counted (:func:`flexsearch.sim.footprint.grad_bytes`), Hugging
    Face's GPT-2 -21.0% and the Llama +7.0% (+10.0% with them, until the tracer counted
    the fused attention's cast copies of RoPE's fp32 queries and keys, not the fp32
    tensors: +7.2%; then an op saved for every floating input, RoPE's ``q * cos`` kept
    ``q``, until the tracer gave gradients to the inputs computed from parameters only).
    Now -0.9%, -0.4%, -1.6%, -2.2%, -2.9% and +4.1%."""
    import json

    import flexsearch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_step

    measured = json.loads(GPU_STEPS.read_text())["rows"][key]
    case = next(c for c in gpu_step.CASES if c.key == key)
    model, inputs = case.build()
    graph = trace(model, inputs, precision=case.precision)
    plan = plan_graph(graph, Cluster.resolve("dgx-h100", 1), max_iters=0, decentralized=False)
    want, have = plan.predicted.peak_memory_bytes, measured["peak_bytes"]
    print(f"{key}: model {want / 1e9:.2f} GB, H100 allocator {have / 1e9:.2f} GB ({want / have - 1:+.1%})")
    assert want == pytest.approx(have, rel=GPU_MEMORY_RTOL)
    if case.hf:
        return  # its loss is in its forward: no phase of its own
    branches = gpu_step.phase_terms(flexsearch.simulate(graph, plan, timeline=False).memory_terms[0])
    for phase in ("loss", "backward"):
        want, have = branches[phase], measured["phase_bytes"][phase]
        print(f"  {phase}: model {want / 1e9:.2f} GB, allocator {have / 1e9:.2f} GB ({want / have - 1:+.1%})")
        assert want == pytest.approx(have, rel=GPU_PHASE_RTOL), phase
