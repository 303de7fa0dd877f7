"""Plans of a named kind (``plan_graph(kinds=...)``, ``plan --kind``), the strategy values
they are made of, the one prediction entry point, and the FSDP units the simulator and
the emitter share."""

from __future__ import annotations

import pytest
import torch
from conftest import ROOT
from torch import nn

import flexsearch
from flexsearch.cost.calibration import load_calibration
from flexsearch.cost.hardware import Cluster
from flexsearch.emit.data import shard_units
from flexsearch.errors import PlanKindError
from flexsearch.graph.modules import module_facts
from flexsearch.graph.tracer import trace
from flexsearch.search.planner import check_kinds, plan_graph
from flexsearch.sim.context import CostContext
from flexsearch.sim.predict import predict
from flexsearch.sim.simulator import Simulator
from flexsearch.strategy.fsdp import ROOT as ROOT_UNIT
from flexsearch.strategy.fsdp import fsdp_units, node_units
from flexsearch.strategy.kinds import (
    KINDS,
    PIPELINE_SHARDINGS,
    DataParallel,
    Decentralized,
    Pipelined,
    Soap,
)

GPT = str(ROOT / "benchmarks/models/gpt.py:gpt_tiny")
MLP = str(ROOT / "benchmarks/models/mlp.py:mlp_tiny")
RNN = str(ROOT / "benchmarks/models/rnn.py:rnnlm_tiny")


def graph_of(spec: str):
    model, x = flexsearch.load_model(spec)
    return model, trace(model, x, name=spec)


@pytest.fixture(scope="module")
def gpt():
    return graph_of(GPT)[1]


@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_gives_a_plan_of_that_kind(gpt, kind):
    cl = Cluster.resolve("cpu", 4)
    plan = plan_graph(gpt, cl, kinds=(kind,), max_iters=20)
    assert plan.kind == {"fsdp": "data"}.get(kind, kind)
    if kind in ("pipeline", "hybrid"):  # a pipeline may shard over a stage's replicas
        assert plan.shard in PIPELINE_SHARDINGS
    else:
        assert (plan.shard != "none") == (kind == "fsdp")
    if plan.kind == "data" and plan.shard in ("zero2", "zero3", "hsdp"):
        assert plan.fsdp_units == fsdp_units(gpt.modules)
    # the plan re-predicts to the number it records (one entry point, same context)
    again = flexsearch.simulate(gpt, plan, calibration=None)
    assert again.iteration_time_s == pytest.approx(plan.predicted.iteration_time_s, rel=1e-12)
    assert isinstance(plan.strategy(gpt), (DataParallel, Soap, Pipelined, Decentralized))


def test_soap_kind_is_not_plain_data_parallelism(gpt):
    """Restricted to SOAP where tensor splits pay (2 CPU processes, the tiny GPT), the
    search returns them, not the data-parallel decisions (which are a SOAP configuration
    too, priced as DTensor runs them, and returned where they are the fastest)."""
    cl = Cluster.resolve("cpu", 2)
    plan = plan_graph(gpt, cl, kinds=("soap",), max_iters=30)
    data = plan_graph(gpt, cl, kinds=("data",), max_iters=0)
    assert plan.kind == "soap" and plan.decisions != data.decisions


def test_a_kind_the_model_lacks_says_why():
    _, mlp = graph_of(MLP)
    with pytest.raises(PlanKindError, match="no hybrid plan: tensor parallelism inside a stage needs a transformer"):
        plan_graph(mlp, Cluster.resolve("cpu", 2), kinds=("hybrid",), max_iters=0)
    with pytest.raises(PlanKindError, match="no decentralized plan on one device"):
        plan_graph(mlp, Cluster.resolve("cpu", 1), kinds=("decentralized",), max_iters=0)
    with pytest.raises(ValueError, match="unknown plan kind 'zero'"):
        check_kinds(["zero"])


