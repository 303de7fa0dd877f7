"""`flexsearch bench`: the plan-cost regression check fails when the cost model gets
worse, reports improvements, and rewrites the baseline only on purpose."""

from __future__ import annotations

import dataclasses
import json

import pytest
from typer.testing import CliRunner

import flexsearch.sim.context as taskgraph
from flexsearch import bench as b
from flexsearch.cli import app, main

TINY = (  # compute-bound enough that 2x compute is > 1 % slower and 0.5x faster
    b.Case("benchmarks/models/gpt.py:gpt_tiny", "cpu", 2),
    b.Case("benchmarks/models/rnn.py:rnnlm_tiny", "cpu", 2),
)
ITERS = 30


def scale_compute(monkeypatch, factor: float) -> None:
    """Every op's forward and backward time times ``factor`` (the cost model changed)."""
    real = taskgraph.op_cost

    def scaled(*args, **kw):
        c = real(*args, **kw)
        return dataclasses.replace(c, forward_s=c.forward_s * factor, backward_s=c.backward_s * factor)

    monkeypatch.setattr(taskgraph, "op_cost", scaled)


@pytest.fixture(scope="module")
def recorded():
    return b.make_baseline(b.run_matrix(TINY, max_iters=ITERS), max_iters=ITERS)


def test_unchanged_cost_model_passes(recorded):
    again = b.run_matrix(TINY, max_iters=ITERS)
    cmp = b.compare(again, recorded, max_iters=ITERS)
    assert [r.status for r in cmp.rows] == ["same", "same"] and not cmp.failed
    assert again == recorded.entries  # deterministic: fixed seed and iteration budget


def test_slower_cost_model_fails_the_check(recorded, monkeypatch):
    scale_compute(monkeypatch, 2.0)
    cmp = b.compare(b.run_matrix(TINY, max_iters=ITERS), recorded, max_iters=ITERS)
    assert cmp.failed and cmp.count("regressed") == len(TINY)
    assert all(r.change > 0.01 for r in cmp.rows)


def test_faster_cost_model_is_reported_as_improved(recorded, monkeypatch):
    scale_compute(monkeypatch, 0.5)
    cmp = b.compare(b.run_matrix(TINY, max_iters=ITERS), recorded, max_iters=ITERS)
    assert not cmp.failed and cmp.count("improved") == len(TINY)


def _entry(t: float | None) -> b.BenchEntry:
    return b.BenchEntry(model="m.py:x", cluster="c", devices=2, kind=None if t is None else "soap",
                        iteration_time_s=t)


@pytest.mark.parametrize(
    ("before", "now", "status"),
    [
        (1.0, 1.0, "same"),
        (1.0, 1.009, "slower <1%"),
        (1.0, 1.011, "regressed"),
        (1.0, 0.99, "improved"),
        (1.0, None, "regressed"),  # infeasible where it fitted
        (None, 1.0, "improved"),  # fits where it did not
        (None, None, "same"),
    ],
)
def test_classify(before, now, status):
    assert b.classify(_entry(now), _entry(before)) == status
    assert b.classify(_entry(now), None) == "new"


def test_stale_or_incomplete_baseline_fails(recorded):
    results = recorded.entries
    assert b.compare(results, recorded, max_iters=ITERS + 1).failed  # another budget
    partial = recorded.model_copy(update={"entries": recorded.entries[:1]})
    cmp = b.compare(results, partial, max_iters=ITERS)
    assert cmp.failed and cmp.rows[1].status == "new"


def test_checked_in_baseline_covers_the_matrix():
    baseline = b.load_baseline()
    assert baseline is not None, "benchmarks/baseline.json: run `flexsearch bench --update`"
    assert (baseline.seed, baseline.max_iters) == (b.SEED, b.MAX_ITERS)
    assert [e.key for e in baseline.entries] == [c.key for c in b.MATRIX]


def test_cli_update_check_and_regression(tmp_path, monkeypatch):
    monkeypatch.setattr(b, "MATRIX", TINY)
    monkeypatch.setattr(b, "MAX_ITERS", ITERS)
    path = tmp_path / "baseline.json"
    runner = CliRunner()
    r = runner.invoke(app, ["bench", "--check", "--baseline", str(path)])
    assert r.exit_code != 0 and not path.exists()  # nothing to check against
    r = runner.invoke(app, ["bench", "--update", "--baseline", str(path)])
    assert r.exit_code == 0, r.output
    saved = json.loads(path.read_text())
    assert saved["max_iters"] == ITERS and len(saved["entries"]) == len(TINY)
    assert "baseline written" in r.stdout and r.stdout.strip().splitlines()[-1].startswith("cases=2 ")
    r = runner.invoke(app, ["bench", "--check", "--baseline", str(path)])
    assert r.exit_code == 0, r.output
    assert "regressed=0" in r.stdout and "gpt_tiny" in r.stdout
    before = path.read_bytes()

    scale_compute(monkeypatch, 2.0)
    r = runner.invoke(app, ["bench", "--check", "--baseline", str(path)])
    assert r.exit_code == 1
    assert "regressed=2" in r.stdout and "bench --check failed" in r.stderr and "--update" in r.stderr
    assert path.read_bytes() == before  # --check never writes
    assert main(["bench", "--check", "--baseline", str(path)]) == 1  # the console script's exit code

    scale_compute(monkeypatch, 0.25)  # on top of 2x: 0.5x the recorded model
    r = runner.invoke(app, ["bench", "--baseline", str(path)])
    assert r.exit_code == 0
    assert r.stdout.count("improved: ") == 2 and "improved=2" in r.stdout
    assert path.read_bytes() == before  # without --update the baseline stays


@pytest.mark.parametrize(
    ("args", "content", "needle"),
    [
        (["--check", "--update"], None, "pass one"),
        (["--check"], None, "no baseline"),
        (["--check"], "{broken", "not a bench baseline"),
        (["--check"], '{"version": 1, "seed": 0, "entries": []}', "not a bench baseline"),
    ],
)
def test_cli_bad_input(tmp_path, capsys, args, content, needle):
    path = tmp_path / "baseline.json"
    if content is not None:
        path.write_text(content)
    assert main(["bench", *args, "--baseline", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and needle in err


def test_ctrl_c_aborts_the_bench_instead_of_recording_a_cut_search(ctrl_c_in_search):
    with pytest.raises(KeyboardInterrupt):
        b.run_matrix(TINY, max_iters=ITERS)


@pytest.mark.slow
def test_full_bench_check_passes():
    run = b.bench()
    assert not run.comparison.failed, [(r.now.key, r.status) for r in run.comparison.rows]
