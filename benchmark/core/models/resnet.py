"""ResNet-18 with the CIFAR stem (3x3 stride-1 first conv, no max-pool), from torchvision."""
from __future__ import annotations

import torch
from torch import nn
from torchvision.models.resnet import BasicBlock, ResNet


class CifarResNet18(ResNet):
    """torchvision's ResNet-18 with the CIFAR stem, for 32x32 and 64x64 inputs.

    Input ``[B, in_channels, H, W]``, output logits ``[B, num_classes]``. State-dict keys are
    torchvision's (``conv1.weight``, ``layer1.0.bn1.running_mean``, ``fc.weight`` ...).
    ``dropout`` > 0 drops the last layer's input (last-layer MC Dropout) without adding keys.
    ``width``: channels of the stem and of layer1 (layers 2-4 have 2x, 4x, 8x as many); the
    paper's network is the default 64. Narrower widths (same keys, smaller shapes) are for tests.
    """

    def __init__(self, num_classes: int = 100, dropout: float = 0.0, in_channels: int = 3, width: int = 64) -> None:
        super().__init__(BasicBlock, [2, 2, 2, 2], num_classes=num_classes)
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"resnet18: dropout must be in [0, 1), got {dropout}")
        if not (isinstance(width, int) and width >= 1):
            raise ValueError(f"resnet18: width must be a positive integer, got {width!r}")
        if width != 64:
            self._narrow(width, num_classes)
        self.conv1 = nn.Conv2d(in_channels, width, kernel_size=3, stride=1, padding=1, bias=False)
        nn.init.kaiming_normal_(self.conv1.weight, mode="fan_out", nonlinearity="relu")
        self.maxpool = nn.Identity()
        self.dropout = nn.Dropout(dropout)

    def _narrow(self, width: int, num_classes: int) -> None:
        """Rebuild the body with ``width`` base channels, initialised as torchvision initialises it."""
        self.inplanes = width
        self.bn1 = nn.BatchNorm2d(width)
        self.layer1 = self._make_layer(BasicBlock, width, 2)
        self.layer2 = self._make_layer(BasicBlock, 2 * width, 2, stride=2)
        self.layer3 = self._make_layer(BasicBlock, 4 * width, 2, stride=2)
        self.layer4 = self._make_layer(BasicBlock, 8 * width, 2, stride=2)
        self.fc = nn.Linear(8 * width, num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Input of the last layer, ``[B, 8 * width]`` (``[B, 512]`` at the default width; before dropout)."""
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return torch.flatten(self.avgpool(x), 1)

    def _forward_impl(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.dropout(self.features(x)))


def resnet18(num_classes: int = 100, dropout: float = 0.0, in_channels: int = 3, width: int = 64) -> CifarResNet18:
    """Build a CIFAR-stem ResNet-18 (11.2M parameters for 100 classes at the default ``width`` 64)."""
    return CifarResNet18(num_classes=num_classes, dropout=dropout, in_channels=in_channels, width=width)
