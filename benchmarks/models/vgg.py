"""VGG (Simonyan & Zisserman 2015), configuration D = VGG-16, without BatchNorm.

13 3x3 convolutions with ReLU in 5 stages separated by 2x2 max-pools, AdaptiveAvgPool
(7x7), then Linear(25088,4096) ReLU Dropout Linear(4096,4096) ReLU Dropout
Linear(4096,1000). Returns logits.

Model-file convention (DESIGN.md section 3): every builder returns
``(nn.Module, example_inputs)``; dim 0 of the inputs is the global batch of one
training iteration. ``build_model()`` is the headline configuration.

Self-contained on purpose (files are loaded by path): imports only torch.
"""

from __future__ import annotations

import torch
from torch import nn

VGG16_CFG = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")

# PipeDream (Narayanan et al., SOSP 2019) trains VGG-16 with a minibatch of 64 per GPU
# (approx.); the global batch below is that times the 16 GPUs of its clusters
# (Cluster-A: 4 servers x 4 V100; Cluster-B: 2 servers x 8 V100).
PIPEDREAM_PER_GPU_BATCH = 64
PIPEDREAM_GPUS = 16


def _features(cfg, in_channels: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    c = in_channels
    for v in cfg:
        if v == "M":
            layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
        else:
            layers.append(nn.Conv2d(c, v, kernel_size=3, padding=1))
            layers.append(nn.ReLU())
            c = v
    return nn.Sequential(*layers)


class VGG(nn.Module):
    def __init__(
        self,
        cfg=VGG16_CFG,
        num_classes: int = 1000,
        pool: int = 7,
        hidden: int = 4096,
        dropout: float = 0.5,
    ) -> None:
        super().__init__()
        last = [v for v in cfg if v != "M"][-1]
        self.features = _features(cfg, 3)
        self.avgpool = nn.AdaptiveAvgPool2d((pool, pool))
        self.classifier = nn.Sequential(
            nn.Linear(last * pool * pool, hidden),
            nn.ReLU(),
            nn.Dropout(p=dropout),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Dropout(p=dropout),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.avgpool(self.features(x))
        return self.classifier(torch.flatten(x, 1))


def vgg16(batch_size: int = PIPEDREAM_PER_GPU_BATCH * PIPEDREAM_GPUS, dropout: float = 0.5):
    """VGG-16, ImageNet 3x224x224, 1000 classes (138.4M parameters), global batch 1024.

    Simonyan & Zisserman 2015 configuration D, as benchmarked by PipeDream (Narayanan et
    al., "PipeDream: Generalized Pipeline Parallelism for DNN Training", SOSP 2019).
    Batch: 64 per GPU x 16 GPUs (approx.). Built on meta.
    """
    with torch.device("meta"):
        model = VGG(dropout=dropout)
        x = torch.randn(batch_size, 3, 224, 224)
    return model, (x,)


def vgg_tiny(batch_size: int = 8):
    """Tiny VGG for equivalence tests: 8,M,16,M,32,32,M on 3x32x32, pool 2x2, hidden 64,
    10 classes, batch 8, no BN/dropout."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = VGG(
            cfg=(8, "M", 16, "M", 32, 32, "M"), num_classes=10, pool=2, hidden=64, dropout=0.0
        )
        x = torch.randn(batch_size, 3, 32, 32)
    return model, (x,)


def build_model():
    """Headline configuration: :func:`vgg16`."""
    return vgg16()
