"""A searched strategy and its prediction as a :class:`~flexsearch.plan.Plan`.

:func:`plan_from` is the one place a plan is built from a strategy value
(:mod:`flexsearch.strategy.kinds`) of any kind: the fields every plan has (model,
fingerprint, inputs, devices, cluster) from the graph and the cluster, the kind's own
fields from the strategy, the prediction from its simulation.
"""

from __future__ import annotations

from typing import Any

from flexsearch.cost.hardware import Cluster
from flexsearch.graph.microbatch import microbatch_graph
from flexsearch.graph.opgraph import OpGraph, TensorMeta
from flexsearch.plan import Plan, Predicted, Stage
from flexsearch.sim.result import Simulation
from flexsearch.strategy.config import Config
from flexsearch.strategy.kinds import DataParallel, Decentralized, Pipelined, Soap, Strategy
from flexsearch.strategy.recipes import stage_configs

SHARED_FIELDS = ("model", "graph_fingerprint", "devices", "cluster", "optimizer", "objective", "precision",
                 "lower_bound_s", "model_flops", "inputs", "input_names", "constant_inputs", "search")
"""The fields a plan derived from another (``like``) keeps."""


def graph_inputs(graph: OpGraph) -> tuple[TensorMeta, ...]:
    """The shapes and dtypes of the model's example inputs, in order."""
    return tuple(n.outputs[0] for n in graph.nodes if n.kind == "input" and n.outputs)


def predicted(s: Simulation) -> Predicted:
    """A simulation's prediction as the plan records it."""
    return Predicted(iteration_time_s=s.iteration_time_s, peak_memory_bytes=s.peak_memory_bytes,
                     memory_bytes=s.memory_bytes, compute_s=s.compute_s)


def _texts(configs) -> dict[str, str]:
    return {k: v.text for k, v in configs.items()}


def pipeline_configs(graph: OpGraph, strategy: Pipelined) -> dict[str, Config]:
    """A pipeline's per-node layout: the stage's tensor-parallel configuration, data
    parallel over the replicas."""
    local = stage_configs(microbatch_graph(graph, strategy.replicas * strategy.microbatches), strategy.tensor)
    if local is None:
        raise ValueError(f"no tensor-parallel layout of degree {strategy.tensor} for this model")
    d = strategy.replicas
    return {k: Config(s=d, kind=c.kind, t=c.t, dim=c.dim) if c.s == 1 else c for k, c in local.items()}


def strategy_fields(graph: OpGraph, strategy: Strategy) -> dict[str, Any]:
    """The plan fields that describe ``strategy``."""
    if isinstance(strategy, DataParallel):
        return {"kind": "data", "decisions": _texts(strategy.decisions), "configs": _texts(strategy.configs),
                "shard": strategy.shard, "shard_group": strategy.shard_group or None,
                "fsdp_units": strategy.fsdp_units if strategy.fsdp else (),
                "microbatches": strategy.microbatches if strategy.microbatches > 1 else None,
                "recompute": strategy.recompute}
    if isinstance(strategy, Soap):
        return {"kind": "soap", "decisions": _texts(strategy.decisions), "configs": _texts(strategy.configs),
                "recompute": strategy.recompute}
    if isinstance(strategy, Decentralized):
        top = strategy.topology
        return {"kind": "decentralized", "topology": top.name, "topology_edges": top.edges,
                "spectral_gap": top.spectral_gap}
    names = [n.name for n in graph.nodes]
    stages = tuple(Stage(nodes=tuple(names[a:b]), devices=strategy.devices(k), replicas=strategy.replicas)
                   for k, (a, b) in enumerate(strategy.bounds))
    return {"kind": strategy.kind, "stages": stages, "schedule": strategy.schedule,
            "microbatches": strategy.microbatches, "chunks": strategy.chunks, "recompute": strategy.recompute,
            "shard": strategy.shard}


def plan_from(graph: OpGraph, cluster: Cluster, strategy: Strategy, simulation: Simulation, *,
              like: Plan | None = None, configs: dict[str, Config] | None = None, **fields: Any) -> Plan:
    """The plan of ``strategy`` for ``graph`` on ``cluster`` with ``simulation``'s
    prediction. ``like``: a plan whose shared fields (:data:`SHARED_FIELDS`) to keep;
    ``configs``: a pipeline's per-node layout when the caller has it (default
    :func:`pipeline_configs`); ``fields``: the rest (baselines, lower bound, search,
    notes, ...)."""
    base: dict[str, Any] = {"model": graph.model, "graph_fingerprint": graph.fingerprint,
                            "devices": cluster.devices, "cluster": cluster.spec, "inputs": graph_inputs(graph),
                            "input_names": graph.input_names if any(graph.input_names) else (),
                            "constant_inputs": graph.constant_inputs,
                            "precision": graph.precision, "model_flops": float(graph.flops + graph.backward_flops)}
    if like is not None:
        base.update({k: getattr(like, k) for k in SHARED_FIELDS})
    kind = strategy_fields(graph, strategy)
    if isinstance(strategy, Pipelined):
        kind["configs"] = _texts(configs if configs is not None else pipeline_configs(graph, strategy))
    return Plan(**{**base, **kind, "predicted": predicted(simulation), **fields})
