"""The paper's SGHMC: the scale-adapted sampler of the Bayesian-Neural-Networks code base
(``src/Stochastic_Gradient_HMC_SA``, after Springenberg et al. 2016, "Bayesian optimization with
robust Bayesian neural networks"), which the paper names as its SGHMC (its appendix B). Written
here from that code's algorithm, so that readers can see what our SGHMC row (``methods.sghmc``:
BAOA steps, several chains from the trained base, the recipe's prior) changes.

One chain per repetition, from a random initialisation (the plain model's under the repetition's
base seed, as the vBNN starts: the base's trained weights are not used), run for ``epochs``
epochs of minibatches of ``batch_size`` from a per-epoch reshuffle of the un-augmented train
split (the code base's ``DataLoader(shuffle=True)``, last batch short), in train mode (BatchNorm
learns its running statistics as in training). Per step, for each parameter tensor ``p`` (its
own state; products elementwise):

    d   = grad_p [N * mean CE(batch)] + lambda_p * p                      (likelihood + prior)
    burn-in only:  tau += 1 - tau * g^2 / (V + eps);  g += (d - g) / (tau + eps);  V += (d^2 - V) / (tau + eps)
    r   = 1 / (sqrt(V) + eps)                                             (the preconditioner)
    v   = -lr^2 r d + (1 - C) v + sqrt(max(2 lr^2 r C - lr^4, 1e-16)) z,   z ~ N(0, 1)
    p  += v

with the momentum resampled ``v ~ N(0, lr^2 r)`` every ``momentum_resample_steps`` steps and the
prior precision ``lambda_p`` of each tensor (initially ``1 / prior_std^2``) redrawn from its Gibbs
conditional ``Gamma(shape = alpha0 + n_p / 2, rate = beta0 + |p|^2 / 2)`` every
``prior_resample_steps`` steps (both at step 0 too). ``-lr^4`` is the code's estimate of the
minibatch-noise variance that the gradient brings in the preconditioned coordinates (it takes the
squared gradient ``V`` for the noise variance, which is exact only where the mean gradient is 0).
Gradients are clipped to ``mean + clip_std_multiplier * std`` of the last ``clip_window`` gradient
norms once that many were seen (the code's dynamic clipping; a clipped norm is not added).

The target is the hierarchical posterior ``p(theta, lambda | D)`` with ``theta | lambda ~ N(0,
I / lambda)`` per tensor and ``lambda ~ Gamma(alpha0, beta0)``: another prior than the recipe's
weight decay that ``methods.sghmc`` and ``methods.hmc`` use (precision ``N * weight_decay``). A
state is kept at the end of every epoch ``e >= burn_in_epochs`` with ``e % thinning_epochs == 0``
(0-based), and ``sample(n)`` returns the last ``n`` kept states (the code base keeps its last 100
of 250 epochs): consecutive states of one chain, as correlated as its ``ess`` diagnostic says.

What the code base does that is not reproduced: its model is an MLP on flattened MNIST (ours:
the experiment's model); its noise comes from torch's and numpy's global RNGs (ours: a generator
seeded by the repetition, so that a unit is reproducible).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from benchmark.core.models import predict_with_weights
from benchmark.core.settings import require
from benchmark.core.store import SampleSet, SampleSetMetadata, stack_state_dicts
from benchmark.core.training import NonFiniteError, seeded
from methods.base import MethodConfigError, MethodSettings, PosteriorMethod
from metrics.mcmc import chain_ess

log = logging.getLogger(__name__)
EPS = 1e-6  # the code base's eps in the preconditioner and the adaptation


@dataclass
class ScaleAdaptedSGHMCSettings(MethodSettings):
    """Settings of the scale-adapted SGHMC; the defaults are the code base's (``train_SGHMC_MNIST.py``
    and ``H_SA_SGHMC``): ``lr`` 1e-2 (the step ``lr^2`` multiplies the preconditioned gradient),
    ``friction`` 0.05 (``base_C``), ``prior_std`` 0.1 (``gauss_sig``: the prior until its first
    redraw), the Gamma hyperprior on each tensor's prior precision ``hyperprior_shape`` 10
    (``alpha0``) and ``hyperprior_rate`` 10 (``beta0``), ``batch_size`` 256, ``epochs`` 250,
    ``burn_in_epochs`` 20 (scale adaptation on, nothing kept), ``thinning_epochs`` 2 (a kept state
    every 2 epochs after the burn-in), ``kept_states`` 100 (the last ones are kept, ``N_saves``),
    ``momentum_resample_steps`` 50, ``prior_resample_steps`` 15, ``clip_window`` 1000 and
    ``clip_std_multiplier`` 20 (``grad_std_mul`` of the MNIST script)."""

    lr: float = 0.01
    friction: float = 0.05
    prior_std: float = 0.1
    hyperprior_shape: float = 10.0
    hyperprior_rate: float = 10.0
    batch_size: int = 256
    epochs: int = 250
    burn_in_epochs: int = 20
    thinning_epochs: int = 2
    kept_states: int = 100
    momentum_resample_steps: int = 50
    prior_resample_steps: int = 15
    clip_window: int = 1000
    clip_std_multiplier: float = 20.0

    def __post_init__(self) -> None:
        for key in ("lr", "friction", "prior_std", "hyperprior_shape", "hyperprior_rate", "clip_std_multiplier"):
            value = getattr(self, key)
            require(math.isfinite(value) and value > 0, key, value, "a positive number")
        require(self.friction <= 1, "friction", self.friction, "a number in (0, 1] (the momentum's decay per step)")
        for key in ("batch_size", "epochs", "thinning_epochs", "kept_states", "momentum_resample_steps",
                    "prior_resample_steps", "clip_window"):
            require(getattr(self, key) >= 1, key, getattr(self, key), "a positive integer")
        require(0 <= self.burn_in_epochs < self.epochs, "burn_in_epochs", self.burn_in_epochs,
                f"an integer in [0, epochs = {self.epochs})")

    def kept_epochs(self) -> list[int]:
        """The (0-based) epochs after which a state is kept, the last ``kept_states`` of them."""
        return [e for e in range(self.burn_in_epochs, self.epochs) if e % self.thinning_epochs == 0][-self.kept_states:]


class ScaleAdaptedSGHMC(torch.optim.Optimizer):
    """The scale-adapted SGHMC update (module doc) over ``params``, as a torch optimizer: call
    ``step`` after ``backward`` of ``N x mean loss`` (without the prior: the sampler adds it).

    ``generator`` draws the Gaussian noise, ``rng`` (numpy) the Gamma prior precisions.
    """

    def __init__(self, params, lr: float, friction: float, prior_std: float, hyperprior_shape: float,
                 hyperprior_rate: float, generator: torch.Generator, rng: np.random.Generator) -> None:
        super().__init__(params, dict(lr=lr, friction=friction))
        self.prior_precision = 1.0 / prior_std**2
        self.shape, self.rate = hyperprior_shape, hyperprior_rate
        self.generator, self.rng = generator, rng

    def _state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            state.update(tau=torch.ones_like(p), g=torch.ones_like(p), v_hat=torch.ones_like(p),
                         momentum=torch.zeros_like(p), precision=self.prior_precision)
        return state

    def _normal(self, like: torch.Tensor) -> torch.Tensor:
        return torch.randn(like.shape, generator=self.generator, dtype=like.dtype).to(like.device)

    @torch.no_grad()
    def step(self, burn_in: bool = False, resample_momentum: bool = False, resample_prior: bool = False) -> None:
        """One update of every parameter with a gradient (module doc): scale adaptation when
        ``burn_in``, a fresh momentum when ``resample_momentum``, fresh prior precisions
        (Gibbs) when ``resample_prior``."""
        for group in self.param_groups:
            lr, friction = group["lr"], group["friction"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self._state(p)
                if resample_prior:
                    shape = self.shape + p.numel() / 2
                    rate = self.rate + float((p.double() ** 2).sum()) / 2
                    state["precision"] = float(self.rng.gamma(shape, 1.0 / rate))
                d = p.grad + state["precision"] * p
                tau, g, v_hat = state["tau"], state["g"], state["v_hat"]
                if burn_in:
                    tau.add_(1 - tau * g**2 / (v_hat + EPS))
                    tau_inv = 1.0 / (tau + EPS)
                    g.add_(tau_inv * (d - g))
                    v_hat.add_(tau_inv * (d**2 - v_hat))
                r = 1.0 / (v_hat.sqrt() + EPS)
                if resample_momentum:
                    state["momentum"] = (lr**2 * r).sqrt() * self._normal(p)
                v = state["momentum"]
                noise = (2 * lr**2 * r * friction - lr**4).clamp_min(1e-16).sqrt() * self._normal(p)
                v.add_(-(lr**2) * r * d - friction * v + noise)
                p.add_(v)

    def precisions(self) -> list[float]:
        """The current prior precision of each parameter tensor that has been updated."""
        return [float(self.state[p]["precision"]) for group in self.param_groups for p in group["params"] if p in self.state]


class GradientClip:
    """The code base's dynamic clipping: the gradient norm is clipped to ``mean + multiplier * std``
    of the last ``window`` unclipped norms once more than ``window`` were seen (before that, no
    clipping); a norm at or above the limit is not added to them."""

    def __init__(self, window: int, multiplier: float) -> None:
        self.window, self.multiplier = window, multiplier
        self.norms: list[float] = []
        self.limit = math.inf
        self.clipped = 0

    def __call__(self, parameters: list[nn.Parameter]) -> float:
        """Clip the gradients of ``parameters`` in place; return their norm before clipping."""
        if len(self.norms) > self.window:
            self.limit = float(np.mean(self.norms) + self.multiplier * np.std(self.norms))
            self.norms.pop(0)
        norm = float(nn.utils.clip_grad_norm_(parameters, max_norm=self.limit, norm_type=2))
        if norm >= self.limit:
            self.clipped += 1
        else:
            self.norms.append(norm)
        return norm


def reshuffled_batches(n: int, batch_size: int, generator: torch.Generator) -> Iterator[torch.Tensor]:
    """One epoch's minibatch indices: a permutation of ``range(n)`` from ``generator`` cut into
    batches of ``batch_size`` (the last one short), as ``DataLoader(shuffle=True)`` serves them."""
    order = torch.randperm(n, generator=generator)
    yield from order.split(batch_size)


class ScaleAdaptedSGHMCMethod(PosteriorMethod):
    """One scale-adapted SGHMC chain per repetition from a random initialisation (module doc).

    ``fit(base, seed)`` runs the whole chain under ``seed`` (initialisation, batches, noise) and
    keeps its states; ``sample(n, generator)`` returns the last ``n`` of them (deterministic:
    ``generator`` is not used), ``predict_own`` predicts with the same states.
    """

    name = "sghmc_sa"
    order = 60
    paper_label = "SGHMC"
    label = "SGHMC (scale-adapted)"
    table_note = (
        "{label}: the paper's SGHMC, the scale-adapted sampler of the Bayesian-Neural-Networks code base with its "
        "settings (one chain from a random initialisation, per-weight preconditioning adapted during a 20-epoch "
        "burn-in, a Gaussian prior whose precision per tensor has a Gamma(10, 10) hyperprior, momentum resampled "
        "every 50 steps, a state kept every 2 epochs of 250, minibatches of 256 from a per-epoch reshuffle); the "
        "SGHMC row is ours (several BAOA chains from the trained base under the recipe's prior). Its 100 states are "
        "consecutive states of one chain (ESS in diagnostics.md)."
    )
    diagnostics_note = (
        "SGHMC (scale-adapted), the paper's code base: steps of the one chain, fraction of steps whose gradient the "
        "dynamic clipping cut, the mean prior standard deviation 1/sqrt(lambda) over parameter tensors at the end "
        "(the Gamma hyperprior's draws), and the effective sample size of its 100 consecutive kept states (median "
        "over weights)."
    )
    Settings = ScaleAdaptedSGHMCSettings
    modes = ("one",)
    markov_chain = True

    @classmethod
    def chain_layout(cls, meta: SampleSetMetadata, n: int) -> tuple[int, int] | None:
        """One chain: its last ``n`` states."""
        return 1, n

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._kept: list[dict[str, torch.Tensor]] = []
        self._param_keys: list[str] = []
        self._diagnostics: dict[str, float] = {}

    def check(self, mode: str) -> None:
        if mode not in self.modes:
            raise MethodConfigError(
                f"method={self.name} mode={mode}: the paper runs SGHMC one-mode only (one chain per repetition); use mode=one"
            )
        super().check(mode)

    def fit(self, base: dict[str, torch.Tensor], seed: int) -> None:
        """Run the chain under ``seed`` (``base`` is not used: the chain starts from the model's
        initialisation under ``seed``). NaN/Inf raises ``NonFiniteError``."""
        s = self.settings
        self._kept = []
        with seeded(seed):
            model = self.new_model()
        model.train()
        self._param_keys = [k for k, _ in model.named_parameters()]
        images, labels = self.data.train_tensors
        images, labels = images.to(self.device), labels.to(self.device)
        n = len(labels)
        generator = torch.Generator().manual_seed(int(seed))
        sampler = ScaleAdaptedSGHMC(model.parameters(), s.lr, s.friction, s.prior_std, s.hyperprior_shape,
                                    s.hyperprior_rate, generator, np.random.default_rng(int(seed)))
        clip = GradientClip(s.clip_window, s.clip_std_multiplier)
        keep = set(s.kept_epochs())
        params = list(model.parameters())
        step = 0
        for epoch in range(s.epochs):
            for index in reshuffled_batches(n, s.batch_size, generator):
                index = index.to(self.device)
                model.zero_grad(set_to_none=True)
                loss = F.cross_entropy(model(images[index]), labels[index]) * n
                if not math.isfinite(float(loss.detach())):
                    raise NonFiniteError(f"{self.name} seed {seed}: loss {float(loss.detach())} at epoch {epoch + 1}, step {step + 1} "
                                         f"(lower methods.{self.name}.lr, now {s.lr})")
                loss.backward()
                clip(params)
                sampler.step(burn_in=epoch < s.burn_in_epochs, resample_momentum=step % s.momentum_resample_steps == 0,
                             resample_prior=step % s.prior_resample_steps == 0)
                step += 1
            if epoch in keep:
                state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
                if not all(bool(torch.isfinite(v).all()) for v in state.values() if v.is_floating_point()):
                    raise NonFiniteError(f"{self.name} seed {seed}: a weight became NaN/Inf by epoch {epoch + 1} "
                                         f"(lower methods.{self.name}.lr, now {s.lr})")
                self._kept.append(state)
        precisions = sampler.precisions()
        self._diagnostics = {
            "steps": float(step), "clipped_fraction": clip.clipped / max(step, 1),
            "prior_std_mean": float(np.mean([1 / math.sqrt(p) for p in precisions])),
        }

    def _states(self, n: int) -> list[dict[str, torch.Tensor]]:
        if not self._kept:
            raise RuntimeError(f"method={self.name}: call fit() before sample() or predict_own()")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"method={self.name}: number of samples must be a positive integer, got {n!r}")
        if n > len(self._kept):
            s = self.settings
            raise MethodConfigError(
                f"method={self.name}: {n} samples asked, the chain keeps {len(self._kept)} (methods.{self.name}.epochs="
                f"{s.epochs}, burn_in_epochs={s.burn_in_epochs}, thinning_epochs={s.thinning_epochs}, "
                f"kept_states={s.kept_states}); raise epochs or kept_states"
            )
        return self._kept[-n:]

    def sample(self, n: int, generator: torch.Generator) -> SampleSet:
        """The last ``n`` kept states ``{key: [n, ...]}`` (CPU; buffers included)."""
        return stack_state_dicts(self._states(n))

    def predict_own(self, images: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
        """Softmax probabilities ``[n, N, C]`` (float32, CPU) of the plain model with each of the
        states ``sample(n, generator)`` returns."""
        return predict_with_weights(self.new_model(), self.sample(n, generator), images)

    def diagnostics(self, images: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        """Of the last fit: ``steps`` (updates run), ``clipped_fraction`` (steps whose gradient was
        clipped), ``prior_std_mean`` (mean over tensors of the last prior standard deviation
        ``1 / sqrt(lambda)``), and ``ess`` (median over the weights that move of
        ``metrics.mcmc.chain_ess`` of the kept states as the one chain they are; NaN below 4) and
        ``ess_chain_min`` (the same: one chain)."""
        out = dict(self._diagnostics)
        if len(self._kept) >= 4:
            rows = torch.stack([torch.cat([sd[k].reshape(-1) for k in self._param_keys]) for sd in self._kept]).double()
            moving = rows.std(0) > 0
            ess = chain_ess(rows[None, :, moving].numpy()) if bool(moving.any()) else {"total": math.nan, "chain_min": math.nan}
            out["ess"], out["ess_chain_min"] = ess["total"], ess["chain_min"]
        return out
