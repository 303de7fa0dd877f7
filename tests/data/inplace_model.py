"""A residual MLP with in-place ops (``ReLU(inplace=True)``, ``+=``), as torchvision's
ResNets write them: the emitter must run ops that modify their input in place."""

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.fc1 = nn.Linear(d, d)
        self.act = nn.ReLU(inplace=True)
        self.fc2 = nn.Linear(d, d)

    def forward(self, x):
        out = self.fc2(self.act(self.fc1(x)))
        out += x
        return self.act(out)


def model():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(inplace=True), Block(32), Block(32), nn.Linear(32, 8))
    return net, (torch.randn(8, 16),)
