"""A non-editable install works: the wheel carries the hardware presets, efficiency
factors and calibration, and plans from another directory."""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys

from conftest import ROOT

MODEL = """
import torch
from torch import nn

def build_model():
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)), (torch.randn(16, 32),)
"""


def test_wheel_installs_and_plans(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(wheels), str(ROOT)], check=True, capture_output=True, text=True, timeout=300)
    wheel = next(wheels.glob("flexsearch-*.whl"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    # the dependencies (torch, ortools, pydantic, ...) from this environment, not flexsearch itself:
    # a directory named in a .pth file is on the path, but its own .pth files (the editable install's) are not read
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    with open(os.path.join(purelib, "deps.pth"), "w") as f:
        f.write("\n".join(site.getsitepackages()) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index", "-q",
                    str(wheel)], check=True, capture_output=True, text=True, timeout=300)
    work = tmp_path / "elsewhere"
    work.mkdir()
    (work / "model.py").write_text(MODEL)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    where = subprocess.run([str(py), "-c", "import flexsearch; print(flexsearch.__file__)"], cwd=work, env=env,
                           check=True, capture_output=True, text=True).stdout
    assert str(venv) in where and str(ROOT) not in where  # the installed copy, not the source tree
    out = subprocess.run([str(venv / "bin" / "flexsearch"), "plan", "model.py", "--devices", "2", "--cluster", "cpu",
                          "--max-iters", "5", "--json"], cwd=work, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads(out.stdout)
    assert summary["devices"] == 2 and summary["iteration_time_s"] > 0
    listed = subprocess.run([str(venv / "bin" / "flexsearch"), "cluster"], cwd=work, env=env, capture_output=True,
                            text=True, timeout=120)
    assert listed.returncode == 0 and "dgx-h100" in listed.stdout
