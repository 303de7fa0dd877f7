"""The list-scheduling simulator: time bounds, memory, delta simulation equal to a full
one, the Chrome trace, collectives of data parallelism, scaling."""

from __future__ import annotations

import functools
import json
import sys

import pytest
import torch
from conftest import ROOT, Branchy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

sys.path.insert(0, str(ROOT / "benchmarks"))
import zoo  # noqa: E402

from flexsearch import Cluster, trace  # noqa: E402
from flexsearch.sim.simulator import Simulator, simulate_configs  # noqa: E402
from flexsearch.sim.tasks import busy_compute  # noqa: E402
from flexsearch.strategy import recipes as baselines  # noqa: E402
from flexsearch.strategy.config import Config, is_source
from flexsearch.strategy.space import Space

SETTINGS = settings(
    max_examples=15, derandomize=True, deadline=None, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

CLUSTERS = [("dgx-h100", 4), ("flexflow-k80", 4), ("flexflow-k80", 8)]
GRAPHS = ["mlp_tiny", "gpt_tiny", "alexnet_tiny", "branchy"]


@functools.cache
def graph(name: str):
    if name == "branchy":
        torch.manual_seed(0)
        return trace(Branchy(), (torch.randn(8, 16),))
    model, inputs = zoo.build(name)
    return trace(model, inputs)


@functools.cache
def cluster(name: str, devices: int) -> Cluster:
    return Cluster.preset(name, devices)


def decisions(space: Space):
    """A strategy: one candidate per unit."""
    return st.fixed_dictionaries(
        {u.name: st.sampled_from(space.candidates(u)) for u in space.units}
    )


def used_devices(g, configs) -> set[int]:
    out: set[int] = set()
    for n in g.nodes:
        if not is_source(n):
            out |= set(configs[n.name].devices)
    return out


def summary(sim):
    """What a search reads, exactly; the critical path is only computed with a timeline.
    The serial time, a sum, to 12 digits (one replica's tasks, counted for all, are
    summed in another order)."""
    out = (sim.iteration_time_s, sim.memory_bytes, sim.compute_s, float(f"{sim.serial_s:.12g}"),
           sim.capacity_bytes)
    return out + ((sim.critical_path_s,) if sim.timeline else ())


# --------------------------------------------------------------------------- bounds


@pytest.mark.parametrize(("cl", "devices"), CLUSTERS, ids=[f"{c}x{d}" for c, d in CLUSTERS])
@pytest.mark.parametrize("name", GRAPHS)
def test_time_bounds_and_memory(name, cl, devices):
    g = graph(name)
    space = Space(g, devices)
    sim = Simulator(g, cluster(cl, devices))

    @SETTINGS
    @given(decisions(space))
    def check(dec):
        configs = space.expand(dec)
        s = sim.simulate(configs)
        rel = 1e-12
        assert s.iteration_time_s > 0
        assert s.iteration_time_s >= s.critical_path_s * (1 - rel)
        assert s.iteration_time_s >= max(s.compute_s) * (1 - rel)
        assert s.iteration_time_s <= s.serial_s * (1 + rel)
        assert len(s.memory_bytes) == len(s.compute_s) == devices
        used = used_devices(g, configs)
        for d in range(devices):
            if d in used:
                assert s.memory_bytes[d] > 0, d
                assert s.compute_s[d] > 0, d
            else:  # nothing placed there: nothing kept, nothing computed
                assert s.memory_bytes[d] == 0 and s.compute_s[d] == 0, d
        assert s.peak_memory_bytes == max(s.memory_bytes)
        assert s.feasible == (s.peak_memory_bytes <= s.capacity_bytes)
        # the timeline: every task inside [0, makespan], durations >= 0, resources valid
        assert s.timeline
        nres = devices + len(s.link_names)
        for t in s.timeline:
            assert 0 <= t.start <= t.end <= s.iteration_time_s * (1 + rel)
            spans = t.pieces or ((t.start, t.end),)  # a transfer that paused over others: its pieces
            assert sum(b - a for a, b in spans) == pytest.approx(t.task.duration, rel=1e-8, abs=1e-18)
            assert (spans[0][0], spans[-1][1]) == (t.start, t.end)
            assert all(0 <= r < nres for r in t.task.resources)
        assert max(t.end for t in s.timeline) == s.iteration_time_s
        # every task starts after the tasks (scheduled before it) that define its deps
        ready: dict = {}
        for t in s.timeline:
            for k in t.task.deps:
                assert t.start >= ready.get(k, 0.0), (t.task, k)
            for k in t.task.defines:
                ready[k] = max(ready.get(k, 0.0), t.end)
        # no resource runs two tasks at once
        by_res: dict[int, list] = {}
        for t in s.timeline:
            for r in t.task.resources:
                by_res.setdefault(r, []).extend((a, b, t.task.name) for a, b in
                                                (t.pieces if t.pieces and r >= devices else [(t.start, t.end)]))
        for r, spans in by_res.items():
            spans.sort()
            for (_, e0, n0), (s1, _, n1) in zip(spans, spans[1:], strict=False):
                assert s1 >= e0 * (1 - rel), (r, n0, n1)

    check()


# --------------------------------------------------------------------------- delta == full


@pytest.mark.parametrize(("cl", "devices"), CLUSTERS, ids=[f"{c}x{d}" for c, d in CLUSTERS])
@pytest.mark.parametrize("name", GRAPHS)
def test_delta_simulation_equals_full(name, cl, devices):
    g = graph(name)
    space = Space(g, devices)
    units = space.units
    c = cluster(cl, devices)

    moves = st.lists(
        st.tuples(st.integers(0, len(units) - 1), st.integers(0, 10**6)), min_size=1, max_size=12
    )

    @settings(SETTINGS, max_examples=8)
    @given(decisions(space), moves)
    def check(start, walk):
        sim = Simulator(g, c)  # ONE simulator for the whole walk
        dec = dict(start)
        sim.simulate(space.expand(dec), timeline=False)
        for ui, k in walk:
            u = units[ui]
            cands = space.candidates(u)
            dec[u.name] = cands[k % len(cands)]
            configs = space.expand(dec)
            before = sim.rebuilt
            delta = sim.simulate(configs, timeline=bool(k % 2))
            rebuilt = sim.rebuilt - before
            fresh = Simulator(g, c)
            full = fresh.simulate(configs)
            assert fresh.rebuilt == len(g.nodes)
            assert rebuilt <= len(g.nodes)
            if k % 2:
                assert summary(delta) == summary(full)
                assert delta.timeline == full.timeline
            else:  # no timeline: time and memory only (the critical path is not computed)
                assert summary(delta) == summary(full)[:-1]

    check()


@pytest.mark.parametrize(("cl", "devices"), CLUSTERS, ids=[f"{c}x{d}" for c, d in CLUSTERS])
@pytest.mark.parametrize("name", GRAPHS)
def test_a_cutoff_stops_only_simulations_that_end_after_it(name, cl, devices):
    """``simulate(..., cutoff=)`` returns None only when the iteration takes longer than
    the cutoff, the simulation itself otherwise; and it is None once the cutoff is below
    the compute some device must run (the bound it stops on), whatever the shardings and
    recomputation: one simulator, cut and not cut in turn (a cut schedule leaves the
    delta simulation's state whole)."""
    g, c = graph(name), cluster(cl, devices)
    space = Space(g, devices)

    @settings(SETTINGS, max_examples=6)
    @given(decisions(space), st.sampled_from(["none", "zero1", "zero3"]), st.sampled_from(["none", "full"]),
           st.sampled_from([0.5, 0.99, 0.999999, 1.0, 1.5]))
    def check(dec, shard, recompute, factor):
        sim = Simulator(g, c)
        configs = space.expand(dec)
        kw = dict(timeline=False, recompute=recompute, shard=shard if sim.is_ddp(configs) or shard == "none"
                  else "none")
        full = sim.simulate(configs, **kw)
        t = full.iteration_time_s
        cut = sim.simulate(configs, cutoff=t * factor, **kw)
        if factor >= 1.0:
            assert cut is not None and summary(cut) == summary(full)
        elif cut is not None:
            assert summary(cut) == summary(full)  # not sure to end after it yet: simulated in full
        shown = sim.simulate(configs, **{**kw, "timeline": True})
        if max(busy_compute([x.task for x in shown.timeline], devices, ("fwd", "bwd"))) > t * factor:
            assert cut is None
        assert summary(sim.simulate(configs, **kw)) == summary(full)

    check()


def test_delta_rebuilds_fewer_fragments():
    g = graph("gpt_tiny")
    space = Space(g, 4)
    sim = Simulator(g, cluster("dgx-h100", 4))
    dec = baselines.data_parallel(space)
    sim.simulate(space.expand(dec))
    assert sim.rebuilt == len(g.nodes)
    sim.simulate(space.expand(dec))
    assert sim.rebuilt == len(g.nodes)  # nothing changed: nothing rebuilt
    before = sim.rebuilt
    dec["h_0_mlp_c_fc"] = Config(1, "p", 4, 2)  # both blocks' first MLP linear
    sim.simulate(space.expand(dec))
    changed = sim.rebuilt - before
    # exactly the changed nodes and their consumers: the two linears, their GELUs
    # (followers: now attribute-split) and the two Linears reading the GELUs
    assert changed == 6
    assert changed < len(g.nodes) // 4
    dec2 = {**dec, "lm_head": Config(2, "x", 2)}
    before = sim.rebuilt
    moved = sim.simulate(space.expand(dec2))
    assert sim.rebuilt - before == 2  # lm_head and the output
    # back to the configuration before the move (a rejected MCMC step), and forward again:
    # the fragments of both are kept (FRAGMENTS_KEPT), nothing is rebuilt, and the results
    # are a fresh simulator's
    before = sim.rebuilt
    back = sim.simulate(space.expand(dec))
    again = sim.simulate(space.expand(dec2))
    assert sim.rebuilt == before
    assert summary(back) == summary(Simulator(g, cluster("dgx-h100", 4)).simulate(space.expand(dec)))
    assert summary(again) == summary(moved)


def test_simulate_configs_is_a_full_simulation():
    g = graph("mlp_tiny")
    space = Space(g, 4)
    configs = space.expand(baselines.data_parallel(space))
    a = simulate_configs(g, configs, cluster("dgx-h100", 4))
    b = Simulator(g, cluster("dgx-h100", 4)).simulate(configs)
    assert summary(a) == summary(b)


# --------------------------------------------------------------------------- one replica for all

QUOTIENT_CASES = [("gpt_tiny", "dgx-h100", 16), ("gpt_tiny", "dgx-a100", 8), ("alexnet_tiny", "flexflow-k80", 8),
                  ("mlp_tiny", "cpu", 4)]


@pytest.mark.parametrize(("name", "cl", "devices"), QUOTIENT_CASES, ids=[f"{n}-{c}x{d}" for n, c, d in QUOTIENT_CASES])
def test_one_replica_simulates_all(name, cl, devices):
    """Without a timeline, configurations that repeat every w devices are simulated on
    the first w (every baseline recipe; data parallelism as DDP, ZeRO-1/2/3, HSDP, with
    recompute; random layouts of whole-cluster candidates): the same time, memory and
    compute per device as a simulation of every device."""
    from flexsearch.cost.calibration import load_calibration
    from flexsearch.sim.context import CostContext

    g = graph(name)
    c = cluster(cl, devices)
    ctx = CostContext(c, calibration=load_calibration(c.device.name) if cl == "cpu" else None)
    space = Space(g, devices)
    runs = [(dec, {}) for dec in baselines.baselines(space, c.devices_per_node).values()]
    data = baselines.data_parallel(space)
    runs += [(data, dict(ddp=True, shard=shard, shard_group=c.devices_per_node, recompute=rc))
             for shard in ("none", "zero1", "zero2", "zero3", "hsdp") for rc in ("none", "full")]
    whole = {u.name: [x for x in space.candidates(u) if x.first == 0 and x.n == devices] for u in space.units}

    @SETTINGS
    @given(st.fixed_dictionaries({u: st.sampled_from(cs) for u, cs in whole.items() if cs}))
    def check(dec):
        configs = space.expand(dec)
        assert summary(Simulator(g, ctx).simulate(configs, timeline=False)) == \
            summary(Simulator(g, ctx).simulate(configs))[:-1]

    quotients = 0
    for dec, kw in runs:
        configs = space.expand(dec)
        if kw.get("shard") == "hsdp" and not 1 < c.devices_per_node < devices:
            continue
        sim = Simulator(g, ctx)
        quotients += sim.replica(configs, c.devices_per_node if kw.get("shard") == "hsdp" else 0) is not None
        fast = sim.simulate(configs, timeline=False, **kw)
        full = Simulator(g, ctx).simulate(configs, **kw)
        assert summary(fast) == summary(full)[:-1], (dec, kw)
        assert fast.memory_terms == full.memory_terms
    assert quotients >= len(runs) // 2  # the quotient applied (to data parallelism at least)
    check()


def test_replica_width():
    g = graph("gpt_tiny")
    space = Space(g, 16)
    sim = Simulator(g, cluster("dgx-h100", 16))
    recipes = baselines.baselines(space, 8)
    width = {k: getattr(sim.replica(space.expand(dec)), "width", None) for k, dec in recipes.items()}
    # 8 samples on 16 devices: each sample's ops replicated on 2
    assert width == {"data": 2, "megatron-t2": 2, "megatron-t4": 4, "megatron-t8": 8}
    assert Simulator(g, cluster("dgx-h100", 8)).replica(Space(g, 8).expand(baselines.data_parallel(Space(g, 8)))).width == 1
    assert sim.replica(space.expand(recipes["data"]), group=8).width == 8  # HSDP: one shard group
    some = {**recipes["data"], "lm_head": Config(1, "", 1)}  # one op on device 0 only
    assert sim.replica(space.expand(some)) is None


# --------------------------------------------------------------------------- chrome trace


@pytest.mark.parametrize(
    ("name", "cl", "devices", "dec"),
    [
        ("mlp_tiny", "flexflow-k80", 8, "data"),
        ("alexnet_tiny", "dgx-h100", 4, "expert"),
        ("branchy", "flexflow-k80", 4, "mixed"),
        ("mlp_tiny", "dgx-h100", 4, "single"),
    ],
)
def test_chrome_trace(tmp_path, name, cl, devices, dec):
    g = graph(name)
    space = Space(g, devices)
    if dec == "data":
        d = baselines.data_parallel(space)
    elif dec == "expert":
        d = baselines.expert(space)
    elif dec == "mixed":
        d = {"a": Config(4), "b": Config(1, "p", 2, 1), "c": Config(2, first=2),
             "d": Config(1, "r", 4, 0)}
    else:
        d = {}
    configs = space.expand(d)
    s = Simulator(g, cluster(cl, devices)).simulate(configs)
    path = tmp_path / "trace.json"
    s.to_chrome_trace(path)
    data = json.loads(path.read_text())
    events = data["traceEvents"]
    xs = [e for e in events if e["ph"] == "X"]
    assert xs
    for e in xs:
        assert e["dur"] >= 0 and e["ts"] >= 0
        assert e["pid"] in (0, 1)
        assert isinstance(e["name"], str) and e["cat"] in ("fwd", "bwd", "xfer", "coll", "update", "bubble")
    dev_tids = {e["tid"] for e in xs if e["pid"] == 0 and e["cat"] != "bubble"}
    used = used_devices(g, configs)
    assert dev_tids == used
    assert all(0 <= t < devices for t in dev_tids)
    comm = [t for t in s.timeline if t.task.kind in ("xfer", "coll")]
    link_tids = {e["tid"] for e in xs if e["pid"] == 1}
    if any(t.task.duration > 0 and t.task.resources for t in comm):
        assert link_tids
        assert all(0 <= t < len(s.link_names) for t in link_tids)
    if dec == "single":
        assert not comm and not link_tids
    # metadata names every device and link track
    names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
             if e["ph"] == "M" and e["name"] in ("process_name", "thread_name")}
    assert names[(0, None)] == "devices" and names[(1, None)] == "links"
    for d in range(devices):
        assert (0, d) in names
    for i in range(len(s.link_names)):
        assert (1, i) in names
    # the makespan in the trace matches (microseconds)
    assert max(e["ts"] + e["dur"] for e in xs) == pytest.approx(s.iteration_time_s * 1e6, rel=1e-9)


