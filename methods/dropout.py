"""MC Dropout on the last layer's input (Gal & Ghahramani 2016) as a mixture of Diracs in weight space.

A network is trained from scratch with dropout of rate ``p`` on the input of its last Linear
layer (appendix B: p 0.2 OptuNet, 0.5 ResNet-18, at train and test time). Dropping input j
of that layer and scaling the kept inputs by ``1/(1-p)`` is the same as zeroing column j of
its weight and scaling the other columns by ``1/(1-p)``; so each dropout mask is one weight
sample (bias and every other layer unchanged), and predicting with the weight sample equals
predicting with the mask.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from benchmark.core.models import predict_with_weights
from benchmark.core.settings import require
from benchmark.core.store import SampleSet
from benchmark.core.training import seeded, train_network
from methods.base import MethodConfigError, MethodFitError, MethodSettings, PosteriorMethod


def dropout_layers(model: nn.Module) -> tuple[nn.Dropout, str, nn.Linear]:
    """``(the Dropout module, the last Linear's name, the last Linear)`` of a model built with dropout.

    The model factories put their single Dropout on the last Linear's input.
    """
    drops = [m for m in model.modules() if isinstance(m, nn.Dropout)]
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    if len(drops) != 1 or not linears:
        raise MethodConfigError(
            f"method=dropout: model {type(model).__name__} needs exactly one Dropout before a last Linear layer, "
            f"found {len(drops)} Dropout and {len(linears)} Linear modules"
        )
    return drops[0], *linears[-1]


def draw_masks(n: int, width: int, p: float, generator: torch.Generator) -> torch.Tensor:
    """``n`` dropout masks ``[n, width]`` (float 0/1), each unit kept with probability ``1 - p``."""
    return (torch.rand(n, width, generator=generator) >= p).float()


def masked_weights(weight: torch.Tensor, masks: torch.Tensor, p: float) -> torch.Tensor:
    """Last-layer weights ``[n, out, in]`` of masks ``[n, in]``: dropped columns zeroed, kept ones scaled by 1/(1-p)."""
    return weight[None] * (masks / (1.0 - p))[:, None, :]


@dataclass
class DropoutSettings(MethodSettings):
    """``p``: dropout rate on the last layer's input, at train and test time (appendix B:
    0.2 OptuNet, 0.5 ResNet-18; set per model in ``conf/model/*.yaml``)."""

    p: float = 0.2

    def __post_init__(self) -> None:
        require(0.0 < self.p < 1.0, "p", self.p, "a dropout rate in (0, 1)")


class DropoutMethod(PosteriorMethod):
    """Last-layer MC Dropout; ``fit`` retrains a dropout network from the base's seed."""

    name = "dropout"
    label = "Dropout"
    fits_can_fail = True
    Settings = DropoutSettings

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._model: nn.Module | None = None
        self._weights: dict[str, torch.Tensor] | None = None

    @property
    def p(self) -> float:
        return float(self.settings.p)

    def check(self, mode: str) -> None:
        super().check(mode)
        with seeded(0):  # building a model draws from the global RNG; leave it as it was
            dropout_layers(self.model_factory(dropout=self.p))

    def fit(self, base: dict[str, torch.Tensor], seed: int) -> None:
        """Train a dropout network from scratch with the experiment's recipe; ``seed`` fixes its
        initialisation (the base's), data order and training masks. ``base`` itself is not used:
        dropout changes training.

        Raises ``NonFiniteError`` on NaN/Inf, ``MethodFitError`` if the run fails the recipe's
        convergence rule.
        """
        self._model = self._weights = None
        with seeded(seed):  # the initialisation and the dropout masks drawn in training
            model = self.new_model(dropout=self.p)
            result = train_network(model, self.data.train, self.data.check, self.recipe, seed,
                                   where=f"dropout seed {seed}")
        if result.failure:
            raise MethodFitError(f"method=dropout: the dropout network of seed {seed} failed: {result.failure}")
        self._model, self._weights = model.eval(), result.state_dict

    def _fitted(self) -> tuple[nn.Module, dict[str, torch.Tensor]]:
        if self._model is None or self._weights is None:
            raise RuntimeError("method=dropout: call fit() before sample() or predict_own()")
        return self._model, self._weights

    def sample(self, n: int, generator: torch.Generator) -> SampleSet:
        """``n`` masked copies of the trained weights ``{key: [n, ...]}``; only the last Linear's weight varies."""
        model, weights = self._fitted()
        _, name, last = dropout_layers(model)
        masks = draw_masks(n, last.in_features, self.p, generator)
        out = {k: v[None].expand(n, *v.shape).clone() for k, v in weights.items()}
        out[f"{name}.weight"] = masked_weights(weights[f"{name}.weight"], masks, self.p)
        return out

    @torch.no_grad()
    def predict_own(self, images: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
        """Probabilities ``[n, N, C]`` of the dropout network with mask i (drawn as ``sample`` draws
        them) applied to the last layer's input of every image."""
        model, _ = self._fitted()
        drop, _, last = dropout_layers(model)
        masks = draw_masks(n, last.in_features, self.p, generator)
        out = []
        for mask in masks.to(self.device):
            handle = drop.register_forward_hook(lambda _m, inputs, _out: inputs[0] * mask / (1.0 - self.p))
            try:
                out.append(predict_with_weights(model, {k: v[None] for k, v in model.state_dict().items()}, images)[0])
            finally:
                handle.remove()
        return torch.stack(out)
