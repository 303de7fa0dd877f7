"""D-PSGD and the centralized baselines on the shared simulator: the shape the D-PSGD
paper reports (decentralized wins on a slow network by a factor growing with n, not on a
fast one), overlap of the exchange with compute, gossip time independent of n, receive
buffers in memory, the time-to-accuracy objective, agreement with the data baseline."""

from __future__ import annotations

import json

import pytest
from conftest import ROOT

from flexsearch.cost import comm
from flexsearch.cost.hardware import Cluster
from flexsearch.graph.tracer import trace
from flexsearch.model_files import load_model
from flexsearch.search.baselines import flat_baselines
from flexsearch.search.decentralized import (
    COMPLETE_MAX_RANKS,
    DecentralizedResult,
    candidate_topologies,
    centralized_baselines,
    decentralized_candidates,
    effective_time,
    explain,
)
from flexsearch.sim.accounting import roofline_update_s
from flexsearch.sim.context import CostContext
from flexsearch.sim.decentralized import (
    average_time,
    simulate_all_reduce,
    simulate_gossip,
    simulate_parameter_server,
    snapshot_time,
)
from flexsearch.sim.simulator import Simulator
from flexsearch.sim.stages import replica_cost
from flexsearch.strategy import recipes as bl
from flexsearch.strategy.space import Space
from flexsearch.strategy.topology import build, iterations_factor

NS = (8, 16, 32, 64, 112)


@pytest.fixture(scope="module")
def resnet20():
    """ResNet-20 / CIFAR-10 traced at its zoo batch, 128: one worker's batch."""
    model, inputs = load_model(f"{ROOT}/benchmarks/models/resnet.py:resnet20")
    return trace(model, inputs)


@pytest.fixture(scope="module")
def worker(resnet20):
    """Per-worker cost (128 images) on each preset."""
    return {c: replica_cost(resnet20, CostContext(Cluster.preset(c, 1)), replicas=1) for c in ("commodity", "dgx-h100")}


def _times(cost, preset: str, n: int, optimizer: str = "momentum") -> dict[str, float]:
    ctx = CostContext(Cluster.preset(preset, n))
    out = {k: simulate_gossip(ctx, cost, build(k, n), optimizer=optimizer, timeline=False).iteration_time_s
           for k in ("ring", "exponential")}
    out["ps"] = simulate_parameter_server(ctx, cost, optimizer=optimizer, timeline=False).iteration_time_s
    out["ps-sharded"] = simulate_parameter_server(ctx, cost, servers=range(n), optimizer=optimizer,
                                                  timeline=False).iteration_time_s
    out["all-reduce"] = simulate_all_reduce(ctx, cost, optimizer=optimizer, timeline=False).iteration_time_s
    return out


def test_commodity_dpsgd_wins_by_a_factor_growing_with_n(worker):
    rows = [_times(worker["commodity"], "commodity", n) for n in NS]
    for name in ("ps", "ps-sharded", "all-reduce"):
        ratios = [r[name] / r["ring"] for r in rows]
        assert all(x > 1.5 for x in ratios), (name, ratios)
        if name == "all-reduce":
            # tree all-reduce: 2 floor(log2 n) latency terms, the same at 64 and 112
            assert all(b > a for a, b in zip(ratios[:4], ratios[1:4], strict=False)), ratios
            assert ratios[4] >= ratios[3] * (1 - 1e-9), ratios
        else:
            assert all(b > a for a, b in zip(ratios, ratios[1:], strict=False)), (name, ratios)
    # the paper's order of magnitude at 112 workers
    assert rows[-1]["all-reduce"] / rows[-1]["ring"] > 3
    assert rows[-1]["ps"] / rows[-1]["ring"] > 50


