"""Whose calibration a prediction uses: the one-line warning when this host's devices
are predicted with no calibration or another host's, and "within noise" when two
predictions differ by less than the calibration's measured step spread."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

import flexsearch
from flexsearch.api import calibration_warning
from flexsearch.cli import app
from flexsearch.cost import profiler
from flexsearch.cost.calibration import host_warning, load_calibration_file, within_noise
from flexsearch.cost.hardware import Cluster
from flexsearch.errors import CalibrationWarning

CPU = Cluster.resolve("cpu", 2)
BUILTIN = load_calibration_file().devices[CPU.device.name]
ELSEWHERE = {"cpu": "Some Other CPU 9000", "cores": 64, "torch": "2.13.0+cpu"}


def _here() -> dict:
    h = BUILTIN.host
    return {"cpu": h.cpu, "cores": h.cores, "torch": h.torch}


def test_host_warning_names_the_problem_and_the_fix():
    assert host_warning("dev", BUILTIN, _here()) is None
    other = host_warning("dev", BUILTIN, ELSEWHERE)
    assert other is not None and "\n" not in other
    assert BUILTIN.host.cpu in other and "Some Other CPU 9000" in other and "flexsearch calibrate" in other
    missing = host_warning("dev", None, ELSEWHERE)
    assert missing.startswith("no calibration of dev") and "flexsearch calibrate" in missing
    unrecorded = host_warning("dev", BUILTIN.model_copy(update={"host": None}), ELSEWHERE)
    assert "does not say which host" in unrecorded


def test_only_this_hosts_devices_are_warned_about(monkeypatch, tmp_path):
    monkeypatch.setenv("FLEXSEARCH_HOME", str(tmp_path))  # no calibration of this machine's: the built-in one
    monkeypatch.setattr(profiler, "host_info", lambda: ELSEWHERE)
    assert "another host" in calibration_warning("auto", CPU)
    assert calibration_warning(None, CPU) is None  # asked for no calibration: nothing to warn about
    assert calibration_warning("auto", Cluster.resolve("dgx-h100", 8)) is None  # not this host's devices
    monkeypatch.setattr(profiler, "host_info", _here)
    assert calibration_warning("auto", CPU) is None


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)), (torch.randn(32, 64),)


def test_plan_and_simulate_warn_once_in_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("FLEXSEARCH_HOME", str(tmp_path))
    monkeypatch.setattr(profiler, "host_info", lambda: ELSEWHERE)
    model, x = _mlp()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        p = flexsearch.plan(model, x, devices=2, cluster="cpu", max_iters=0, decentralized=False, precision="fp32")
    mine = [w for w in caught if issubclass(w.category, CalibrationWarning)]
    assert len(mine) == 1 and "\n" not in str(mine[0].message)
    graph = flexsearch.trace(model, x)
    with pytest.warns(CalibrationWarning, match="another host"):
        flexsearch.simulate(graph, p)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CalibrationWarning)
        flexsearch.plan(model, x, devices=8, cluster="dgx-h100", max_iters=0)  # an accelerator: no warning


def test_cli_plan_warns_in_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("FLEXSEARCH_HOME", str(tmp_path))
    monkeypatch.setattr(profiler, "host_info", lambda: ELSEWHERE)
    res = CliRunner().invoke(app, ["plan", "benchmarks/models/mlp.py:mlp_tiny", "--devices", "2", "--cluster", "cpu",
                                   "--max-iters", "0", "--json"])
    assert res.exit_code == 0, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("warning:")]
    assert len(lines) == 1 and "another host" in lines[0] and "flexsearch calibrate" in lines[0]
    json.loads(res.stdout)  # the summary on stdout is untouched


def test_within_noise():
    assert within_noise(1.0, 1.04, 0.05) and within_noise(1.04, 1.0, 0.05) and not within_noise(1.0, 1.06, 0.05)
    assert not within_noise(1.0, 1.001, None) and not within_noise(1.0, 1.0, 0.0)


def test_plan_says_which_baselines_are_within_noise():
    model, x = _mlp()
    p = flexsearch.plan(model, x, devices=2, cluster="cpu", max_iters=0, decentralized=False, calibration=None)
    assert p.noise is None and p.within_noise == ()
    t = p.predicted.iteration_time_s
    q = p.model_copy(update={"noise": 0.05, "baselines": {"near": t * 1.04, "far": t * 1.2}})
    assert q.within_noise == ("near",)
    from flexsearch.tables import plan_summary, plan_table

    summary = plan_summary(q, None)
    assert summary["within_noise"] == ["near"] and summary["noise"] == 0.05
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(plan_table(q, None))
    text = console.export_text()
    assert "within noise" in text.split("baseline near")[1].splitlines()[0]
    assert "within noise" not in text.split("baseline far")[1].splitlines()[0]
