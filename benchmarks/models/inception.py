"""Inception-v3 (Szegedy et al., "Rethinking the Inception Architecture for Computer
Vision", CVPR 2016), input 3x299x299.

Real block structure with parallel branches concatenated on the channel dim:
stem (5 conv + 2 max-pool) -> 3 x InceptionA (35x35) -> InceptionB (grid reduction) ->
4 x InceptionC (17x17, factorised 1x7/7x1 convs) -> InceptionD (grid reduction) ->
2 x InceptionE (8x8, expanded 1x3/3x1 branches) -> global average pool -> Dropout ->
Linear(2048, 1000). Every conv is Conv(bias=False) + BatchNorm(eps=1e-3) + ReLU.
The auxiliary classifier (a training-time side head on the 17x17 grid) is OMITTED.

``width`` scales every channel count (used by the tiny configuration).

Returns logits. Model-file convention (DESIGN.md section 3): every builder returns
``(nn.Module, example_inputs)``; dim 0 of the inputs is the global batch of one training
iteration. ``build_model()`` is the headline configuration.

Self-contained on purpose (files are loaded by path): imports only torch.
"""

from __future__ import annotations

import torch
from torch import nn

# FlexFlow (Jia et al., SysML 2019) benchmarks Inception-v3 with a fixed per-GPU batch
# (64, approx.); global batch = per-GPU batch x the 16 GPUs of its P100 cluster.
FLEXFLOW_PER_GPU_BATCH = 64
FLEXFLOW_GPUS = 16


class _W:
    """Channel scaler: ``w(c)`` = round(c * width), at least 1."""

    def __init__(self, width: float) -> None:
        self.width = width

    def __call__(self, c: int) -> int:
        return max(1, int(round(c * self.width)))


class BasicConv2d(nn.Module):
    def __init__(self, cin: int, cout: int, kernel_size, stride=1, padding=0) -> None:
        super().__init__()
        self.out_channels = cout
        self.conv = nn.Conv2d(cin, cout, kernel_size, stride=stride, padding=padding, bias=False)
        self.bn = nn.BatchNorm2d(cout, eps=0.001)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.bn(self.conv(x)))


