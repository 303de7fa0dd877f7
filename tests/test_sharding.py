"""Sharded data parallelism (ZeRO-1, ZeRO-2, ZeRO-3, HSDP): simulated, searched, saved and
emitted as one value (:data:`flexsearch.strategy.kinds.SHARDINGS`).

The simulator's terms are checked against each other (what each stage shards, which
collectives it runs), the planner's choice against memory, the plan file against old
files, and every sharding's emitted module against the single-process model on gloo
ranks (loss, every gradient, parameters after 3 steps; ZeRO-1 through
``make_optimizer``'s ``ZeroRedundancyOptimizer``)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from emit_cases import FAMILIES, check_job, load

import flexsearch
from flexsearch.cost.hardware import Cluster, Positive
from flexsearch.emit.launch import run_ranks
from flexsearch.graph.tracer import trace
from flexsearch.plan import Plan
from flexsearch.precision import precision as precision_of
from flexsearch.search.planner import plan_graph, shardings
from flexsearch.search.results import plan_from
from flexsearch.sim.accounting import OPTIMIZER_STATE
from flexsearch.sim.context import CostContext
from flexsearch.sim.predict import predict
from flexsearch.strategy.fsdp import fsdp_units
from flexsearch.strategy.kinds import FSDP_SHARDINGS, DataParallel


def sharded(graph, base: DataParallel, shard: str, group: int = 0) -> DataParallel:
    return dataclasses.replace(base, shard=shard, shard_group=group,
                               fsdp_units=fsdp_units(graph.modules) if shard in FSDP_SHARDINGS else ())


@pytest.fixture(scope="module")
def gpt_small():
    model, x = flexsearch.load_model(f"{__import__('conftest').ROOT}/benchmarks/models/gpt.py:gpt2_small")
    return trace(model, x, precision="bf16-mixed")


def _all(graph, cluster: Cluster) -> dict[str, object]:
    base = plan_graph(graph, cluster, kinds=("data",), max_iters=0).strategy(graph)
    ctx = CostContext(cluster, precision=precision_of(graph.precision))
    out = {"none": predict(graph, base, ctx)}
    for shard, group in shardings(cluster):
        out[shard] = predict(graph, sharded(graph, base, shard, group), ctx)
    return out


def test_each_stage_shards_more_and_runs_its_collectives(gpt_small):
    """On 2 DGX-H100 nodes: memory falls stage by stage (ZeRO-1 the optimizer state,
    ZeRO-2 the gradients, ZeRO-3 the gathered parameters; HSDP holds twice ZeRO-3's
    shard), ZeRO-3 gathers each unit twice and ZeRO-2 once, HSDP all-reduces the shards
    across the nodes, ZeRO-1 all-gathers the updated parameters once."""
    cl = Cluster.preset("dgx-h100", 16)
    sims = _all(gpt_small, cl)
    assert set(sims) == {"none", "zero1", "zero2", "zero3", "hsdp"}
    peak = {k: s.peak_memory_bytes for k, s in sims.items()}
    assert peak["none"] > peak["zero1"] > peak["zero2"] > peak["zero3"]
    assert peak["zero3"] < peak["hsdp"] < peak["zero1"]
    params = sum(n.param_bytes for n in gpt_small.nodes)
    # ZeRO-1 saves (k - k/n) P of Adam's fp32 state (k = 2)
    saved = OPTIMIZER_STATE["adam"] * params * (1 - 1 / 16)
    assert peak["none"] - peak["zero1"] == pytest.approx(saved, rel=1e-6)

    def ops(s, op, what="FSDP unit"):
        return [t for t in s.timeline if t.task.kind == "coll" and t.task.detail.startswith(what)
                and f" {op}/" in t.task.detail]

    units = len({u for u in fsdp_units(gpt_small.modules)}) + 1  # and the root
    assert len(ops(sims["zero3"], "all_gather")) == 2 * units
    assert len(ops(sims["zero2"], "all_gather")) == units
    assert len(ops(sims["hsdp"], "all_gather")) == 2 * units * 2  # per node
    assert len(ops(sims["hsdp"], "all_reduce")) == units * 8  # per device of a node, across the 2 nodes
    assert len(ops(sims["zero1"], "all_gather", "ZeRO-1")) == 1
    assert not ops(sims["none"], "all_gather", "ZeRO-1")
    assert sims["zero3"].iteration_time_s >= sims["zero2"].iteration_time_s


def test_the_planner_shards_as_far_as_memory_needs(gpt_small):
    """``--kind fsdp`` returns the fastest sharding that fits, says which others it
    simulated; with memory between ZeRO-3's and ZeRO-2's need only ZeRO-3 (or
    checkpointing) fits, and the search takes it."""
    cl = Cluster.preset("dgx-h100", 16)
    plan = plan_graph(gpt_small, cl, kinds=("fsdp",), max_iters=0)
    assert plan.shard in ("zero1", "zero2", "zero3", "hsdp") and plan.kind == "data"
    assert any(n.startswith(f"sharding {plan.shard}: the fastest") for n in plan.notes)
    sims = _all(gpt_small, cl)
    between = (sims["zero3"].peak_memory_bytes + sims["zero2"].peak_memory_bytes) / 2
    dev = cl.spec.device.model_copy(update={"memory_capacity": Positive(value=between, source="test")})
    tight = Cluster.from_spec(cl.spec.model_copy(update={"device": dev}), cl.devices)
    got = plan_graph(gpt_small, tight, kinds=("fsdp",), max_iters=0)
    assert got.predicted.peak_memory_bytes <= between
    assert got.shard == "zero3" or got.recompute != "none"
    data = plan_graph(gpt_small, tight, kinds=("data", "fsdp"), max_iters=0)
    assert data.shard != "none"  # plain DDP does not fit: the default search shards


def test_plan_files_record_the_sharding_and_old_files_load(gpt_small, tmp_path):
    cl = Cluster.preset("dgx-h100", 16)
    base = plan_graph(gpt_small, cl, kinds=("data",), max_iters=0)
    st = base.strategy(gpt_small)
    ctx = CostContext(cl, precision=precision_of("bf16-mixed"))
    for shard, group in shardings(cl):
        s = sharded(gpt_small, st, shard, group)
        p = plan_from(gpt_small, cl, s, predict(gpt_small, s, ctx), baselines={}, lower_bound_s=0.0)
        back = Plan.from_json(p.to_json())
        assert back.shard == shard and back.strategy(gpt_small) == s
        assert back.shard_params == (shard in FSDP_SHARDINGS)
    raw = json.loads(base.to_json())
    raw.pop("shard")
    raw.pop("shard_group")
    for old, new in ((True, "zero3"), (False, "none")):
        assert Plan.from_json(json.dumps({**raw, "version": 4, "shard_params": old})).shard == new
    from flexsearch.errors import PlanFileError

    with pytest.raises(PlanFileError, match="shard"):
        Plan.from_json(json.dumps({**raw, "shard": "zero9"}))
    with pytest.raises(PlanFileError, match="hsdp"):
        Plan.from_json(json.dumps({**raw, "shard": "hsdp"})).strategy(gpt_small)


def _plans(family: str, world: int, which, precision: str = "fp32") -> list[Plan]:
    model, x = load(FAMILIES[family])
    g = trace(model, x, precision=precision)
    cl = Cluster.resolve("cpu", world)
    base = plan_graph(g, cl, kinds=("data",), max_iters=0).strategy(g)
    ctx = CostContext(cl, precision=precision_of(precision))
    out = []
    for shard, group in which:
        s = sharded(g, base, shard, group)
        out.append(plan_from(g, cl, s, predict(g, s, ctx), baselines={}, lower_bound_s=0.0))
    return out


@pytest.mark.parametrize("family,precision", [("gpt", "fp32"), ("mlp", "bf16-mixed"),
                                              pytest.param("cnn", "fp32", marks=pytest.mark.slow)])
def test_every_sharding_computes_what_the_model_does(family, precision):
    plans = _plans(family, 2, [("zero1", 0), ("zero2", 0), ("zero3", 0)], precision)
    results = run_ranks(check_job, 2, FAMILIES[family], plans, timeout_s=600)
    for (_, _, loss, ref, params), p in zip(results[0], plans, strict=True):
        assert params, p.shard
        assert loss == pytest.approx(ref, rel=1e-5 if precision == "fp32" else 1e-2), p.shard


def test_hsdp_on_two_groups_of_two_ranks_computes_what_the_model_does():
    """4 ranks (oversubscribing CI's 2 cores: slower, not different): shard groups of 2,
    replicated twice, on FSDP2's 2-D mesh."""
    plans = _plans("gpt", 4, [("hsdp", 2)])
    results = run_ranks(check_job, 4, FAMILIES["gpt"], plans, timeout_s=600)
    (_, _, loss, ref, _), = results[0]
    assert loss == pytest.approx(ref, rel=1e-5)
