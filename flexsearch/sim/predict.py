"""One way to predict any plan: :func:`predict` (graph, strategy, cost context) -> Simulation.

Every prediction goes through here (the planner's candidates and baselines,
:func:`flexsearch.api.simulate`, ``flexsearch bench``, the fidelity benchmark), so all
plan kinds are costed by one cost model under one explicit context
(:class:`~flexsearch.sim.context.CostContext`: cluster, measured op costs, calibration):

- :class:`~flexsearch.strategy.kinds.Soap`: the op-level simulator
  (:mod:`flexsearch.sim.simulator`), each op on DTensors;
- :class:`~flexsearch.strategy.kinds.DataParallel`: as the emitter runs it: sharded
  (``zero1``: the op-level simulation with DDP and a sharded update; ``zero2``, ``zero3``,
  ``hsdp``: with FSDP2 over its units); with gradient accumulation as one stage on every device
  running its microbatches, then one gradient synchronisation (ZeRO-1 and ZeRO-2 as such
  a pipeline stage shards: :data:`~flexsearch.strategy.kinds.ACCUMULATING_SHARDINGS`); with DDP otherwise,
  which is the op-level simulation with DDP's buckets when calibrated, and else the
  faster of the op-level simulation
  (every layer's gradients all-reduced as the backward produces them, each collective
  paying its latency) and the stage-level one (one replica's step, then all gradients
  in one collective: DDP's single bucket for a model under its 25 MB bucket size).
  DDP's bucketing is closest to the first for large models and to the second for small
  ones;
- :class:`~flexsearch.strategy.kinds.Pipelined`: stage costs summed from the op-level
  model (:mod:`flexsearch.sim.stages`), scheduled by :mod:`flexsearch.sim.pipeline`
  (with ZeRO-1 over a stage's replicas when the strategy shards its optimizer state);
- :class:`~flexsearch.strategy.kinds.Decentralized`: one replica's stage cost and the
  topology's gossip (:mod:`flexsearch.sim.decentralized`).

Each on the graph the emitted module computes (:func:`runtime_graph`): a plan FSDP2 runs
under mixed precision computes with bf16 parameters (:func:`fsdp_graph`).
"""

from __future__ import annotations

from flexsearch.graph.opgraph import OpGraph
from flexsearch.sim.context import CostContext
from flexsearch.sim.decentralized import simulate_gossip
from flexsearch.sim.result import Simulation
from flexsearch.sim.simulator import Simulator
from flexsearch.sim.stages import replica_cost, simulate_stages
from flexsearch.strategy.fsdp import param_units
from flexsearch.strategy.kinds import (
    ACCUMULATING_SHARDINGS,
    FSDP_SHARDINGS,
    DataParallel,
    Decentralized,
    Pipelined,
    Soap,
    Strategy,
)


def predict(graph: OpGraph, strategy: Strategy, ctx: CostContext, *, optimizer: str = "adam",
            timeline: bool = True, simulator: Simulator | None = None) -> Simulation:
    """Predict one training iteration of ``strategy`` for ``graph`` under ``ctx``
    (module docstring). ``simulator``: an op-level simulator of ``graph`` under ``ctx``
    whose fragment cache to reuse (a search's). Raises ValueError for a strategy that
    does not fit the cluster or the model (a pipeline layout that does not make the
    devices, a batch that does not split)."""
    graph = runtime_graph(graph, strategy, ctx)
    if simulator is not None and (simulator.graph is not graph or simulator.ctx is not ctx):
        raise ValueError("the simulator given to predict() was made for another graph or cost context "
                         "(a plan FSDP2 runs under mixed precision is simulated on runtime_graph(...))")
    if isinstance(strategy, Pipelined):
        return simulate_stages(graph, ctx, bounds=strategy.bounds, tensor=strategy.tensor,
                               replicas=strategy.replicas, schedule=strategy.schedule,
                               microbatches=strategy.microbatches, chunks=strategy.chunks,
                               recompute=strategy.recompute, optimizer=optimizer, timeline=timeline,
                               shard=strategy.shard)
    if isinstance(strategy, Decentralized):
        return simulate_gossip(ctx, replica_cost(graph, ctx), strategy.topology, optimizer=optimizer,
                               timeline=timeline)
    if isinstance(strategy, DataParallel) and strategy.microbatches > 1:
        return data_stage(graph, strategy, ctx, optimizer=optimizer, timeline=timeline)
    sim = simulator if simulator is not None else Simulator(graph, ctx, optimizer=optimizer)
    if sim.optimizer != optimizer:
        raise ValueError(f"the simulator given to predict() costs {sim.optimizer!r}, not {optimizer!r}")
    if isinstance(strategy, Soap):
        return sim.simulate(strategy.configs, timeline=timeline, ddp=False, recompute=strategy.recompute)
    if not isinstance(strategy, DataParallel):
        raise TypeError(f"not a strategy: {type(strategy).__name__}")
    whole = ((0, len(graph.nodes)),)
    if strategy.shard != "none":
        return sim.simulate(strategy.configs, timeline=timeline, shard=strategy.shard,
                            shard_group=strategy.shard_group, fsdp_units=strategy.fsdp_units,
                            recompute=strategy.recompute, ddp=True)
    oplevel = sim.simulate(strategy.configs, timeline=timeline, ddp=True, recompute=strategy.recompute)
    if ctx.calibration is not None:
        return oplevel
    one_bucket = Pipelined(whole, tensor=1, replicas=ctx.cluster.devices, schedule="1f1b", microbatches=1,
                           recompute=strategy.recompute)
    try:
        flat = predict(graph, one_bucket, ctx, optimizer=optimizer, timeline=timeline)
    except ValueError:  # the batch does not split over the devices
        return oplevel
    return flat if better(flat, oplevel) else oplevel


