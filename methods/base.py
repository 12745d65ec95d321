"""The common interface of every posterior approximation.

A method is fitted around one trained base network (one-mode) or, one at a time, around
each of K base networks (multi-mode); it then draws weight samples as a **sample set**
keyed exactly like the plain model's state dict, so MMD and the symmetry engine can treat
every method alike. Methods that change the architecture (dropout masks, BLiTZ layers)
still return plain-keyed weights.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, Mapping

import torch
from torch import nn
from torch.func import functional_call

from benchmark.experiment import Experiment
from benchmark.store import SampleSet, sample_count

MODES = ("one", "multi")


class MethodConfigError(ValueError):
    """A method/model/mode combination that cannot work; raised before any training."""


class MethodFitError(RuntimeError):
    """A fit around one base network gave no usable approximation (e.g. a retrained network
    failed the recipe's convergence rule); NaN/Inf raises ``NonFiniteError`` instead."""


class PosteriorMethod(ABC):
    """Base class of the methods in ``methods/``.

    Subclasses set ``name`` and ``modes`` (and ``samples_per_base`` if fixed) and implement ``fit``, ``sample`` and
    ``predict_own``. ``settings`` is the method's config node (``cfg.methods.<name>``).
    """

    name: ClassVar[str]
    modes: ClassVar[tuple[str, ...]] = MODES
    # Fixed number of samples drawn around each base network (Deep Ensembles: 1, each member
    # is a sample); None = the mode's split (one: all samples, multi: per_method / modes_multi).
    samples_per_base: ClassVar[int | None] = None

    def __init__(self, exp: Experiment, settings: Mapping[str, Any]) -> None:
        self.exp = exp
        self.settings = settings

    def check(self, mode: str) -> None:
        """Refuse a combination that cannot work, with the reason and the setting to use instead.

        Called before any training; the default checks only the mode.
        """
        if mode not in self.modes:
            raise MethodConfigError(
                f"method={self.name} mode={mode}: this method supports mode={' or mode='.join(self.modes)}"
            )

    @abstractmethod
    def fit(self, base: dict[str, torch.Tensor], seed: int) -> None:
        """Fit the approximation around ``base`` (a trained plain-model state dict).

        ``seed`` fixes every random choice of the fit (data order, initialisation of
        retrained networks). NaN/Inf during fitting raises ``benchmark.training.NonFiniteError``.
        """

    @abstractmethod
    def sample(self, n: int, generator: torch.Generator) -> SampleSet:
        """``n`` weight samples ``{key: [n, ...]}`` keyed like the plain model's state dict."""

    @abstractmethod
    def predict_own(self, images: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
        """Probabilities ``[n, N, C]`` on ``images`` ``[N, ...]`` through the method's own machinery.

        Must consume ``generator`` exactly as ``sample`` does, so that with two generators
        seeded alike, prediction i corresponds to weight sample i (the consistency test).
        """


@torch.no_grad()
def predict_with_weights(
    model: nn.Module, sample_set: SampleSet, images: torch.Tensor, batch_size: int = 1024
) -> torch.Tensor:
    """Softmax probabilities ``[S, N, C]`` (float32, CPU) of the plain ``model`` run with each
    weight sample of ``sample_set`` on ``images`` ``[N, ...]``, in eval mode."""
    model.eval()
    device = next(model.parameters()).device
    out = []
    for i in range(sample_count(sample_set)):
        weights = {k: v[i].to(device) for k, v in sample_set.items()}
        probs = [
            torch.softmax(functional_call(model, weights, (images[a : a + batch_size].to(device),)), dim=-1).float().cpu()
            for a in range(0, len(images), batch_size)
        ]
        out.append(torch.cat(probs))
    return torch.stack(out)
