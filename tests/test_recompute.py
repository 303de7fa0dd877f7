"""Activation checkpointing (none, selective, full per unit) and gradient accumulation:
the units, what the simulation charges for them (memory down, time up, in the stated
order), the planner using them only when memory is short, and every emitted plan kind
running them for real against a single-process reference."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import ROOT
from emit_cases import check_job

import flexsearch
from flexsearch.cost.hardware import Cluster, Positive
from flexsearch.emit.launch import run_ranks
from flexsearch.graph.tracer import trace
from flexsearch.plan import Plan
from flexsearch.search.planner import plan_graph
from flexsearch.search.results import plan_from
from flexsearch.sim.context import CostContext
from flexsearch.sim.predict import predict
from flexsearch.sim.stages import NodeCost, stage_cost
from flexsearch.strategy.kinds import DataParallel, Pipelined
from flexsearch.strategy.recompute import SAVED_KINDS, Checkpointing, recompute_units

GPT = str(ROOT / "benchmarks/models/gpt.py:gpt_tiny")


@pytest.fixture(scope="module")
def gpt():
    model, x = flexsearch.load_model(GPT)
    return model, x, trace(model, x)


def test_units_are_the_block_instances(gpt):
    _, _, g = gpt
    units = recompute_units(g)
    assert [u.path for u in units] == [m for b in g.blocks for m in b.modules]
    assert all(a.end <= b.start for a, b in zip(units, units[1:], strict=False))
    full, sel = Checkpointing.of(g, "full"), Checkpointing.of(g, "selective")
    inside = {i for u in units for i in range(u.start, u.end)}
    assert {i for i, d in enumerate(full.dropped) if d} == inside
    assert all(sel.dropped[i] == (g.nodes[i].kind not in SAVED_KINDS) for i in inside)
    assert all(sel.cached[i] == (i in inside and g.nodes[i].kind in SAVED_KINDS) for i in range(len(g.nodes)))
    assert not any(full.cached)
    # a unit's output (read by the next unit or the head) stays: it is the next one's input
    readers = g.consumers
    for u in units:
        assert full.boundary[u.end - 1]
        mine = {g.nodes[j].name for j in range(u.start, u.end)}
        for i in range(u.start, u.end):
            assert full.boundary[i] == any(r not in mine for r in readers.get(g.nodes[i].name, ()))


def test_a_stage_reruns_its_dropped_forwards_and_keeps_only_its_input():
    costs = [NodeCost(1.0, 2.0, 10.0, 100.0)] * 4
    cuts = (0.0, 5.0, 5.0, 5.0, 5.0)
    full = Checkpointing("full", (True,) * 4, (0,) * 4, (False,) * 4)
    plain = stage_cost(costs, 0, 4, cuts)
    again = stage_cost(costs, 0, 4, cuts, recompute=full)
    assert (plain.backward_s, again.backward_s) == (8.0, 12.0)
    assert (plain.stash_bytes, plain.working_bytes) == (400.0, 0.0)
    assert (again.stash_bytes, again.working_bytes) == (0.0, 400.0)  # one unit rebuilt at a time
    later = stage_cost(costs, 2, 4, cuts, recompute=full)  # starts inside the unit: keeps what it received
    assert (later.stash_bytes, later.working_bytes) == (5.0, 200.0)


def _sims(g, strategy, cl):
    ctx = CostContext(cl)
    return {m: predict(g, dataclasses.replace(strategy, recompute=m), ctx, timeline=False)
            for m in ("none", "selective", "full")}


@pytest.mark.parametrize("kind", ["data", "fsdp", "pipeline"])
def test_checkpointing_trades_time_for_memory(gpt, kind):
    _, _, g = gpt
    # compute-bound (on 2 H100s this tiny model's step is latency: the list schedule's
    # overlap decides, and a longer backward can hide a collective better)
    cl = Cluster.preset("cpu", 2)
    if kind == "pipeline":
        n = len(g.nodes)
        strategy = Pipelined(((0, n // 2), (n // 2, n)), 1, 1, "1f1b", 4)
    else:
        strategy = plan_graph(g, cl, kinds=(kind,), max_iters=0).strategy(g)
    s = _sims(g, strategy, cl)
    # device 0: a pipeline's first stage holds two microbatches under 1F1B (the last
    # holds one, and rebuilding its one unit costs what keeping it did)
    mem = {m: r.memory_bytes[0] for m, r in s.items()}
    time = {m: r.iteration_time_s for m, r in s.items()}
    assert mem["full"] < mem["selective"] < mem["none"], mem
    assert time["none"] < time["selective"] < time["full"], time


def test_accumulation_lowers_memory_and_keeps_the_arithmetic(gpt):
    _, _, g = gpt
    cl = Cluster.preset("dgx-h100", 2)
    ctx = CostContext(cl)
    one = plan_graph(g, cl, kinds=("data",), max_iters=0).strategy(g)
    two = dataclasses.replace(one, microbatches=2)
    a, b = predict(g, one, ctx), predict(g, two, ctx)
    assert b.peak_memory_bytes < a.peak_memory_bytes and b.iteration_time_s >= a.iteration_time_s * 0.9
    with pytest.raises(ValueError, match="accumulation"):
        dataclasses.replace(one, shard="zero3", microbatches=2)
    with pytest.raises(ValueError, match="recompute mode"):
        DataParallel({}, recompute="sometimes")


def _short_of_memory(cl: Cluster, capacity: float) -> Cluster:
    dev = cl.spec.device.model_copy(update={"memory_capacity": Positive(value=capacity, source="test")})
    return Cluster.from_spec(cl.spec.model_copy(update={"device": dev}), cl.devices)


def test_the_planner_checkpoints_only_when_memory_is_short(gpt):
    _, _, g = gpt
    cl = Cluster.preset("dgx-h100", 2)
    plain = plan_graph(g, cl, kinds=("data",), max_iters=0)
    assert plain.recompute == "none" and not plain.microbatches
    s = _sims(g, plain.strategy(g), cl)
    between = (s["none"].peak_memory_bytes + s["full"].peak_memory_bytes) / 2
    tight = plan_graph(g, _short_of_memory(cl, between), kinds=("data",), max_iters=0)
    assert tight.recompute != "none" or (tight.microbatches or 1) > 1
    assert tight.predicted.peak_memory_bytes <= between
    assert tight.predicted.iteration_time_s >= plain.predicted.iteration_time_s
    back = Plan.model_validate_json(tight.model_dump_json())
    assert back.strategy(g) == tight.strategy(g)
    assert Plan.model_validate({**plain.model_dump(), "recompute": True}).recompute == "full"  # version 3 files


def _plans(family: str) -> list[Plan]:
    from emit_cases import FAMILIES, load

    model, x = load(FAMILIES[family])
    g = trace(model, x)
    cl = Cluster.resolve("cpu", 2)
    out = []
    for kind in ("data", "fsdp", "pipeline"):
        base = plan_graph(g, cl, kinds=(kind,), max_iters=0, schedules=("1f1b",))
        st = base.strategy(g)
        for mode in ("full", "selective"):
            for m in ((1, 2) if kind == "data" and mode == "full" else (1,)):
                s2 = dataclasses.replace(st, recompute=mode, **({"microbatches": m} if kind == "data" else {}))
                sim = predict(g, s2, CostContext(cl))
                out.append(plan_from(g, cl, s2, sim, baselines={}, lower_bound_s=0.0,
                                     configs=base.node_configs() if kind == "pipeline" else None))
    return out


@pytest.mark.parametrize("family", ["gpt", pytest.param("cnn", marks=pytest.mark.slow),
                                    pytest.param("rnn", marks=pytest.mark.slow)])
def test_emitted_plans_checkpoint_and_accumulate_exactly(family):
    """DDP, FSDP2 and a 2-stage pipeline (cut inside a unit when the partitioner says so),
    each under full and selective checkpointing, DDP also with 2 accumulated microbatches:
    loss and gradients over 3 steps equal the single-process model's."""
    from emit_cases import FAMILIES

    plans = _plans(family)
    assert {(p.kind, p.shard_params, p.recompute) for p in plans} >= {
        ("data", False, "full"), ("data", True, "selective"), ("pipeline", False, "full")}
    results = run_ranks(check_job, 2, FAMILIES[family], plans, timeout_s=600)
    for rank in results:
        for (_, _, loss, ref, _), p in zip(rank, plans, strict=True):
            assert loss == pytest.approx(ref, rel=1e-5), (p.kind, p.recompute, p.microbatches)


