"""Plan files: save/load round trip, one-line errors for missing, damaged, newer or
foreign plans, and re-simulation of a saved plan."""

from __future__ import annotations

import functools
import json
import sys

import pytest
import torch
from conftest import ROOT
from torch import nn

sys.path.insert(0, str(ROOT / "benchmarks"))
import zoo  # noqa: E402

import flexsearch  # noqa: E402
from flexsearch import Cluster, Plan, PlanFileError, trace  # noqa: E402
from flexsearch.plan import PLAN_VERSION  # noqa: E402
from flexsearch.strategy.space import Space


@functools.cache
def planned(name: str = "alexnet_tiny", devices: int = 4, cluster: str = "flexflow-k80"):
    model, inputs = zoo.build(name)
    plan = flexsearch.plan(model, inputs, devices=devices, cluster=cluster, max_iters=80, decentralized=False)
    graph = trace(model, inputs, precision=plan.precision)
    return graph, plan


def one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert msg and "\n" not in msg, msg
    return msg


def write_raw(tmp_path, raw) -> str:
    path = tmp_path / "plan.json"
    path.write_text(raw if isinstance(raw, str) else json.dumps(raw))
    return str(path)


# --------------------------------------------------------------------------- round trip


@pytest.mark.parametrize(("name", "devices", "cluster"),
                         [("alexnet_tiny", 4, "flexflow-k80"), ("gpt_tiny", 8, "dgx-h100")])
def test_save_load_round_trip(tmp_path, name, devices, cluster):
    _, plan = planned(name, devices, cluster)
    path = tmp_path / "p.json"
    plan.save(path)
    back = Plan.load(path)
    assert back.model_dump() == plan.model_dump()
    assert back.to_json() == plan.to_json() == path.read_text()
    assert back.version == PLAN_VERSION
    assert back.predicted.iteration_time_s == plan.predicted.iteration_time_s
    assert back.node_configs() == plan.node_configs()
    assert back.decision_configs() == plan.decision_configs()
    assert back.cluster == plan.cluster and back.devices == devices
    # the search time is a runtime attribute: not in the file
    assert plan.search_time_s is not None and back.search_time_s is None
    assert "search_time" not in path.read_text()
    # frozen
    with pytest.raises(Exception):  # noqa: B017 (pydantic's frozen-instance error)
        back.kind = "data"  # type: ignore[misc]


def test_loaded_plan_equals_saved_plan(tmp_path):
    _, plan = planned()
    path = tmp_path / "p.json"
    plan.save(path)
    back = Plan.load(path)
    assert back.to_json() == plan.to_json()
    assert back == plan


def test_save_refuses_to_overwrite_when_asked(tmp_path):
    _, plan = planned()
    path = tmp_path / "p.json"
    plan.save(path)
    plan.save(path)  # overwrite is the default
    with pytest.raises(PlanFileError) as e:
        plan.save(path, overwrite=False)
    assert "exists" in one_line(e)


def test_plan_fields():
    graph, plan = planned()
    assert plan.model == graph.model and plan.graph_fingerprint == graph.fingerprint
    assert set(plan.configs) == {n.name for n in graph.nodes}
    assert set(plan.decisions) == {u.name for u in Space(graph, 4).units}
    assert plan.speedup_over_data == pytest.approx(
        plan.baselines["data"] / plan.predicted.iteration_time_s)
    assert len(plan.predicted.memory_bytes) == len(plan.predicted.compute_s) == 4
    assert plan.predicted.peak_memory_bytes == max(plan.predicted.memory_bytes)


# --------------------------------------------------------------------------- bad files


def test_missing_file(tmp_path):
    with pytest.raises(PlanFileError) as e:
        Plan.load(tmp_path / "nope.json")
    msg = one_line(e)
    assert "does not exist" in msg and "nope.json" in msg


def test_directory_is_not_a_plan(tmp_path):
    with pytest.raises(PlanFileError) as e:
        Plan.load(tmp_path)
    one_line(e)


@pytest.mark.parametrize("text", ["", "{", "not json", '{"version": 1,}', "\x00\x01"])
def test_invalid_json(tmp_path, text):
    with pytest.raises(PlanFileError) as e:
        Plan.load(write_raw(tmp_path, text))
    msg = one_line(e)
    assert "not valid JSON" in msg and "plan.json" in msg


def test_not_utf8(tmp_path):
    path = tmp_path / "plan.json"
    path.write_bytes(b"\xff\xfe\xfa{")
    with pytest.raises(PlanFileError) as e:
        Plan.load(path)
    one_line(e)


@pytest.mark.parametrize("raw", [[], {"model": "x"}, 3, '"plan"', "null"])
def test_not_a_plan(tmp_path, raw):
    with pytest.raises(PlanFileError) as e:
        Plan.load(write_raw(tmp_path, raw))
    assert "no version" in one_line(e)


def _raw() -> dict:
    return json.loads(planned()[1].to_json())


@pytest.mark.parametrize("version", [PLAN_VERSION + 1, 99, "1", 1.5, None])
def test_newer_or_odd_version(tmp_path, version):
    raw = _raw()
    raw["version"] = version
    with pytest.raises(PlanFileError) as e:
        Plan.load(write_raw(tmp_path, raw))
    msg = one_line(e)
    assert "version" in msg
    if version in (PLAN_VERSION + 1, 99):
        assert "upgrade flexsearch" in msg


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("devices", 0, "devices"),
        ("devices", "four", "devices"),
        ("kind", "magic", "kind"),
        ("predicted", "fast", "predicted"),
        ("baselines", [1, 2], "baselines"),
        ("objective", "speed", "objective"),
        ("unknown_field", 1, "unknown_field"),
        ("cluster", {"name": "x"}, "cluster"),
    ],
)
def test_damaged_field(tmp_path, field, value, needle):
    raw = _raw()
    raw[field] = value
    with pytest.raises(PlanFileError) as e:
        Plan.load(write_raw(tmp_path, raw))
    msg = one_line(e)
    assert "damaged" in msg and needle in msg


