"""SGHMC started from a trained checkpoint (one-mode only), with the minibatch gradient noise
accounted for, so that the chain samples the configured tempered posterior.

SGHMC (Chen et al. 2014) simulates underdamped Langevin dynamics (momentum, friction, injected
noise) with minibatch gradients, integrated here by Leimkuhler & Matthews' BAOA splitting (one
gradient per step; it samples a Gaussian's positions exactly at any stable step, where an
explicit-Euler SGHMC step inflates stiff variances). Per step, with unit mass, step ``lr``,
friction ``friction`` and ``c = exp(-friction * lr)``:

    m += lr * g;  theta += lr/2 * m;  m = c m + sqrt((1 - c^2) (T - lr V / (2 friction))_+) z;  theta += lr/2 * m

Target: ``exp(log_posterior / T)`` with the per-example log posterior
``log p(theta | batch) / N = -mean NLL(batch) - weight_decay / 2 * |theta|^2`` and ``T =
temperature / N``, i.e. ``p(theta | D)^(1/temperature)`` with the Gaussian prior of precision
``N * weight_decay`` that the L2-regularised training implies.

The minibatch gradient ``g`` is the full-data gradient plus noise of variance ``V`` per
coordinate; the B-step then injects ``lr^2 V`` into the momentum on top of the O-step's noise,
which alone makes the chain run hot (at digits' default settings, about as much noise again as
intended). With ``noise_correction`` the O-step injects only what is missing (Chen et al.'s
correction, in BAOA form): ``V`` is estimated every step from the two half-batch gradients
``g1, g2`` (``E[(g1 - g2)^2] n1 n2 / (n1 + n2)^2 = V``) and averaged over the chain; where the
gradient noise alone exceeds the target (``lr V / (2 friction) > T``), nothing is injected and
the chain is hotter than asked there (the clamped fraction is reported; lower ``lr`` then).
Full-batch gradients (``batch_size`` >= N) have no noise and need no correction. ``posteriors``'
BAOA has no such correction, hence this integrator.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad_and_value

from benchmark.core.data import InMemoryImageDataset
from benchmark.core.models import predict_with_weights
from benchmark.core.settings import require
from benchmark.core.store import SampleSet, stack_state_dicts
from benchmark.core.training import NonFiniteError, iterate_batches, seeded
from methods.base import MethodConfigError, MethodSettings, PosteriorMethod

log = logging.getLogger(__name__)
LogPosterior = Callable[[Mapping[str, torch.Tensor], Any], tuple[torch.Tensor, Any]]
Params = dict[str, torch.Tensor]


@dataclass
class ChainState:
    """Where a chain is: ``params`` and ``momenta`` (``{name: tensor}``), the running estimate of
    the minibatch gradient-noise variance per coordinate (``noise_variance``, averaged over
    ``steps`` steps), and running sums for the diagnostics."""

    params: Params
    momenta: Params
    noise_variance: Params = field(default_factory=dict)
    steps: int = 0
    log_posterior: float = math.nan
    kinetic_sum: float = 0.0  # sum over steps of mean(m^2) / T
    clamped_sum: float = 0.0  # sum over steps of the fraction of coordinates whose injected noise is clamped at 0

    def copy(self) -> "ChainState":
        """An independent copy (tensors cloned)."""
        clone = lambda tree: {k: v.clone() for k, v in tree.items()}  # noqa: E731
        return ChainState(clone(self.params), clone(self.momenta), clone(self.noise_variance), self.steps,
                          self.log_posterior, self.kinetic_sum, self.clamped_sum)


@dataclass(frozen=True)
class Chain:
    """An SGHMC chain (BAOA steps) on ``log_posterior(params, batch) -> (value, aux)``, the batch a
    tuple of tensors whose first axis is the examples (the value is the mean over them plus the
    per-example log prior).

    ``lr`` is the step size, ``friction`` the friction alpha, ``temperature`` the temperature of
    the (unnormalised) target ``exp(log_posterior / temperature)``; ``noise_correction`` removes the
    estimated minibatch gradient noise from the injected noise (see the module doc).
    """

    log_posterior: LogPosterior
    lr: float
    friction: float
    temperature: float
    noise_correction: bool = True

    def start(self, params: Mapping[str, torch.Tensor]) -> ChainState:
        """Initial state: a copy of ``params`` (``{name: tensor}``) with zero momenta."""
        params = {k: v.detach().clone() for k, v in params.items()}
        return ChainState(params, {k: torch.zeros_like(v) for k, v in params.items()},
                          {k: torch.zeros_like(v) for k, v in params.items()})

    def _gradient(self, params: Params, batch: tuple) -> tuple[Params, float, Params | None]:
        """``(gradient, log posterior, per-coordinate noise variance of this step's gradient)``;
        the variance from the two halves of the batch (None without correction or a batch < 2)."""
        grad = grad_and_value(lambda p, b: self.log_posterior(p, b), has_aux=True)
        size = len(batch[0]) if isinstance(batch, tuple) and batch else 0
        if not self.noise_correction or size < 2:
            g, (value, _) = grad(params, batch)
            return g, float(value), None
        n1 = size // 2
        halves = [tuple(t[:n1] for t in batch), tuple(t[n1:] for t in batch)]
        (g1, (v1, _)), (g2, (v2, _)) = (grad(params, half) for half in halves)
        w1, w2 = n1 / size, (size - n1) / size
        gradient = {k: w1 * g1[k] + w2 * g2[k] for k in g1}
        variance = {k: (g1[k] - g2[k]) ** 2 * (w1 * w2) for k in g1}
        return gradient, float(w1 * v1 + w2 * v2), variance

    def step(self, state: ChainState, batch: tuple) -> None:
        """One BAOA step in place (noise from torch's global RNG)."""
        gradient, value, variance = self._gradient(state.params, batch)
        state.steps += 1
        state.log_posterior = value
        if variance is not None:  # running mean of the per-step estimates (each a 1-dof chi-square)
            for k, v in variance.items():
                state.noise_variance[k] += (v - state.noise_variance[k]) / state.steps
        c = math.exp(-self.friction * self.lr)
        clamped = total = kinetic = 0.0
        for k, theta in state.params.items():
            m = state.momenta[k]
            m.add_(gradient[k], alpha=self.lr)
            theta.add_(m, alpha=self.lr / 2)
            missing = self.temperature - self.lr * state.noise_variance[k] / (2 * self.friction)
            clamped += float((missing <= 0).sum())
            total += m.numel()
            m.mul_(c).add_(torch.sqrt((1 - c * c) * missing.clamp_min(0.0)) * torch.randn_like(m))
            theta.add_(m, alpha=self.lr / 2)
            kinetic += float((m * m).sum())
        state.kinetic_sum += kinetic / total / self.temperature
        state.clamped_sum += clamped / total

    def run(self, state: ChainState, batches: Iterator[Any], steps: int, where: str) -> ChainState:
        """Advance ``state`` in place by ``steps`` updates, one batch of ``batches`` each.

        A non-finite log posterior or parameter raises ``NonFiniteError`` naming ``where`` and the step.
        """
        for step in range(steps):
            self.step(state, next(batches))
            if not math.isfinite(state.log_posterior):
                raise NonFiniteError(
                    f"{where}: log posterior became {state.log_posterior} at step {step + 1} (the step is too large "
                    f"for the curvature here: lower methods.sghmc.lr, now {self.lr})"
                )
        for name, value in state.params.items():
            if not bool(torch.isfinite(value).all()):
                raise NonFiniteError(f"{where}: parameter {name!r} became NaN/Inf (lower methods.sghmc.lr, now {self.lr})")
        return state

    def thinned(
        self, state: ChainState, batches: Iterator[Any], n: int, thinning: int, where: str
    ) -> Iterator[Params]:
        """Run ``n * thinning`` more steps from ``state`` (in place); yield a copy of the
        parameters after every ``thinning`` steps (``n`` states)."""
        for i in range(n):
            state = self.run(state, batches, thinning, f"{where}, kept state {i + 1}")
            yield {k: v.detach().clone() for k, v in state.params.items()}


def network_log_posterior(model: nn.Module, buffers: Mapping[str, torch.Tensor], weight_decay: float) -> LogPosterior:
    """Per-example log posterior of ``model`` (run in eval mode with ``buffers``):
    ``(params, (images [B, ...], labels [B])) -> (-mean NLL - weight_decay/2 |params|^2, logits [B, C])``."""
    model.eval()

    def log_posterior(params: Mapping[str, torch.Tensor], batch: tuple[torch.Tensor, torch.Tensor]):
        images, labels = batch
        logits = functional_call(model, {**params, **buffers}, (images,))
        log_prior = -0.5 * weight_decay * sum((p**2).sum() for p in params.values())
        return -F.cross_entropy(logits, labels) + log_prior, logits

    return log_posterior


def endless_batches(
    dataset: InMemoryImageDataset, batch_size: int, generator: torch.Generator, device: torch.device
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Shuffled minibatches ``(images [B, ...], labels [B])``, epoch after epoch, order from ``generator``."""
    while True:
        yield from iterate_batches(dataset, batch_size, generator, device)


@dataclass
class SGHMCSettings(MethodSettings):
    """SGHMC settings. ``lr``: step size (lr 0.05 with friction 1 moves like SGD with learning
    rate lr^2 = 0.0025 and momentum exp(-0.05) = 0.95; at 0.1 the minibatch gradient noise alone
    exceeded the target on 10% of OptuNet's coordinates on digits, 3% at 0.05); ``friction``: alpha; ``temperature`` of the
    target ``p(theta | D)^(1/temperature)``; ``weight_decay``: the Gaussian prior's precision
    per example (null = the recipe's weight decay); ``batch_size`` (null = the recipe's);
    ``burn_in_epochs``: steps discarded after the base checkpoint, in epochs of the train set;
    ``thinning_epochs``: steps between kept states, in epochs (any positive fraction);
    ``noise_correction``: remove the estimated minibatch gradient noise from the injected noise
    (see the module doc; false = plain SGHMC, which runs hot); ``step_halvings``: when the
    burn-in diverges (a step too large for the curvature at the base, e.g. a barely trained
    ResNet-18 whose BatchNorm statistics are far off), restart it with half the step, at most
    this many times (the step used is in the diagnostics).
    """

    lr: float = 0.05
    friction: float = 1.0
    temperature: float = 1.0
    weight_decay: Optional[float] = None
    batch_size: Optional[int] = None
    burn_in_epochs: float = 10.0
    thinning_epochs: float = 2.0
    noise_correction: bool = True
    step_halvings: int = 2

    def __post_init__(self) -> None:
        require(self.step_halvings >= 0, "step_halvings", self.step_halvings, "an integer >= 0")
        for key in ("lr", "friction", "temperature", "thinning_epochs"):
            value = getattr(self, key)
            require(math.isfinite(value) and value > 0, key, value, "a positive number")
        require(math.isfinite(self.burn_in_epochs) and self.burn_in_epochs >= 0, "burn_in_epochs",
                self.burn_in_epochs, "a number >= 0")
        require(self.weight_decay is None or self.weight_decay >= 0, "weight_decay", self.weight_decay,
                "a number >= 0 or null (= train.weight_decay)")
        require(self.batch_size is None or self.batch_size >= 1, "batch_size", self.batch_size,
                "a positive integer or null (= train.batch_size)")


@dataclass(frozen=True)
class ChainPlan:
    """The settings resolved against the recipe and the train set; burn-in and thinning in steps."""

    lr: float
    friction: float
    temperature: float
    weight_decay: float
    batch_size: int
    burn_in: int
    thinning: int
    noise_correction: bool


class SGHMCMethod(PosteriorMethod):
    """One SGHMC chain from the base checkpoint on the un-augmented train set.

    ``fit(base, seed)`` runs the burn-in from ``base`` (noise and data order from ``seed``)
    and keeps the burnt-in state. ``sample(n, generator)`` continues a copy of that state for
    ``n * thinning`` steps under one seed drawn from ``generator`` and returns every
    ``thinning``-th state; ``predict_own`` re-runs the same continuation (deterministic given
    the seed) and predicts with each kept state, so the two correspond for same-seeded
    generators. The network runs in eval mode: BatchNorm uses the base's running statistics,
    which stay fixed, so the target is the posterior of the network as it predicts.
    """

    name = "sghmc"
    label = "SGHMC"
    Settings = SGHMCSettings
    modes = ("one",)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._state: ChainState | None = None
        self._sampled: ChainState | None = None
        self._lr_factor = 1.0
        self._buffers: dict[str, torch.Tensor] = {}
        self._model: nn.Module | None = None
        self._train: InMemoryImageDataset | None = None

    def check(self, mode: str) -> None:
        if mode not in self.modes:
            raise MethodConfigError(
                f"method=sghmc mode={mode}: SGHMC runs one chain from one trained checkpoint (the paper uses it "
                f"one-mode only); use mode=one"
            )
        super().check(mode)

    def plan(self) -> ChainPlan:
        """The chain's settings in steps, defaults taken from the recipe."""
        s, recipe = self.settings, self.recipe
        batch_size = recipe.batch_size if s.batch_size is None else s.batch_size
        weight_decay = recipe.weight_decay if s.weight_decay is None else s.weight_decay
        steps_per_epoch = math.ceil(len(self._train_data()) / batch_size)
        return ChainPlan(
            lr=s.lr, friction=s.friction, temperature=s.temperature, weight_decay=weight_decay, batch_size=batch_size,
            burn_in=math.ceil(s.burn_in_epochs * steps_per_epoch),
            thinning=max(1, math.ceil(s.thinning_epochs * steps_per_epoch)),
            noise_correction=s.noise_correction and batch_size < len(self._train_data()),
        )

    def _train_data(self) -> InMemoryImageDataset:
        """The un-augmented train split in memory: the data the posterior conditions on."""
        if self._train is None:
            self._train = InMemoryImageDataset(*self.data.train_tensors)
        return self._train

    def _chain(self, settings: ChainPlan) -> Chain:
        assert self._model is not None
        n = len(self._train_data())
        return Chain(
            network_log_posterior(self._model, self._buffers, settings.weight_decay),
            lr=settings.lr * self._lr_factor, friction=settings.friction, temperature=settings.temperature / n,
            noise_correction=settings.noise_correction,
        )

    def _batches(self, settings: ChainPlan, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        generator = torch.Generator().manual_seed(seed)
        return endless_batches(self._train_data(), settings.batch_size, generator, self.device)

    def fit(self, base: dict[str, torch.Tensor], seed: int) -> None:
        """Burn in a chain started at ``base`` (plain state dict); ``seed`` fixes its noise and data order.

        NaN/Inf raises ``NonFiniteError`` and leaves the method unfitted.
        """
        self._state = None
        settings = self.plan()
        with seeded(0):  # building a model draws from the global RNG; leave it as it was
            model = self.new_model()
        try:
            model.load_state_dict(base)
        except RuntimeError as err:
            raise ValueError(f"method=sghmc: the base checkpoint does not fit the model: {err}") from err
        self._model = model
        self._buffers = {k: v.detach() for k, v in model.named_buffers()}
        for halvings in range(self.settings.step_halvings + 1):
            self._lr_factor = 0.5**halvings
            chain = self._chain(settings)
            where = f"sghmc seed {seed}, burn-in at lr {chain.lr:g}"
            try:
                with seeded(seed):
                    state = chain.run(chain.start(dict(model.named_parameters())), self._batches(settings, seed),
                                      settings.burn_in, where)
                break
            except NonFiniteError as err:
                if halvings == self.settings.step_halvings:
                    raise
                log.warning("%s; restarting the burn-in with half the step", err)
        self._state = state

    def _kept_states(self, n: int, generator: torch.Generator) -> Iterator[dict[str, torch.Tensor]]:
        """The ``n`` kept plain state dicts of the continuation seeded from ``generator``."""
        if self._state is None:
            raise RuntimeError("method=sghmc: call fit() before sample() or predict_own()")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"method=sghmc: number of samples must be a positive integer, got {n!r}")
        settings = self.plan()
        seed = int(torch.randint(0, 2**62, (1,), generator=generator))
        chain = self._chain(settings)
        keys = list(self._model.state_dict())
        state = self._state.copy()
        state.kinetic_sum = state.clamped_sum = 0.0
        start = state.steps
        with seeded(seed):
            for params in chain.thinned(state, self._batches(settings, seed), n, settings.thinning, "sghmc sampling"):
                merged = {**params, **self._buffers}
                yield {k: merged[k] for k in keys}
        state.steps -= start  # the sums cover the sampling steps only
        self._sampled = state

    def diagnostics(self, images: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        """Of the last ``sample`` call's chain segment: ``kinetic_temperature`` (mean over steps of
        mean(m^2) / T: 1 when the momenta are at the configured temperature), ``clamped_fraction``
        (coordinates where the gradient noise alone exceeded the target), ``noise_to_target``
        (mean over coordinates of lr V / (2 friction T): the share of the intended noise that the
        minibatch gradients bring by themselves)."""
        state = self._sampled
        if state is None or state.steps == 0:
            return {}
        settings = self.plan()
        target = settings.temperature / len(self._train_data())
        ratio = [v * settings.lr / (2 * settings.friction * target) for v in state.noise_variance.values()]
        coordinates = sum(r.numel() for r in ratio)
        return {
            "lr": settings.lr * self._lr_factor,
            "kinetic_temperature": state.kinetic_sum / state.steps,
            "clamped_fraction": state.clamped_sum / state.steps,
            "noise_to_target": float(sum(r.sum() for r in ratio)) / coordinates,
        }

    def sample(self, n: int, generator: torch.Generator) -> SampleSet:
        """``n`` thinned chain states ``{plain key: [n, ...]}`` (CPU); buffers are the base's."""
        return stack_state_dicts([{k: v.cpu() for k, v in sd.items()} for sd in self._kept_states(n, generator)])

    def predict_own(self, images: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
        """Softmax probabilities ``[n, N, C]`` (float32, CPU) of each kept state of the same
        continuation ``sample(n, generator)`` returns, predicted as the chain reaches it."""
        return torch.cat([
            predict_with_weights(self._model, {k: v[None] for k, v in weights.items()}, images)
            for weights in self._kept_states(n, generator)
        ])