def _megatron_soap(g, recompute: str = "none"):
    from flexsearch.strategy.kinds import Soap
    from flexsearch.strategy.recipes import megatron
    from flexsearch.strategy.space import Space

    space = Space(g, 2)
    dec = megatron(space, 2)
    return Soap(space.expand(dec), dec, recompute)


def test_a_soap_plan_recomputes_its_units_with_their_redistributions(gpt):
    """Megatron's layout on 2 devices, fully checkpointed: each unit keeps its input,
    and its ops run again in its backward with the transfers and collectives of their
    forward (the all-reduce after each row-parallel projection, the gathers before the
    attention). Selectively checkpointed, its matmuls keep their outputs and run no
    compute again, but the whole unit's transfers and collectives rerun as under full
    (the emitter's recomputation runs every op of the unit, its policy returning the
    matmuls' cached outputs): it keeps more than full and less than none, and takes
    less time than full."""
    g = gpt[2]
    ctx = CostContext(Cluster.resolve("cpu", 2))
    plain, selective, full = (predict(g, _megatron_soap(g, rc), ctx) for rc in ("none", "selective", "full"))
    assert max(m.activations for m in full.memory_terms) < 0.5 * max(m.activations for m in plain.memory_terms)
    dropped = {n.name for n, d in zip(g.nodes, Checkpointing.of(g, "full").dropped, strict=True) if d}
    forward = sorted((x.task.name, x.task.duration) for x in plain.timeline if x.task.kind in ("xfer", "coll")
                     and x.task.name in dropped and x.task.defines[0][0] in ("x", "F"))
    for sim in (full, selective):
        again = sorted((x.task.name[:-len(" again")], x.task.duration) for x in sim.timeline
                       if x.task.name.endswith(" again"))
        assert forward and again == forward
    assert plain.iteration_time_s < selective.iteration_time_s < full.iteration_time_s

    def kept(sim):
        return max(m.activations for m in sim.memory_terms)

    assert kept(full) < kept(selective) < kept(plain)
    # an op of a unit on part of the devices: not recomputed (the ranks would rebuild
    # different ops and collectives)
    from flexsearch.strategy.config import Config
    from flexsearch.strategy.recompute import partial_unit_op

    configs = dict(_megatron_soap(g).configs)
    assert partial_unit_op(g, configs, 2) is None
    inner = g.nodes[recompute_units(g)[0].start].name
    configs[inner] = Config()  # on device 0 alone
    assert partial_unit_op(g, configs, 2) == inner


