"""The planner's one-line explanations: the notes of a plan (why a pipeline or a
data-parallel plan shards its state as it does, :func:`oplevel_notes`), why no plan
fits (:func:`infeasible_error`), and why no plan of the asked kinds exists (the message of
:class:`~flexsearch.errors.PlanKindError`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from flexsearch.cost.hardware import Cluster
from flexsearch.errors import InfeasiblePlanError
from flexsearch.report import fmt_bytes
from flexsearch.search.pipeline import PipelineResult
from flexsearch.sim.result import Simulation

if TYPE_CHECKING:
    from flexsearch.search.baselines import BaselineRun


def sharding_note(pipe: PipelineResult, pipes: list[PipelineResult]) -> str:
    """Why a pipeline plan shards its state (``zero1``, ``zero2``): its layout replicated,
    as simulated (slower, or over memory), or not simulated (over memory by the
    simulation's model)."""
    twin = next((r for r in pipes if r.shard == "none" and (r.stages, r.schedule, r.microbatches, r.recompute)
                 == (pipe.stages, pipe.schedule, pipe.microbatches, pipe.recompute)), None)
    what = "the optimizer state" if pipe.shard == "zero1" else "its state"
    if twin is None:
        why = (f"the same layout with {what} replicated not simulated (over memory by the simulation's model, "
               "or past the budget)")
    elif not twin.simulation.feasible:
        why = (f"the same layout with {what} replicated needs {fmt_bytes(twin.simulation.peak_memory_bytes)} "
               "per device")
    else:
        why = f"the same layout with {what} replicated: {twin.simulation.iteration_time_s * 1e3:.3f} ms"
    if pipe.shard == "zero1":
        return (f"sharding zero1: the optimizer state sharded over each stage's {pipe.replicas} replicas "
                f"(build the optimizer with flexsearch.make_optimizer); {why}")
    return (f"sharding zero2: each stage an FSDP2 module over its {pipe.replicas} replicas (parameters, gradients "
            f"and optimizer state sharded at rest; build the optimizer with flexsearch.make_optimizer); {why}")


def fsdp_note(strategy, sim: Simulation, candidates: Sequence[tuple]) -> str:
    """Why a data-parallel plan shards its state as it does: the fastest sharding that
    fits, the other shardings simulated (``candidates``: the planner's ``(kind,
    strategy, simulation)``) with their times; a tie in time goes to the least memory per
    device (the planner's order), and the note says so."""
    others = [(c[1].shard, c[2]) for c in candidates if c[0] == "fsdp" and c[1] is not strategy]
    tried = ", ".join(f"{shard} {o.iteration_time_s * 1e3:.3f} ms" for shard, o in others)
    tied = [(shard, o) for shard, o in others if o.feasible
            and math.isclose(o.iteration_time_s, sim.iteration_time_s, rel_tol=1e-9)]
    if tied:
        names = ", ".join(shard for shard, _ in tied)
        held = ", ".join(f"{shard} {o.peak_memory_bytes / 1e9:.2f} GB" for shard, o in tied)
        return (f"sharding {strategy.shard}: the fastest sharded data parallelism that fits, tied with {names} "
                f"({sim.iteration_time_s * 1e3:.3f} ms) and holding the least memory per device "
                f"({sim.peak_memory_bytes / 1e9:.2f} GB; {held}); also simulated: {tried}")
    return (f"sharding {strategy.shard}: the fastest sharded data parallelism that fits"
            + (f" (also simulated: {tried})" if tried else ""))


def data_label(strategy) -> str:
    """A data-parallel strategy in a few words: its runtime (DDP, or the sharding), and its
    activation checkpointing and accumulated microbatches when it has them."""
    what = "DDP" if strategy.shard == "none" else f"{strategy.shard} data parallelism"
    if strategy.recompute != "none":
        what += f" with {strategy.recompute} activation checkpointing"
    if strategy.microbatches > 1:
        what += f" over {strategy.microbatches} accumulated microbatches"
    return what


def pipeline_label(pipe: PipelineResult) -> str:
    """A pipeline or hybrid layout in a few words: stages x replicas x tensor degree, its
    schedule and microbatches, and its sharding and checkpointing when it has them."""
    what = (f"{pipe.kind} {len(pipe.stages) // max(pipe.chunks, 1)} x {pipe.replicas} x {pipe.tensor} "
            f"({pipe.schedule}, {pipe.microbatches} microbatches")
    if pipe.shard != "none":
        what += f", {pipe.shard}"
    if pipe.recompute != "none":
        what += f", {pipe.recompute} activation checkpointing"
    return what + ")"


def leanest(tried: Sequence[tuple[str, Simulation]]) -> tuple[str, Simulation] | None:
    """The run of ``tried`` (label, simulation) that needs the least memory on its fullest
    device (None when nothing was simulated)."""
    return min(tried, key=lambda t: t[1].peak_memory_bytes, default=None)


def unsplit_fix(unsplit: str, devices: int) -> str:
    """What to do when the batch does not split over ``devices`` (``unsplit``:
    :func:`~flexsearch.search.variants.unsplit_reason`'s words)."""
    if "no batch dimension" in unsplit:
        return "give the inputs as tensors whose dim 0 is the batch (a trailing dict of them is passed by keyword)"
    return f"use a batch that is a multiple of {devices}, or a device count that divides the batch"


def no_plan_reason(kinds: Sequence[str], base: dict[str, BaselineRun], pipes: list[PipelineResult],
                   cluster: Cluster, *, data_runs: Sequence[tuple[str, Simulation]] = (),
                   unsplit: str | None = None) -> str:
    """One line: why no plan of ``kinds`` exists here. ``data_runs``: the data-parallel
    runs of ``kinds`` simulated (label, simulation: DDP, the shardings and their
    checkpointed or accumulating variants), the leanest of which a memory message quotes;
    ``unsplit``: why the batch does not split over the devices, which sharded data
    parallelism needs (None when it does)."""
    what = "/".join(kinds)
    if {"pipeline", "hybrid"} & set(kinds):
        if pipes:
            lean = min(pipes, key=lambda r: r.simulation.peak_memory_bytes).simulation
            return (f"no {what} plan fits in {fmt_bytes(lean.capacity_bytes)} per device on {cluster.devices} "
                    f"devices (the leanest layout needs {fmt_bytes(lean.peak_memory_bytes)}); "
                    "use more devices or a smaller batch")
        if "hybrid" in kinds and "pipeline" not in kinds:
            return (f"no hybrid plan: tensor parallelism inside a stage needs a transformer (attention or "
                    f"Linear blocks) and a tensor degree within a node that divides {cluster.devices} devices")
        return (f"no {what} plan: no layout of at least 2 stages x replicas x tensor degree makes "
                f"{cluster.devices} devices with the batch splitting over replicas and microbatches; "
                "change --devices or the batch")
    if "soap" in kinds:
        lean = leanest([(name, b.simulation) for name, b in base.items()])
        need = f" (the leanest baseline, {lean[0]}, needs {fmt_bytes(lean[1].peak_memory_bytes)})" if lean else ""
        return (f"no {what} plan fits in memory on {cluster.devices} x {cluster.device.name}{need}: no SOAP "
                "configuration the search simulated fits, nor its baselines with activation checkpointing; "
                "use more devices or a smaller batch")
    if set(kinds) == {"fsdp"} and cluster.devices < 2:
        return "no fsdp plan on one device: sharded data parallelism needs 2 or more; use --kind data or more devices"
    if set(kinds) <= {"data", "fsdp"} and unsplit is not None:
        return (f"no {what} plan on {cluster.devices} devices: {unsplit} (data parallelism gives every "
                f"device an equal share); {unsplit_fix(unsplit, cluster.devices)}")
    lean = leanest(data_runs)
    need = (f" (the leanest simulated, {lean[0]}, needs {fmt_bytes(lean[1].peak_memory_bytes)} per device)"
            if lean is not None else "")
    return f"no {what} plan fits in memory on {cluster.devices} x {cluster.device.name}{need}; use more devices"


def budget_error(budget_s: float, cut: Sequence[str], tried: Sequence[tuple[str, Simulation]]) -> InfeasiblePlanError:
    """No plan fits among those simulated before the budget ran out (``cut``: the phases
    it cut short; ``tried`` as :func:`infeasible_error`'s): the budget, not the cluster,
    is what to change."""
    lean = leanest(tried)
    need = (f"; the leanest simulated, {lean[0]}, needs {fmt_bytes(lean[1].peak_memory_bytes)} of "
            f"{fmt_bytes(lean[1].capacity_bytes)}") if lean is not None else ""
    return InfeasiblePlanError(f"budget {budget_s:g} s: no plan that fits was found before it ran out (cut short: "
                               f"{', '.join(cut)}{need}); give a longer --budget, or none")


def infeasible_error(tried: Sequence[tuple[str, Simulation]], cluster: Cluster) -> InfeasiblePlanError:
    """Why no plan fits: the leanest of everything simulated (``tried``: label and
    simulation of the baselines, the data-parallel variants and the pipeline layouts),
    what it needs on its fullest device and in all."""
    lean = leanest(tried)
    if lean is None:
        return InfeasiblePlanError(
            f"no plan runs on {cluster.devices} devices: the batch does not split over them and no pipeline "
            "layout fits the model; use fewer devices or a batch that is a multiple of the device count")
    name, best = lean
    cap = best.capacity_bytes
    total = sum(best.memory_bytes)
    worth = math.ceil(total / cap)
    spread = (f"{fmt_bytes(total)} in all, {worth} devices' worth" if worth > cluster.devices else
              f"{fmt_bytes(total)} in all, which {cluster.devices} devices could hold only if "
              "it were spread evenly")
    return InfeasiblePlanError(
        f"no plan fits in {fmt_bytes(cap)} per device on {cluster.devices} x "
        f"{cluster.device.name} (the leanest plan simulated, {name}, needs "
        f"{fmt_bytes(best.peak_memory_bytes)} on its fullest device and {spread}); "
        "use more devices, a smaller batch, or a cluster with more memory"
    )


def oplevel_notes(strategy, sim: Simulation, candidates: Sequence[tuple], data_strategy,
                  baselines: dict[str, float]) -> list[str]:
    """The notes of an op-level plan (``strategy``, predicted ``sim``): a SOAP plan data
    parallel in every op (the fastest SOAP configuration; DDP's time beside it), a data
    plan's checkpointing or accumulation (what does not fit without them) and its
    sharding (:func:`fsdp_note`)."""
    from flexsearch.strategy.kinds import DataParallel, Soap

    notes = []
    if isinstance(strategy, Soap) and strategy.configs == data_strategy.configs and "data" in baselines:
        notes.append(f"data parallel in every op: the fastest SOAP configuration found, on DTensor; DDP runs "
                     f"it in {baselines['data'] * 1e3:.3f} ms (--kind data)")
    if isinstance(strategy, Soap) and strategy.recompute != "none":
        notes.append(f"{strategy.recompute} activation checkpointing: the SOAP plan without it does not fit in "
                     "memory (each unit's ops and their redistributions run again in its backward)")
    if isinstance(strategy, DataParallel) and (strategy.recompute != "none" or strategy.microbatches > 1):
        how = [f"{strategy.recompute} activation checkpointing"] if strategy.recompute != "none" else []
        how += [f"{strategy.microbatches} accumulated microbatches"] if strategy.microbatches > 1 else []
        plain = "data parallelism" if strategy.shard == "none" else f"{strategy.shard} data parallelism"
        notes.append(f"{' and '.join(how)}: {plain} without them does not fit in memory")
    if isinstance(strategy, DataParallel) and strategy.shard != "none":
        notes.append(fsdp_note(strategy, sim, candidates))
    return notes
