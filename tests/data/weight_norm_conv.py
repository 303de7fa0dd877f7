"""A convolution under a ``weight_norm`` parametrization (as Wav2Vec2's positional
convolution and many audio and GAN models have): its weight is computed from two
parameters by a submodule each call. Tracing failed (the FLOP counter's module tracker
hooked the parameters, leaves, which autograd.grad refuses)."""

import torch
from torch import nn


class WN(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.conv = nn.utils.parametrizations.weight_norm(nn.Conv1d(16, 16, 3, padding=1), dim=2)
        self.out = nn.Linear(16, 4)
    def forward(self, x):
        h = self.inp(x)
        h = h + self.conv(h.transpose(1, 2)).transpose(1, 2)
        return self.out(h).mean(1)
def model():
    torch.manual_seed(0)
    return WN(), (torch.randn(4, 6, 8),)