def test_dgx_no_real_gain_and_all_reduce_wins_time_to_accuracy(resnet20, worker):
    cost = worker["dgx-h100"]
    for n in (8, 16, 64, 112):
        r = _times(cost, "dgx-h100", n)
        # a fast network: communication is not the bottleneck, D-PSGD saves only the
        # all-reduce's un-overlapped tail (a few % of the compute)
        assert r["all-reduce"] <= 1.1 * min(r["ring"], r["exponential"]), r
        cluster = Cluster.preset("dgx-h100", n)
        for c in decentralized_candidates(resnet20, CostContext(cluster), optimizer="momentum", cost=cost,
                                          objective="time_to_accuracy"):
            if c.iterations_factor >= 1.1:
                assert r["all-reduce"] < c.effective_time_s, (n, c.name)


def test_gossip_time_independent_of_n_for_fixed_degree(worker):
    cost = worker["commodity"]
    for name, ns in (("ring", NS), ("one_peer_exponential", (8, 16, 32, 64))):
        times = [simulate_gossip(CostContext(Cluster.preset("commodity", n)), cost, build(name, n),
                                 timeline=False).iteration_time_s for n in ns]
        assert max(times) == pytest.approx(min(times), rel=1e-9), (name, times)
    # the static exponential graph's degree ceil(log2 n) grows, and so does its time
    expo = [_times(cost, "commodity", n)["exponential"] for n in (8, 16, 32)]
    assert expo[0] < expo[1] < expo[2]


def test_exchange_overlaps_compute(worker):
    cost = worker["commodity"]
    n = 16
    cluster = Cluster.preset("commodity", n)
    ctx = CostContext(cluster)
    compute = cost.forward_s + cost.backward_s
    p = cost.param_bytes
    sends = [(i, k, p) for i in range(n) for k in ((i - 1) % n, (i + 1) % n)]
    exchange = comm.exchange(cluster, sends).time_s
    assert compute > 0.3 * exchange and exchange > 0.3 * compute  # both significant
    sim = simulate_gossip(ctx, cost, build("ring", n), optimizer="momentum")
    assert sim.iteration_time_s < compute + exchange
    tail = average_time(ctx, p, 2) + roofline_update_s(ctx, "momentum", p)
    assert sim.iteration_time_s == pytest.approx(snapshot_time(ctx, p) + max(compute, exchange) + tail, rel=1e-9)
    # alpha + d M / B: degree 2, one 5 ms latency, each NIC sends two models
    link = cluster.spec.inter_node
    assert exchange == pytest.approx(link.latency.value + 2 * p / link.bandwidth.value, rel=1e-9)


def test_memory_counts_receive_buffers(worker):
    cost = worker["commodity"]
    n = 16
    ctx = CostContext(Cluster.preset("commodity", n))
    ar = simulate_all_reduce(ctx, cost, optimizer="adam").peak_memory_bytes
    ring = simulate_gossip(ctx, cost, build("ring", n), optimizer="adam").peak_memory_bytes
    expo = simulate_gossip(ctx, cost, build("exponential", n), optimizer="adam").peak_memory_bytes
    one = simulate_gossip(ctx, cost, build("one_peer_exponential", n), optimizer="adam").peak_memory_bytes
    p = cost.param_bytes
    assert ring - ar == pytest.approx(3 * p)  # the sent snapshot and 2 receive buffers
    assert expo - ar == pytest.approx(5 * p)  # the snapshot, log2 16 in-neighbours
    assert one - ar == pytest.approx(2 * p)
    # the loss's hold on the output too, and the backward's first gradients beside it;
    # the gradients, with Adam's temporaries (one copy) where it updates, in their place
    held = cost.stash_bytes + cost.loss_bytes + cost.grad_working_bytes
    assert cost.loss_bytes > 0 and cost.grad_working_bytes > 0
    assert ar == pytest.approx((1 + 2) * p + max(held, 2 * p))
    ps = simulate_parameter_server(ctx, cost, optimizer="adam").memory_bytes
    assert ps[0] == pytest.approx((1 + 2 + 1) * p + max(held, 2 * p))  # server: Adam state + buffer
    assert ps[1] == pytest.approx(p + max(held, p))