# --------------------------------------------------------------------------- collectives


@pytest.mark.parametrize("name", ["mlp_tiny", "alexnet_tiny", "gpt_tiny"])
def test_data_parallel_gradient_all_reduces(name):
    g = graph(name)
    space = Space(g, 4)
    s = Simulator(g, cluster("dgx-h100", 4)).simulate(space.expand(baselines.data_parallel(space)))
    grads = [t.task for t in s.timeline
             if t.task.kind == "coll" and "gradients" in t.task.detail]
    with_params = {n.name for n in g.nodes if n.param_bytes}
    assert {t.name for t in grads} == with_params
    for t in grads:
        assert "all_reduce" in t.detail
        assert t.nbytes == g.node(t.name).param_bytes  # each device holds the whole gradient
        assert t.duration > 0
    assert len(grads) == len(with_params)
    # data parallel on a sample split never moves activations between devices
    assert not [t for t in s.timeline if t.task.kind == "xfer"]
    # gradients are synchronised before each device's optimizer update
    updates = [t for t in s.timeline if t.task.kind == "update"]
    assert len(updates) == 4
    last_sync = max(t.end for t in s.timeline if t.task in grads)
    assert min(u.start for u in updates) >= last_sync * (1 - 1e-12)


def test_frozen_layers_synchronise_and_update_nothing():
    """Three Linear layers of 1 MB, the first two frozen (fine-tuning the last): no
    backward before the last (it ran theirs); every
    simulator synchronises and updates the last one's gradients only (DDP's op-level
    all-reduces, FSDP's reduce-scatters, the stage-level one-bucket all-reduce, the
    pipeline's per-stage syncs and D-PSGD's gossip), and counts its gradients and
    optimizer state alone; the parameters held are all three."""
    from flexsearch.sim.context import CostContext
    from flexsearch.sim.predict import predict
    from flexsearch.strategy import topology
    from flexsearch.strategy.kinds import DataParallel, Decentralized, Pipelined

    def build(frozen: bool):
        model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(3)])
        for layer in model[:2]:
            layer.requires_grad_(not frozen)
        return trace(model, (torch.randn(64, 512),))

    ctx = CostContext(cluster("dgx-h100", 4))
    layer = 512 * 513 * 4
    out = {}
    for frozen in (False, True):
        g = build(frozen)
        space = Space(g, 4)
        configs = space.expand(baselines.data_parallel(space))
        dec = baselines.data_parallel(space)
        sims = {
            "ddp": Simulator(g, ctx).simulate(configs, ddp=True),
            "zero3": predict(g, DataParallel(configs, dec, shard="zero3", fsdp_units=("0", "1", "2")), ctx),
            "flat": predict(g, Pipelined(((0, len(g.nodes)),), tensor=1, replicas=4, schedule="1f1b",
                                         microbatches=1), ctx),
            "pipeline": predict(g, Pipelined(((0, 3), (3, len(g.nodes))), tensor=1, replicas=2, schedule="1f1b",
                                             microbatches=2), ctx),
            "dpsgd": predict(g, Decentralized(topology.build("ring", 4)), ctx),
        }
        out[frozen] = sims
        synced = {k: sorted(t.task.nbytes for t in s.timeline if t.task.kind == "coll" and t.task.nbytes)
                  for k, s in sims.items() if k != "dpsgd"}
        if frozen:
            assert synced["ddp"] == synced["flat"] == synced["pipeline"] == [layer]
            gossip = {t.task.detail for t in sims["dpsgd"].timeline if "models of" in t.task.detail}
            assert gossip == {f"ring step 0: 8 models of {layer} bytes"}
            assert sum(t.task.nbytes for t in sims["zero3"].timeline if "reduce_scatter" in t.task.detail) == layer
            assert sims["ddp"].memory_terms[0].grads == layer and sims["ddp"].memory_terms[0].params == 3 * layer
            assert sims["ddp"].memory_terms[0].optimizer == 2 * layer
            assert sims["zero3"].memory_terms[0].grads == layer / 4
            # nothing before the trained layer carries a gradient: autograd runs no backward there
            bwd = {t.task.name: t.end - t.start for t in sims["ddp"].timeline if t.task.kind == "bwd"}
            assert bwd["_0"] == bwd["_1"] == 0 < bwd["_2"]
    # the pipeline partitioner's chain: trained bytes all-reduced, frozen ones held once
    from flexsearch.graph.microbatch import microbatch_graph
    from flexsearch.search.pipeline import stage_chain
    from flexsearch.sim.stages import cut_bytes, stage_node_costs

    mg = microbatch_graph(build(True), 1)
    chain = stage_chain(stage_node_costs(mg, ctx, 1), cut_bytes(mg))
    assert sum(chain.params) == layer and sum(chain.frozen) == 2 * layer
    for k in out[True]:
        fine, full = out[True][k], out[False][k]
        assert fine.iteration_time_s < full.iteration_time_s, k
        assert fine.peak_memory_bytes < full.peak_memory_bytes, k


