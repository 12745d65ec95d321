"""Study: can the one-mode SGHMC on digits, under its minibatches, reach a split R-hat of the train log-likelihood below 1.05 and an ESS of the mean of at least 30 of 100 kept states, and at what budget? Last result (issue 39, bases 100001/100145/100290): no affordable budget does. ESS of the mean 11.3/11.3/11.2 at 820 steps, 11.1/11.2/11.1 at the configured 7,380 (8 bases: 11.1-11.2, R-hat 1.34-1.89), 11.2 at 29,520 (base 100001); split R-hat 2.96/1.89/2.51, 1.65/1.60/1.34, 1.42; noise_margin 0.5 (9x the step) at 7,380: ESS 11.2, R-hat 1.93. 144 of the 355 Hessian eigenvalues at base 100001 are below 1e-3 (the prior alone: 2e-4): directions the data do not constrain, which the step the minibatch noise allows crosses only by diffusion (spread_growth ~2 at every budget).

SGHMC (``methods/sghmc.py``) sets its step from the minibatch noise measured at the base
(``noise_margin``: the top direction's noise at most that share of the injected noise). This study
measures, against the project's own checks (the sampler's diagnostics: ``split_rhat_loglik`` and
``stationary``, ``metrics.mcmc.split_rhat`` of the kept states' train log-likelihood; ``ess``, the
ESS of the mean from the chain means, ``metrics.mcmc.chain_ess``; what diagnostics.md shows), how
the chains' stationarity moves with the budget, and why.

1. ``chains``: the one-mode row as configured (``conf/experiment/digits_optunet.yaml``) on
   ``--bases`` bases, at each burn-in:thinning budget of ``--budgets`` (epochs of 41 batches of
   32), 100 kept states (10 chains x 10): per repetition the step the margin set, the steps, the
   CPU seconds of ``fit`` + ``sample`` (the machine is shared: wall time is not comparable), the
   split R-hat, the ESS of the mean, ``spread_growth`` and ``stationary``. Bases: the first
   converged held-out seed at or after ``100000 + 145 k`` for repetition k (145: the design's stride
   of 100 converged seeds at 69% convergence; the benchmark reads the store's own), trained here
   with the recipe as the zoo stage trains it.
2. ``linear``: the chains linearised at the first base. The Hessian of the per-example log
   posterior (355 x 355) and the covariance of the per-example gradients; per Hessian eigenmode
   the BAOA step is a 2 x 2 linear map with the injected noise and the minibatch noise along that
   mode (batch mean, drawn with replacement), started at the base with zero momentum, so the
   covariance of the 10 kept states of a chain follows exactly (modes at curvature below the
   prior's, 2e-4, including the negative ones of a base that is not a posterior mode, are taken at
   the prior's). The predicted ESS of the mean is the method's formula on those covariances
   (median over weights); it is first set against the chains of section 1 at their budgets, then
   asked how many steps an ESS of 30 needs at other batch sizes, margins and frictions (the largest
   step, at most 0.3, BAOA's stability at the largest curvature being ~0.5, at which the minibatch
   noise heats no mode's stationary variance by more than the margin), and without minibatch noise.
   It is first checked against the method's own ``Chain`` on a quadratic target with known gradient
   noise (``check_against_chain``).

Usage: ``OMP_NUM_THREADS=1 nice -n 10 python studies/sghmc_stationarity.py [--sections chains,linear]
[--bases 3] [--budgets 10:1,100:8,400:32]``. Section ``chains`` at the default budgets costs ~8 CPU
minutes per base (37,720 steps at ~12 CPU ms, pilot and log-likelihoods included; 3-5x that in wall time
with 4 other jobs on the 2 cores); ``linear`` took 19 wall minutes here at 3 bases (a Hessian per
base, then the grid).

Result (2026-11-28, 2-core machine shared with 4 other jobs; bases 100001, 100145, 100290 trained here; the
``chains`` figures per base, in that order):

    chains, burn-in 10 + thinning 1 epochs (410 + 10 x 41 = 820 steps; 10 CPU s for 100001): lr 0.0057 / 0.0131 / 0.0081
      split R-hat 2.96 / 1.89 / 2.51; ESS of the mean 11.26 / 11.27 / 11.25; spread_growth 2.08 / 2.03 / 2.01
    chains, 100 + 8, the configured budget (4,100 + 10 x 328 = 7,380 steps; 300-400 s wall each here, ~90 CPU s)
      split R-hat 1.65 / 1.60 / 1.34; ESS of the mean 11.15 / 11.16 / 11.12; spread_growth 1.87 / 2.01 / 1.95
    chains, 100 + 8 on the bases of repetitions 3-7 (100435, 100580, 100725, 100870, 101015; --bases 8
      --budgets 100:8): split R-hat 1.54 / 1.89 / 1.58 / 1.72 / 1.67; ESS of the mean 11.12 / 11.16 / 11.15 /
      11.16 / 11.11 (81 s wall for 100725 once the machine had quietened)
    chains, 400 + 32 (16,400 + 10 x 1,312 = 29,520 steps; 1,323 s wall), base 100001
      split R-hat 1.42; ESS of the mean 11.16; spread_growth 2.05
    chains, 100 + 8 with noise_margin 0.5 (the step 0.05, 9x), base 100001
      split R-hat 1.93; ESS of the mean 11.23; spread_growth 1.77
    stationary = 0 in every run.

    linear, the model against Chain (quadratic target, 4,000 chains, 60 steps): variance 0.0409 / 0.437 vs
      0.0400 / 0.4346 (full batch), 0.3744 / 0.5509 vs 0.3724 / 0.5471 (batches of 5)
    linear, Hessian at each base: 144 / 155 / 177 of 355 eigenvalues below 1e-3, 31 / 27 / 33 negative; the
      weights' mean share of variance in those modes 0.36-0.61 by layer
    linear, base 100001, configured (exact noise: step 0.0088, heat 1.116): predicted ESS of the mean 11.2 /
      11.0 / 11.1 at 820 / 7,380 / 29,520 steps (measured 11.26 / 11.15 / 11.16)
    linear, steps until the predicted ESS of the mean reaches 30 (decades; any friction of 0.05-20, each at the
      largest step whose noise heats no mode by more than the margin): batches of 32: 1e8 (margin 0.1 or 0.5);
      256: 1e7; 1,024: 1e7 (margin 0.1), 1e6 (0.5); without minibatch noise (full batch, step 0.3): 1e4 at
      friction 0.05 (ESS 17.9 / 48.3 at 2,000 / 10,000 steps), 5e4 at 0.2, beyond 5e4 at 1
    At 5.8 / 29 CPU ms per step of 10 chains (batches of 32 / 256) that is ~160 / ~80 CPU hours per repetition.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from methods.sghmc import SGHMCMethod, step_for_noise  # noqa: E402

KEPT = 100  # kept states per repetition, as the benchmark's rows
DRAWS, CHAINS = 10, 10  # the configured layout of those 100
STRIDE = 145  # held-out seeds between repetitions' first bases (100 converged at 69%)
STEP_CAP = 0.3  # the largest step tried in the linear model (BAOA's stability limit 2 / sqrt(15) ~ 0.5)


def experiment(store: str):
    from benchmark.loader import compose_config
    from benchmark.experiment import Experiment

    return Experiment(compose_config([f"store={store}", "device=cpu"]))


def train_base(exp, first: int) -> tuple[int, dict[str, torch.Tensor]]:
    """The first held-out seed from ``first`` that converges under the recipe and its rule, trained as
    the zoo stage trains it (``benchmark.stages.zoo.train_seed``): ``(seed, plain state dict)``."""
    from benchmark.stages.zoo import train_seed

    for seed in range(first, first + 20):
        result = train_seed(exp, seed, role="heldout")
        if result.failure is None:
            return seed, {k: v.detach().clone() for k, v in result.state_dict.items()}
    raise RuntimeError(f"no converged held-out seed in [{first}, {first + 20})")


def run_chains(exp, seed: int, base: dict, burn_in: float, thinning: float) -> dict[str, float]:
    """One repetition of the one-mode row on ``base`` at ``burn_in`` and ``thinning`` epochs: the
    sampler's diagnostics after ``sample(KEPT)``, with ``steps`` and ``cpu_s`` (fit + sample)."""
    settings = dataclasses.replace(exp.method_settings("sghmc"), burn_in_epochs=burn_in, thinning_epochs=thinning)
    method = SGHMCMethod(exp.model, exp.training_data, settings, recipe=exp.recipe, device=exp.device)
    start = time.process_time()
    method.fit(base, seed)
    method.sample(KEPT, torch.Generator().manual_seed(seed))
    cpu = time.process_time() - start
    plan = method.plan()
    return {**method.diagnostics(*exp.test_tensors), "cpu_s": cpu,
            "steps": plan.burn_in + plan.thinning * math.ceil(KEPT / plan.chains)}