def test_time_to_accuracy_uses_iterations_factor(resnet20, worker):
    cost = worker["commodity"]
    cluster = Cluster.preset("commodity", 64)
    per_iter = decentralized_candidates(resnet20, CostContext(cluster), cost=cost, objective="iteration")
    tta = decentralized_candidates(resnet20, CostContext(cluster), cost=cost, objective="time_to_accuracy")
    by = {r.name: r for r in tta}
    for r in tta:
        assert r.iterations_factor == pytest.approx(iterations_factor(r.topology))
        assert r.effective_time_s == pytest.approx(r.iteration_time_s * r.iterations_factor)
    for r in per_iter:
        assert r.effective_time_s == r.iteration_time_s
    order = [r.name for r in per_iter]
    assert order.index("ring") < order.index("exponential")  # faster per iteration
    assert [r.name for r in tta].index("ring") > [r.name for r in tta].index("exponential")
    assert by["ring"].iterations_factor > 10  # gap ~ 1/n^2 at 64 ranks
    assert [r.effective_time_s for r in tta] == sorted(r.effective_time_s for r in tta)
    assert effective_time(2.0, 3.0, "time_to_accuracy") == 6.0
    with pytest.raises(ValueError, match="objective"):
        effective_time(1.0, 1.0, "wall")


def test_all_reduce_is_the_data_baseline(resnet20):
    for preset in ("commodity", "dgx-h100"):
        cluster = Cluster.preset(preset, 8)
        data = flat_baselines(resnet20, CostContext(cluster), "momentum")["data"].simulation
        cost = replica_cost(resnet20, CostContext(cluster))
        ar = centralized_baselines(resnet20, CostContext(cluster), optimizer="momentum", cost=cost, all_reduce=True)["all-reduce"]
        assert ar.iteration_time_s == pytest.approx(data.iteration_time_s, rel=1e-9)
        assert ar.memory_bytes == pytest.approx(data.memory_bytes)
        # the op-level data-parallel simulation gives every device the same compute
        space = Space(resnet20, 8)
        op = Simulator(resnet20, cluster, optimizer="momentum").simulate(space.expand(bl.data_parallel(space)),
                                                                         timeline=False)
        assert op.compute_s[0] == pytest.approx(ar.compute_s[0], rel=0.01)


def test_parameter_server_phases_match_cost_model(worker):
    cost = worker["commodity"]
    n = 8
    cluster = Cluster.preset("commodity", n)
    ctx = CostContext(cluster)
    p = cost.param_bytes
    compute = cost.forward_s + cost.backward_s
    for servers in ((0,), tuple(range(n))):
        sim = simulate_parameter_server(ctx, cost, servers=servers, optimizer="sgd")
        comm_s = comm.parameter_server(cluster, range(n), servers, p).time_s
        upd = roofline_update_s(ctx, "sgd", p / len(servers))
        assert sim.iteration_time_s == pytest.approx(compute + comm_s + upd, rel=1e-9)
    # one server: 2 alpha + 2 (n-1) M / B on its NIC
    link = cluster.spec.inter_node
    one = comm.parameter_server(cluster, range(n), 0, p).time_s
    assert one == pytest.approx(2 * link.latency.value + 2 * (n - 1) * p / link.bandwidth.value)


def test_time_varying_topology_reports_mean_per_iteration(worker, tmp_path):
    cost = worker["commodity"]
    n = 16
    ctx = CostContext(Cluster.preset("commodity", n))
    top = build("one_peer_exponential", n)
    assert top.period == 4
    sim = simulate_gossip(ctx, cost, top, optimizer="momentum")
    p = cost.param_bytes
    link = ctx.cluster.spec.inter_node
    step = max(cost.forward_s + cost.backward_s, link.latency.value + p / link.bandwidth.value)
    step += snapshot_time(ctx, p) + average_time(ctx, p, 1) + roofline_update_s(ctx, "momentum", p)
    assert sim.iteration_time_s == pytest.approx(step, rel=1e-9)
    assert sum(1 for s in sim.timeline if s.task.name.startswith("gossip")) == 4
    trace_ = sim.to_chrome_trace(tmp_path / "t.json")
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert any(e.get("name") == "coll gossip 3" for e in events)
    assert trace_ is None or "traceEvents" in trace_


