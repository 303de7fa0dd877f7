"""Every benchmark's ``--quick`` mode runs to the end and prints its headline figures as
``key=value`` pairs on its last line, so a benchmark that breaks fails CI."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from conftest import ROOT

BENCHMARKS = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py") if p.name != "zoo.py")
PAIR = re.compile(r"^[A-Za-z0-9_]+=\S+$")


def test_every_benchmark_is_listed():
    """A new benchmark script is run below (zoo.py is the model registry, not a benchmark)."""
    assert set(BENCHMARKS) >= {"costmodel_accuracy.py", "decentralized.py", "fidelity.py", "gpu_step.py", "pipeline_speed.py",
                               "plan_quality.py", "search_speed.py", "trace_speed.py"}


@pytest.mark.parametrize("script", BENCHMARKS)
def test_quick_mode_runs(script, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--quick"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"{script} --quick failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    last = out.stdout.strip().splitlines()[-1]
    pairs = last.split()
    assert pairs and all(PAIR.match(p) for p in pairs), f"{script}: last line is not key=value pairs: {last!r}"
