"""The planner's steps 1 and 2 (:mod:`flexsearch.search.planner`): the lower bound no
plan beats, and the baselines every plan is measured against: the recipes
(:mod:`flexsearch.strategy.recipes`: data parallelism as DDP runs it, Megatron's tensor
degrees, the expert layouts) simulated op by op, or, for a graph too large for the
op-level simulator, data parallelism and Megatron as one pipeline stage."""

from __future__ import annotations

from dataclasses import dataclass

from flexsearch.cost.hardware import Cluster
from flexsearch.graph.opgraph import OpGraph
from flexsearch.search.clock import past
from flexsearch.search.pipeline import tensor_degrees
from flexsearch.sim.context import CostContext
from flexsearch.sim.predict import better, fsdp_graph, predict
from flexsearch.sim.result import Simulation
from flexsearch.sim.simulator import Simulator
from flexsearch.strategy import recipes as bl
from flexsearch.strategy.config import Config
from flexsearch.strategy.kinds import DataParallel, Pipelined, Soap
from flexsearch.strategy.space import Space


@dataclass(frozen=True)
class BaselineRun:
    name: str
    decisions: dict[str, Config]
    simulation: Simulation


def lower_bound(graph: OpGraph, ctx: CostContext, optimizer: str = "adam") -> float:
    """Single-device iteration time (memory ignored) divided by the device count; under
    mixed precision, of the faster of the graph and what FSDP2 computes
    (:func:`flexsearch.sim.predict.fsdp_graph`: parameters in autocast's dtype)."""
    one = ctx.on(Cluster.from_spec(ctx.cluster.spec, 1))
    space = Space(graph, 1)
    configs = space.expand({})
    low = fsdp_graph(graph, ctx)
    return min(Simulator(g, one, optimizer=optimizer).simulate(configs, timeline=False).iteration_time_s
               for g in ((graph,) if low is graph else (graph, low))) / ctx.cluster.devices


def run_baselines(space: Space, sim: Simulator, devices_per_node: int,
                  deadline: float | None = None) -> dict[str, BaselineRun]:
    """Simulate every baseline recipe at op level (the data baseline as DDP runs it);
    Megatron degrees collapse into the best one. Past ``deadline`` (a
    ``time.perf_counter()`` time) only the first recipe, data parallelism, is run."""
    out: dict[str, BaselineRun] = {}
    for name, dec in bl.baselines(space, devices_per_node).items():
        if out and past(deadline):
            break
        configs = space.expand(dec)
        strategy = DataParallel(configs, dec) if name == "data" else Soap(configs, dec)
        run = BaselineRun(name, dec, predict(space.graph, strategy, sim.ctx, optimizer=sim.optimizer,
                                             timeline=False, simulator=sim))
        key = "megatron" if name.startswith("megatron") else name
        prev = out.get(key)
        if prev is None or better(run.simulation, prev.simulation):
            out[key] = BaselineRun(key, dec, run.simulation)
    return out


def flat_baselines(graph: OpGraph, ctx: CostContext, optimizer: str = "adam",
                   deadline: float | None = None) -> dict[str, BaselineRun]:
    """Data parallel and Megatron (best tensor degree within a node) simulated as one
    pipeline stage on every device (one replica stands for all): the baselines of a
    graph too large for the op-level simulator (past ``deadline``, data parallelism only)."""
    out: dict[str, BaselineRun] = {}
    for t in tensor_degrees(ctx.cluster):
        if out and past(deadline):
            break
        one_stage = Pipelined(((0, len(graph.nodes)),), tensor=t, replicas=ctx.cluster.devices // t,
                              schedule="1f1b", microbatches=1)
        try:
            sim = predict(graph, one_stage, ctx, optimizer=optimizer, timeline=False)
        except ValueError:
            continue
        key = "data" if t == 1 else "megatron"
        prev = out.get(key)
        if prev is None or better(sim, prev.simulation):
            out[key] = BaselineRun(key, {}, sim)
    return out
