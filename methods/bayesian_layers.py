"""Turn a plain network into a BLiTZ variational network whose weight draws are plain-keyed.

Every chosen ``nn.Conv2d``/``nn.Linear`` is replaced by BLiTZ's ``BayesianConv2d``/
``BayesianLinear`` with the same shapes, stride, padding, dilation and groups (a grouped
convolution stays grouped: BLiTZ's weight is ``[out, in // groups, kh, kw]`` like torch's),
and a bias only where the plain layer has one. Every other module (BatchNorm, pooling) is
kept as is and trained as a point estimate. The posterior means start from the plain
layer's weights, so converting a freshly initialised model gives the usual initialisation.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from enum import Enum

import torch
from blitz.modules import BayesianConv2d, BayesianLinear
from blitz.modules.weight_sampler import TrainableRandomDistribution
from torch import nn



class BNNLayers(str, Enum):
    """Which layers of the plain network become variational."""

    all = "all"
    """Every Conv2d and Linear."""
    last_layer = "last_layer"
    """The last Linear (in registration order)."""


@dataclass
class BayesianNetwork:
    """A converted network: ``model`` (BLiTZ layers inside) and, for every plain state-dict key
    that became variational, the BLiTZ sampler that draws it (``samplers``). ``plain_keys``
    are the plain model's state-dict keys, in order."""

    model: nn.Module
    samplers: dict[str, TrainableRandomDistribution]
    plain_keys: tuple[str, ...]

    def sigma_over_mu(self) -> dict[str, float]:
        """Per plain key: the mean over its weights of ``softplus(rho) / |mu|`` (how far the
        variational posterior is from a point mass, relative to the weights' size)."""
        out = {}
        for key, sampler in self.samplers.items():
            sigma = torch.nn.functional.softplus(sampler.rho.detach())
            out[key] = float((sigma / sampler.mu.detach().abs().clamp_min(1e-12)).mean())
        return out

    def sigma_mean(self) -> dict[str, float]:
        """Per plain key: the mean posterior standard deviation ``softplus(rho)``."""
        return {key: float(torch.nn.functional.softplus(s.rho.detach()).mean()) for key, s in self.samplers.items()}

    def last_draw(self) -> dict[str, torch.Tensor]:
        """The weights the last forward pass used, keyed like the plain model's state dict.

        Variational keys hold the samplers' current draws (``mu + softplus(rho) * eps``);
        the other keys (BatchNorm weights and running statistics) their trained values.
        """
        missing = [k for k, s in self.samplers.items() if s.w is None]
        if missing:
            raise RuntimeError(f"BayesianNetwork.last_draw: no forward pass has drawn {missing[0]!r} yet")
        state = self.model.state_dict()
        return {
            k: (self.samplers[k].w if k in self.samplers else state[k]).detach().clone() for k in self.plain_keys
        }


def bayesian_layer_names(model: nn.Module, layers: BNNLayers | str) -> list[str]:
    """Module names of ``model`` that become Bayesian under ``layers`` (see ``BNNLayers``)."""
    layers = BNNLayers(layers)
    convs_and_linears = [n for n, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    if layers == BNNLayers.all:
        return convs_and_linears
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise ValueError(f"layers=last_layer: {type(model).__name__} has no Linear layer; use all")
    return linears[-1:]


def check_convertible(model: nn.Module, layers: BNNLayers | str) -> None:
    """Raise ``ValueError`` naming the first chosen layer BLiTZ cannot represent exactly."""
    for name in bayesian_layer_names(model, layers):
        module = model.get_submodule(name)
        if type(module) not in (nn.Conv2d, nn.Linear):
            raise ValueError(f"layer {name!r}: {type(module).__name__} is not a plain Conv2d/Linear; BLiTZ cannot replace it")
        if isinstance(module, nn.Conv2d) and module.padding_mode != "zeros":
            raise ValueError(f"layer {name!r}: padding_mode={module.padding_mode!r}; BLiTZ convolutions pad with zeros only")


def _bayesian_copy(module: nn.Module, rho_init: float | None = None) -> nn.Module:
    """A BLiTZ layer with the shapes of ``module``; its posterior means are ``module``'s weights,
    its ``rho`` drawn around ``rho_init`` (None: BLiTZ's defaults, -6 Conv2d, -7 Linear)."""
    has_bias = module.bias is not None
    init = {} if rho_init is None else {"posterior_rho_init": rho_init}
    if isinstance(module, nn.Conv2d):
        layer = BayesianConv2d(
            in_channels=module.in_channels, out_channels=module.out_channels, kernel_size=tuple(module.kernel_size),
            groups=module.groups, stride=module.stride, padding=module.padding, dilation=module.dilation, bias=has_bias,
            **init,
        )
    else:
        layer = BayesianLinear(in_features=module.in_features, out_features=module.out_features, bias=has_bias, **init)
    with torch.no_grad():
        layer.weight_sampler.mu.copy_(module.weight)  # shares memory with layer.weight_mu
        if has_bias:
            layer.bias_sampler.mu.copy_(module.bias)
    return layer.to(module.weight.device)


def to_bayesian(model: nn.Module, layers: BNNLayers | str, rho_init: float | None = None) -> BayesianNetwork:
    """Convert a copy of ``model`` (left untouched) per ``layers`` (see ``bayesian_layer_names``).

    BLiTZ's default priors are kept, and its posterior ``rho`` initialisation unless ``rho_init``
    is given (``rho ~ N(rho_init, 0.1^2)``, sigma = softplus(rho)); ``rho`` is drawn from torch's
    global RNG (wrap the call in ``benchmark.core.training.seeded`` for reproducibility).
    """
    check_convertible(model, layers)
    plain_keys = tuple(model.state_dict())
    bnn = copy.deepcopy(model)
    samplers: dict[str, TrainableRandomDistribution] = {}
    for name in bayesian_layer_names(model, layers):
        layer = _bayesian_copy(model.get_submodule(name), rho_init)
        parent_name, _, child = name.rpartition(".")
        setattr(bnn.get_submodule(parent_name) if parent_name else bnn, child, layer)
        samplers[f"{name}.weight"] = layer.weight_sampler
        if model.get_submodule(name).bias is not None:
            samplers[f"{name}.bias"] = layer.bias_sampler
    return BayesianNetwork(bnn, samplers, plain_keys)
