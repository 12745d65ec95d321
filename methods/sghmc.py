"""SGHMC started from a trained checkpoint (one-mode only), integrated by `posteriors`.

SGHMC (Chen et al. 2014) simulates underdamped Langevin dynamics (momentum, friction,
injected noise) with minibatch gradients. We integrate it with ``posteriors.sgmcmc.baoa``
(Leimkuhler & Matthews' BAOA splitting, one gradient per step) rather than
``posteriors.sgmcmc.sghmc``, whose explicit-Euler step (position moved with the old
momentum, momentum kicked with the old gradient) diverges once ``lr * curvature > friction``
and inflated the stiff variance of the 2-D Gaussian test by 19% at ``lr = 0.05``; BAOA
samples a Gaussian's positions exactly at any stable step (``lr^2 * curvature < 4``).

Target: the per-example log posterior
``log p(theta | batch) / N = -mean NLL(batch) - weight_decay / 2 * |theta|^2`` at temperature
``temperature / N``, i.e. ``p(theta | D)^(1/temperature)`` with the Gaussian prior of
precision ``N * weight_decay`` that the L2-regularised training implies. Per step (unit mass):
``m += lr * grad``; ``theta += lr/2 * m``; ``m = exp(-friction * lr) * m + noise``;
``theta += lr/2 * m`` -- roughly SGD with learning rate ``lr^2`` and momentum
``exp(-friction * lr)``, plus Langevin noise.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from benchmark.data import InMemoryImageDataset
from benchmark.models import predict_with_weights
from benchmark.settings import require
from benchmark.store import SampleSet, stack_state_dicts
from benchmark.training import NonFiniteError, iterate_batches, seeded
from methods.base import MethodConfigError, MethodSettings, PosteriorMethod

with warnings.catch_warnings():  # tensordict warns about its dataclass defaults at import
    warnings.filterwarnings("ignore", category=FutureWarning)
    from posteriors.sgmcmc import baoa

LogPosterior = Callable[[Mapping[str, torch.Tensor], Any], tuple[torch.Tensor, Any]]


@dataclass(frozen=True)
class Chain:
    """An SGHMC chain (BAOA steps) on ``log_posterior(params, batch) -> (value, aux)`` (``posteriors``' form).

    ``lr`` is the step size, ``friction`` the friction alpha, ``temperature`` the temperature
    of the (unnormalised) target ``exp(log_posterior / temperature)``.
    """

    log_posterior: LogPosterior
    lr: float
    friction: float
    temperature: float

    def start(self, params: Mapping[str, torch.Tensor]) -> baoa.BAOAState:
        """Initial state: a copy of ``params`` (``{name: tensor}``) with zero momenta."""
        return baoa.init({k: v.detach().clone() for k, v in params.items()}, momenta=0.0)

    def run(self, state: baoa.BAOAState, batches: Iterator[Any], steps: int, where: str) -> baoa.BAOAState:
        """Advance ``state`` in place by ``steps`` updates, one batch of ``batches`` each.

        Noise comes from torch's global RNG. A non-finite log posterior or parameter raises
        ``NonFiniteError`` naming ``where`` and the step.
        """
        for step in range(steps):
            state, _ = baoa.update(
                state, next(batches), self.log_posterior, lr=self.lr, alpha=self.friction,
                temperature=self.temperature, inplace=True,
            )
            if not bool(torch.isfinite(state.log_posterior)):
                raise NonFiniteError(f"{where}: log posterior became {float(state.log_posterior)} at step {step + 1}")
        for name, value in state.params.items():
            if not bool(torch.isfinite(value).all()):
                raise NonFiniteError(f"{where}: parameter {name!r} became NaN/Inf")
        return state

    def thinned(
        self, state: baoa.BAOAState, batches: Iterator[Any], n: int, thinning: int, where: str
    ) -> Iterator[dict[str, torch.Tensor]]:
        """Run ``n * thinning`` more steps from ``state`` (in place); yield a copy of the
        parameters after every ``thinning`` steps (``n`` states)."""
        for i in range(n):
            state = self.run(state, batches, thinning, f"{where}, kept state {i + 1}")
            yield {k: v.detach().clone() for k, v in state.params.items()}


def copy_state(state: baoa.BAOAState) -> baoa.BAOAState:
    """An independent copy of a chain state (parameters and momenta)."""
    return baoa.BAOAState(
        {k: v.clone() for k, v in state.params.items()}, {k: v.clone() for k, v in state.momenta.items()}
    )


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
    """SGHMC settings. ``lr``: step size (lr 0.1 with friction 1 moves like SGD with learning
    rate lr^2 = 0.01 and momentum exp(-0.1) = 0.90); ``friction``: alpha; ``temperature`` of the
    target ``p(theta | D)^(1/temperature)``; ``weight_decay``: the Gaussian prior's precision
    per example (null = the recipe's weight decay); ``batch_size`` (null = the recipe's);
    ``burn_in_epochs``: steps discarded after the base checkpoint, in epochs of the train set;
    ``thinning_epochs``: steps between kept states, in epochs (any positive fraction).
    """

    lr: float = 0.1
    friction: float = 1.0
    temperature: float = 1.0
    weight_decay: Optional[float] = None
    batch_size: Optional[int] = None
    burn_in_epochs: float = 10.0
    thinning_epochs: float = 1.0

    def __post_init__(self) -> None:
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
        self._state: baoa.BAOAState | None = None
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
            lr=settings.lr, friction=settings.friction, temperature=settings.temperature / n,
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
        chain = self._chain(settings)
        where = f"sghmc seed {seed}, burn-in"
        with seeded(seed):
            state = chain.run(chain.start(dict(model.named_parameters())), self._batches(settings, seed), settings.burn_in, where)
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
        with seeded(seed):
            for params in chain.thinned(copy_state(self._state), self._batches(settings, seed), n, settings.thinning,
                                        "sghmc sampling"):
                merged = {**params, **self._buffers}
                yield {k: merged[k] for k in keys}

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
