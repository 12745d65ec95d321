"""The paper's scale-adapted SGHMC (methods/sghmc_sa.py): the sampler against closed forms with the
batches the method draws (a per-epoch reshuffle), the Gibbs step of the prior precision against its
Gamma conditional, the hierarchical target against numerical integration, the dynamic clipping,
and the method on the tiny digits experiment."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from benchmark.core.models import predict_with_weights
from methods.base import MethodConfigError
from methods.sghmc_sa import GradientClip, ScaleAdaptedSGHMC, ScaleAdaptedSGHMCSettings, reshuffled_batches
from tests.methods.conftest import build

pytestmark = pytest.mark.slow  # trains networks (bases, vBNNs, chains): make test, not make test-fast


def _regression(n: int, d: int, seed: int, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = scale * torch.randn(n, d, generator=g, dtype=torch.float64)
    y = x @ torch.linspace(1.0, -0.5, d, dtype=torch.float64) + torch.randn(n, generator=g, dtype=torch.float64)
    return x, y


def _epochs(n: int, batch: int, generator: torch.Generator):
    """The method's batch stream: a fresh reshuffle every epoch."""
    while True:
        yield from reshuffled_batches(n, batch, generator)


def _run(params, x, y, lr, steps, burn_in, batch, seed, prior_std=1.0, shape=1.0, rate=1.0, resample_prior=False):
    """Run the sampler on Bayesian linear regression (unit noise) of ``params`` (each ``[chains, d]``
    or ``[1]``), with the gradient of the N-scaled minibatch loss as the method computes it; the
    states after the burn-in, ``[steps, total chains, d]``."""
    n = len(y)
    g = torch.Generator().manual_seed(seed)
    sampler = ScaleAdaptedSGHMC(params, lr, 0.05, prior_std, shape, rate, g, np.random.default_rng(seed))
    batches = _epochs(n, batch, g)
    kept = []
    for t in range(burn_in + steps):
        index = next(batches)
        xb, yb = x[index], y[index]
        for p in params:
            w = p.detach().reshape(-1, x.shape[1])
            p.grad = (-((yb[None] - w @ xb.T) @ xb) * n / len(yb)).reshape(p.shape)
        sampler.step(burn_in=t < burn_in, resample_momentum=t % 50 == 0, resample_prior=resample_prior and t % 15 == 0)
        if t >= burn_in:
            kept.append(torch.cat([p.detach().reshape(-1, x.shape[1]) for p in params]))
    return torch.stack(kept)


def test_the_sampler_with_reshuffled_minibatches_samples_a_bayesian_linear_regression():
    # The code base's setting: lr 1e-2, friction 0.05, momentum redrawn every 50 steps, batches from a
    # per-epoch reshuffle, the prior precision fixed (no redraws) at 1. Known posterior N(mu, H^-1).
    # Measured (this seed): variance / target 0.99 and 0.95; at lr 0.03 0.89 / 0.86 and at 0.1 0.35 /
    # 0.36 with the reshuffle (independent batches: 1.01 / 0.99 and 1.5 / 1.7): the code's -lr^4
    # noise estimate and the reshuffle's cancelling noise are small at its lr only.
    x, y = _regression(60, 2, seed=0)
    precision = x.T @ x + torch.eye(2, dtype=torch.float64)
    cov = torch.linalg.inv(precision)
    mean = cov @ x.T @ y
    w = torch.nn.Parameter(torch.zeros(100, 2, dtype=torch.float64))
    kept = _run([w], x, y, lr=0.01, steps=6000, burn_in=2000, batch=10, seed=0)
    draws = kept.reshape(-1, 2)  # the chains share one batch stream, so their errors correlate
    assert ((draws.mean(0) - mean) / cov.diag().sqrt()).abs().max() < 0.1
    ratio = draws.var(0) / cov.diag()
    assert ((ratio - 1).abs() < 0.1).all(), ratio


def test_the_gibbs_step_draws_the_prior_precision_from_its_gamma_conditional():
    p = torch.nn.Parameter(torch.tensor([0.5, -1.0, 2.0]))
    sampler = ScaleAdaptedSGHMC([p], lr=1e-9, friction=0.05, prior_std=0.1, hyperprior_shape=3.0, hyperprior_rate=2.0,
                                generator=torch.Generator().manual_seed(0), rng=np.random.default_rng(0))
    assert sampler.precisions() == []
    p.grad = torch.zeros(3)
    draws = []
    for _ in range(20000):
        with torch.no_grad():
            p.copy_(torch.tensor([0.5, -1.0, 2.0]))  # the conditional given these weights
        sampler.step(resample_prior=True)
        draws.append(sampler.precisions()[0])
    shape, rate = 3.0 + 3 / 2, 2.0 + (0.25 + 1.0 + 4.0) / 2  # Gamma(alpha0 + n/2, beta0 + |p|^2/2)
    assert np.mean(draws) == pytest.approx(shape / rate, rel=0.01)
    assert np.var(draws) == pytest.approx(shape / rate**2, rel=0.05)