def test_the_soap_search_checkpoints_where_nothing_else_fits(gpt):
    """With memory below every SOAP baseline's need and above a checkpointed one's, and
    no other SOAP configuration to find (no ILP, no MCMC steps: the ILP's plan found one
    that fits at 3.22 MB), ``--kind soap`` returns the fastest baseline that fits
    checkpointed (each selectively if that fits, else fully), and says why; with memory
    for the full checkpointing of some baseline only, that one."""
    from flexsearch.search.baselines import run_baselines
    from flexsearch.sim.simulator import Simulator
    from flexsearch.strategy.space import Space

    g = gpt[2]
    cl = Cluster.resolve("cpu", 2)
    ctx = CostContext(cl)
    space, sim = Space(g, 2), Simulator(g, ctx)
    base = run_baselines(space, sim, cl.devices_per_node)
    from flexsearch.strategy.kinds import Soap

    sims = {k: {rc: predict(g, Soap(space.expand(b.decisions), b.decisions, rc), ctx, timeline=False)
                for rc in ("none", "selective", "full")} for k, b in base.items()}

    def planned(cap):
        dev = cl.spec.device.model_copy(update={"memory_capacity": Positive(value=cap, source="test")})
        tight = Cluster.from_spec(cl.spec.model_copy(update={"device": dev}), cl.devices)
        return plan_graph(g, tight, kinds=("soap",), max_iters=0, ilp_max_units=0)

    def expected(cap):  # per baseline the first mode that fits, the fastest of those
        fits = [next((rc, s[rc]) for rc in ("selective", "full") if s[rc].peak_memory_bytes <= cap)
                for s in sims.values() if s["full"].peak_memory_bytes <= cap]
        return min(fits, key=lambda f: f[1].iteration_time_s)

    need = {k: s["none"].peak_memory_bytes for k, s in sims.items()}
    selective = min(s["selective"].peak_memory_bytes for s in sims.values())
    full = min(s["full"].peak_memory_bytes for s in sims.values())
    assert full < selective < min(need.values())
    for cap in (min(need.values()) * 0.99, (full + selective) / 2):
        plan = planned(cap)
        mode, sim = expected(cap)
        assert plan.kind == "soap" and plan.recompute == mode and plan.predicted.peak_memory_bytes <= cap
        assert plan.predicted.iteration_time_s == pytest.approx(sim.iteration_time_s)
        assert any(n.startswith(f"{mode} activation checkpointing: the SOAP plan without it") for n in plan.notes)
        assert Plan.from_json(plan.to_json()).strategy(g).recompute == mode
    assert planned(min(need.values()) * 0.99).recompute == "selective"
    assert planned((full + selective) / 2).recompute == "full"
    # below every checkpointed need too: one line that says so
    from flexsearch.errors import PlanKindError

    low = full * 0.9
    dev = cl.spec.device.model_copy(update={"memory_capacity": Positive(value=low, source="test")})
    with pytest.raises(PlanKindError, match="nor its baselines with activation checkpointing"):
        plan_graph(g, Cluster.from_spec(cl.spec.model_copy(update={"device": dev}), cl.devices), kinds=("soap",),
                   max_iters=0, ilp_max_units=0)