def test_kinds_restrict_the_default_choice(gpt):
    """The default search's choice among all kinds is the fastest of the per-kind bests."""
    cl = Cluster.resolve("pipedream-a", 4)
    best = plan_graph(gpt, cl, max_iters=40, decentralized=False)
    times = {k: plan_graph(gpt, cl, kinds=(k,), max_iters=40).predicted.iteration_time_s
             for k in ("data", "soap", "pipeline")}
    assert best.predicted.iteration_time_s == pytest.approx(min(times.values()), rel=1e-9)


def test_the_cost_context_reads_no_calibration_by_itself(gpt):
    """An explicit context without a calibration is uncalibrated, whatever is on disk;
    the API reads the device's calibration only when asked ("auto", its default)."""
    cl = Cluster.resolve("cpu", 2)
    cal = load_calibration(cl.device.name)
    assert cal is not None  # the built-in file has the cpu preset's device
    assert CostContext(cl).calibration is None
    assert Simulator(gpt, cl).ctx.calibration is None
    plan = plan_graph(gpt, cl, kinds=("data",), max_iters=0, calibration=cal)
    calibrated = flexsearch.simulate(gpt, plan)  # "auto": the calibration on disk
    plain = flexsearch.simulate(gpt, plan, calibration=None)
    assert calibrated.iteration_time_s == pytest.approx(plan.predicted.iteration_time_s, rel=1e-12)
    assert plain.iteration_time_s != pytest.approx(calibrated.iteration_time_s)


def test_predict_rejects_a_simulator_of_another_context(gpt):
    cl = Cluster.resolve("cpu", 2)
    plan = plan_graph(gpt, cl, kinds=("data",), max_iters=0)
    strategy = plan.strategy(gpt)
    ctx = CostContext(cl)
    with pytest.raises(ValueError, match="another graph or cost context"):
        predict(gpt, strategy, ctx, simulator=Simulator(gpt, CostContext(cl)))
    assert predict(gpt, strategy, ctx, simulator=Simulator(gpt, ctx)).iteration_time_s == \
        predict(gpt, strategy, ctx).iteration_time_s


class Tied(nn.Module):
    """A list of blocks, a Sequential, a tied embedding/output pair and a bare parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(2)])
        self.extra = nn.ModuleDict({"a": nn.Linear(8, 8)})
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return self.head(self.extra["a"](h)) * self.scale


class Wrapped(nn.Module):
    """A Hugging Face causal LM's shape: a body (``model``) around an embedding, a list of
    blocks (each with a list of its own) and a norm, beside an output layer."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.embed = nn.Embedding(10, 8)
        self.model.layers = nn.ModuleList([nn.Module() for _ in range(2)])
        for layer in self.model.layers:
            layer.sub = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.model.norm = nn.LayerNorm(8)
        self.lm_head = nn.Linear(8, 10)

    def forward(self, x):
        h = self.model.embed(x)
        for layer in self.model.layers:
            h = layer.sub[1](layer.sub[0](h))
        return self.lm_head(self.model.norm(h))


@pytest.mark.parametrize("spec", [GPT, MLP, RNN, "tied", "wrapped"])
def test_fsdp_units_are_the_emitters(spec):
    """The units recorded from the graph are the modules the emitter wraps: top-level
    modules with parameters, a container's items separately (whatever they hold), the
    children of a module around a container (a Hugging Face body: each decoder layer a
    unit, not the whole stack), tied ones left to the root."""
    if spec in ("tied", "wrapped"):
        model = Tied() if spec == "tied" else Wrapped()
        graph = trace(model, (torch.randint(0, 10, (4, 3)),))
    else:
        model, graph = graph_of(spec)
    units = fsdp_units(graph.modules)
    assert units == fsdp_units(module_facts(model))
    assert [id(m) for m in shard_units(model, units)] == [id(m) for m in shard_units(model)]
    if spec == "tied":
        assert units == ("blocks.0", "blocks.1", "extra.a")  # emb and head share a weight: root
    if spec == "wrapped":
        assert units == ("model.embed", "model.layers.0", "model.layers.1", "model.norm", "lm_head")
    by_node = node_units(graph, units)
    for n in graph.nodes:
        if n.module.startswith("blocks.1"):
            assert by_node[n.name] == "blocks.1"
        if n.module in ("emb", "head"):
            assert by_node[n.name] == ROOT_UNIT
