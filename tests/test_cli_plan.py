"""`flexsearch plan`, `simulate` and `show`: summary, --json, files, bad input."""

from __future__ import annotations

import json

import pytest
from conftest import ROOT
from test_cli import run

from flexsearch.search.planner import ASYNCHRONOUS_BASELINES

TINY = str(ROOT / "benchmarks/models/alexnet.py:alexnet_tiny")


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    d = tmp_path_factory.mktemp("plan")
    out, tl = d / "plan.json", d / "timeline.json"
    r = run("plan", TINY, "--devices", "4", "--cluster", "flexflow-k80", "--max-iters", "60",
            "--out", str(out), "--trace", str(tl), "--json")
    assert r.returncode == 0, r.stderr
    return d, out, tl, json.loads(r.stdout)


def test_plan_json_summary_and_files(planned):
    _, out, tl, summary = planned
    for key in ("kind", "devices", "iteration_time_s", "peak_memory_bytes", "lower_bound_s",
                "baselines", "search_time_s"):
        assert key in summary
    assert summary["devices"] == 4 and "data" in summary["baselines"]
    sync = [t for k, t in summary["baselines"].items() if k not in ASYNCHRONOUS_BASELINES]
    assert summary["iteration_time_s"] <= min(sync) * (1 + 1e-9)
    assert summary["lower_bound_s"] <= summary["iteration_time_s"]
    plan = json.loads(out.read_text())
    assert plan["version"] == 1 and plan["kind"] == summary["kind"]
    events = json.loads(tl.read_text())["traceEvents"]
    assert any(e["ph"] == "X" for e in events)


def test_plan_is_reproducible(planned, tmp_path):
    _, out, _, _ = planned
    again = tmp_path / "again.json"
    r = run("plan", TINY, "--devices", "4", "--cluster", "flexflow-k80", "--max-iters", "60",
            "--out", str(again))
    assert r.returncode == 0, r.stderr
    assert "predicted iteration" in r.stdout and "speedup over data parallel" in r.stdout
    assert again.read_bytes() == out.read_bytes()


def test_simulate_and_show(planned):
    _, out, _, summary = planned
    r = run("simulate", str(out), "--json")
    assert r.returncode == 0, r.stderr
    sim = json.loads(r.stdout)
    assert sim["iteration_time_s"] == pytest.approx(summary["iteration_time_s"], rel=1e-12)
    r = run("show", str(out))
    assert r.returncode == 0, r.stderr
    assert "features_0" in r.stdout


def test_plan_refuses_to_overwrite(planned):
    _, out, _, _ = planned
    before = out.read_bytes()
    r = run("plan", TINY, "--devices", "4", "--max-iters", "5", "--out", str(out))
    assert r.returncode == 2 and "--force" in r.stderr
    assert out.read_bytes() == before


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["plan", TINY, "--cluster", "no-such-cluster"], "no-such-cluster"),
        (["plan", TINY, "--devices", "0"], "--devices"),
        (["plan", TINY, "--objective", "speed"], "--objective"),
        (["simulate", "absent.json"], "does not exist"),
        (["show", "absent.json"], "does not exist"),
    ],
)
def test_bad_input_is_one_line_exit_2(args, needle):
    r = run(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in r.stderr


def test_damaged_plan_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    r = run("simulate", str(bad))
    assert r.returncode == 2 and "damaged" in r.stderr