def chains(exp, bases: list[tuple[int, dict]], budgets: list[tuple[float, float]]) -> None:
    print("== chains: the one-mode row as configured, per repetition (base seed)")
    for burn_in, thinning in budgets:
        for seed, base in bases:
            d = run_chains(exp, seed, base, burn_in, thinning)
            print(f"burn-in {burn_in:g} + thinning {thinning:g} epochs ({d['steps']:.0f} steps), base {seed}: "
                  f"lr {d['lr']:.4g}, {d['cpu_s']:.0f} CPU s; split R-hat {d['split_rhat_loglik']:.3f}, ESS of the "
                  f"mean {d['ess']:.2f}, spread_growth {d['spread_growth']:.2f}, stationary {d['stationary']:.0f}",
                  flush=True)


class LinearChains:
    """SGHMC linearised at a base: per eigenmode ``j`` of the Hessian ``H`` of the per-example log
    posterior (curvature ``h_j``, taken at least ``prior`` so that every mode has a stationary law),
    BAOA's exact 2 x 2 map of (position, momentum) with the injected noise at ``T = 1/N`` and the
    minibatch noise of the batch mean along the mode (``noise_j / B``; cross-mode correlations of
    the noise left out)."""

    def __init__(self, curvature: np.ndarray, modes: np.ndarray, noise: np.ndarray, n: int, prior: float) -> None:
        self.h = np.maximum(curvature, prior)  # [d]
        self.loading = modes**2  # [d weights, d modes]
        self.noise = np.einsum("ij,ik,kj->j", modes, noise, modes)  # per-example noise variance along each mode
        self.temperature = 1.0 / n

    def _maps(self, lr: float, friction: float, j: int, batch: int | None) -> tuple[np.ndarray, np.ndarray]:
        c, h = math.exp(-friction * lr), self.h[j]
        step = np.array([[1 - lr * lr * h * (1 + c) / 2, lr * (1 + c) / 2], [-c * lr * h, c]])
        injected = (1 - c * c) * self.temperature * np.array([[lr * lr / 4, lr / 2], [lr / 2, 1.0]])
        leak = np.array([lr * lr * (1 + c) / 2, c * lr])  # where the B-step's gradient noise ends up after A, O, A
        minibatch = 0.0 if batch is None else self.noise[j] / batch
        return step, injected + minibatch * np.outer(leak, leak)

    def _stationary(self, step: np.ndarray, noise: np.ndarray) -> np.ndarray:
        return np.linalg.solve(np.eye(4) - np.kron(step, step), noise.reshape(-1)).reshape(2, 2)

    def heat(self, lr: float, friction: float, batch: int) -> float:
        """The largest ratio over modes of the stationary position variance with the minibatch noise to
        that without it (1: the noise heats no mode)."""
        ratios = []
        for j in range(len(self.h)):
            step, noisy = self._maps(lr, friction, j, batch)
            _, quiet = self._maps(lr, friction, j, None)
            ratios.append(self._stationary(step, noisy)[0, 0] / self._stationary(step, quiet)[0, 0])
        return max(ratios)

    def step_for_heat(self, cap: float, friction: float, batch: int, margin: float) -> float:
        """The largest step ``<= cap`` at which the minibatch noise heats no mode by more than ``margin``
        (bisection to 1%). Unlike ``methods.sghmc.noise_share_at``, it counts the noise that reaches the
        position through the first half-step before the friction acts, which dominates at large
        ``friction x lr``."""
        if self.heat(cap, friction, batch) <= 1 + margin:
            return cap
        low, high = 0.0, cap
        while high - low > 0.01 * high:
            mid = (low + high) / 2
            low, high = (mid, high) if self.heat(mid, friction, batch) <= 1 + margin else (low, mid)
        return low

    def variance_after(self, lr: float, friction: float, j: int, batch: int | None, steps: int) -> float:
        """The variance of mode ``j``'s position ``steps`` steps after the base (zero momentum)."""
        step, noise = self._maps(lr, friction, j, batch)
        stationary = self._stationary(step, noise)
        power = np.linalg.matrix_power(step, steps)
        return float((stationary - power @ stationary @ power.T)[0, 0])

    def ess_of_mean(self, lr: float, friction: float, batch: int | None, burn_in: int, thinning: int) -> float:
        """Expected ESS of the mean (``metrics.mcmc.chain_ess``'s formula on the expected within- and
        between-chain variances) of ``CHAINS`` chains of ``DRAWS`` states from the base, median over weights."""
        draws = np.zeros((len(self.h), DRAWS, DRAWS))
        times = burn_in + thinning * np.arange(1, DRAWS + 1)
        for j in range(len(self.h)):
            step, noise = self._maps(lr, friction, j, batch)
            stationary = self._stationary(step, noise)
            ahead = np.linalg.matrix_power(step, thinning)
            for k, t in enumerate(times):
                power = np.linalg.matrix_power(step, int(t))
                cov = stationary - power @ stationary @ power.T  # from the base, zero momentum
                for m in range(k, DRAWS):
                    draws[j, k, m] = draws[j, m, k] = cov[0, 0]
                    cov = ahead @ cov
        per_weight = np.einsum("ij,jkl->ikl", self.loading, draws)
        trace, total = np.einsum("ikk->i", per_weight), per_weight.sum((1, 2))
        within, between = (trace - total / DRAWS) / (DRAWS - 1), total / DRAWS**2
        return float(np.median(CHAINS * (within * (DRAWS - 1) / DRAWS + between) / between))


