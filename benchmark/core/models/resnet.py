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
    """

    def __init__(self, num_classes: int = 100, dropout: float = 0.0, in_channels: int = 3) -> None:
        super().__init__(BasicBlock, [2, 2, 2, 2], num_classes=num_classes)
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"resnet18: dropout must be in [0, 1), got {dropout}")
        self.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
        nn.init.kaiming_normal_(self.conv1.weight, mode="fan_out", nonlinearity="relu")
        self.maxpool = nn.Identity()
        self.dropout = nn.Dropout(dropout)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Input of the last layer, ``[B, 512]`` (before dropout)."""
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return torch.flatten(self.avgpool(x), 1)

    def _forward_impl(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.dropout(self.features(x)))


def resnet18(num_classes: int = 100, dropout: float = 0.0, in_channels: int = 3) -> CifarResNet18:
    """Build a CIFAR-stem ResNet-18 (11.2M parameters for 100 classes)."""
    return CifarResNet18(num_classes=num_classes, dropout=dropout, in_channels=in_channels)
