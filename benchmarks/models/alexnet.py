"""AlexNet (the single-tower "one weird trick" variant used by FlexFlow and torchvision).

features: Conv(3,64,11,s4,p2) ReLU MaxPool(3,2) Conv(64,192,5,p2) ReLU MaxPool
Conv(192,384,3) ReLU Conv(384,256,3) ReLU Conv(256,256,3) ReLU MaxPool
-> AdaptiveAvgPool(6x6) -> flatten -> Dropout Linear(9216,4096) ReLU Dropout
Linear(4096,4096) ReLU Linear(4096,1000). Returns logits.

Model-file convention (DESIGN.md section 3): every builder returns
``(nn.Module, example_inputs)``; dim 0 of the inputs is the global batch of one
training iteration. ``build_model()`` is the headline configuration.

Self-contained on purpose (files are loaded by path): imports only torch.
"""

from __future__ import annotations

import torch
from torch import nn

# FlexFlow (Jia et al., SysML 2019) trains with a fixed per-GPU batch (64, approx.) and
# scales it with the GPU count; the global batch below is that per-GPU batch times the
# 16 GPUs of the paper's P100 cluster (4 nodes x 4 GPUs).
FLEXFLOW_PER_GPU_BATCH = 64
FLEXFLOW_GPUS = 16


class AlexNet(nn.Module):
    def __init__(self, num_classes: int = 1000, dropout: float = 0.5) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 64, kernel_size=11, stride=4, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=3, stride=2),
            nn.Conv2d(64, 192, kernel_size=5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=3, stride=2),
            nn.Conv2d(192, 384, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.Conv2d(384, 256, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.Conv2d(256, 256, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=3, stride=2),
        )
        self.avgpool = nn.AdaptiveAvgPool2d((6, 6))
        self.classifier = nn.Sequential(
            nn.Dropout(p=dropout),
            nn.Linear(256 * 6 * 6, 4096),
            nn.ReLU(),
            nn.Dropout(p=dropout),
            nn.Linear(4096, 4096),
            nn.ReLU(),
            nn.Linear(4096, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.avgpool(self.features(x))
        return self.classifier(torch.flatten(x, 1))


class TinyAlexNet(nn.Module):
    """AlexNet-shaped (5 convs, 3 max-pools, 3 Linear) for 32x32 inputs; no BN, no dropout."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, kernel_size=5, stride=2, padding=2),  # 16x16
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=2, stride=2),  # 8x8
            nn.Conv2d(8, 16, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=2, stride=2),  # 4x4
            nn.Conv2d(16, 24, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.Conv2d(24, 16, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 16, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=2, stride=2),  # 2x2
        )
        self.classifier = nn.Sequential(
            nn.Linear(16 * 2 * 2, 64),
            nn.ReLU(),
            nn.Linear(64, 64),
            nn.ReLU(),
            nn.Linear(64, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))


def alexnet(batch_size: int = FLEXFLOW_PER_GPU_BATCH * FLEXFLOW_GPUS, dropout: float = 0.5):
    """AlexNet, ImageNet 3x224x224, 1000 classes (61.1M parameters), global batch 1024.

    Krizhevsky 2014 ("One weird trick") single-tower layout, as benchmarked by FlexFlow
    (Jia, Zaharia, Aiken, "Beyond Data and Model Parallelism for Deep Neural Networks",
    SysML 2019). Batch: 64 per GPU x 16 GPUs (approx.). Built on the meta device.
    """
    with torch.device("meta"):  # no memory: planned, never run at this size
        model = AlexNet(dropout=dropout)
        x = torch.randn(batch_size, 3, 224, 224)
    return model, (x,)


def alexnet_tiny(batch_size: int = 8):
    """Tiny AlexNet for equivalence tests: 3x32x32 input, 10 classes, batch 8, no BN/dropout."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = TinyAlexNet()
        x = torch.randn(batch_size, 3, 32, 32)
    return model, (x,)


def build_model():
    """Headline configuration: :func:`alexnet`."""
    return alexnet()
