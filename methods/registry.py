"""Method name -> class, imported lazily (BLiTZ and laplace-torch load only when used)."""
from __future__ import annotations

import importlib

from methods.base import PosteriorMethod

_CLASSES = {
    "dropout": "methods.dropout:DropoutMethod",
    "bnn": "methods.bnn:BNNMethod",
    "sghmc": "methods.sghmc:SGHMCMethod",
    "swag": "methods.swag:SWAGMethod",
    "laplace": "methods.laplace:LaplaceMethod",
    "ensemble": "methods.ensemble:EnsembleMethod",
}
METHOD_NAMES = tuple(_CLASSES)  # the paper's row order


def method_class(name: str) -> type[PosteriorMethod]:
    """The class implementing method ``name`` (one of ``METHOD_NAMES``)."""
    if name not in _CLASSES:
        raise ValueError(f"method={name!r}: unknown method; expected one of {', '.join(METHOD_NAMES)} or all")
    module, cls = _CLASSES[name].split(":")
    return getattr(importlib.import_module(module), cls)