def test_candidates_and_skips(resnet20):
    tops, skipped = candidate_topologies(112)
    assert {t.name for t in tops} == {"ring", "torus", "exponential"}
    assert "power of two" in skipped["one_peer_exponential"]
    assert str(COMPLETE_MAX_RANKS) in skipped["complete"]
    tops, skipped = candidate_topologies(7)
    assert "torus" in skipped and "prime" in skipped["torus"]
    assert candidate_topologies(1)[0] == []
    custom = build("custom", 8, edges=[(i, (i + 1) % 8) for i in range(8)] + [(0, 4)])
    tops, _ = candidate_topologies(8, ["ring", custom])
    assert [t.name for t in tops] == ["ring", "custom"]
    # end to end from the graph: global batch 128 over 8 workers
    cluster = Cluster.preset("commodity", 8)
    res = decentralized_candidates(resnet20, CostContext(cluster), optimizer="momentum")
    assert {r.name for r in res} == {"ring", "torus", "exponential", "one_peer_exponential", "complete"}
    assert all(isinstance(r, DecentralizedResult) and r.simulation.feasible for r in res)
    base = centralized_baselines(resnet20, CostContext(cluster), optimizer="momentum")
    assert set(base) == {"ps", "ps-sharded"}
    assert decentralized_candidates(resnet20, CostContext(Cluster.preset("commodity", 1))) == []
    with pytest.raises(ValueError, match="divisible"):
        replica_cost(resnet20, CostContext(Cluster.preset("commodity", 3)))


def test_explain(resnet20, worker):
    cost = worker["commodity"]
    cluster = Cluster.preset("commodity", 64)
    tta = decentralized_candidates(resnet20, CostContext(cluster), cost=cost, objective="time_to_accuracy",
                                   topologies=("ring",))
    ring = tta[0]
    line = explain(ring, "all-reduce", 0.030, objective="time_to_accuracy")
    assert line.startswith("objective time_to_accuracy: ring D-PSGD 22.5 ms/iter but needs")
    assert "all-reduce 30.0 ms/iter wins" in line
    sourced = explain(ring, "all-reduce", 0.030, objective="time_to_accuracy", factor_source="measured for X")
    assert sourced == line + "; iterations factor: measured for X"
    line = explain(tta, "all-reduce", 0.0877, objective="iteration")
    assert "beats all-reduce 87.7 ms/iter" in line
    assert "wins" in explain(ring, "data", 0.010, objective="iteration")
    assert "beats" in explain(ring, "all-reduce", 10.0, objective="time_to_accuracy")
    assert explain([], "data", 0.01, reason="one device", factor_source="x") == \
        "objective iteration: no decentralized candidate (one device); data 10.0 ms/iter is the plan"
    assert "\n" not in line


# --------------------------------------------------------------------------- the planner


@pytest.fixture(scope="module")
def resnet20_plans(resnet20):
    """ResNet-20 at 16 x 32 samples on 16 devices of the slow network, per objective
    (``time_to_accuracy`` the default) and with decentralized plans switched off."""
    from flexsearch.search.planner import plan_graph

    model, inputs = load_model(f"{ROOT}/benchmarks/models/resnet.py:resnet20")
    import torch

    g = trace(model, (torch.empty(512, *inputs[0].shape[1:]),))
    cl = Cluster.preset("commodity", 16)
    return g, {k: plan_graph(g, cl, max_iters=30, **kw) for k, kw in {
        "iteration": {"objective": "iteration"}, "time_to_accuracy": {},
        "synchronous": {"decentralized": False}}.items()}


