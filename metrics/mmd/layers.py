"""Layers of a sample set: which keys form one layer, and checks that two sample sets compare.

A layer is a module owning parameters: its keys share the prefix before the last dot
(``layer1.0.conv1.weight`` -> ``layer1.0.conv1``; ``fc1.weight`` and ``fc1.bias`` -> ``fc1``).
BatchNorm running statistics are buffers, not parameters, and belong to no layer.
"""
from __future__ import annotations

from typing import Iterable, Mapping

BUFFER_SUFFIXES = ("running_mean", "running_var", "num_batches_tracked")


class MMDInputError(ValueError):
    """Sample sets or column blocks that cannot be compared (the message names the layer)."""


def layer_name(key: str) -> str:
    """The module prefix of a state-dict key (the key itself when it has no dot)."""
    return key.rsplit(".", 1)[0] if "." in key else key


def is_buffer(key: str) -> bool:
    """True for BatchNorm running statistics (not parameters, excluded from MMD)."""
    return key.rsplit(".", 1)[-1] in BUFFER_SUFFIXES


def group_layers(keys: Iterable[str]) -> dict[str, list[str]]:
    """Group parameter keys by layer: ``{layer: [key, ...]}`` in first-seen order.

    Buffers (``running_mean``, ``running_var``, ``num_batches_tracked``) are dropped.
    """
    layers: dict[str, list[str]] = {}
    for key in keys:
        if not is_buffer(key):
            layers.setdefault(layer_name(key), []).append(key)
    return layers


def check_comparable_shapes(
    x_shapes: Mapping[str, tuple[int, ...]], y_shapes: Mapping[str, tuple[int, ...]]
) -> dict[str, list[str]]:
    """Check two sample sets (given as key -> full shape ``[S, ...]``) and return their layers.

    Raises ``MMDInputError`` naming the layer when the parameter keys differ, a key's
    per-sample shape differs, or a side has fewer than 2 samples (the U-statistic needs 2).
    """
    x_layers, y_layers = group_layers(x_shapes), group_layers(y_shapes)
    for layer in sorted(set(x_layers) ^ set(y_layers)):
        side = "reference X" if layer in x_layers else "method Y"
        raise MMDInputError(f"layer {layer!r} exists only in the {side} sample set")
    for layer, keys in x_layers.items():
        if sorted(keys) != sorted(y_layers[layer]):
            raise MMDInputError(
                f"layer {layer!r}: X has keys {sorted(keys)} but Y has keys {sorted(y_layers[layer])}"
            )
        for key in keys:
            xs, ys = tuple(x_shapes[key]), tuple(y_shapes[key])
            if len(xs) == 0 or len(ys) == 0:
                raise MMDInputError(f"layer {layer!r}: key {key!r} has no leading sample axis [S, ...]")
            if xs[1:] != ys[1:]:
                raise MMDInputError(
                    f"layer {layer!r}: key {key!r} has per-sample shape {list(xs[1:])} in X "
                    f"but {list(ys[1:])} in Y"
                )
            for side, shape in (("X", xs), ("Y", ys)):
                if shape[0] < 2:
                    raise MMDInputError(
                        f"layer {layer!r}: key {key!r} has {shape[0]} sample(s) in {side}; need at least 2"
                    )
    return x_layers
