"""Shared fixtures: the repo root and helpers to write model files for tests."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent


def pytest_configure(config) -> None:
    """Files this machine wrote (``~/.flexsearch``: a calibration, measured presets)
    must not change what the tests see: every test process, and the rank processes it
    spawns, use an empty machine directory instead."""
    import os
    import tempfile

    os.environ["FLEXSEARCH_HOME"] = tempfile.mkdtemp(prefix="flexsearch-home-")


@pytest.fixture
def root() -> Path:
    return ROOT


@pytest.fixture
def model_file(tmp_path):
    """Write a model file from source text and return its path."""

    def write(source: str, name: str = "model.py") -> Path:
        path = tmp_path / name
        path.write_text(textwrap.dedent(source))
        return path

    return write


@pytest.fixture
def ctrl_c_in_search(monkeypatch):
    """Ctrl-C lands inside the MCMC loop: its cost function raises KeyboardInterrupt on
    the 15th call."""
    import flexsearch.search.mcmc as mcmc

    real, calls = mcmc.cost_of, []

    def cost_then_ctrl_c(sim):
        calls.append(1)
        if len(calls) == 15:
            raise KeyboardInterrupt
        return real(sim)

    monkeypatch.setattr(mcmc, "cost_of", cost_then_ctrl_c)


def reference_flops(model, inputs) -> int:
    """FlopCounterMode over one whole forward, on meta copies of the state and inputs
    (nothing is computed), with the math attention backend the tracer also counts."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    def meta(t):
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta") if torch.is_tensor(t) else t

    state = {k: meta(v) for k, v in list(model.named_parameters()) + list(model.named_buffers())}
    args = tuple(meta(x) for x in inputs)
    was = model.training
    model.train()
    try:
        with sdpa_kernel([SDPBackend.MATH]), FlopCounterMode(display=False) as counter:
            torch.func.functional_call(model, state, args)
    finally:
        model.train(was)
    return counter.get_total_flops()


class Branchy(nn.Module):
    """Two branches side by side, joined by an add."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 32)
        self.c = nn.Linear(32, 32)
        self.d = nn.Linear(32, 8)

    def forward(self, x):
        h = torch.relu(self.a(x))
        return self.d(torch.relu(self.b(h)) + torch.tanh(self.c(h)))
