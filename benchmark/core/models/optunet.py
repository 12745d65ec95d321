"""OptuNet: the public OptuMNIST-v1 network (355 parameters)."""
from __future__ import annotations

import torch
from torch import nn


class OptuNet(nn.Module):
    """Conv(1->2, k4, no bias) - ReLU - MaxPool(3) - Conv(2->10, k5, groups 2, no bias) - ReLU
    - global average pool - Linear(10->3) - ReLU - [Dropout] - Linear(3->10).

    Input ``[B, 1, 28, 28]`` (any size >= 28 works through the global pool), output logits
    ``[B, num_classes]``. ``dropout`` > 0 drops the last layer's input (MC Dropout); it adds
    no parameters, so the state dict is the same with or without it.
    """

    def __init__(self, num_classes: int = 10, dropout: float = 0.0, in_channels: int = 1) -> None:
        super().__init__()
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"OptuNet: dropout must be in [0, 1), got {dropout}")
        self.conv1 = nn.Conv2d(in_channels, 2, kernel_size=4, bias=False)
        self.pool = nn.MaxPool2d(3)
        self.conv2 = nn.Conv2d(2, 10, kernel_size=5, groups=2, bias=False)
        self.fc1 = nn.Linear(10, 3)
        self.dropout = nn.Dropout(dropout)
        self.fc2 = nn.Linear(3, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Input of the last layer, ``[B, 3]`` (before dropout)."""
        x = self.pool(torch.relu(self.conv1(x)))
        x = torch.relu(self.conv2(x))
        x = x.mean(dim=(2, 3))
        return torch.relu(self.fc1(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.dropout(self.features(x)))

    def layer_chain(self) -> list[tuple[str, nn.Module]]:
        """The forward pass as a chain of ``(state-dict prefix, module)`` applied in order
        (the functional ReLUs and the global pool as modules); running the chain equals
        ``forward``. Whatever walks the network layer by layer (the symmetry specs) reads it."""
        return [
            ("conv1", self.conv1), ("relu1", nn.ReLU()), ("pool", self.pool), ("conv2", self.conv2),
            ("relu2", nn.ReLU()), ("gap", nn.AdaptiveAvgPool2d(1)), ("flatten", nn.Flatten()), ("fc1", self.fc1),
            ("relu3", nn.ReLU()), ("dropout", self.dropout), ("fc2", self.fc2),
        ]


def optunet(num_classes: int = 10, dropout: float = 0.0, in_channels: int = 1) -> OptuNet:
    """Build an OptuNet for ``num_classes`` outputs (355 parameters for 10 classes)."""
    return OptuNet(num_classes=num_classes, dropout=dropout, in_channels=in_channels)