def check_against_chain(chains: int = 4000, steps: int = 60) -> None:
    """``LinearChains`` against the method's own ``Chain`` on a quadratic target of two modes with
    known per-example gradient noise (50 points; full batch and batches of 5, drawn as the method
    draws them): the variance of each mode after ``steps`` steps from 0, over ``chains`` chains."""
    from benchmark.core.training import seeded
    from methods.sghmc import Chain, full_batches, independent_batches

    n, h, lr, friction = 50, np.array([0.5, 0.01]), 0.4, 2.0
    noise = np.random.default_rng(0).normal(size=(n, 2)) * np.array([3.0, 0.5])
    noise -= noise.mean(0)
    per_example = torch.tensor(noise)

    def log_posterior(params, indices):
        q = params["q"]  # [chains, 2]
        value = -(torch.tensor(h) * q * q).sum() / 2
        return (value if indices is None else value + (per_example[indices] * q[:, None, :]).mean(1).sum()), None

    model = LinearChains(h, np.eye(2), np.cov(noise.T, bias=True), n, prior=0.0)
    for batch in (None, 5):
        chain = Chain(log_posterior, lr=lr, friction=friction, temperature=1.0 / n, noise_correction=False)
        stream = full_batches() if batch is None else independent_batches(n, batch, chains, torch.Generator().manual_seed(1))
        with seeded(0):
            state = chain.run(chain.start({"q": torch.zeros(chains, 2, dtype=torch.float64)}), stream, steps, "check")
        predicted = [model.variance_after(lr, friction, j, batch, steps) for j in range(2)]
        print(f"linear model against Chain, batch {batch or 'full'}: variance after {steps} steps "
              f"{state.params['q'].var(0).numpy().round(4).tolist()} (chains) vs {np.round(predicted, 4).tolist()} (model)")