def calls_job(rank: int, world: int, spec: str, plans: list) -> list[int]:
    """Per plan: how many times one step runs the first block's first LayerNorm."""
    import torch
    from emit_cases import mse, with_target

    from flexsearch.emit import parallelize

    out = []
    for plan in plans:
        model, x, y = with_target(spec)
        module = parallelize(model, plan)
        calls: list[int] = []
        norm = next(m for m in module.modules() if isinstance(m, torch.nn.LayerNorm))
        norm.register_forward_hook(lambda *_, seen=calls: seen.append(1))
        module.train_step(x, y, mse)
        out.append(len(calls))
    return out


@pytest.mark.parametrize("part", ["core", pytest.param("bf16-full", marks=pytest.mark.slow)])
def test_checkpointed_soap_plans_compute_what_the_model_does(part):
    """2 gloo ranks: Megatron's layout on the tiny GPT, fully checkpointed in fp32 and
    selectively in bf16-mixed (``core``), fully in bf16-mixed (``bf16-full``, behind the
    ``slow`` marker; in fp32 selectively: Hugging Face Llama's SOAP plan,
    ``tests/test_hf.py``): loss, gradients and parameters after 3 steps as the single
    process's; a step runs a block's LayerNorm twice (once again in the backward) under
    either, once unchecked."""
    from emit_cases import FAMILIES, load

    from flexsearch.precision import precision as precision_of

    cases = {"core": (("full", "fp32"), ("selective", "bf16-mixed")), "bf16-full": (("full", "bf16-mixed"),)}[part]
    plans = []
    for recompute, precision in cases:
        model, x = load(FAMILIES["gpt"])
        g = trace(model, x, precision=precision)
        cl = Cluster.resolve("cpu", 2)
        s = _megatron_soap(g, recompute)
        plans.append(plan_from(g, cl, s, predict(g, s, CostContext(cl, precision=precision_of(precision))),
                               baselines={}, lower_bound_s=0.0))
    assert [p.recompute for p in plans] == [rc for rc, _ in cases]
    res = run_ranks(check_job, 2, FAMILIES["gpt"], plans, timeout_s=600)
    for rank in range(2):
        for (kind, _s, loss, ref, _params), plan in zip(res[rank], plans, strict=True):
            assert kind == "soap" and loss == pytest.approx(ref, rel=1e-5 if plan.precision == "fp32" else 1e-2)
    plain = plans[0].model_copy(update={"recompute": "none"})
    assert run_ranks(calls_job, 2, FAMILIES["gpt"], [*plans, plain], timeout_s=300)[0] == [2] * len(plans) + [1]