class _LoRA(nn.Module):
    """A frozen Linear and its low-rank adapters, read as ``x @ A.t() @ B.t()`` (loralib's
    form: ``A.t()`` is an op on a parameter alone)."""

    def __init__(self, d: int = 64, r: int = 4):
        super().__init__()
        self.base = nn.Linear(d, d).requires_grad_(False)
        self.A = nn.Parameter(torch.randn(r, d) * 0.1)
        self.B = nn.Parameter(torch.zeros(d, r))

    def forward(self, x):
        return self.base(x) + (x @ self.A.t()) @ self.B.t()


def test_parameters_read_through_an_op_on_them_alone_are_held_and_synchronised():
    """LoRA's adapters read through ``A.t()``: the op has no activation input, so it is a
    source; its parameters were left out of every simulator (the review's ``lora_sim.py``:
    1,056 of 5,152 trained bytes). They are held on every device, their gradients
    all-reduced after the backward of the op that reads them, sharded by ZeRO-3."""
    from flexsearch.sim.context import CostContext
    from flexsearch.sim.predict import predict
    from flexsearch.strategy.kinds import DataParallel

    model = nn.Sequential(_LoRA(), nn.ReLU(), _LoRA())
    g = trace(model, (torch.randn(8, 64),))
    held = sum(p.numel() * 4 for p in model.parameters())
    trained = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    space = Space(g, 2)
    dec = baselines.data_parallel(space)
    configs = space.expand(dec)
    ctx = CostContext(cluster("dgx-h100", 2))
    ddp = Simulator(g, ctx).simulate(configs, ddp=True)
    zero3 = predict(g, DataParallel(configs, dec, shard="zero3", fsdp_units=()), ctx)
    assert (ddp.memory_terms[0].params, ddp.memory_terms[0].grads) == (held, trained)
    assert (zero3.memory_terms[0].params, zero3.memory_terms[0].grads) == (held / 2, trained / 2)
    synced = [t for t in ddp.timeline if t.task.kind == "coll"]
    assert sum(t.task.nbytes for t in synced) == trained
    ends = {t.task.name: t.end for t in ddp.timeline if t.task.kind == "bwd"}
    for t in synced:  # after the backward of the matmul that reads the transposed adapter
        reader = next(n.name for n in g.nodes if t.task.name in n.inputs)
        assert t.start >= ends[reader]


