"""An MLP with dropout active in training: each rank draws its own masks, so an emitted
plan cannot reproduce the single-process step; `flexsearch verify` must say it differs."""

import torch
from torch import nn


def build_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 4))
    return model, (torch.randn(8, 16),)
