"""Build a model from its config name (``model.name`` in ``conf/model/*.yaml``)."""
from __future__ import annotations

from typing import Any, Callable

from torch import nn

from benchmark.core.models.mlp import mlp
from benchmark.core.models.optunet import optunet
from benchmark.core.models.resnet import resnet18

_FACTORIES: dict[str, Callable[..., nn.Module]] = {"optunet": optunet, "resnet18": resnet18, "mlp": mlp}
MODEL_NAMES = tuple(sorted(_FACTORIES))


def build_model(name: str, **kwargs: Any) -> nn.Module:
    """Instantiate model ``name`` (one of ``MODEL_NAMES``) with factory keyword ``kwargs``."""
    if name not in _FACTORIES:
        raise ValueError(f"model.name: unknown model {name!r}; expected one of {', '.join(MODEL_NAMES)}")
    return _FACTORIES[name](**kwargs)