@pytest.mark.parametrize("name", ["mlp_tiny", "gpt_tiny", "alexnet_tiny", "branchy"])
def test_single_device_plan_has_no_communication(name):
    g = graph(name)
    for cl, devices, dec in (("cpu", 1, None), ("dgx-h100", 4, {}),
                             ("dgx-h100", 4, "dev2")):
        space = Space(g, devices)
        if dec == "dev2":
            dec = {u.name: Config(first=2) for u in space.units}
        s = Simulator(g, cluster(cl, devices)).simulate(space.expand(dec or {}))
        kinds = {t.task.kind for t in s.timeline}
        assert not kinds & {"xfer", "coll"}, (cl, kinds)
        assert kinds <= {"fwd", "bwd", "update"}
        busy = [d for d in range(devices) if s.compute_s[d] > 0]
        assert len(busy) == 1
        # one device, no overlap possible: the makespan is that device's busy time
        assert s.iteration_time_s == pytest.approx(s.compute_s[busy[0]], rel=1e-12)
        assert s.iteration_time_s == pytest.approx(s.serial_s, rel=1e-12)


def test_parameter_split_communicates_and_reduce_split_all_reduces():
    g = graph("mlp_tiny")
    space = Space(g, 4)
    s = Simulator(g, cluster("dgx-h100", 4)).simulate(
        space.expand({"net_2": Config(1, "r", 4, 0)})
    )
    partial = [t.task for t in s.timeline if "partial sums" in t.task.detail]
    assert len(partial) == 1 and partial[0].name == "net_2"
    assert partial[0].nbytes == g.node("net_2").output_bytes
    s = Simulator(g, cluster("dgx-h100", 4)).simulate(
        space.expand({"net_2": Config(1, "p", 4, 1)})
    )
    xfers = [t.task for t in s.timeline if t.task.kind == "xfer"]
    assert xfers and not any("partial sums" in t.task.detail for t in s.timeline)