def test_missing_required_field(tmp_path):
    raw = _raw()
    del raw["graph_fingerprint"]
    with pytest.raises(PlanFileError) as e:
        Plan.load(write_raw(tmp_path, raw))
    assert "graph_fingerprint" in one_line(e)


@pytest.mark.parametrize("table", ["configs", "decisions"])
@pytest.mark.parametrize("text", ["bogus", "s0", "s2.a2", "s2.q2:1", "", "s1.x1"])
def test_bad_config_text(tmp_path, table, text):
    raw = _raw()
    name = next(iter(raw[table]))
    raw[table][name] = text
    with pytest.raises(PlanFileError) as e:
        Plan.load(write_raw(tmp_path, raw))
    msg = one_line(e)
    assert "damaged" in msg and name in msg


# --------------------------------------------------------------------------- simulate


@pytest.mark.parametrize(("name", "devices", "cluster"),
                         [("alexnet_tiny", 4, "flexflow-k80"), ("gpt_tiny", 8, "dgx-h100"),
                          ("mlp_tiny", 2, "cpu")])  # cpu: the calibrated device (DDP buckets)
def test_simulate_reproduces_the_prediction(tmp_path, name, devices, cluster):
    graph, plan = planned(name, devices, cluster)
    path = tmp_path / "p.json"
    plan.save(path)
    for p in (plan, Plan.load(path)):
        sim = flexsearch.simulate(graph, p)
        assert sim.iteration_time_s == plan.predicted.iteration_time_s
        assert sim.memory_bytes == plan.predicted.memory_bytes
        assert sim.compute_s == plan.predicted.compute_s
        assert sim.peak_memory_bytes == plan.predicted.peak_memory_bytes
    # the embedded cluster is used: naming the same preset gives the same result
    again = flexsearch.simulate(graph, plan, cluster=cluster)
    assert again.iteration_time_s == plan.predicted.iteration_time_s
    # a different cluster of the same size predicts a different time
    other = "commodity" if cluster != "commodity" else "dgx-h100"
    assert flexsearch.simulate(graph, plan, cluster=other).iteration_time_s != pytest.approx(
        plan.predicted.iteration_time_s)
    # and the baselines it reports re-simulate too
    from flexsearch.api import resolve_calibration
    from flexsearch.sim.context import CostContext
    from flexsearch.sim.predict import predict
    from flexsearch.strategy import recipes as baselines
    from flexsearch.strategy.kinds import DataParallel

    space = Space(graph, devices)
    cl = Cluster.preset(cluster, devices)
    dp = baselines.data_parallel(space)
    ctx = CostContext(cl, calibration=resolve_calibration("auto", cl))
    assert predict(graph, DataParallel(space.expand(dp), dp), ctx).iteration_time_s == plan.baselines["data"]


def test_simulate_with_another_models_graph():
    _, plan = planned()
    model, inputs = zoo.build("mlp_tiny")
    other = trace(model, inputs)
    with pytest.raises(PlanFileError) as e:
        flexsearch.simulate(other, plan)
    msg = one_line(e)
    assert "made for model" in msg and "flexsearch plan" in msg


def test_simulate_same_architecture_other_shape():
    """Same layers, another batch: another graph (fingerprint), so an error."""

    def build(batch: int):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        return model, (torch.randn(batch, 8),)

    model, inputs = build(8)
    plan = flexsearch.plan(model, inputs, devices=2, cluster="dgx-h100", max_iters=20)
    assert flexsearch.simulate(trace(*build(8), precision=plan.precision), plan).iteration_time_s == (
        plan.predicted.iteration_time_s)
    with pytest.raises(PlanFileError):
        flexsearch.simulate(trace(*build(16)), plan)


def test_simulate_damaged_configs():
    graph, plan = planned()
    # a node without a configuration
    configs = dict(plan.configs)
    configs.pop(next(n.name for n in graph.nodes if n.kind == "linear"))
    broken = plan.model_copy(update={"configs": configs})
    with pytest.raises(PlanFileError) as e:
        flexsearch.simulate(graph, broken)
    assert "no configuration" in one_line(e)
    # an illegal decision (a block past the last device)
    name = next(iter(plan.decisions))
    configs = {**plan.configs, name: "s4@4"}
    decisions = {**plan.decisions, name: "s4@4"}
    broken = plan.model_copy(update={"configs": configs, "decisions": decisions})
    with pytest.raises(PlanFileError) as e:
        flexsearch.simulate(graph, broken)
    assert "not legal" in one_line(e)


@pytest.mark.parametrize("text", ["s1@7", "s8", "s1.x8", "s4@4"])
def test_simulate_rejects_follower_config_outside_the_cluster(tmp_path, text):
    graph, plan = planned()  # 4 devices
    raw = json.loads(plan.to_json())
    raw["configs"]["features_1"] = text  # a ReLU: a follower, not a decision
    path = write_raw(tmp_path, raw)
    with pytest.raises(PlanFileError) as e:
        flexsearch.simulate(graph, Plan.load(path))
    one_line(e)


def test_simulate_rejects_decision_without_config(tmp_path):
    graph, plan = planned()
    raw = json.loads(plan.to_json())
    raw["decisions"]["not_a_node"] = "s1"
    path = write_raw(tmp_path, raw)
    with pytest.raises(PlanFileError) as e:
        flexsearch.simulate(graph, Plan.load(path))
    one_line(e)
