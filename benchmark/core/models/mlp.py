"""A small ReLU multi-layer perceptron (toy study, tests)."""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from torch import nn


def mlp(
    in_features: int,
    hidden: Sequence[int],
    num_classes: int,
    dropout: float = 0.0,
    flatten: bool = True,
) -> nn.Sequential:
    """Sequential ReLU MLP ``in_features -> hidden[0] -> ... -> num_classes``.

    Layers are named ``fc1 .. fcL`` (keys ``fc1.weight``, ``fc1.bias`` ...), with ``relu<i>``
    between them and ``dropout`` (no parameters) before the last Linear; inputs of any shape
    ``[B, ...]`` are flattened first when ``flatten`` is true. Output: logits ``[B, num_classes]``.
    """
    if in_features < 1 or num_classes < 1 or any(h < 1 for h in hidden):
        raise ValueError(f"mlp: sizes must be positive, got in={in_features} hidden={list(hidden)} out={num_classes}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"mlp: dropout must be in [0, 1), got {dropout}")
    layers: "OrderedDict[str, nn.Module]" = OrderedDict()
    if flatten:
        layers["flatten"] = nn.Flatten()
    sizes = [in_features, *hidden]
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:]), start=1):
        layers[f"fc{i}"] = nn.Linear(a, b)
        layers[f"relu{i}"] = nn.ReLU()
    layers["dropout"] = nn.Dropout(dropout)
    layers[f"fc{len(sizes)}"] = nn.Linear(sizes[-1], num_classes)
    return nn.Sequential(layers)
