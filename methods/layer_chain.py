"""A network's forward pass as a chain of layers, for the methods that change a chain network
layer by layer (the symmetry-breaking vBNNs): OptuNet declares it with ``layer_chain()``, an
``nn.Sequential`` (the MLP) is one. ResNets (residual blocks) are not chains."""
from __future__ import annotations

from blitz.modules import BayesianConv2d, BayesianLinear
from torch import nn

PARAMETRISED = (nn.Linear, nn.Conv2d, BayesianLinear, BayesianConv2d)  # plain, or converted by methods.bayesian_layers
SHAPE_OPS = (nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d, nn.Flatten, nn.Identity)
ACTIVATIONS = (nn.ReLU, nn.LeakyReLU)


def layer_chain(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``[(state-dict prefix, module), ...]`` applied in order equals ``model``'s forward pass.
    Raises ``ValueError`` for a model that is not a chain, or whose chain holds a module other
    than Linear, Conv2d (or their BLiTZ versions), ReLU/LeakyReLU, pooling, Flatten, Identity and Dropout (BatchNorm
    included: its running statistics would need their own treatment)."""
    declared = getattr(model, "layer_chain", None)
    if callable(declared):
        chain = list(declared())
    elif isinstance(model, nn.Sequential):
        chain = list(model.named_children())
    else:
        raise ValueError(f"{type(model).__name__} is not a chain of layers (no layer_chain() method and not an "
                         "nn.Sequential); residual networks are not supported")
    for name, module in chain:
        if not isinstance(module, (*PARAMETRISED, *SHAPE_OPS, *ACTIVATIONS, nn.Dropout)):
            raise ValueError(f"{type(model).__name__}: layer {name!r} ({type(module).__name__}) is not supported in a "
                             "chain: Linear, Conv2d, ReLU, pooling, Flatten, Identity and Dropout only")
    return chain