def linearise(exp, base: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, float]]:
    """At ``base``: Hessian eigenvalues ``[d]`` and eigenvectors ``[d, d]`` of the per-example log
    posterior's negative (the recipe's L2 as the prior), the per-example gradient covariance
    ``[d, d]`` (float64), and each layer's mean share of weight variance in modes below 1e-3."""
    from torch.func import functional_call, grad, hessian, vmap

    images, labels = exp.train_tensors
    n, wd = len(labels), exp.recipe.weight_decay
    model = exp.model().double().eval()
    keys = [k for k, _ in model.named_parameters()]
    shapes, sizes = [base[k].shape for k in keys], [base[k].numel() for k in keys]
    flat = torch.cat([base[k].reshape(-1) for k in keys]).double()

    def unflat(f):
        return {k: t.view(s) for k, t, s in zip(keys, f.split(sizes), shapes)}

    def nll(f, x, y):
        return F.cross_entropy(functional_call(model, unflat(f), (x[None],)), y[None])

    per_example = vmap(grad(nll), in_dims=(None, 0, 0))(flat, images.double(), labels)  # [n, d]
    covariance = torch.cov(per_example.T, correction=0)
    curvature = wd * torch.eye(len(flat), dtype=torch.float64)
    for part in torch.arange(n).split(50):
        curvature += hessian(lambda f: F.cross_entropy(functional_call(model, unflat(f), (images[part].double(),)),
                                                       labels[part], reduction="sum") / n)(flat)
    h, modes = torch.linalg.eigh(curvature)
    flat_modes = (modes[:, h < 1e-3] ** 2).sum(1)  # per weight: its share of unit variance in the flat modes
    layer = [k.split(".")[0] for k, s in zip(keys, sizes) for _ in range(s)]
    shares = {name: float(flat_modes[[i for i, x in enumerate(layer) if x == name]].mean()) for name in dict.fromkeys(layer)}
    return h.numpy(), modes.numpy(), covariance.numpy(), shares


