"""Data-parallel variants the planner tries: the sharded layouts (ZeRO-1/2/3, HSDP) and,
for a data-parallel strategy that does not fit, activation checkpointing and gradient
accumulation."""

from __future__ import annotations

import dataclasses

from flexsearch.cost.hardware import Cluster
from flexsearch.graph.microbatch import batch_size
from flexsearch.graph.opgraph import OpGraph
from flexsearch.search.clock import past
from flexsearch.search.pipeline import RECOMPUTE_ORDER, microbatch_options
from flexsearch.sim.context import CostContext
from flexsearch.sim.predict import data_stage, predict
from flexsearch.sim.result import Simulation
from flexsearch.sim.simulator import Simulator
from flexsearch.strategy.kinds import ACCUMULATING_SHARDINGS, DataParallel


def shardings(cluster: Cluster) -> list[tuple[str, int]]:
    """The sharded data-parallel layouts the search tries on ``cluster`` (``shard``,
    ``shard_group``): ZeRO-1, ZeRO-2 and ZeRO-3 over every device, and HSDP sharded
    within a node and replicated across nodes when there is more than one whole node;
    none on one device (nothing to shard over: FSDP2 there would only change the
    parameters' compute dtype, :func:`flexsearch.sim.predict.runtime_graph`)."""
    if cluster.devices < 2:
        return []
    out = [("zero1", 0), ("zero2", 0), ("zero3", 0)]
    per_node = cluster.devices_per_node
    if 1 < per_node < cluster.devices and cluster.devices % per_node == 0:
        out.append(("hsdp", per_node))
    return out


def unsplit_reason(graph: OpGraph, devices: int) -> str | None:
    """Why the batch does not split evenly over ``devices`` (a sharded data-parallel
    plan's premise), in a few words; None when it does."""
    try:
        batch = batch_size(graph)
    except ValueError:
        return "the model's inputs have no batch dimension to split"
    return None if batch % devices == 0 else f"the batch of {batch} does not split evenly over {devices} devices"


def splits(graph: OpGraph, devices: int) -> bool:
    """Does the batch split evenly over ``devices`` (a data-parallel plan's premise)?"""
    return unsplit_reason(graph, devices) is None


def fitting_variant(graph: OpGraph, strategy: DataParallel, ctx: CostContext, optimizer: str,
                    sim: Simulator | None, deadline: float | None = None,
                    seen: list[tuple[DataParallel, Simulation]] | None = None,
                    ) -> tuple[DataParallel, Simulation] | None:
    """The fastest variant of a data-parallel strategy that does not fit as it is, with
    activation checkpointing (:data:`~flexsearch.search.pipeline.RECOMPUTE_ORDER`) and, for
    DDP, ZeRO-1 and ZeRO-2 (:data:`~flexsearch.strategy.kinds.ACCUMULATING_SHARDINGS`),
    gradient accumulation over microbatches of the per-device batch; None when
    none fits. Neither makes an iteration faster, so they are tried only then: per
    checkpointing mode the fewest microbatches that fit (more only add time), the
    fastest of those (accumulating without checkpointing can beat checkpointing
    without accumulating: GPT-2 small on 16 H100s under ZeRO-2, 2 microbatches cost 2%
    where full checkpointing costs 27%, ``tests/test_sharding.py``). Past
    ``deadline``, the first variant that fits. Without an op-level simulator (``sim``
    None: a graph too large for it) every variant is simulated as one pipeline stage on
    every device (:func:`flexsearch.sim.predict.data_stage`), as accumulation always is.
    ``seen``: a list every simulated variant is appended to, with its simulation."""
    try:
        per_device = batch_size(graph) // ctx.cluster.devices
    except ValueError:
        per_device = 1
    steps = [1] if strategy.shard not in ACCUMULATING_SHARDINGS \
        else [1, *(m for m in microbatch_options(max(per_device, 1), 2) if m > 1)]
    best = None
    for mode in RECOMPUTE_ORDER:
        for m in steps:
            if best is not None and past(deadline):
                return best
            variant = dataclasses.replace(strategy, microbatches=m, recompute=mode)
            if variant == strategy:
                continue
            try:
                if sim is None or m > 1:
                    got = data_stage(graph, variant, ctx, optimizer=optimizer, timeline=False)
                else:
                    got = predict(graph, variant, ctx, optimizer=optimizer, timeline=False, simulator=sim)
            except ValueError:
                continue
            if seen is not None:
                seen.append((variant, got))
            if got.feasible:
                if best is None or got.iteration_time_s < best[1].iteration_time_s:
                    best = (variant, got)
                break  # more microbatches under the same checkpointing only add time
    return best