class InceptionA(nn.Module):
    """35x35 block: 1x1 | 1x1-5x5 | 1x1-3x3-3x3 | avgpool-1x1."""

    def __init__(self, cin: int, pool_features: int, w: _W) -> None:
        super().__init__()
        self.branch1x1 = BasicConv2d(cin, w(64), 1)
        self.branch5x5_1 = BasicConv2d(cin, w(48), 1)
        self.branch5x5_2 = BasicConv2d(w(48), w(64), 5, padding=2)
        self.branch3x3dbl_1 = BasicConv2d(cin, w(64), 1)
        self.branch3x3dbl_2 = BasicConv2d(w(64), w(96), 3, padding=1)
        self.branch3x3dbl_3 = BasicConv2d(w(96), w(96), 3, padding=1)
        self.branch_pool_avg = nn.AvgPool2d(3, stride=1, padding=1)
        self.branch_pool = BasicConv2d(cin, w(pool_features), 1)
        self.out_channels = w(64) + w(64) + w(96) + w(pool_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b1 = self.branch1x1(x)
        b5 = self.branch5x5_2(self.branch5x5_1(x))
        b3 = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        bp = self.branch_pool(self.branch_pool_avg(x))
        return torch.cat([b1, b5, b3, bp], 1)


class InceptionB(nn.Module):
    """35x35 -> 17x17 grid reduction: 3x3/2 | 1x1-3x3-3x3/2 | maxpool/2."""

    def __init__(self, cin: int, w: _W) -> None:
        super().__init__()
        self.branch3x3 = BasicConv2d(cin, w(384), 3, stride=2)
        self.branch3x3dbl_1 = BasicConv2d(cin, w(64), 1)
        self.branch3x3dbl_2 = BasicConv2d(w(64), w(96), 3, padding=1)
        self.branch3x3dbl_3 = BasicConv2d(w(96), w(96), 3, stride=2)
        self.branch_pool = nn.MaxPool2d(3, stride=2)
        self.out_channels = w(384) + w(96) + cin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b3 = self.branch3x3(x)
        bd = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        bp = self.branch_pool(x)
        return torch.cat([b3, bd, bp], 1)


class InceptionC(nn.Module):
    """17x17 block with factorised 7x7: 1x1 | 1x1-1x7-7x1 | 1x1-7x1-1x7-7x1-1x7 | pool-1x1."""

    def __init__(self, cin: int, channels_7x7: int, w: _W) -> None:
        super().__init__()
        c7 = w(channels_7x7)
        self.branch1x1 = BasicConv2d(cin, w(192), 1)
        self.branch7x7_1 = BasicConv2d(cin, c7, 1)
        self.branch7x7_2 = BasicConv2d(c7, c7, (1, 7), padding=(0, 3))
        self.branch7x7_3 = BasicConv2d(c7, w(192), (7, 1), padding=(3, 0))
        self.branch7x7dbl_1 = BasicConv2d(cin, c7, 1)
        self.branch7x7dbl_2 = BasicConv2d(c7, c7, (7, 1), padding=(3, 0))
        self.branch7x7dbl_3 = BasicConv2d(c7, c7, (1, 7), padding=(0, 3))
        self.branch7x7dbl_4 = BasicConv2d(c7, c7, (7, 1), padding=(3, 0))
        self.branch7x7dbl_5 = BasicConv2d(c7, w(192), (1, 7), padding=(0, 3))
        self.branch_pool_avg = nn.AvgPool2d(3, stride=1, padding=1)
        self.branch_pool = BasicConv2d(cin, w(192), 1)
        self.out_channels = 4 * w(192)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b1 = self.branch1x1(x)
        b7 = self.branch7x7_3(self.branch7x7_2(self.branch7x7_1(x)))
        bd = self.branch7x7dbl_1(x)
        bd = self.branch7x7dbl_3(self.branch7x7dbl_2(bd))
        bd = self.branch7x7dbl_5(self.branch7x7dbl_4(bd))
        bp = self.branch_pool(self.branch_pool_avg(x))
        return torch.cat([b1, b7, bd, bp], 1)


class InceptionD(nn.Module):
    """17x17 -> 8x8 grid reduction: 1x1-3x3/2 | 1x1-1x7-7x1-3x3/2 | maxpool/2."""

    def __init__(self, cin: int, w: _W) -> None:
        super().__init__()
        self.branch3x3_1 = BasicConv2d(cin, w(192), 1)
        self.branch3x3_2 = BasicConv2d(w(192), w(320), 3, stride=2)
        self.branch7x7x3_1 = BasicConv2d(cin, w(192), 1)
        self.branch7x7x3_2 = BasicConv2d(w(192), w(192), (1, 7), padding=(0, 3))
        self.branch7x7x3_3 = BasicConv2d(w(192), w(192), (7, 1), padding=(3, 0))
        self.branch7x7x3_4 = BasicConv2d(w(192), w(192), 3, stride=2)
        self.branch_pool = nn.MaxPool2d(3, stride=2)
        self.out_channels = w(320) + w(192) + cin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b3 = self.branch3x3_2(self.branch3x3_1(x))
        b7 = self.branch7x7x3_2(self.branch7x7x3_1(x))
        b7 = self.branch7x7x3_4(self.branch7x7x3_3(b7))
        bp = self.branch_pool(x)
        return torch.cat([b3, b7, bp], 1)


class InceptionE(nn.Module):
    """8x8 block: 1x1 | 1x1-(1x3,3x1) | 1x1-3x3-(1x3,3x1) | avgpool-1x1."""

    def __init__(self, cin: int, w: _W) -> None:
        super().__init__()
        self.branch1x1 = BasicConv2d(cin, w(320), 1)
        self.branch3x3_1 = BasicConv2d(cin, w(384), 1)
        self.branch3x3_2a = BasicConv2d(w(384), w(384), (1, 3), padding=(0, 1))
        self.branch3x3_2b = BasicConv2d(w(384), w(384), (3, 1), padding=(1, 0))
        self.branch3x3dbl_1 = BasicConv2d(cin, w(448), 1)
        self.branch3x3dbl_2 = BasicConv2d(w(448), w(384), 3, padding=1)
        self.branch3x3dbl_3a = BasicConv2d(w(384), w(384), (1, 3), padding=(0, 1))
        self.branch3x3dbl_3b = BasicConv2d(w(384), w(384), (3, 1), padding=(1, 0))
        self.branch_pool_avg = nn.AvgPool2d(3, stride=1, padding=1)
        self.branch_pool = BasicConv2d(cin, w(192), 1)
        self.out_channels = w(320) + 4 * w(384) + w(192)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b1 = self.branch1x1(x)
        b3 = self.branch3x3_1(x)
        b3 = torch.cat([self.branch3x3_2a(b3), self.branch3x3_2b(b3)], 1)
        bd = self.branch3x3dbl_2(self.branch3x3dbl_1(x))
        bd = torch.cat([self.branch3x3dbl_3a(bd), self.branch3x3dbl_3b(bd)], 1)
        bp = self.branch_pool(self.branch_pool_avg(x))
        return torch.cat([b1, b3, bd, bp], 1)


class InceptionV3(nn.Module):
    def __init__(self, num_classes: int = 1000, width: float = 1.0, dropout: float = 0.5) -> None:
        super().__init__()
        w = _W(width)
        self.Conv2d_1a_3x3 = BasicConv2d(3, w(32), 3, stride=2)
        self.Conv2d_2a_3x3 = BasicConv2d(w(32), w(32), 3)
        self.Conv2d_2b_3x3 = BasicConv2d(w(32), w(64), 3, padding=1)
        self.maxpool1 = nn.MaxPool2d(3, stride=2)
        self.Conv2d_3b_1x1 = BasicConv2d(w(64), w(80), 1)
        self.Conv2d_4a_3x3 = BasicConv2d(w(80), w(192), 3)
        self.maxpool2 = nn.MaxPool2d(3, stride=2)
        self.Mixed_5b = InceptionA(w(192), 32, w)
        self.Mixed_5c = InceptionA(self.Mixed_5b.out_channels, 64, w)
        self.Mixed_5d = InceptionA(self.Mixed_5c.out_channels, 64, w)
        self.Mixed_6a = InceptionB(self.Mixed_5d.out_channels, w)
        self.Mixed_6b = InceptionC(self.Mixed_6a.out_channels, 128, w)
        self.Mixed_6c = InceptionC(self.Mixed_6b.out_channels, 160, w)
        self.Mixed_6d = InceptionC(self.Mixed_6c.out_channels, 160, w)
        self.Mixed_6e = InceptionC(self.Mixed_6d.out_channels, 192, w)
        self.Mixed_7a = InceptionD(self.Mixed_6e.out_channels, w)
        self.Mixed_7b = InceptionE(self.Mixed_7a.out_channels, w)
        self.Mixed_7c = InceptionE(self.Mixed_7b.out_channels, w)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(self.Mixed_7c.out_channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.Conv2d_2b_3x3(self.Conv2d_2a_3x3(self.Conv2d_1a_3x3(x)))  # 147x147
        x = self.maxpool1(x)  # 73x73
        x = self.Conv2d_4a_3x3(self.Conv2d_3b_1x1(x))  # 71x71
        x = self.maxpool2(x)  # 35x35
        x = self.Mixed_5d(self.Mixed_5c(self.Mixed_5b(x)))
        x = self.Mixed_6a(x)  # 17x17
        x = self.Mixed_6e(self.Mixed_6d(self.Mixed_6c(self.Mixed_6b(x))))
        x = self.Mixed_7a(x)  # 8x8
        x = self.Mixed_7c(self.Mixed_7b(x))
        x = self.dropout(torch.flatten(self.avgpool(x), 1))
        return self.fc(x)


def inception_v3(batch_size: int = FLEXFLOW_PER_GPU_BATCH * FLEXFLOW_GPUS, dropout: float = 0.5):
    """Inception-v3 without the auxiliary classifier (23.8M parameters), 3x299x299, 1000
    classes, global batch 1024.

    Szegedy et al. 2016 architecture, as benchmarked by FlexFlow (Jia, Zaharia, Aiken,
    SysML 2019): 64 per GPU x 16 GPUs (approx.). Built on the meta device.
    """
    with torch.device("meta"):  # no memory: planned, never run at this size
        model = InceptionV3(dropout=dropout)
        x = torch.randn(batch_size, 3, 299, 299)
    return model, (x,)


def inception_tiny(batch_size: int = 4):
    """Tiny Inception-v3 for equivalence tests: the full block structure at width 1/16,
    3x75x75 input (the smallest the stem and reductions accept), 10 classes, batch 4,
    BatchNorm kept, dropout 0."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = InceptionV3(num_classes=10, width=1 / 16, dropout=0.0)
        x = torch.randn(batch_size, 3, 75, 75)
    return model, (x,)


def build_model():
    """Headline configuration: :func:`inception_v3`."""
    return inception_v3()
