"""An MLP with a leftover layer its forward never calls (and so never trains): a
data-parallel plan must run without it (DDP fails a step that waits for a gradient
that never comes)."""

import torch
from torch import nn


class Leftover(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.unused = nn.Linear(32, 32)  # never called
        self.b = nn.Linear(32, 8)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def model():
    torch.manual_seed(0)
    return Leftover(), (torch.randn(8, 16),)