def linear(exp, bases: list[tuple[int, dict]], budgets: list[tuple[float, float]]) -> None:
    check_against_chain()
    n = len(exp.train_tensors[1])
    for seed, base in bases:
        h, modes, covariance, shares = linearise(exp, base)
        print(f"== linear: base {seed}: Hessian eigenvalues {np.quantile(h, [0, 0.25, 0.5, 0.75, 1]).round(5).tolist()} "
              f"(min, quartiles, max); {int((h < 1e-3).sum())} of {len(h)} below 1e-3, {int((h < 0).sum())} negative "
              f"(prior alone: {exp.recipe.weight_decay:g}); mean share of each layer's weights in those modes "
              f"{ {k: round(v, 2) for k, v in shares.items()} }", flush=True)
        if seed == bases[0][0]:
            first = h, modes, covariance
    h, modes, covariance = first
    print(f"predictions at base {bases[0][0]}:")
    model = LinearChains(h, modes, covariance, n, exp.recipe.weight_decay)
    top = float(np.linalg.eigvalsh(covariance)[-1])
    settings = exp.method_settings("sghmc")
    per_epoch = math.ceil(n / settings.batch_size)
    lr = step_for_noise(settings.lr, settings.friction, 1.0 / n, top / settings.batch_size, settings.noise_margin)
    for burn_in, thinning in budgets:
        b, t = math.ceil(burn_in * per_epoch), math.ceil(thinning * per_epoch)
        print(f"configured (batch {settings.batch_size}, friction {settings.friction:g}, the margin's step from the exact "
              f"noise {lr:.4g}, heat {model.heat(lr, settings.friction, settings.batch_size):.3f}), {b} + 10 x {t} steps: "
              f"predicted ESS of the mean {model.ess_of_mean(lr, settings.friction, settings.batch_size, b, t):.1f}", flush=True)
    print("steps (burn-in half, 10 thinning intervals the other half) until the predicted ESS reaches 30, at the "
          "largest step whose minibatch noise heats no mode by more than the margin:")
    for batch in (32, 256, 1024):
        for margin in (0.1, 0.5):
            for friction in (0.05, 1.0, 5.0, 20.0):
                step = model.step_for_heat(STEP_CAP, friction, batch, margin)
                for steps in (10**4, 10**5, 10**6, 10**7, 10**8):
                    ess = model.ess_of_mean(step, friction, batch, steps // 2, steps // 20)
                    if ess >= 30:
                        break
                print(f"  batch {batch}, margin {margin}, friction {friction:g}: step {step:.3g}, ESS {ess:.1f} at "
                      f"{steps:.0e} steps", flush=True)
    for friction in (0.05, 0.2, 1.0):
        found = ", ".join(f"{steps}: {model.ess_of_mean(STEP_CAP, friction, None, steps // 2, steps // 20):.1f}"
                          for steps in (2_000, 10_000, 50_000))
        print(f"  no minibatch noise (full batch), step {STEP_CAP}, friction {friction:g}: ESS at steps {found}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default="chains,linear")
    parser.add_argument("--bases", type=int, default=3,
                        help="repetitions (bases): chains on each; linear's spectrum at each, its predictions at the first")
    parser.add_argument("--budgets", default="10:1,100:8,400:32", help="burn-in:thinning epochs, comma-separated")
    parser.add_argument("--store", default="/tmp/sghmc-stationarity-store",
                        help="store of the experiment (nothing is written)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    sections = args.sections.split(",")
    budgets = [tuple(float(x) for x in b.split(":")) for b in args.budgets.split(",")]
    exp = experiment(args.store)
    bases = [train_base(exp, 100000 + STRIDE * k) for k in range(args.bases)]
    print(f"bases (trained here): {[seed for seed, _ in bases]}")
    if "chains" in sections:
        chains(exp, bases, budgets)
    if "linear" in sections:
        linear(exp, bases, budgets)


if __name__ == "__main__":
    main()
