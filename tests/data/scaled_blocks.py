"""Repeated blocks that read a parameter of their own between two layers (``x *
self.gain``: a ``get_attr`` in the middle of the block's nodes under symbolic tracing),
for activation checkpointing, whose units are the blocks."""

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.gain = nn.Parameter(torch.ones(2 * width))
        self.down = nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)) * self.gain)


class Scaled(nn.Module):
    def __init__(self, width: int = 16, depth: int = 3):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 4)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def model():
    torch.manual_seed(0)
    return Scaled(), (torch.randn(8, 16),)