def runs_fsdp(strategy: Strategy) -> bool:
    """Does the emitter run ``strategy`` with FSDP2 (sharded data parallelism over FSDP
    units, with or without accumulation; FSDP2 pipeline stages)?"""
    return isinstance(strategy, (DataParallel, Pipelined)) and strategy.shard in FSDP_SHARDINGS


def fsdp_graph(graph: OpGraph, ctx: CostContext) -> OpGraph:
    """What FSDP2 computes under ``ctx``'s precision: under mixed precision, with the
    parameters gathered in autocast's dtype
    (:attr:`~flexsearch.graph.opgraph.OpGraph.low_param_graph`: an embedding's output and
    the residual stream after it in bf16, where autocast over fp32 parameters keeps
    them fp32); else the graph. Also the graph when ``ctx`` prices ops by a measured
    profile: the profiler measured the graph's ops, keyed by their dtypes, so the other
    graph's would miss it and mix roofline prices into measured ones."""
    if ctx.precision.autocast is None or ctx.measured is not None:
        return graph
    return graph.low_param_graph


def runtime_graph(graph: OpGraph, strategy: Strategy, ctx: CostContext) -> OpGraph:
    """The graph as the emitted module computes ``strategy``: :func:`fsdp_graph` for a
    plan FSDP2 runs, the graph as traced for every other."""
    return fsdp_graph(graph, ctx) if runs_fsdp(strategy) else graph


def data_stage(graph: OpGraph, strategy: DataParallel, ctx: CostContext, *, optimizer: str = "adam",
               timeline: bool = True) -> Simulation:
    """A data-parallel plan as one pipeline stage on every device running its
    microbatches under 1F1B (each microbatch's backward right after its forward), one
    gradient synchronisation after the last: how accumulation is simulated, and a data
    plan too large for the op-level simulator. Sharded as a pipeline stage shards
    (:data:`~flexsearch.strategy.kinds.ACCUMULATING_SHARDINGS`: ZeRO-1, FSDP2 stages;
    ZeRO-3 and HSDP as replicated), run by FSDP2 over its units holding parameters (the
    root among them) or, calibrated, by DDP (uncalibrated, as the op-level simulation:
    without DDP's terms)."""
    graph = runtime_graph(graph, strategy, ctx)
    shard = strategy.shard if strategy.shard in ACCUMULATING_SHARDINGS else "none"
    runtime = "fsdp" if shard == "zero2" else "ddp" if ctx.calibration is not None else "pipeline"
    units = param_units(graph, strategy.fsdp_units or None) if shard == "zero2" else {}
    held = [sum(graph.nodes[i].param_bytes for i in idx) for idx in units.values()]
    share = max(held) / sum(held) if held and sum(held) else 1.0  # the largest unit's share of the parameters
    return simulate_stages(graph, ctx, bounds=((0, len(graph.nodes)),), tensor=1, replicas=ctx.cluster.devices,
                           schedule="1f1b", microbatches=strategy.microbatches, recompute=strategy.recompute,
                           optimizer=optimizer, timeline=timeline, shard=shard, runtime=runtime,
                           fsdp_calls=max(1, len(units)), fsdp_unit_share=share)


def better(a: Simulation, b: Simulation) -> bool:
    """Is ``a`` the better prediction: feasible first, then faster?"""
    return (a.feasible, -a.iteration_time_s) > (b.feasible, -b.iteration_time_s)
