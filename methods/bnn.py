"""Variational BNN (Bayes by Backprop with BLiTZ layers; paper appendix B.1).

The vBNN is trained from scratch with the experiment's recipe (changed per experiment by
``train``), no weight decay, and an ELBO of ``elbo_samples`` Monte Carlo terms per step with
the KL weighted by ``kl_weight``. Its weight samples are BLiTZ draws, returned keyed like
the plain model. Which layers are variational: ``layers`` (set per model in ``conf/model/*.yaml``).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from blitz.losses import kl_divergence_from_nn
from torch import nn

from benchmark.core.settings import SettingsError, require
from benchmark.core.store import SampleSet, stack_state_dicts
from benchmark.core.training import (
    LossFn, NonFiniteError, OptimizerChain, Recipe, RecipeOverrides, TrainResult, make_optimizer, seeded, train_network,
)
from benchmark.core.training.stacked import StackedNetworks, stacked_networks
from benchmark.core.training.vectorised import stacking_problem, train_networks
from methods.base import MethodConfigError, MethodFitError, MethodSettings, PosteriorMethod
from methods.bayesian_layers import BayesianNetwork, BNNLayers, check_convertible, to_bayesian
from methods.bnn_stacked import Transform, VariationalObjective

log = logging.getLogger(__name__)

PREDICT_BATCH = 1024
# Fewest vBNNs worth stacking: alone, a vBNN trains faster through BLiTZ's layers (15 digits epochs:
# 4.2 s against 6.3 s stacked, whose kernels compute 16 lanes at once for its 3 draws); 10 stacked
# cost 7.4 s against ~41 s one at a time.
MIN_STACK = 2


class RhoOptimizer(str, Enum):
    """What trains the variational scales ``rho`` (sigma = softplus(rho))."""

    sgd = "sgd"
    """The recipe's SGD, with the means (the paper's vBNN)."""
    adam = "adam"
    """A separate Adam on the rho parameters (the means keep the recipe's SGD)."""


@dataclass
class VarianceSettings:
    """How the variational posterior's standard deviations start and learn.

    The defaults are the paper's (BLiTZ's initialisation rho ~ -7 Linear / -6 Conv2d, i.e.
    sigma ~ 1e-3, trained by the recipe's SGD with the means). Under SGD the gradient on rho
    is scaled by sigmoid(rho) ~ sigma ~ 1e-3, so sigma barely moves from its initial value and the
    vBNN is close to a point mass. ``rho_init`` (null = BLiTZ's), ``optimizer`` and ``lr`` (the
    rate of the rho group at the recipe's initial rate, following its schedule; null = the
    recipe's lr for sgd, 1e-3 for adam) let sigma learn, e.g. ``rho_init: -5, optimizer: adam,
    lr: 0.003``.
    """

    rho_init: Optional[float] = None
    optimizer: RhoOptimizer = RhoOptimizer.sgd
    lr: Optional[float] = None

    def __post_init__(self) -> None:
        self.optimizer = RhoOptimizer(self.optimizer)
        require(self.rho_init is None or -20 < self.rho_init < 5, "rho_init", self.rho_init,
                "a number in (-20, 5) or null (= BLiTZ's -7 / -6)")
        require(self.lr is None or self.lr > 0, "lr", self.lr, "a positive number or null")


@dataclass
class BNNSettings(MethodSettings):
    """vBNN settings (appendix B.1).

    ``elbo_samples``: Monte Carlo terms of the ELBO per step (paper: 3). ``kl_weight``: weight
    of BLiTZ's KL term in the per-example loss; ``null`` = 1/N of the train set (the exact
    per-example ELBO). ``train``: changes to the experiment's recipe for the vBNN (weight decay
    is always 0). ``layers``: which layers are variational (set per model in ``conf/model/*.yaml``). ``variance``:
    how the posterior scales start and learn (``VarianceSettings``; default the paper's).
    """

    elbo_samples: int = 3
    kl_weight: Optional[float] = None
    train: RecipeOverrides = field(default_factory=RecipeOverrides)
    layers: BNNLayers = BNNLayers.all
    variance: VarianceSettings = field(default_factory=VarianceSettings)

    def __post_init__(self) -> None:
        self.layers = BNNLayers(self.layers)
        if isinstance(self.variance, dict):
            self.variance = VarianceSettings(**self.variance)
        if isinstance(self.train, dict):
            self.train = RecipeOverrides(**self.train)
        require(self.elbo_samples >= 1, "elbo_samples", self.elbo_samples, "a positive integer")
        require(self.kl_weight is None or self.kl_weight >= 0, "kl_weight", self.kl_weight, "a number >= 0 or null (= 1/N)")


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
    order = 20
    paper_label = "BNN"
    label = "BNN"
    family_note = (
        "vBNN rows: BLiTZ's mean-field Gaussian posterior under its N(0, 0.1^2) prior, whose log-density BLiTZ "
        "computes as log(pdf + 1e-6), which is flat (no pull towards 0) beyond |w| of about 0.55; the KL weight each "
        "row was trained with is in diagnostics.md (1/N of the training split is the exact ELBO)."
    )
    diagnostics_note = (
        "vBNN: mean sigma/|mu| per parameter tensor (0 = a point mass); with BLiTZ's initialisation (sigma ~ 1e-3) "
        "trained by SGD, sigma barely leaves its start (methods.bnn.variance lets it learn). kl_weight: the weight "
        "of the KL term in the per-example loss; kl_weight_times_n: that weight times the training split's size (1 = "
        "the exact ELBO, the paper's recipe; below 1 a tempered posterior)."
    )
    fits_can_fail = True
    Settings = BNNSettings
    network_stacks = True
    """Declared by the class that defines ``variational_network``: ``VariationalObjective`` reproduces
    that network (with ``stacked_template``, ``stacked_form`` and ``stacked_transforms``). A subclass
    that builds another network without declaring it is trained one at a time through BLiTZ."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._net: BayesianNetwork | None = None
        self._prefitted: dict[int, tuple[BayesianNetwork, TrainResult | NonFiniteError]] = {}

    def check(self, mode: str) -> None:
        super().check(mode)
        self.bnn_recipe()
        with seeded(0):  # building a model draws from the global RNG; leave it as it was
            model = self.model_factory()
        try:
            check_convertible(model, self.settings.layers)
        except ValueError as err:
            raise MethodConfigError(f"method=bnn: {err}") from err

    def bnn_recipe(self) -> Recipe:
        """The experiment's recipe changed by ``settings.train``, without weight decay."""
        try:
            return self.settings.train.apply(self.recipe, weight_decay=0.0)
        except SettingsError as err:
            raise SettingsError(f"train.{err.key}", err.value, err.expected) from err

    def optimizer_factory(self, net: BayesianNetwork):
        """None (the recipe's SGD for every parameter) for the paper's vBNN; otherwise SGD for the
        means and the other parameters, and a separate group for the samplers' rho parameters."""
        variance, recipe = self.settings.variance, self.bnn_recipe()
        if variance.optimizer == RhoOptimizer.sgd and variance.lr is None:
            return None
        default = recipe.lr if variance.optimizer == RhoOptimizer.sgd else 1e-3

        def build(model: nn.Module, recipe: Recipe):
            rho = [sampler.rho for sampler in net.samplers.values()]
            ids = {id(p) for p in rho}
            others = make_optimizer([p for p in model.parameters() if id(p) not in ids], recipe)
            group = {"params": rho, "lr_scale": (variance.lr or default) / recipe.lr}
            if variance.optimizer == RhoOptimizer.adam:
                return OptimizerChain(others, torch.optim.Adam([group], lr=variance.lr or default))
            others.add_param_group({**group, "weight_decay": 0.0})
            return others

        return build

    def kl_weight(self) -> float:
        """``settings.kl_weight``, or 1 / train-set size when it is null."""
        weight = self.settings.kl_weight
        return 1.0 / len(self.data.train) if weight is None else float(weight)

    # --- interface ------------------------------------------------------------------------
    def stacking_problem(self) -> str | None:
        """Why this vBNN cannot be trained as stacked networks (``methods.bnn_stacked``), or None:
        it needs a network the stacked objective reproduces (``network_stacks``), every layer
        variational, the recipe's SGD for the scales, an in-memory training set and an architecture
        the stacked networks run."""
        owner = next(c for c in type(self).__mro__ if "variational_network" in c.__dict__)
        if not owner.__dict__.get("network_stacks", False):
            return f"method={self.name} builds its own network"
        if self.settings.layers != BNNLayers.all:
            return f"layers={self.settings.layers.value}: the point-estimate layers are not stacked"
        if self.optimizer_factory(None) is not None:
            return "variance.optimizer/lr: the scales have their own optimizer"
        if self.data.check is None:
            return "no validation split to judge the convergence rule on"
        return stacking_problem(self.data.train, lambda: self.stacked_form(self.stacked_template()))

    def stacked_template(self) -> nn.Module:
        """A plain network of the architecture the vBNN's draws run in (on the device; built from
        torch's global RNG, whose values do not matter): the plain model. Variants change it."""
        return self.new_model()

    def stacked_form(self, template: nn.Module) -> StackedNetworks:
        """How K networks of ``template``'s architecture run stacked (``stacked_networks``)."""
        return stacked_networks(template, self.device)

    def stacked_transforms(self) -> dict[str, Transform]:
        """``{plain key: transform}`` of the parameters that are a transform of their Gaussian draw
        (``VariationalObjective``): none for the plain vBNN."""
        return {}

    def prefit(self, seeds: Sequence[int], load_base: Callable[[int], dict[str, torch.Tensor]]) -> None:
        """Train the vBNNs of ``seeds`` together as stacked networks when the vBNN can be
        (``stacking_problem``) and there are at least ``MIN_STACK`` of them: each as ``fit`` would
        train it alone through BLiTZ, up to float rounding (``methods.bnn_stacked``); ``fit`` then
        takes its result."""
        todo = [int(s) for s in seeds if int(s) not in self._prefitted]
        if len(todo) < MIN_STACK or self.stacking_problem() is not None:
            return
        nets, states = [], []
        for seed in todo:
            with seeded(seed):
                nets.append(self.variational_network())
                nets[-1].model.to(self.device)
                states.append(torch.get_rng_state())  # where BLiTZ's draws would start
        with seeded(0):  # building a model draws from the global RNG; leave it as it was
            template = self.stacked_template()
        objective = VariationalObjective(template, self.stacked_form(template), nets, states,
                                         self.settings.elbo_samples, self.kl_weight(), self.data.input_shape,
                                         transforms=self.stacked_transforms())
        templates = [template] * len(todo)  # the architecture and device: the objective holds the parameters
        outcomes = train_networks(templates, self.data, self.bnn_recipe(), todo, [f"bnn seed {s}" for s in todo],
                                  objective=objective, progress=f"{self.name}: {len(todo)} networks stacked")
        for seed, net, outcome in zip(todo, nets, outcomes):
            if isinstance(outcome, TrainResult):
                objective.load_into(net, outcome.state_dict)
            self._prefitted[seed] = (net, outcome)

    def fit(self, base: dict[str, torch.Tensor], seed: int) -> None:
        """Train a vBNN from scratch under ``seed`` (``base`` is not used; see the class doc):
        through BLiTZ's layers, or, when ``prefit`` trained it with others, as stacked networks,
        which follow the same training up to float rounding.

        Raises ``NonFiniteError`` on NaN/Inf, ``MethodFitError`` if the recipe's
        non-convergence rule fails; nothing is kept from a failed fit.
        """
        self._net = None
        where = f"bnn seed {seed}"
        if seed in self._prefitted:
            net, result = self._prefitted[seed]  # kept: a base shared by two units is trained once
            if isinstance(result, NonFiniteError):
                raise result
        else:
            with seeded(seed):
                net = self.variational_network()
                net.model.to(self.device)
                result = train_network(
                    net.model, self.data.train, self.data.check, self.bnn_recipe(), seed, where=where,
                    loss_fn=elbo_loss(self.settings.elbo_samples, self.kl_weight()),
                    optimizer_factory=self.optimizer_factory(net),
                )
        if result.failure:
            raise MethodFitError(f"{where}: {result.failure}")
        log.info("%s: validation accuracy of one draw %.3f after %d epochs", where, result.check_accuracy, result.epochs_run)
        self._net = net

    def variational_network(self) -> BayesianNetwork:
        """The network ``fit`` trains, built from a fresh plain model (called under the fit's seed):
        BLiTZ layers in place of ``settings.layers``. Variants (``methods.bnn_ordered``,
        ``methods.bnn_skip``) change it."""
        return to_bayesian(self.model_factory(), self.settings.layers, self.settings.variance.rho_init)

    def diagnostics(self, images: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        """Per layer, the mean ``sigma / |mu|`` (``sigma_over_mu.<layer>``, how far from a point
        mass the posterior is), the mean ``sigma`` over the layer's weights, and the KL weight the
        fit used (``kl_weight``; ``kl_weight_times_n`` = 1 for the exact ELBO)."""
        if self._net is None:
            return {}
        out = {"kl_weight": self.kl_weight(), "kl_weight_times_n": self.kl_weight() * len(self.data.train)}
        for key, ratio in self._net.sigma_over_mu().items():
            out[f"sigma_over_mu.{key}"] = ratio
        out["sigma_mean"] = sum(self._net.sigma_mean().values()) / len(self._net.samplers)
        return out

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
        probe = torch.zeros(1, *self.data.input_shape, device=self.device)
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
                    logits = net.model(images[start : start + PREDICT_BATCH].to(self.device))
                probs.append(torch.softmax(logits, dim=-1).float().cpu())
            out.append(torch.cat(probs))
        return torch.stack(out)
