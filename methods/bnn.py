"""Variational BNN (Bayes by Backprop with BLiTZ layers; paper appendix B.1).

The vBNN is trained from scratch with the experiment's recipe (overridable per experiment
under ``methods.bnn.train``), no weight decay, and an ELBO of ``elbo_samples`` Monte Carlo
terms per step with the KL weighted by ``kl_weight``. Its weight samples are BLiTZ draws,
returned keyed like the plain model. Which layers are variational: ``model.bnn_layers``.
"""
from __future__ import annotations

import logging
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from blitz.losses import kl_divergence_from_nn
from omegaconf import DictConfig, OmegaConf
from torch import nn

from benchmark.store import SampleSet, stack_state_dicts
from benchmark.training import LossFn, Recipe, seeded, train_network
from methods.base import MethodConfigError, MethodFitError, PosteriorMethod
from methods.bayesian_layers import BNN_LAYERS, BayesianNetwork, check_convertible, to_bayesian

log = logging.getLogger(__name__)

# Datasets on which the paper could not train vBNNs (appendix B.1): no recipe to reproduce.
UNTRAINABLE = {"tinyimagenet": "the paper did not manage to train vBNNs on TinyImageNet (appendix B.1)"}
PREDICT_BATCH = 1024


def elbo_loss(elbo_samples: int, kl_weight: float) -> LossFn:
    """Loss ``(model, images [B, ...], labels [B]) -> scalar``: the negative ELBO per example,
    averaged over ``elbo_samples`` weight draws: mean over draws of
    ``cross_entropy(model(images), labels) + kl_weight * (log q(w) - log p(w))`` (BLiTZ's
    ``sample_elbo``; the KL is BLiTZ's one-draw estimate from the last forward pass)."""

    def loss(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        total = 0.0
        for _ in range(elbo_samples):
            total = total + F.cross_entropy(model(images), labels) + kl_weight * kl_divergence_from_nn(model)
        return total / elbo_samples

    return loss


def _plain(value: Any) -> Any:
    return OmegaConf.to_container(value, resolve=True) if isinstance(value, DictConfig) else value


def draw_seeds(n: int, generator: torch.Generator) -> list[int]:
    """``n`` seeds from ``generator`` (one per weight sample), consuming it the same way every call."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"number of samples must be a positive integer, got {n!r}")
    return [int(s) for s in torch.randint(0, 2**62, (n,), generator=generator)]


class BNNMethod(PosteriorMethod):
    """Mean-field Gaussian vBNN (BLiTZ's default scale-mixture priors, 3-sample ELBO).

    ``fit(base, seed)`` trains a vBNN from scratch, as the paper does: the posterior means
    start from the plain model's initialisation under ``seed`` and the data order is that
    of ``seed``, i.e. the vBNN starts where the base network started (an initialisation known
    to train); ``base``'s trained weights are not used: starting from them would turn the
    method into a local fit around a mode. Weight samples are
    BLiTZ draws; ``predict_own`` is the BLiTZ network's forward pass with the same draws.
    """

    name = "bnn"

    def __init__(self, exp, settings: Mapping[str, Any]) -> None:
        super().__init__(exp, settings)
        self._net: BayesianNetwork | None = None

    # --- settings -------------------------------------------------------------------------
    def check(self, mode: str) -> None:
        super().check(mode)
        self._layers()
        self._recipe()
        self._elbo_settings()

    def _layers(self) -> str:
        dataset = self.exp.info.name
        if dataset in UNTRAINABLE:
            raise MethodConfigError(
                f"method=bnn on dataset={dataset}: {UNTRAINABLE[dataset]}, so there is no recipe to reproduce; "
                f"run the other methods on this experiment, or use experiment=cifar100_resnet18 for a ResNet-18 vBNN"
            )
        layers = str(self.exp.cfg.model.get("bnn_layers", "all"))
        if layers not in BNN_LAYERS:
            raise MethodConfigError(f"model.bnn_layers={layers!r}: expected one of {', '.join(BNN_LAYERS)}")
        with seeded(0):  # building a model draws from the global RNG; leave it as it was
            model = self.exp.model()
        try:
            check_convertible(model, layers)
        except ValueError as err:
            raise MethodConfigError(f"method=bnn model={self.exp.cfg.model.name}: {err}") from err
        return layers

    def _recipe(self) -> Recipe:
        """The experiment's recipe, overridden by ``methods.bnn.train``, without weight decay."""
        base = _plain(self.exp.cfg.train)
        overrides = dict(_plain(self.settings.get("train")) or {})
        unknown = sorted(set(overrides) - set(base))
        if unknown:
            raise MethodConfigError(
                f"methods.bnn.train.{unknown[0]}: unknown recipe key; expected one of {', '.join(sorted(base))}"
            )
        try:
            return Recipe.from_config({**base, **overrides, "weight_decay": 0.0})
        except (ValueError, TypeError) as err:
            raise MethodConfigError(f"methods.bnn.train: {err}") from err

    def _elbo_settings(self) -> tuple[int, float]:
        """``(elbo_samples, kl_weight)``; ``kl_weight: null`` = 1 / train-set size (the exact per-example ELBO)."""
        samples = self.settings.get("elbo_samples", 3)
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
            raise MethodConfigError(f"methods.bnn.elbo_samples={samples!r}: expected a positive integer")
        weight = self.settings.get("kl_weight")
        if weight is None:
            return samples, 1.0 / len(self.exp.train_set)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight >= 0:
            raise MethodConfigError(f"methods.bnn.kl_weight={weight!r}: expected a number >= 0 or null (= 1/N)")
        return samples, float(weight)

    # --- interface ------------------------------------------------------------------------
    def fit(self, base: dict[str, torch.Tensor], seed: int) -> None:
        """Train a vBNN from scratch under ``seed`` (``base`` is not used; see the class doc).

        Raises ``NonFiniteError`` on NaN/Inf, ``MethodFitError`` if the recipe's
        non-convergence rule fails; nothing is kept from a failed fit.
        """
        self._net = None
        layers, recipe = self._layers(), self._recipe()
        elbo_samples, kl_weight = self._elbo_settings()
        where = f"{self.exp.name} bnn seed {seed}"
        with seeded(seed):
            net = to_bayesian(self.exp.model(), layers)
            net.model.to(self.exp.device)
            result = train_network(
                net.model, self.exp.train_set, self.exp.test_tensors, recipe, seed, where=where,
                loss_fn=elbo_loss(elbo_samples, kl_weight),
            )
        if result.failure:
            raise MethodFitError(f"{where}: {result.failure}")
        log.info("%s: test accuracy of one draw %.3f after %d epochs", where, result.test_accuracy, result.epochs_run)
        self._net = net

    @property
    def network(self) -> BayesianNetwork:
        """The fitted variational network (after ``fit``)."""
        if self._net is None:
            raise RuntimeError("method=bnn: call fit() before sample() or predict_own()")
        return self._net

    @torch.no_grad()
    def sample(self, n: int, generator: torch.Generator) -> SampleSet:
        """``n`` BLiTZ weight draws ``{plain key: [n, ...]}`` (CPU); draw i is the one the BLiTZ
        forward pass makes under seed i of ``draw_seeds(n, generator)``."""
        net = self.network
        net.model.eval()
        info = self.exp.info
        probe = torch.zeros(1, info.in_channels, info.image_size, info.image_size, device=self.exp.device)
        draws = []
        for seed in draw_seeds(n, generator):
            with seeded(seed):
                net.model(probe)
            draws.append({k: v.cpu() for k, v in net.last_draw().items()})
        return stack_state_dicts(draws)

    @torch.no_grad()
    def predict_own(self, images: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
        """Softmax probabilities ``[n, N, C]`` (float32, CPU) of the BLiTZ network on ``images``
        ``[N, ...]``; every batch of sample i is predicted under seed i, hence with one draw."""
        net = self.network
        net.model.eval()
        out = []
        for seed in draw_seeds(n, generator):
            probs = []
            for start in range(0, len(images), PREDICT_BATCH):
                with seeded(seed):
                    logits = net.model(images[start : start + PREDICT_BATCH].to(self.exp.device))
                probs.append(torch.softmax(logits, dim=-1).float().cpu())
            out.append(torch.cat(probs))
        return torch.stack(out)
