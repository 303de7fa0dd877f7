"""Multi-layer perceptron: a stack of square Linear layers with ReLU in between.

Model-file convention (DESIGN.md section 3): every builder returns
``(nn.Module, example_inputs)``; dim 0 of the inputs is the global batch of one
training iteration. ``build_model()`` is the headline configuration.

Self-contained on purpose (files are loaded by path): imports only torch.
"""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    """``layers`` Linear layers ``in -> hidden -> ... -> hidden -> out``, ReLU between them."""

    def __init__(self, in_features: int, hidden: int, out_features: int, layers: int) -> None:
        super().__init__()
        if layers < 1:
            raise ValueError("layers must be >= 1")
        dims = [in_features] + [hidden] * (layers - 1) + [out_features]
        mods: list[nn.Module] = []
        for i in range(layers):
            mods.append(nn.Linear(dims[i], dims[i + 1]))
            if i < layers - 1:
                mods.append(nn.ReLU())
        self.net = nn.Sequential(*mods)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def mlp(batch_size: int = 1024, hidden: int = 8192, layers: int = 4):
    """4 Linear layers of 8192x8192 (268M parameters), ReLU between them, batch 1024.

    Synthetic benchmark, no paper: the square-MLP weak-scaling workload commonly used to
    exercise operator (tensor) parallelism (as in FlexFlow/Unity's MLP example). Built on
    the meta device (1 GiB of fp32 weights).
    """
    # Batch 1024: synthetic choice (no paper).
    with torch.device("meta"):
        model = MLP(hidden, hidden, hidden, layers)
        x = torch.randn(batch_size, hidden)
    return model, (x,)


def mlp_tiny(batch_size: int = 16):
    """Tiny MLP for equivalence tests: 16 -> 32 -> 32 -> 32 -> 8 (4 Linear layers), batch 16."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = MLP(16, 32, 8, 4)
        x = torch.randn(batch_size, 16)
    return model, (x,)


def mlp_digits(batch_size: int = 32):
    """MLP for scikit-learn's 8x8 digits: 64 -> 128 -> 128 -> 10 (3 Linear layers), batch 32
    (what ``flexsearch calibrate --convergence`` trains for the MLP family)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = MLP(64, 128, 10, 3)
        x = torch.rand(batch_size, 64)
    return model, (x,)


def build_model():
    """Headline configuration: :func:`mlp`."""
    return mlp()