def test_a_weight_read_inside_a_unit_does_not_split_it():
    """Blocks that multiply by a parameter of their own between two layers (a
    ``get_attr`` among the block's nodes): each block is one checkpointed run (it was
    two, and what passed between them was kept, uncounted); fully checkpointed SOAP and
    1F1B plans on 2 gloo ranks compute what the model does."""
    from emit_cases import load

    from flexsearch.emit.recompute import unit_runs
    from flexsearch.graph.lift import lift
    from flexsearch.strategy.kinds import Soap
    from flexsearch.strategy.space import Space

    spec = "tests/data/scaled_blocks.py:model"
    model, x = load(spec)
    g = trace(model, x)
    gm = lift(model, x, {})[0]
    assert any(n.op == "get_attr" for n in gm.graph.nodes)
    assert len(unit_runs(gm, g)) == len(recompute_units(g)) > 1
    cl = Cluster.resolve("cpu", 2)
    ctx = CostContext(cl)
    data = plan_graph(g, cl, kinds=("data",), max_iters=0)
    soap = Soap(Space(g, 2).expand(data.decision_configs()), data.decision_configs(), "full")
    pipe = plan_graph(g, cl, kinds=("pipeline",), max_iters=0)
    plans = [plan_from(g, cl, soap, predict(g, soap, ctx), baselines={}, lower_bound_s=0.0),
             pipe.model_copy(update={"recompute": "full"})]
    res = run_ranks(check_job, 2, spec, plans, timeout_s=600)
    assert [r[0] for r in res[0]] == ["soap", "pipeline"]
    for _kind, _s, loss, ref, _params in res[0]:
        assert loss == pytest.approx(ref, rel=1e-5)


def test_the_models_output_stays_through_a_checkpointed_backward():
    """:func:`~flexsearch.sim.footprint.backward_working` with ``held``: a unit of two
    dropped nodes (rebuilding 5 bytes each, ``C`` = 10) before the node whose output
    (10 bytes, its kept bytes) the model returns. Freed once the backward has passed
    that node, the output makes room for the unit's gradients (``W`` 0); the step's
    caller holds it, so the unit's rebuilt activations and its two gradients (2 + 2)
    come on top of it: ``W`` = 4. The simulator holds a loss operand's output share
    (``tests/test_memory_tracker.py``: Megatron's layout fully checkpointed, against
    torch's allocator)."""
    from flexsearch.sim.footprint import backward_working

    kept, grads, rebuilt, units = [0, 0, 10], [2, 2, 3], [5, 5, 0], [0, 0, -1]
    assert backward_working(kept, grads, rebuilt=rebuilt, units=units) == 0.0
    assert backward_working(kept, grads, rebuilt=rebuilt, units=units, held=[0, 0, 10]) == 4.0
    assert backward_working(kept, grads, rebuilt=rebuilt, units=units, held=[0, 0, 4]) == 0.0  # 6 freed: room
    # unchecked, the returned output's own backward is the peak either way
    assert backward_working([10, 10, 10], [4, 4, 4], held=[0, 0, 10]) == backward_working([10, 10, 10], [4, 4, 4])