def test_the_chain_with_the_hyperprior_samples_the_hierarchical_posterior():
    # One weight per chain (the Gibbs step is per tensor), y = w x + N(0, 1) on 8 weakly informative
    # points, w | lambda ~ N(0, 1/lambda), lambda ~ Gamma(1, 1): the marginal posterior of w is the
    # likelihood times a Student-t prior, integrated on a grid. A fixed precision a0/b0 = 1 instead
    # would give variance 0.635 against the hierarchical 0.754.
    x, y = _regression(8, 1, seed=1, scale=0.4)
    grid = torch.linspace(-8, 8, 160001, dtype=torch.float64)
    log_density = -((y[None] - grid[:, None] * x.T) ** 2).sum(1) / 2 - 1.5 * torch.log(1 + grid**2 / 2)
    weights = torch.exp(log_density - log_density.max())
    weights /= weights.sum()
    mean = (weights * grid).sum()
    var = (weights * (grid - mean) ** 2).sum()
    chains = [torch.nn.Parameter(torch.zeros(1, dtype=torch.float64)) for _ in range(8)]
    kept = _run(chains, x, y, lr=0.03, steps=10000, burn_in=2000, batch=4, seed=0, resample_prior=True)
    assert abs(float(kept.mean()) - float(mean)) < 0.15 * math.sqrt(var)
    assert float(kept.var()) / float(var) == pytest.approx(1.0, abs=0.12)


def test_dynamic_clipping_starts_after_the_window_and_leaves_outliers_out():
    p = torch.nn.Parameter(torch.zeros(2))
    clip = GradientClip(window=4, multiplier=2.0)
    for norm in (1.0, 1.1, 0.9, 1.0, 1.0):
        p.grad = torch.tensor([norm, 0.0])
        assert clip([p]) == pytest.approx(norm) and math.isinf(clip.limit)
    p.grad = torch.tensor([50.0, 0.0])
    assert clip([p]) == pytest.approx(50.0)  # returned unclipped, the gradient clipped to the limit
    limit = float(np.mean([1.0, 1.1, 0.9, 1.0, 1.0]) + 2 * np.std([1.0, 1.1, 0.9, 1.0, 1.0]))
    assert clip.limit == pytest.approx(limit) and float(p.grad.norm()) == pytest.approx(limit, rel=1e-5)
    assert clip.clipped == 1 and 50.0 not in clip.norms


def test_reshuffled_batches_cover_the_split_once_per_epoch_last_batch_short():
    batches = list(reshuffled_batches(10, 4, torch.Generator().manual_seed(0)))
    assert [len(b) for b in batches] == [4, 4, 2]
    assert sorted(torch.cat(batches).tolist()) == list(range(10))


def test_the_kept_epochs_are_the_last_after_the_burn_in():
    assert ScaleAdaptedSGHMCSettings().kept_epochs() == list(range(50, 250, 2))  # the code base's last 100 of 115
    assert ScaleAdaptedSGHMCSettings(epochs=5, burn_in_epochs=1, thinning_epochs=2, kept_states=9).kept_epochs() == [2, 4]
    with pytest.raises(ValueError, match="burn_in_epochs"):
        ScaleAdaptedSGHMCSettings(epochs=5, burn_in_epochs=5)
    with pytest.raises(ValueError, match="friction"):
        ScaleAdaptedSGHMCSettings(friction=1.5)


SHORT = dict(epochs=4, burn_in_epochs=1, thinning_epochs=1, kept_states=3, batch_size=128)


def test_the_method_runs_one_chain_from_the_seeds_initialisation(tiny_exp, tiny_bases):
    seed, base = tiny_bases[0]
    method = build(tiny_exp, "sghmc_sa", **SHORT)
    method.fit(base, seed)
    samples = method.sample(3, torch.Generator().manual_seed(1))
    assert set(samples) == set(tiny_exp.model().state_dict()) and all(v.shape[0] == 3 for v in samples.values())
    again = build(tiny_exp, "sghmc_sa", **SHORT)
    again.fit({k: torch.zeros_like(v) for k, v in base.items()}, seed)  # the base is not used
    for key, value in again.sample(3, torch.Generator()).items():
        torch.testing.assert_close(value, samples[key], rtol=0, atol=0)
    images = tiny_exp.test_tensors[0][:20]
    torch.testing.assert_close(method.predict_own(images, 3, torch.Generator()),
                               predict_with_weights(tiny_exp.model(), samples, images))
    assert not torch.equal(samples["fc2.weight"][0], samples["fc2.weight"][2])  # the chain moves
    diagnostics = method.diagnostics(*tiny_exp.test_tensors)
    assert diagnostics["steps"] == 4 * math.ceil(len(tiny_exp.training_data.train_tensors[1]) / 128)
    assert 0 < diagnostics["prior_std_mean"] < 10
    with pytest.raises(MethodConfigError, match=r"4 samples asked, the chain keeps 3 .*kept_states=3"):
        method.sample(4, torch.Generator())


def test_the_method_is_one_mode_only(tiny_exp):
    with pytest.raises(MethodConfigError, match="method=sghmc_sa mode=multi: .*use mode=one"):
        build(tiny_exp, "sghmc_sa").check("multi")


def test_on_resnet18_the_kept_states_carry_their_batchnorm_statistics(tiny_resnet):
    # The code base samples in train mode: BatchNorm learns running statistics along the chain, and
    # each kept state predicts with its own.
    exp = tiny_resnet()
    method = build(exp, "sghmc_sa", epochs=3, burn_in_epochs=1, thinning_epochs=1, kept_states=2, batch_size=4)
    method.fit({}, 7)
    samples = method.sample(2, torch.Generator())
    running = [k for k in samples if k.endswith("running_var")]
    assert running and not torch.equal(samples[running[0]][0], samples[running[0]][1])
    torch.testing.assert_close(method.predict_own(exp.test_tensors[0], 2, torch.Generator()),
                               predict_with_weights(exp.model(), samples, exp.test_tensors[0]))