def test_planner_chooses_dpsgd_on_the_slow_network_and_says_why(resnet20_plans, tmp_path):
    import flexsearch
    from flexsearch.plan import Plan

    g, plans = resnet20_plans
    sync = plans["synchronous"]
    assert sync.kind != "decentralized" and sync.topology is None
    assert any("D-PSGD" in note for note in sync.notes)  # rejected, with the reason
    assert "ps" in sync.baselines and "ps-sharded" in sync.baselines
    # the table says which baselines the plan is not compared with, and why
    from rich.console import Console

    from flexsearch.tables import plan_table

    console = Console(width=240, record=True)
    console.print(plan_table(sync, None))
    shown = {line.split("│")[1].strip(): line for line in console.export_text().splitlines() if "baseline " in line}
    assert "not emitted, no runtime cost per step" in shown["baseline ps"]
    assert "for reference" in shown["baseline ps-sharded"] and "for reference" not in shown["baseline data"]
    for objective in ("iteration", "time_to_accuracy"):
        p = plans[objective]
        assert p.kind == "decentralized" and p.objective == objective
        assert p.topology is not None and 0 < p.spectral_gap <= 1 and p.iterations_factor >= 1
        assert any("D-PSGD" in note and "beats" in note for note in p.notes)
        factor = p.iterations_factor if objective == "time_to_accuracy" else 1.0
        assert p.predicted.iteration_time_s * factor < sync.predicted.iteration_time_s
        assert p.baselines[sync.kind] == sync.predicted.iteration_time_s
        # saved, loaded and re-simulated: the same prediction
        path = tmp_path / f"{objective}.json"
        p.save(path)
        q = Plan.load(path)
        assert q == p
        assert flexsearch.simulate(g, q).iteration_time_s == p.predicted.iteration_time_s
    # time to accuracy weighs the iterations: it never picks a worse-connected graph
    # than the per-iteration objective does
    assert plans["time_to_accuracy"].spectral_gap >= plans["iteration"].spectral_gap


def test_past_the_deadline_one_topology_and_a_note(resnet20):
    """Past the planner's deadline the decentralized phase simulates one topology (so a
    decentralized plan still exists to compare), no parameter server, and says so; the
    sharded parameter server is left out beyond PS_SHARDED_MAX_DEVICES (n^2 transfers)."""
    import time

    from flexsearch.search.decentralized import PS_SHARDED_MAX_DEVICES
    from flexsearch.search.planner import plan_graph, with_decentralized

    cluster = Cluster.preset("commodity", 8)
    ctx = CostContext(cluster)
    past = time.perf_counter()
    assert len(decentralized_candidates(resnet20, ctx, optimizer="momentum", deadline=past)) == 1
    plan = plan_graph(resnet20, cluster, kinds=("data", "soap", "pipeline", "hybrid"), optimizer="momentum",
                      max_iters=0)
    late = with_decentralized(plan, resnet20, ctx, allow=False, deadline=past)
    assert "the budget cut short: 4 of 5 D-PSGD topologies, the parameter-server baselines not simulated" \
        in late.notes[-1]
    assert not {"ps", "ps-sharded"} & set(late.baselines)
    assert {"ps", "ps-sharded"} <= set(with_decentralized(plan, resnet20, ctx, allow=False).baselines)
    assert PS_SHARDED_MAX_DEVICES < 3072
    # simulated beforehand (the planner does while its worker searches the pipelines): the same plan
    from flexsearch.search.decentralized import simulate_decentralized

    for allow in (False, True):
        runs = simulate_decentralized(resnet20, ctx, optimizer=plan.optimizer, objective=plan.objective)
        assert repr(with_decentralized(plan, resnet20, ctx, allow=allow, runs=runs)) == \
            repr(with_decentralized(plan, resnet20, ctx, allow=allow))
    early = simulate_decentralized(resnet20, ctx, optimizer=plan.optimizer, objective=plan.objective, deadline=past)
    assert repr(with_decentralized(plan, resnet20, ctx, allow=False, runs=early)) == repr(late)
