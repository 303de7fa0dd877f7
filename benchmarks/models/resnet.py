"""ResNets (He et al., "Deep Residual Learning for Image Recognition", CVPR 2016).

- ImageNet ResNet-50/101: 7x7 stem, 4 stages of bottleneck blocks (1x1, 3x3, 1x1 convs
  with BatchNorm; the stride sits on the 3x3 conv, the "v1.5" layout of most
  frameworks), projection shortcuts (1x1 conv + BN) where the shape changes, global
  average pool, Linear(2048, 1000).
- CIFAR ResNet-20 (paper section 4.2): 3x3 stem with 16 channels, 3 stages of n=3 basic
  blocks (16/32/64 channels), global average pool, Linear(64, 10). Shortcuts that change
  shape use a 1x1 conv + BN projection (the paper's option B; option A, zero padding,
  would save ~3K parameters).

Returns logits. Model-file convention (DESIGN.md section 3): every builder returns
``(nn.Module, example_inputs)``; dim 0 of the inputs is the global batch of one training
iteration. ``build_model()`` is the headline configuration (ResNet-50).

Self-contained on purpose (files are loaded by path): imports only torch.
"""

from __future__ import annotations

import torch
from torch import nn

# FlexFlow (Jia et al., SysML 2019) benchmarks ResNet-101 with a fixed per-GPU batch
# (64, approx.); global batch = per-GPU batch x the 16 GPUs of its P100 cluster.
FLEXFLOW_PER_GPU_BATCH = 64
FLEXFLOW_GPUS = 16


def _conv_bn(cin: int, cout: int, k: int, stride: int = 1) -> list[nn.Module]:
    return [
        nn.Conv2d(cin, cout, kernel_size=k, stride=stride, padding=k // 2, bias=False),
        nn.BatchNorm2d(cout),
    ]


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        cout = planes * self.expansion
        self.conv1 = nn.Conv2d(cin, planes, kernel_size=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(planes, planes, kernel_size=3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.relu2 = nn.ReLU()
        self.conv3 = nn.Conv2d(planes, cout, kernel_size=1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.relu3 = nn.ReLU()
        if stride != 1 or cin != cout:
            self.downsample: nn.Module = nn.Sequential(*_conv_bn(cin, cout, 1, stride))
        else:
            self.downsample = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.relu2(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu3(out + self.downsample(x))


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, kernel_size=3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(cout, cout, kernel_size=3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu2 = nn.ReLU()
        if stride != 1 or cin != cout:
            self.shortcut: nn.Module = nn.Sequential(*_conv_bn(cin, cout, 1, stride))
        else:
            self.shortcut = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu2(out + self.shortcut(x))


class ImageNetResNet(nn.Module):
    def __init__(self, blocks: tuple[int, int, int, int], num_classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU()
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        cin = 64
        stages = []
        for i, (planes, n) in enumerate(zip((64, 128, 256, 512), blocks, strict=True)):
            layer = []
            for j in range(n):
                stride = 2 if (i > 0 and j == 0) else 1
                layer.append(Bottleneck(cin, planes, stride))
                cin = planes * Bottleneck.expansion
            stages.append(nn.Sequential(*layer))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class CifarResNet(nn.Module):
    """6n+2-layer CIFAR ResNet: stem, 3 stages of n basic blocks, pool, Linear."""

    def __init__(
        self, n: int = 3, widths: tuple[int, int, int] = (16, 32, 64), num_classes: int = 10
    ) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, widths[0], kernel_size=3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.relu = nn.ReLU()
        cin = widths[0]
        stages = []
        for i, w in enumerate(widths):
            layer = []
            for j in range(n):
                stride = 2 if (i > 0 and j == 0) else 1
                layer.append(BasicBlock(cin, w, stride))
                cin = w
            stages.append(nn.Sequential(*layer))
        self.layer1, self.layer2, self.layer3 = stages
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet50(batch_size: int = 256):
    """ResNet-50, ImageNet 3x224x224, 1000 classes (25.6M parameters), batch 256.

    He et al. 2016 (section 3.4: SGD with a mini-batch of 256). Built on the meta device.
    """
    with torch.device("meta"):  # no memory: planned, never run at this size
        model = ImageNetResNet((3, 4, 6, 3))
        x = torch.randn(batch_size, 3, 224, 224)
    return model, (x,)


def resnet101(batch_size: int = FLEXFLOW_PER_GPU_BATCH * FLEXFLOW_GPUS):
    """ResNet-101, ImageNet 3x224x224, 1000 classes (44.5M parameters), global batch 1024.

    He et al. 2016 architecture, as benchmarked by FlexFlow (Jia, Zaharia, Aiken, SysML
    2019): 64 per GPU x 16 GPUs (approx.). He et al. themselves used 256. Built on the meta device.
    """
    with torch.device("meta"):  # no memory: planned, never run at this size
        model = ImageNetResNet((3, 4, 23, 3))
        x = torch.randn(batch_size, 3, 224, 224)
    return model, (x,)


def resnet20(batch_size: int = 128):
    """CIFAR-10 ResNet-20 (0.27M parameters): 3 stages x 3 basic blocks, 3x32x32, batch 128.

    He et al. 2016 section 4.2 (also batch 128), the model of the D-PSGD paper (Lian et
    al., "Can Decentralized Algorithms Outperform Centralized Algorithms?", NeurIPS 2017),
    batch 128 (approx.: D-PSGD's per-worker vs total batch not checked). Real CPU weights.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = CifarResNet(n=3)
        x = torch.randn(batch_size, 3, 32, 32)
    return model, (x,)


def resnet_tiny(batch_size: int = 8):
    """Tiny CIFAR-style ResNet for equivalence tests: 1 basic block per stage, widths
    8/16/32, BatchNorm, 3x32x32, 10 classes, batch 8."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = CifarResNet(n=1, widths=(8, 16, 32))
        x = torch.randn(batch_size, 3, 32, 32)
    return model, (x,)


def resnet20_digits(batch_size: int = 32):
    """ResNet-20 (as :func:`resnet20`) on 3x8x8 images: scikit-learn's digits in each
    channel (what ``flexsearch calibrate --convergence`` trains for the CifarResNet
    family; stages at 8x8, 4x4 and 2x2), batch 32. Real CPU weights."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = CifarResNet(n=3)
        x = torch.rand(batch_size, 3, 8, 8)
    return model, (x,)


def build_model():
    """Headline configuration: :func:`resnet50`."""
    return resnet50()
