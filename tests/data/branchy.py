"""A model with two constructs no tracer can follow (decisions on tensor values), for the
test that every unsupported line is reported at once."""

import torch
from torch import nn


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        x = self.a(x)
        if x.sum() > 0:  # a decision on a tensor's value
            x = x * 2
        x = self.b(x)
        n = int(x.abs().max().item())  # a Python number out of a tensor
        return x[:, : n + 1]


def build_model():
    return Branchy(), (torch.randn(4, 8),)