def test_soap_output_comes_back_whole_to_every_device():
    """Calibrated (the emitter's runtime), a SOAP plan's output is brought whole to every
    device before the loss's gradient: an all-gather over a split output's block, a
    broadcast (and the calibrated cost of a move) from a block on some devices only.
    Every device then holds the whole output and the loss's hold over it; the same
    layout run with DDP keeps each device's share."""
    from flexsearch.cost.calibration import Term, load_calibration
    from flexsearch.sim.context import CostContext

    g = graph("mlp_tiny")
    c = cluster("cpu", 2)
    cal = load_calibration(c.device.name)
    ctx = CostContext(c, calibration=cal.model_copy(update={"move_s": Term(value=1e-3, source="test")}))
    space = Space(g, 2)
    data = space.expand(baselines.data_parallel(space))
    last = g.node(next(n for n in g.nodes if n.kind == "output").inputs[0])
    out_bytes = last.outputs[0].nbytes

    def gathers(sim):
        return [s for s in sim.timeline if s.task.detail.startswith("output ")]

    soap, ddp = Simulator(g, ctx).simulate(data, ddp=False), Simulator(g, ctx).simulate(data, ddp=True)
    (gather,) = gathers(soap)
    assert not gathers(ddp) and "all_gather" in gather.task.detail and gather.task.nbytes == out_bytes
    assert gather.task.duration == pytest.approx(ctx.collective("all_gather", (0, 1), out_bytes).time_s)
    backward = [s for s in soap.timeline if s.task.kind == "bwd" and s.task.name == last.name]
    assert backward and min(s.start for s in backward) >= gather.end  # the loss's gradient waits
    # the whole output, twice (the gathered tensor and the loss's hold), less DDP's two shares
    assert soap.memory_terms[0].activations - ddp.memory_terms[0].activations >= out_bytes
    assert soap.memory_terms[0].loss_grad == pytest.approx(2 * ddp.memory_terms[0].loss_grad)

    on_one = {n: Config(first=1) if not is_source(g.node(n)) else x for n, x in data.items()}
    (gather,) = gathers(Simulator(g, ctx).simulate(on_one))
    assert "broadcast" in gather.task.detail and "all_gather" not in gather.task.detail
    assert gather.task.duration == pytest.approx(ctx.collective("broadcast", (0, 1), out_bytes).time_s + 1e-3)
    copies = {n: Config(1, "x", 2) if not is_source(g.node(n)) else x for n, x in data.items()}
    (gather,) = gathers(Simulator(g, ctx).simulate(copies))  # whole on both: moved to the runtime's mesh only
    assert gather.task.detail.endswith(" move") and gather.task.duration == pytest.approx(1e-3)
    uncalibrated = Simulator(g, CostContext(c)).simulate(data, ddp=False)
    assert not gathers(uncalibrated)  # FlexFlow's runtime: the loss over each device's share


