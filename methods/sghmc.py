"""SGHMC started from a trained checkpoint (one-mode only): independent chains that sample the
configured tempered posterior with the gradients they are given.

SGHMC (Chen et al. 2014) simulates underdamped Langevin dynamics (momentum, friction, injected
noise) with stochastic gradients, integrated here by Leimkuhler & Matthews' BAOA splitting (one
gradient per step; it samples a Gaussian's positions exactly at any stable step, where an
explicit-Euler SGHMC step inflates stiff variances). Per step, with unit mass, step ``lr``,
friction ``friction`` and ``c = exp(-friction * lr)``:

    m += lr * g;  theta += lr/2 * m;  m = c m + sqrt(((1 - c^2) T - c^2 lr^2 V)_+) z;  theta += lr/2 * m

Target: ``exp(log_posterior / T)`` with the per-example log posterior
``log p(theta | batch) / N = -mean NLL(batch) - weight_decay / 2 * |theta|^2`` and ``T =
temperature / N``, i.e. ``p(theta | D)^(1/temperature)`` with the Gaussian prior of precision
``N * weight_decay`` that the L2-regularised training implies.

Gradients. ``full_batch``: the gradient of the whole train split (chunked), which has no noise:
the chain is plain BAOA Langevin dynamics. Otherwise minibatches of ``batch_size`` examples drawn
uniformly WITH replacement, independently at every step and for every chain
(``independent_batches``). Independence matters: a per-epoch reshuffle (the training loop's
batches) makes the minibatch noise cancel over each epoch, so a correction for independent noise
then removes noise that is not there (``python studies/check_sghmc.py --sections toys``).

Minibatch noise: the step (``noise_margin``). The minibatch gradient is the full gradient plus
noise of covariance ``V``; the B-step brings ``c^2 lr^2 V`` into the momentum, against the
O-step's intended ``(1 - c^2) T`` (the share ``noise_share_at``, about ``lr V / (2 friction T)``).
No correction can remove noise above the target, and at trained OptuNets on digits (batches of
32, lr 0.05, friction 1) the noise is 12-21x the target along the top eigenvector of ``V``
while 0.09-0.17 per coordinate on average (``python studies/check_sghmc.py``, section "noise").
So before the burn-in the method measures the top eigenvalue of ``V`` at the base
(``top_noise_variance``, from the two halves of ``noise_pilot_steps`` batches) and lowers the
step until the share along that direction is at most ``noise_margin`` (``step_for_noise``):
then the chain is hot by at most about that share along the noisiest direction and less
elsewhere. On a Bayesian linear regression at digits' noise level (N = 1,295, batches of 32 from
``independent_batches``, top share 28 at lr 0.05 and friction 1; friction 9) margin 0.1 gives
1.00-1.03 of the exact variance, the unlowered step 1.56-1.79x (tests/methods/test_sghmc.py;
``python studies/check_sghmc.py --sections regression``).

Per-coordinate correction (``noise_correction``, off by default). It estimates the per-coordinate
``V_ii`` from the two halves of every batch and injects ``(1 - c^2) T - c^2 lr^2 V_ii`` instead
(the exact balance of the step above for noise that is independent across coordinates). Minibatch
noise is not: concentrated along a few directions, its diagonal spreads each coordinate's share
of the top direction's noise over every direction, and the correction removes it from all of
them: on that regression it runs cold, 0.96-0.98x at margin 0.1, 0.93-0.96x at 0.25, 0.77-0.91x
at 0.5 (uncorrected: 1.00-1.03x, 0.99-1.09x, 1.01-1.05x), and at the unlowered step 0.69-1.08x with
40% of the coordinates clamped (``studies/check_sghmc.py --sections regression``).
It is exact where the noise is spread over the coordinates (the Gaussian toys of the tests). Where
the noise alone exceeds the target, the correction clamps and the chain runs hot there (the clamped
fraction is a diagnostic). ``kinetic_temperature`` measures the momenta, not where the weights sit.
The step is set from the noise at the base; where the chains reach regions of larger noise, the
share grows past the margin (a lag no diagnostic shows).

Chains. ``chains`` independent chains start at the base checkpoint, each with its own noise and
batches; the kept states are stored chain after chain: sample ``i`` is chain ``i div
states_per_chain`` after ``burn_in + (i mod states_per_chain + 1) * thinning`` steps
(``states_per_chain = ceil(n / chains)``). The ``ess`` diagnostic reads them as chains
(``metrics.mcmc.chain_ess``: the ESS of the mean from the chain means, which holds at any number
of states per chain; ArviZ's per-chain bulk ESS beside it), so storage order plays no part.
Independence given the base is not convergence: directions flatter than about ``friction /
(lr * steps)`` keep spreading from the base (``spread_growth``), and ``stationary`` (split R-hat
of the kept states' train log-likelihood below 1.05) says whether the chains have settled; a row
whose chains have not is marked so (``stationary`` 0), not run longer. On digits no affordable
budget settles them: 40-50% of the directions at a base are nearly as flat as the prior alone, and
the step the minibatch noise allows crosses them by diffusion (``studies/sghmc_stationarity.py``). Stackable models (OptuNet)
run all chains as one stack (``benchmark.core.training.stacked``); others (ResNet-18 with
BatchNorm) one chain after another.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Optional, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from benchmark.core.data import InMemoryImageDataset
from benchmark.core.models import predict_with_weights
from benchmark.core.settings import require
from benchmark.core.store import SampleSet, SampleSetMetadata, stack_state_dicts
from benchmark.core.training import NonFiniteError, seeded
from benchmark.core.training.stacked import NotStackableError, StackedNetworks, stacked_networks
from methods.base import MethodConfigError, MethodSettings, PosteriorMethod
from metrics.mcmc import RHAT_STATIONARY, chain_ess, split_rhat

log = logging.getLogger(__name__)
Params = dict[str, torch.Tensor]
LogPosterior = Callable[[Mapping[str, torch.Tensor], Optional[torch.Tensor]], tuple[torch.Tensor, Any]]
CHUNK_ELEMENTS = 2**23  # input elements (images x pixels x chains) per chunk of a full-batch gradient (32 MiB)
DIAGNOSTIC_COORDINATES = 20_000  # weights (a fixed random subset of larger models) behind ess and spread_growth


def independent_batches(n: int, batch_size: int, chains: int, generator: torch.Generator) -> Iterator[torch.Tensor]:
    """Minibatch indices ``[chains, batch_size]`` (int64), step after step: every index drawn
    uniformly from ``[0, n)`` with replacement, independently across examples, chains and steps
    (so that the minibatch noise of successive steps, and of the two halves of a batch, is independent)."""
    while True:
        yield torch.randint(0, n, (chains, batch_size), generator=generator)


def full_batches() -> Iterator[None]:
    """The batch stream of full-batch chains: ``None`` (= the whole train split) at every step."""
    while True:
        yield None


class Target(Protocol):
    """What a chain samples: the log posterior of ``params`` (one or several chains' parameters)."""

    def value_and_grad(self, params: Params, indices: Optional[torch.Tensor]) -> tuple[float, Params]:
        """``(value, gradient)``: the sum over chains of each chain's per-example log posterior
        on minibatch ``indices`` (``[chains, B]``; ``None``: the whole data set), and its gradient
        with respect to ``params`` (same keys and shapes)."""


@dataclass(frozen=True)
class FunctionTarget:
    """A ``Target`` from a differentiable ``log_posterior(params, indices) -> (value, aux)``."""

    log_posterior: LogPosterior

    def value_and_grad(self, params: Params, indices: Optional[torch.Tensor]) -> tuple[float, Params]:
        leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
        value, _ = self.log_posterior(leaves, indices)
        grads = torch.autograd.grad(value, list(leaves.values()))
        return float(value.detach()), dict(zip(leaves, grads))


def _chunks(n: int, per_item: int) -> list[slice]:
    size = max(1, CHUNK_ELEMENTS // max(1, per_item))
    return [slice(start, min(n, start + size)) for start in range(0, n, size)]


class StackedNetworkTarget:
    """``chains`` copies of a stackable network (``StackedNetworks``) on ``data``, each with the
    per-example log posterior ``-mean NLL - weight_decay / 2 |theta|^2``."""

    def __init__(self, stacked: StackedNetworks, data: InMemoryImageDataset, weight_decay: float,
                 device: torch.device) -> None:
        self.stacked, self.weight_decay = stacked, weight_decay
        self.images = data.images.to(device)
        self.labels = data.labels.to(device)
        self.source = stacked.source(data.images, device)

    def pack(self, state: Mapping[str, torch.Tensor], chains: int) -> Params:
        """``chains`` copies of the plain parameters ``state`` in the stacked layout."""
        return self.stacked.pack([state] * chains)

    def unpack(self, params: Params, chain: int) -> dict[str, torch.Tensor]:
        """The plain parameters of chain ``chain``."""
        return self.stacked.unpack(params, chain)

    def count(self, params: Params) -> int:
        key = next(iter(params))
        return params[key].shape[self.stacked.network_axis(key)]

    def value_and_grad(self, params: Params, indices: Optional[torch.Tensor]) -> tuple[float, Params]:
        leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
        chains = self.count(params)
        n = len(self.labels)
        if indices is None:
            value, grads = 0.0, {k: torch.zeros_like(v) for k, v in params.items()}
            for part in _chunks(n, self.images[0].numel() * chains):
                logits = self.stacked.predict(leaves, self.images[part])  # [chains, b, classes]
                labels = self.labels[part].expand(chains, -1)
                nll = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / n
                for k, g in zip(leaves, torch.autograd.grad(nll, list(leaves.values()))):
                    grads[k] -= g
                value -= float(nll.detach())
        else:
            logits = self.stacked.forward(leaves, self.stacked.batch(self.source, indices, None, 0, 0.0))
            nll = F.cross_entropy(logits.flatten(0, 1), self.labels[indices].flatten(), reduction="none")
            nll = nll.view(indices.shape).mean(1).sum()
            value = -float(nll.detach())
            grads = {k: -g for k, g in zip(leaves, torch.autograd.grad(nll, list(leaves.values())))}
        return _with_prior(value, grads, params, self.weight_decay)

    @torch.no_grad()
    def log_likelihood(self, params: Params) -> torch.Tensor:
        """Mean log-likelihood over the whole data set of each chain ``[chains]`` (float64, CPU; no prior)."""
        chains, n = self.count(params), len(self.labels)
        total = torch.zeros(chains, dtype=torch.float64, device="cpu")
        for part in _chunks(n, self.images[0].numel() * chains):
            logits = self.stacked.predict(params, self.images[part])  # [chains, b, classes]
            nll = F.cross_entropy(logits.flatten(0, 1), self.labels[part].expand(chains, -1).flatten(), reduction="none")
            total -= nll.view(chains, -1).sum(1).double().cpu()
        return total / n


class NetworkTarget:
    """One chain of any network (run in eval mode with the fixed ``buffers``, e.g. BatchNorm's
    running statistics) on ``data``; per-example log posterior as ``StackedNetworkTarget``."""

    def __init__(self, model: nn.Module, buffers: Mapping[str, torch.Tensor], data: InMemoryImageDataset,
                 weight_decay: float, device: torch.device) -> None:
        self.model, self.buffers, self.weight_decay = model.eval(), dict(buffers), weight_decay
        self.images = data.images.to(device)
        self.labels = data.labels.to(device)

    def pack(self, state: Mapping[str, torch.Tensor], chains: int) -> Params:
        if chains != 1:
            raise ValueError(f"NetworkTarget runs one chain, not {chains}")
        return {k: v.detach().clone() for k, v in state.items()}

    def unpack(self, params: Params, chain: int) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().clone() for k, v in params.items()}

    def count(self, params: Params) -> int:
        return 1

    def value_and_grad(self, params: Params, indices: Optional[torch.Tensor]) -> tuple[float, Params]:
        leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
        n = len(self.labels)
        parts = _chunks(n, self.images[0].numel()) if indices is None else [indices[0]]
        value, grads = 0.0, {k: torch.zeros_like(v) for k, v in params.items()}
        for part in parts:
            logits = functional_call(self.model, {**leaves, **self.buffers}, (self.images[part],))
            nll = F.cross_entropy(logits, self.labels[part], reduction="sum") / (n if indices is None else len(part))
            for k, g in zip(leaves, torch.autograd.grad(nll, list(leaves.values()))):
                grads[k] -= g
            value -= float(nll.detach())
        return _with_prior(value, grads, params, self.weight_decay)

    @torch.no_grad()
    def log_likelihood(self, params: Params) -> torch.Tensor:
        """Mean log-likelihood over the whole data set ``[1]`` (float64, CPU; no prior)."""
        n, total = len(self.labels), 0.0
        for part in _chunks(n, self.images[0].numel()):
            logits = functional_call(self.model, {**params, **self.buffers}, (self.images[part],))
            total -= float(F.cross_entropy(logits, self.labels[part], reduction="sum"))
        return torch.tensor([total / n], dtype=torch.float64, device="cpu")


def _with_prior(value: float, grads: Params, params: Params, weight_decay: float) -> tuple[float, Params]:
    """Add the Gaussian log prior ``-weight_decay / 2 |theta|^2`` (every chain's) and its gradient."""
    if weight_decay:
        value -= 0.5 * weight_decay * sum(float((p.detach() ** 2).sum()) for p in params.values())
        grads = {k: g - weight_decay * params[k].detach() for k, g in grads.items()}
    return value, grads


@dataclass
class ChainState:
    """Where a group of chains is: ``params`` and ``momenta`` (``{name: tensor}``, the target's
    layout), the running mean of the minibatch gradient-noise variance per coordinate
    (``noise_variance``, over ``steps`` steps), and running sums for the diagnostics."""

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
    """BAOA SGHMC steps on ``target`` (a ``Target``, or a function ``log_posterior(params,
    indices) -> (value, aux)``), one batch of indices (or ``None``: full batch) per step.

    ``lr`` is the step size, ``friction`` the friction alpha, ``temperature`` the temperature of
    the (unnormalised) target ``exp(log_posterior / temperature)``; ``noise_correction`` removes the
    estimated minibatch gradient noise from the injected noise (see the module doc).
    """

    target: Any
    lr: float
    friction: float
    temperature: float
    noise_correction: bool = True

    def _target(self) -> Target:
        return self.target if hasattr(self.target, "value_and_grad") else FunctionTarget(self.target)

    def start(self, params: Mapping[str, torch.Tensor]) -> ChainState:
        """Initial state: a copy of ``params`` (``{name: tensor}``) with zero momenta."""
        params = {k: v.detach().clone() for k, v in params.items()}
        return ChainState(params, {k: torch.zeros_like(v) for k, v in params.items()},
                          {k: torch.zeros_like(v) for k, v in params.items()})

    def _gradient(self, params: Params, indices: Optional[torch.Tensor]) -> tuple[Params, float, Params | None]:
        """``(gradient, log posterior, per-coordinate noise variance of this step's gradient)``;
        the variance from the two halves of the batch (None for full batches, without correction
        or for batches of one)."""
        target = self._target()
        size = 0 if indices is None else indices.shape[-1]
        if not self.noise_correction or size < 2:
            value, g = target.value_and_grad(params, indices)
            return g, value, None
        n1 = size // 2
        v1, g1 = target.value_and_grad(params, indices[..., :n1])
        v2, g2 = target.value_and_grad(params, indices[..., n1:])
        w1, w2 = n1 / size, (size - n1) / size
        gradient = {k: w1 * g1[k] + w2 * g2[k] for k in g1}
        variance = {k: (g1[k] - g2[k]) ** 2 * (w1 * w2) for k in g1}
        return gradient, w1 * v1 + w2 * v2, variance

    def noise_share(self, variance: torch.Tensor) -> torch.Tensor:
        """Per coordinate, the share of the O-step's intended noise ``(1 - c^2) T`` that minibatch
        noise of variance ``variance`` brings by itself through the B-step: ``c^2 lr^2 V / ((1 - c^2) T)``."""
        c2 = math.exp(-2 * self.friction * self.lr)
        return variance * (c2 * self.lr**2 / ((1 - c2) * self.temperature))

    def step(self, state: ChainState, indices: Optional[torch.Tensor]) -> None:
        """One BAOA step in place (noise from torch's global RNG)."""
        gradient, value, variance = self._gradient(state.params, indices)
        state.steps += 1
        state.log_posterior = value
        if variance is not None:  # running mean of the per-step estimates (each a 1-dof chi-square)
            for k, v in variance.items():
                state.noise_variance[k] += (v - state.noise_variance[k]) / state.steps
        c = math.exp(-self.friction * self.lr)
        intended = (1 - c * c) * self.temperature
        clamped = total = kinetic = 0.0
        for k, theta in state.params.items():
            m = state.momenta[k]
            m.add_(gradient[k], alpha=self.lr)
            theta.add_(m, alpha=self.lr / 2)
            injected = intended - (c * self.lr) ** 2 * state.noise_variance[k]
            clamped += float((injected <= 0).sum())
            total += m.numel()
            m.mul_(c).add_(torch.sqrt(injected.clamp_min(0.0)) * torch.randn_like(m))
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


def top_noise_variance(target: Any, params: Params, batches: Iterator[torch.Tensor], steps: int) -> float:
    """The largest eigenvalue of the covariance of the minibatch gradient noise (per-example-mean
    units, as ``Chain``'s ``V``) at ``params`` (one or several chains of ``target``, all at the same
    point or near it), from ``steps`` batches of ``batches``: each batch's two halves give one
    noise draw per chain, ``(g1 - g2) sqrt(n1 n2) / n`` (covariance exactly the minibatch noise's),
    pooled over steps and chains. From few draws the top eigenvalue is over- rather than
    under-estimated (Marchenko-Pastur), which errs towards a smaller step."""
    rows = []
    for _ in range(steps):
        indices = next(batches)
        size = indices.shape[-1]
        n1 = size // 2
        _, g1 = target.value_and_grad(params, indices[..., :n1])
        _, g2 = target.value_and_grad(params, indices[..., n1:])
        scale = math.sqrt(n1 * (size - n1)) / size
        diff = {k: (g1[k] - g2[k]) * scale for k in g1}
        rows += [torch.cat([v.reshape(-1) for v in target.unpack(diff, c).values()]).float().cpu()
                 for c in range(target.count(params))]
    draws = torch.stack(rows)  # [draws, d] (float32: 10 draws of a ResNet-18's 11M weights take 440 MB)
    gram = (draws @ draws.T).double() / len(rows)  # the draws' Gram matrix: the covariance's nonzero eigenvalues
    return float(torch.linalg.eigvalsh(gram).max())


def noise_share_at(lr: float, friction: float, temperature: float, variance: float) -> float:
    """The share ``c^2 lr^2 V / ((1 - c^2) T)`` of the O-step's intended noise that minibatch noise
    of variance ``variance`` brings by itself at step ``lr`` (``c = exp(-friction lr)``); increases with ``lr``."""
    c2 = math.exp(-2 * friction * lr)
    return c2 * lr**2 * variance / ((1 - c2) * temperature)


def step_for_noise(lr: float, friction: float, temperature: float, variance: float, margin: float) -> float:
    """The largest step ``<= lr`` at which minibatch noise of variance ``variance`` brings at most
    ``margin`` of the intended noise (``noise_share_at``; bisection to 0.1%)."""
    if noise_share_at(lr, friction, temperature, variance) <= margin:
        return lr
    low, high = 0.0, lr
    while high - low > 1e-3 * high:
        mid = (low + high) / 2
        low, high = (mid, high) if noise_share_at(mid, friction, temperature, variance) <= margin else (low, mid)
    return low


@dataclass
class SGHMCSettings(MethodSettings):
    """SGHMC settings. ``lr``: step size; ``friction``: alpha; ``temperature`` of the target
    ``p(theta | D)^(1/temperature)``; ``weight_decay``: the Gaussian prior's precision per example
    (null = the recipe's weight decay); ``full_batch``: gradients on the whole train split (no
    minibatch noise; an epoch is then one step, so burn-in and thinning count steps); ``batch_size``:
    minibatch size otherwise (null = the recipe's), drawn with replacement; ``chains``: independent
    chains from the base, kept states stored chain after chain (see the module doc; 10 by default, so that
    a non-stackable ResNet-18 costs 10 x (10 + 10 x 2) = 300 epochs per repetition where one chain
    of 100 states 2 epochs apart cost 210; digits runs 10 minibatch chains); ``burn_in_epochs``: steps discarded after the base checkpoint, in epochs
    of the train set; ``thinning_epochs``: steps between a chain's kept states, in epochs (any
    positive fraction); ``noise_correction``: remove the estimated per-coordinate minibatch gradient noise
    from the injected noise (off by default: with noise concentrated in a few directions it runs
    cold, module doc; ``noise_margin`` bounds the noise instead); ``step_halvings``: when the burn-in
    diverges (a step too large for the curvature at the base, e.g. a barely trained ResNet-18
    whose BatchNorm statistics are far off), restart it with half the step, at most this many
    times (the step used is in the diagnostics); ``noise_margin``: with minibatches, the step is lowered
    below ``lr`` until the minibatch noise along its top direction at the base (measured over
    ``noise_pilot_steps`` batches before the burn-in, ``top_noise_variance``) brings at most this
    share of the intended noise, so that the correction never clamps and the noise the
    per-coordinate correction cannot see (its off-diagonal part) is at most this share of the
    target along any direction (null: keep ``lr``).
    """

    lr: float = 0.05
    friction: float = 1.0
    temperature: float = 1.0
    weight_decay: Optional[float] = None
    full_batch: bool = False
    batch_size: Optional[int] = None
    chains: int = 10
    burn_in_epochs: float = 10.0
    thinning_epochs: float = 2.0
    noise_correction: bool = False
    step_halvings: int = 2
    noise_margin: Optional[float] = 0.1
    noise_pilot_steps: int = 10

    def __post_init__(self) -> None:
        require(self.step_halvings >= 0, "step_halvings", self.step_halvings, "an integer >= 0")
        require(self.noise_margin is None or 0 < self.noise_margin < 1, "noise_margin", self.noise_margin,
                "a number in (0, 1) or null (= keep lr whatever the minibatch noise)")
        require(self.noise_pilot_steps >= 1, "noise_pilot_steps", self.noise_pilot_steps, "a positive integer")
        require(self.chains >= 1, "chains", self.chains, "a positive integer")
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
    """The settings resolved against the recipe and the train set; burn-in and thinning in steps;
    ``batch_size`` None for full batches."""

    lr: float
    friction: float
    temperature: float
    weight_decay: float
    batch_size: Optional[int]
    chains: int
    burn_in: int
    thinning: int
    noise_correction: bool


def chain_seed(seed: int, group: int) -> int:
    """The seed of chain group ``group`` of a run seeded with ``seed`` (groups never share noise)."""
    return (int(seed) * 1_000_003 + group) % 2**62


class SGHMCMethod(PosteriorMethod):
    """``chains`` SGHMC chains from the base checkpoint on the un-augmented train set.

    ``fit(base, seed)`` runs every chain's burn-in from ``base`` (noise and batches from ``seed``)
    and keeps the burnt-in states. ``sample(n, generator)`` continues a copy of them under one
    seed drawn from ``generator`` for ``ceil(n / chains)`` thinning intervals and returns the
    states chain after chain (``_kept_states``); ``predict_own`` re-runs the same
    continuation (deterministic given the seed) and predicts with each kept state, so the two
    correspond for same-seeded generators. The network runs in eval mode: BatchNorm uses the
    base's running statistics, which stay fixed, so the target is the posterior of the network as
    it predicts.
    """

    name = "sghmc"
    order = 50
    paper_label = "SGHMC"
    paper_recipe = False  # the paper's SGHMC is the scale-adapted sampler (sghmc_sa)
    starts_from_base = True  # every chain starts from the repetition's base network
    label = "SGHMC"
    diagnostics_note = (
        "SGHMC: kinetic temperature mean(m^2)/T of the sampling segment (1 = at the configured temperature), "
        "fraction of coordinates where the minibatch gradient noise alone exceeded the target (there the chain runs "
        "hot), that noise as a share of the target, and the effective sample size of the kept states (ess: the ESS "
        "of the mean from the chain means, chains as chains, median over weights; ess_arviz_total: the sum over "
        "chains of each chain's ArviZ bulk ESS, which overstates short correlated chains; ess_chain_min: the "
        "smallest chain's). split_rhat_loglik: split R-hat of the kept states' train log-likelihood over every "
        "chain's halves; stationary: 1 when it is below 1.05, 0 when the chains have not settled (the row is not "
        "converged). noise_top_to_target: the minibatch noise along its top direction at the base as a share of the "
        "target, at the step used (the step is lowered until it is at most noise_margin). chains: independent chains "
        "from the base, states_per_chain: kept states of each, full_batch: 1 for full-batch gradients (no minibatch "
        "noise), spread_growth: the chains' spread at the first kept states over their spread half-way there (about "
        "1: settled; about 2: still spreading from the base, as free diffusion does)."
    )
    Settings = SGHMCSettings
    modes = ("one",)
    markov_chain = True

    @classmethod
    def chain_layout(cls, meta: SampleSetMetadata, n: int) -> tuple[int, int] | None:
        """Its ``chains`` x ``states_per_chain`` diagnostics: the chains whose every state is stored."""
        diagnostics = meta.diagnostics or {}
        if not diagnostics.get("states_per_chain") or math.isnan(float(diagnostics["states_per_chain"])):
            return None
        per = int(diagnostics["states_per_chain"])
        return min(int(diagnostics["chains"]), n // per), per

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._groups: list[ChainState] | None = None
        self._targets: list[Any] = []
        self._lr_factor = 1.0
        self._noise_lr = math.inf  # the step the minibatch noise allows (noise_margin), from the pilot at the base
        self._noise_top = math.nan  # the pilot's top eigenvalue of the minibatch noise covariance
        self._buffers: dict[str, torch.Tensor] = {}
        self._model: nn.Module | None = None
        self._train: InMemoryImageDataset | None = None
        self._early_spread: torch.Tensor | None = None
        self._diagnostics: dict[str, float] = {}
        self._sampled: list[ChainState] = []  # the chain groups at the end of the last sample() call

    def check(self, mode: str) -> None:
        if mode not in self.modes:
            raise MethodConfigError(
                f"method={self.name} mode={mode}: SGHMC runs its chains from one trained checkpoint (the paper uses "
                f"it one-mode only); use mode=one"
            )
        super().check(mode)

    def plan(self) -> ChainPlan:
        """The chains' settings in steps, defaults taken from the recipe."""
        s, recipe = self.settings, self.recipe
        n = len(self._train_data())
        batch_size = None if s.full_batch else (recipe.batch_size if s.batch_size is None else s.batch_size)
        if batch_size is not None and batch_size >= n:
            batch_size = None  # a batch of the whole split: full-batch gradients
        weight_decay = recipe.weight_decay if s.weight_decay is None else s.weight_decay
        steps_per_epoch = 1 if batch_size is None else math.ceil(n / batch_size)
        return ChainPlan(
            lr=s.lr, friction=s.friction, temperature=s.temperature, weight_decay=weight_decay, batch_size=batch_size,
            chains=s.chains, burn_in=math.ceil(s.burn_in_epochs * steps_per_epoch),
            thinning=max(1, math.ceil(s.thinning_epochs * steps_per_epoch)),
            noise_correction=s.noise_correction and batch_size is not None,
        )

    def _train_data(self) -> InMemoryImageDataset:
        """The un-augmented train split in memory: the data the posterior conditions on."""
        if self._train is None:
            self._train = InMemoryImageDataset(*self.data.train_tensors)
        return self._train

    def _chain(self, plan: ChainPlan, target: Any) -> Chain:
        return Chain(target, lr=min(plan.lr, self._noise_lr) * self._lr_factor, friction=plan.friction,
                     temperature=plan.temperature / len(self._train_data()), noise_correction=plan.noise_correction)

    def _batches(self, plan: ChainPlan, seed: int, chains: int) -> Iterator[Optional[torch.Tensor]]:
        """The stream of batches of a group of ``chains`` chains: ``independent_batches`` (order
        from ``seed``), or ``full_batches`` without a batch size."""
        if plan.batch_size is None:
            return full_batches()
        return independent_batches(len(self._train_data()), plan.batch_size, chains, torch.Generator().manual_seed(seed))

    def _make_targets(self, plan: ChainPlan) -> list[tuple[Any, int]]:
        """``(target, chains)`` per group: one stack of every chain when the model can be stacked,
        else one group per chain."""
        assert self._model is not None
        try:
            stacked = stacked_networks(self._model, self.device)
        except NotStackableError as err:
            log.info("method=%s: %d chains one after another (%s)", self.name, plan.chains, err)
            target = NetworkTarget(self._model, self._buffers, self._train_data(), plan.weight_decay, self.device)
            return [(target, 1)] * plan.chains
        return [(StackedNetworkTarget(stacked, self._train_data(), plan.weight_decay, self.device), plan.chains)]

    def fit(self, base: dict[str, torch.Tensor], seed: int) -> None:
        """Burn in the chains started at ``base`` (plain state dict); ``seed`` fixes their noise and batches.

        NaN/Inf raises ``NonFiniteError`` and leaves the method unfitted.
        """
        self._groups = None
        plan = self.plan()
        with seeded(0):  # building a model draws from the global RNG; leave it as it was
            model = self.new_model()
        try:
            model.load_state_dict(base)
        except RuntimeError as err:
            raise ValueError(f"method={self.name}: the base checkpoint does not fit the model: {err}") from err
        self._model = model.eval()
        self._buffers = {k: v.detach() for k, v in model.named_buffers()}
        start = {k: v.detach() for k, v in model.named_parameters()}
        groups = self._make_targets(plan)
        self._targets = [target for target, _ in groups]
        self._noise_lr, self._noise_top = math.inf, math.nan
        if plan.batch_size is not None and self.settings.noise_margin is not None:
            target, chains = groups[0]
            pilot = independent_batches(len(self._train_data()), plan.batch_size, chains,
                                        torch.Generator().manual_seed(chain_seed(seed, -1)))
            self._noise_top = top_noise_variance(target, target.pack(start, chains), pilot, self.settings.noise_pilot_steps)
            self._noise_lr = step_for_noise(plan.lr, plan.friction, plan.temperature / len(self._train_data()),
                                            self._noise_top, self.settings.noise_margin)
        # The chains' spread half-way to the first kept state (for spread_growth).
        early = min(plan.burn_in, (plan.burn_in + plan.thinning) // 2)
        for halvings in range(self.settings.step_halvings + 1):
            self._lr_factor = 0.5**halvings
            where = f"{self.name} seed {seed}, burn-in at lr {min(plan.lr, self._noise_lr) * self._lr_factor:g}"
            try:
                states, snapshots = [], []
                for g, (target, chains) in enumerate(groups):
                    chain = self._chain(plan, target)
                    batches = self._batches(plan, chain_seed(seed, g), chains)
                    with seeded(chain_seed(seed, g)):
                        state = chain.run(chain.start(target.pack(start, chains)), batches, early, where)
                        snapshots.append(self._flat(target, state.params))
                        states.append(chain.run(state, batches, plan.burn_in - early, where))
                break
            except NonFiniteError as err:
                if halvings == self.settings.step_halvings:
                    raise
                log.warning("%s; restarting the burn-in with half the step", err)
        self._early_spread = torch.cat(snapshots).var(0) if sum(len(s) for s in snapshots) > 1 else None
        self._groups = states

    def _flat(self, target: Any, params: Params) -> torch.Tensor:
        """The chains of ``params`` as rows ``[chains, d']`` (float64, CPU): every weight, or a fixed
        random subset of ``DIAGNOSTIC_COORDINATES`` of them for larger models."""
        rows = torch.stack([torch.cat([v.reshape(-1) for v in target.unpack(params, c).values()])
                            for c in range(target.count(params))])
        if rows.shape[1] > DIAGNOSTIC_COORDINATES:
            subset = torch.randperm(rows.shape[1], generator=torch.Generator().manual_seed(0))[:DIAGNOSTIC_COORDINATES]
            rows = rows[:, subset.sort().values]
        return rows.double()

    def _kept_states(self, n: int, generator: torch.Generator) -> list[dict[str, torch.Tensor]]:
        """The ``n`` kept plain state dicts of the continuation seeded from ``generator``, chain
        after chain (sample ``i`` is state ``i mod states_per_chain`` of chain ``i div
        states_per_chain``, ``states_per_chain = ceil(n / chains)``), and the diagnostics of that continuation."""
        if self._groups is None:
            raise RuntimeError(f"method={self.name}: call fit() before sample() or predict_own()")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"method={self.name}: number of samples must be a positive integer, got {n!r}")
        plan = self.plan()
        seed = int(torch.randint(0, 2**62, (1,), generator=generator))
        chains = sum(t.count(s.params) for t, s in zip(self._targets, self._groups))
        rounds = math.ceil(n / chains)
        per_round: list[list[torch.Tensor]] = [[] for _ in range(rounds)]  # [round][group] -> [chains_g, d]
        loglik: list[list[torch.Tensor]] = [[] for _ in range(rounds)]  # [round][group] -> [chains_g]
        kept: list[list[dict[str, torch.Tensor]]] = [[] for _ in range(rounds)]
        kinetic = clamped = steps = 0.0
        noise_share = []
        self._sampled = []
        for g, (target, group) in enumerate(zip(self._targets, self._groups)):
            chain = self._chain(plan, target)
            state = group.copy()
            state.kinetic_sum = state.clamped_sum = 0.0
            start = state.steps
            batches = self._batches(plan, chain_seed(seed, g), target.count(state.params))
            with seeded(chain_seed(seed, g)):
                for r, params in enumerate(chain.thinned(state, batches, rounds, plan.thinning, f"{self.name} sampling")):
                    per_round[r].append(self._flat(target, params))
                    loglik[r].append(target.log_likelihood(params))
                    kept[r].extend(target.unpack(params, c) for c in range(target.count(params)))
            kinetic += state.kinetic_sum
            clamped += state.clamped_sum
            steps += state.steps - start
            noise_share.extend(chain.noise_share(v).reshape(-1) for v in state.noise_variance.values())
            self._sampled.append(state)
        buffers = {k: v.cpu() for k, v in self._buffers.items()}
        keys = list(self._model.state_dict())
        chain_major = [kept[r][c] for c in range(chains) for r in range(rounds)]
        states = [{k: {**sd, **buffers}[k] for k in keys} for sd in chain_major][:n]
        values = torch.stack([torch.cat(groups) for groups in loglik]).T  # [chains, rounds]
        self._diagnostics = self._describe(plan, chains, rounds, n, per_round, values, kinetic / steps, clamped / steps,
                                           torch.cat(noise_share))
        return states

    def _describe(self, plan: ChainPlan, chains: int, rounds: int, n: int, per_round: list[list[torch.Tensor]],
                  loglik: torch.Tensor, kinetic: float, clamped: float, noise_share: torch.Tensor) -> dict[str, float]:
        draws = torch.stack([torch.cat(groups) for groups in per_round])  # [rounds, chains, d]
        complete = min(chains, n // rounds)  # the chains whose every state is among the n kept
        by_chain = draws[:, :complete].transpose(0, 1)  # [chains, rounds, d]
        moving = by_chain.reshape(-1, by_chain.shape[-1]).std(0) > 0
        ess = (chain_ess(by_chain[:, :, moving].numpy()) if complete and bool(moving.any())
               else {"total": math.nan, "chain_min": math.nan, "of_mean": math.nan})
        rhat = split_rhat(loglik[:complete]) if complete else math.nan
        growth = math.nan
        if self._early_spread is not None and chains > 1:
            late, early = draws[0].var(0), self._early_spread
            ok = early > 0
            growth = float((late[ok] / early[ok]).median()) if bool(ok.any()) else math.nan
        return {
            "lr": min(plan.lr, self._noise_lr) * self._lr_factor,
            "chains": float(chains),
            "states_per_chain": float(rounds),
            "full_batch": float(plan.batch_size is None),
            "ess": ess["of_mean"] if complete > 1 else ess["total"],
            "ess_chain_min": ess["chain_min"],
            "ess_arviz_total": ess["total"],
            "spread_growth": growth,
            "split_rhat_loglik": rhat,
            "stationary": math.nan if math.isnan(rhat) else float(rhat < RHAT_STATIONARY),
            "kinetic_temperature": kinetic,
            "clamped_fraction": clamped,
            "noise_to_target": float(noise_share.mean()) if plan.noise_correction else 0.0,
            "noise_top_to_target": (noise_share_at(min(plan.lr, self._noise_lr) * self._lr_factor, plan.friction,
                                                   plan.temperature / len(self._train_data()), self._noise_top)
                                    if plan.batch_size is not None else 0.0),
        }

    def diagnostics(self, images: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        """Of the last ``sample`` call: ``lr`` (the step used: ``lr`` lowered by ``noise_margin``, after
        any halvings), ``chains``, ``states_per_chain``, ``full_batch`` (1: full-batch gradients),
        ``ess`` and ``ess_chain_min`` (``metrics.mcmc.chain_ess`` of the weights that move, chains as
        chains, so storage order plays no part: the median over weights of the sum over chains of
        each chain's bulk ESS, and the smallest chain's median; NaN below 4 states per chain),
        ``spread_growth`` (median over weights of the across-chain variance at the first kept
        states over that half-way there: ~1 when the chains have stopped spreading, ~2 where they
        still diffuse away from the base as a free particle does), ``split_rhat_loglik``
        (``metrics.mcmc.split_rhat`` of the kept states' mean train log-likelihood ``[chains,
        states_per_chain]``: every chain's halves against each other and the other chains') and
        ``stationary`` (1 when it is below ``RHAT_STATIONARY`` = 1.05, else 0: the row's chains
        have not settled; NaN below 4 states per chain), ``kinetic_temperature`` (mean over steps
        of mean(m^2) / T: the momenta, not where the weights sit), ``clamped_fraction``
        (coordinates where the minibatch noise alone exceeded the target), ``noise_to_target``
        (mean over coordinates of the share of the intended noise that the minibatch gradients
        bring by themselves, at the step used; 0 for full batches), ``noise_top_to_target`` (that
        share along the top direction of the noise covariance measured at the base, at the step
        used: at most ``noise_margin``; 0 for full batches)."""
        return dict(self._diagnostics)

    def sample(self, n: int, generator: torch.Generator) -> SampleSet:
        """``n`` kept chain states ``{plain key: [n, ...]}`` (CPU); buffers are the base's."""
        return stack_state_dicts([{k: v.cpu() for k, v in sd.items()} for sd in self._kept_states(n, generator)])

    def predict_own(self, images: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
        """Softmax probabilities ``[n, N, C]`` (float32, CPU) of each kept state of the same
        continuation ``sample(n, generator)`` returns."""
        return torch.cat([
            predict_with_weights(self._model, {k: v[None] for k, v in weights.items()}, images)
            for weights in self._kept_states(n, generator)
        ])