def test_selective_caches_a_matmuls_outputs_and_frees_those_no_op_saves():
    """:meth:`Checkpointing.cached_bytes`: a cached op keeps its outputs; its unit's
    recomputation rebuilds its weights' autocast copy and what it saved beside its
    output, and frees its output when no op saves it (a negative share). A unit that
    frees more than it rebuilds rebuilds nothing (``C`` and ``W`` at least 0), and a
    cached output a stage sends is the one it keeps, counted once."""
    from flexsearch.sim.footprint import backward_working
    from flexsearch.sim.stages import BoundaryCopies

    cp = Checkpointing("selective", (True, False, True, True), (0, 0, 0, 0), (False,) * 4,
                       cached=(False, True, False, False), saved=(True, False, True, True))
    assert Checkpointing("full", (True,), (0,), (False,)).cached == (False,)
    # saved output: 40 stash = 30 output + 10 input copy; unsaved output: nothing rebuilt but the copy
    assert Checkpointing("selective", (False,), (0,), (False,), (True,), (True,)).cached_bytes(0, 40, 5, 30) == (30, 15)
    assert cp.cached_bytes(1, 10, 5, 30) == (30, 5 + 10 - 30)
    # a unit whose rebuilt shares sum below 0 (a cached output freed early): no rise above
    # the kept activations (the unit's sum taken as C, -25, added 25 back: 2, as unchecked)
    assert backward_working([0, 30, 0, 0], [1, 1, 1, 1]) == 2.0
    assert backward_working([0, 30, 0, 0], [1, 1, 1, 1], rebuilt=[0, -25, 0, 0], units=[0, 0, 0, 0]) == 0.0
    costs = [NodeCost(1.0, 2.0, 0.0, 10.0, output_bytes=20.0), NodeCost(1.0, 2.0, 0.0, 10.0, output_bytes=30.0),
             NodeCost(1.0, 2.0, 0.0, 10.0, output_bytes=30.0), NodeCost(1.0, 2.0, 0.0, 10.0, output_bytes=30.0)]
    edges = BoundaryCopies(((),) * 2 + (((1, 30.0, (), 3),),) + ((),) * 2)  # node 1's output crosses 2, unsaved
    first = stage_cost(costs, 0, 2, (0.0, 20.0, 30.0, 30.0, 30.0), recompute=cp, edges=edges)
    assert first.stash_bytes == 30.0  # node 1's cached output, sent: once
    assert first.working_bytes == 10.0  # node 0 rebuilt before node 1 frees 20 of its own


def refused_job(rank: int, world: int, spec: str, plans: list) -> list[str]:
    """Per plan: the ``EmitError`` its emission raises on this rank ('' when none)."""
    from emit_cases import emit_error, with_target

    return [emit_error(with_target(spec)[0], plan) or "" for plan in plans]


def test_the_emitter_recomputes_no_unit_with_an_op_on_part_of_the_devices():
    """A SOAP plan that checkpoints a unit one of whose ops runs on device 0 alone is
    refused on every rank (each rank would rebuild different ops and collectives)."""
    from emit_cases import FAMILIES, load

    from flexsearch.strategy.config import Config
    from flexsearch.strategy.kinds import Soap

    model, x = load(FAMILIES["gpt"])
    g = trace(model, x)
    cl = Cluster.resolve("cpu", 2)
    configs = dict(_megatron_soap(g).configs)
    configs[g.nodes[recompute_units(g)[0].start].name] = Config()  # the first block's first op on device 0
    plans = [plan_from(g, cl, s, predict(g, s, CostContext(cl)), baselines={}, lower_bound_s=0.0)
             for s in (Soap(configs, recompute="full"), Soap(configs))]
    for rank in run_ranks(refused_job, 2, FAMILIES["gpt"], plans, timeout_s=300):
        assert "runs on part of the devices" in rank[0] and rank[1] == ""