def test_memory_counts_optimizer_state():
    g = graph("mlp_tiny")
    space = Space(g, 1)
    configs = space.expand({})
    c = cluster("cpu", 1)
    mem = {opt: Simulator(g, c, optimizer=opt).simulate(configs).memory_bytes[0]
           for opt in ("sgd", "momentum", "adam")}
    p = g.param_bytes
    assert mem["momentum"] - mem["sgd"] == pytest.approx(p)  # both update in place
    # Adam's state, and its temporaries (one copy) where the update is the peak
    assert 2 * p <= mem["adam"] - mem["sgd"] <= 3 * p
    assert mem["sgd"] >= 2 * p  # parameters and gradients
    with pytest.raises(ValueError, match="unknown optimizer"):
        Simulator(g, c, optimizer="lamb")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- scaling


def _compute_bound_convnet():
    with torch.device("meta"):
        model = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10),
        )
        x = torch.empty(512, 3, 32, 32)
    return model, (x,)


@functools.cache
def convnet_graph():
    return trace(*_compute_bound_convnet())


@pytest.mark.parametrize("cl", ["dgx-h100", "flexflow-k80"])
def test_more_devices_lower_data_parallel_time(cl):
    g = convnet_graph()
    times = []
    for d in (1, 2, 4, 8):
        space = Space(g, d)
        s = Simulator(g, cluster(cl, d)).simulate(space.expand(baselines.data_parallel(space)))
        assert s.feasible
        times.append(s.iteration_time_s)
    assert all(b < a for a, b in zip(times, times[1:], strict=False)), times
    assert times[-1] < times[0] / 4  # compute bound: close to linear scaling
