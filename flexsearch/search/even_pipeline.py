"""A fixed pipeline, not searched: two ranks over the nodes split evenly, every other
dimension data parallel (:func:`even_pipeline`). The planner offers it where the
search (:mod:`flexsearch.search.pipeline`) returns no pipeline worth running, so that
a caller who asks for a pipeline gets one the emitter can run."""

from __future__ import annotations

import math

from flexsearch.graph.microbatch import batch_size, microbatch_graph
from flexsearch.graph.opgraph import OpGraph
from flexsearch.search.pipeline import SMALLEST_EXPORTED, PipelineResult
from flexsearch.sim.context import CostContext
from flexsearch.sim.predict import predict
from flexsearch.sim.stages import cut_bytes
from flexsearch.strategy.kinds import Pipelined
from flexsearch.strategy.recipes import stage_configs


def even_pipeline(graph: OpGraph, ctx: CostContext, schedule: str, tensor: int = 1, microbatches: int = 2, *,
                  optimizer: str = "adam") -> PipelineResult | None:
    """Two pipeline ranks over the nodes split evenly (two chunks each for the
    interleaved schedule), every other dimension data parallel: a pipeline the emitter
    can always run, for tests and benchmarks that need one where the search finds none
    worth running. None when the devices or the batch do not split that way."""
    cluster = ctx.cluster
    p, chunks = 2, 2 if schedule == "interleaved" else 1
    if cluster.devices % (p * tensor):
        return None
    d = cluster.devices // (p * tensor)
    m = microbatches
    if batch_size(graph) % (d * m) or (graph.via == "export" and batch_size(graph) // (d * m) < SMALLEST_EXPORTED):
        return None
    configs = stage_configs(microbatch_graph(graph, d * m), tensor)
    if configs is None:
        return None
    n, stages = len(graph.nodes), p * chunks
    cuts = cut_bytes(graph)  # infinite where no boundary may be: the nearest finite position instead
    edges = [0]
    for k in range(1, stages):
        x = min((x for x in range(edges[-1] + 1, n) if math.isfinite(cuts[x])), key=lambda x: abs(x - n * k // stages),
                default=None)
        if x is None:
            return None
        edges.append(x)
    edges.append(n)
    bounds = tuple(zip(edges[:-1], edges[1:], strict=True))
    strategy = Pipelined(bounds, tensor, d, schedule, m, chunks)
    sim = predict(graph, strategy, ctx, optimizer=optimizer)
    placed = tuple((a, b, strategy.devices(k)) for k, (a, b) in enumerate(bounds))
    return PipelineResult(strategy.kind, schedule, m, chunks, "none", tensor, d, placed, configs, sim)
