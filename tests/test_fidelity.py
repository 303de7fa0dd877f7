"""The fidelity benchmark end to end on one small case (plan -> emit -> run -> compare),
and the model pieces it calibrates: the calibration file, microbatch profile lookups,
Kendall's tau. Not timed: the numbers depend on the machine and its load."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import fidelity  # noqa: E402

from flexsearch.cost.calibration import load_calibration  # noqa: E402
from flexsearch.cost.compute import Partition  # noqa: E402
from flexsearch.cost.hardware import Cluster  # noqa: E402
from flexsearch.cost.profiler import ProfileDB, ProfileEntry, ProfileFile, profile_key  # noqa: E402
from flexsearch.graph.microbatch import microbatch_graph  # noqa: E402
from flexsearch.graph.tracer import trace  # noqa: E402
from flexsearch.sim.simulator import Simulator  # noqa: E402
from flexsearch.strategy.space import Space  # noqa: E402


def test_one_case_end_to_end(tmp_path):
    """A data-parallel plan of a small MLP: planned with measured op costs, emitted on two
    gloo ranks, three steps run; prediction and measurement both recorded and positive."""
    row = fidelity.run_case("deep8", "data", ranks=2, threads=1, steps=3, warmup=2,
                            profile_path=tmp_path / "profile.json", retries=2, max_wait_s=0, timeout_s=240)
    assert row.error == "", row.error
    assert row.plan == "ddp"
    assert row.predicted_s > 0 and row.measured_s > 0
    assert row.predicted_bytes > 0 and row.measured_bytes > 0
    assert len(row.per_rank_s) == 2 and all(t > 0 for t in row.per_rank_s)
    assert math.isfinite(row.time_error) and math.isfinite(row.memory_error)
    assert (tmp_path / "profile.json").exists()  # the op profile the prediction used
    line = " ".join(f"{k}={v:.3f}" for k, v in fidelity.summary([row]).items())
    assert line.startswith("median_error=") and "memory_median_error=" in line and "kendall_tau=" in line


def test_kendall_tau():
    assert fidelity.kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert fidelity.kendall_tau([1, 2, 3, 4], [40, 30, 20, 10]) == pytest.approx(-1.0)
    assert fidelity.kendall_tau([1, 2, 3], [1, 3, 2]) == pytest.approx(1 / 3)
    assert math.isnan(fidelity.kendall_tau([1.0], [2.0]))


def test_parse_cases():
    assert fidelity.parse_cases("mlp:data+soap,gpt:gpipe") == [("mlp", "data"), ("mlp", "soap"), ("gpt", "gpipe")]
    assert len(fidelity.parse_cases(None)) == len(fidelity.CASES) * len(fidelity.KINDS)
    with pytest.raises(SystemExit):
        fidelity.parse_cases("nosuchmodel")


def test_calibration_applies_to_its_device_only():
    """The cpu preset's device is calibrated (costmodels/calibration.json); GPU presets
    are not, so their predictions are the uncalibrated model's."""
    cpu = Cluster.resolve("cpu", 2)
    cal = load_calibration(cpu.device.name)
    if cal is None:
        pytest.skip("no calibration for this machine's cpu preset (run flexsearch calibrate)")
    assert load_calibration(Cluster.resolve("dgx-h100", 8).device.name) is None
    model, x, _ = fidelity.build("deep8")
    graph = trace(model, x)
    space = Space(graph, 2)
    configs = space.expand({u.name: space.data_parallel(u) for u in space.units})
    plain = Simulator(graph, cpu).simulate(configs)
    calibrated = Simulator(graph, cpu, calibration=cal).simulate(configs, ddp=True)
    assert calibrated.iteration_time_s > plain.iteration_time_s  # per-step costs of the real runtime
    assert calibrated.peak_memory_bytes > plain.peak_memory_bytes  # DDP's buckets, runtime buffers


def test_microbatch_nodes_use_the_sample_split_measurements():
    """A microbatch graph's node keeps the whole node's signature; its measured time is
    the whole node's sample split, not the whole batch's."""
    model, x, _ = fidelity.build("deep8")
    graph = trace(model, x)
    node = next(n for n in graph.nodes if n.kind == "linear")
    db = ProfileDB(ProfileFile(device="dev"))
    db.put(profile_key(node, Partition(), "float32", "dev"),
           ProfileEntry(forward_s=4.0, backward_s=8.0, repeats=1, node_bytes=node.bytes_written))
    db.put(profile_key(node, Partition(sample=2), "float32", "dev"),
           ProfileEntry(forward_s=2.5, backward_s=5.0, repeats=1, node_bytes=node.bytes_written))
    db.put(profile_key(node, Partition(sample=4), "float32", "dev"),
           ProfileEntry(forward_s=1.5, backward_s=3.0, repeats=1, node_bytes=node.bytes_written))
    micro = microbatch_graph(graph, 2).node(node.name)
    assert db.lookup(node, Partition(), "dev", "float32") == (4.0, 8.0)
    assert db.lookup(micro, Partition(), "dev", "float32") == (2.5, 5.0)
    assert db.lookup(micro, Partition(sample=2), "dev", "float32") == (1.5, 3.0)
    assert db.lookup(micro, Partition(sample=4), "dev", "float32") is None  # sample 8: not measured
    fwd, bwd = db.estimate(micro, Partition(sample=4), "dev", "float32")  # t = a + b / d through 2 and 4
    assert fwd == pytest.approx(1.0) and bwd == pytest.approx(2.0)
    assert db.aliased("cluster-device").lookup(node, Partition(), "cluster-device", "float32") == (4.0, 8.0)


def test_tau_over_the_pairs_the_model_separates_and_the_worst_run():
    """Two plans predicted 1% apart (within a 5% noise) measured in the other order do
    not count against the ranking; the plain tau over all pairs still shows them."""
    rows = [fidelity.Row("c", k, k, predicted_s=p, measured_s=m, predicted_bytes=1.0, measured_bytes=1.0)
            for k, p, m in (("a", 1.0, 1.1), ("b", 1.01, 1.0), ("c", 2.0, 2.1))]
    s = fidelity.summary(rows, noise=0.05)
    assert s["kendall_tau"] == pytest.approx(1.0) and s["kendall_tau_all"] == pytest.approx(1 / 3)
    assert s["separated"] == pytest.approx(2 / 3)
    assert fidelity.summary(rows)["kendall_tau"] == pytest.approx(1 / 3)  # no noise: every pair counts
    w = fidelity.worst([s, {**s, "max_error": 9.0, "kendall_tau": 0.5}])
    assert w["max_error"] == 9.0 and w["kendall_tau"] == 0.5 and w["median_error"] == s["median_error"]
