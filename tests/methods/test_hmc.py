"""Full-batch HMC: the stacked kernel against closed forms (a 2-D Gaussian, a Bayesian linear
regression) and against Pyro's HMC on a small network; the network potential against the
plain model; diagnostics against ArviZ; the refusal of random likelihoods; divergence restarts;
resuming a killed chain bit for bit."""
from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from benchmark.core.settings import SettingsError
from benchmark.core.store import ChainFiles
from benchmark.core.training import Recipe, TrainingData, seeded
from methods.base import MethodConfigError
from methods.base import MethodFitError
from benchmark.core.training.stacked import PackedChain
from methods.hmc import HMCMethod, HMCSettings, NetworkPotential, init_seed, sampling_seed, start_seed
from methods.hmc_kernel import DIVERGED, SAMPLING, ChainState, KernelSettings, StackedHMC, new_chain
from metrics.mcmc import bfmi, ess, predictive_convergence, rhat
from tests.methods.conftest import build

pytestmark = pytest.mark.slow  # trains networks (bases, vBNNs, chains): make test, not make test-fast

with warnings.catch_warnings():
    warnings.simplefilter("ignore", FutureWarning)
    import arviz as az


def gaussian_potential(mean: torch.Tensor, precision: torch.Tensor):
    """``U(q) = (q - mean)' P (q - mean) / 2`` for ``q [C, D]``, with its gradient."""
    def potential(q):
        d = q - mean
        g = d @ precision
        return 0.5 * (g * d).sum(-1), g
    return potential


def run(potential, dimension: int, chains: int, draws: int, seed: int = 0, **settings) -> torch.Tensor:
    """``[chains, draws, D]`` from chains started at the origin."""
    kernel = StackedHMC(potential, KernelSettings(**settings))
    states = [new_chain(f"c{i}", torch.zeros(dimension), seed * 1000 + i) for i in range(chains)]
    kernel.run(states, draws)
    assert all(s.phase == SAMPLING and len(s.draws) == draws for s in states)
    return torch.stack([s.draws for s in states])


def assert_moments(draws: torch.Tensor, mean: torch.Tensor, cov: torch.Tensor, sigmas: float = 4.0) -> None:
    """Mean within ``sigmas`` Monte Carlo standard errors (bulk ESS by ArviZ); variances within
    the same number of their standard errors (var x sqrt(2 / ESS)); correlations within 0.1."""
    flat = draws.reshape(-1, draws.shape[-1]).double()
    n_eff = torch.from_numpy(ess(draws))
    sd = cov.diagonal().sqrt()
    assert (flat.mean(0) - mean).abs().le(sigmas * sd / n_eff.sqrt()).all(), (flat.mean(0), mean, n_eff)
    var = flat.var(0)
    assert (var - cov.diagonal()).abs().le(sigmas * cov.diagonal() * (2 / n_eff).sqrt()).all(), (var, cov.diagonal())
    corr = torch.corrcoef(flat.T)
    assert (corr - cov / torch.outer(sd, sd)).abs().max() < 0.1


def test_kernel_samples_a_2d_gaussian():
    mean = torch.tensor([1.0, -2.0], dtype=torch.float64)
    cov = torch.tensor([[1.0, 0.6], [0.6, 0.5]], dtype=torch.float64)  # curvatures 0.7 and 9: one stiff direction
    draws = run(gaussian_potential(mean.float(), torch.linalg.inv(cov).float()), 2, chains=24, draws=150,
                trajectory_length=1.5, warmup=60)
    assert_moments(draws, mean, cov)
    assert float(rhat(draws).max()) < 1.05


def test_kernel_samples_a_bayesian_linear_regression():
    """y = X beta + N(0, 0.5^2), beta ~ N(0, I): posterior N(S X'y / s^2, S), S = (X'X / s^2 + I)^-1."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(40, 3, generator=generator, dtype=torch.float64) * torch.tensor([1.0, 3.0, 0.3], dtype=torch.float64)
    y = x @ torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64) + 0.5 * torch.randn(40, generator=generator, dtype=torch.float64)
    precision = x.T @ x / 0.25 + torch.eye(3, dtype=torch.float64)
    cov = torch.linalg.inv(precision)
    mean = cov @ x.T @ y / 0.25

    def potential(q):  # the negative log posterior written from the model, not from its closed form
        q = q.detach().requires_grad_()
        u = ((y.float() - q @ x.float().T) ** 2).sum(-1) / (2 * 0.25) + 0.5 * (q * q).sum(-1)
        return u.detach(), torch.autograd.grad(u.sum(), q)[0]

    draws = run(potential, 3, chains=24, draws=150, trajectory_length=1.5, warmup=80, max_leapfrog_steps=30)  # mass adaptation on
    assert_moments(draws, mean, cov)


def toy_data(n: int = 30):
    """A 3-class problem on 2 features, as ``[n, 1, 1, 2]`` images (the stacked networks' layout)."""
    generator = torch.Generator().manual_seed(1)
    labels = torch.arange(n) % 3
    centres = torch.tensor([[1.0, 0.0], [-0.5, 0.9], [-0.5, -0.9]])
    features = centres[labels] + 0.8 * torch.randn(n, 2, generator=generator)
    return features.view(n, 1, 1, 2), labels


def logistic_factory(dropout: float = 0.0) -> nn.Module:
    """Multinomial logistic regression as a layer chain (Flatten, Linear)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(2, 3))


@pytest.fixture(scope="module")
def logistic():
    """``(method, chains)``: 8 HMC chains of 120 draws on the toy problem's posterior
    (prior precision 30 x 0.05 = 1.5)."""
    images, labels = toy_data()
    data = TrainingData(train=None, train_tensors=(images, labels), check=None)
    recipe = Recipe(epochs=1, batch_size=8, lr=0.1, weight_decay=0.05)
    settings = HMCSettings(trajectory_length=1.5, warmup=60, max_leapfrog_steps=50)
    method = HMCMethod(logistic_factory, data, settings, recipe=recipe)
    with torch.random.fork_rng():
        chains = method.run_chains(method.start_chains(list(range(8))), 120, progress=False)
    return method, chains


def pyro_potential(method: HMCMethod):
    """Pyro's potential: the plain model's summed cross-entropy plus the Gaussian prior, written
    with the model itself (``functional_call``), independent of the stacked networks."""
    potential = method.potential

    def potential_fn(params):
        w = params["w"]
        state = dict(zip(potential.keys, (v.reshape(s) for v, s in zip(w.split(potential.sizes), potential.shapes))))
        logits = torch.func.functional_call(potential.model, state, (potential.images,))
        return F.cross_entropy(logits, potential.labels, reduction="sum") + 0.5 * method.prior_precision * (w * w).sum()

    return potential_fn


def test_kernel_agrees_with_pyros_hmc_on_a_small_network(logistic):
    """Same posterior means and standard deviations as Pyro's HMC (with its own step and mass
    adaptation) within Monte Carlo error (bulk ESS of each side by ArviZ)."""
    from pyro.infer.mcmc import HMC, MCMC

    method, chains = logistic
    with seeded(0):
        kernel = HMC(potential_fn=pyro_potential(method), trajectory_length=1.5, adapt_mass_matrix=True)
        mcmc = MCMC(kernel, num_samples=400, warmup_steps=100, initial_params={"w": chains[0].start.clone()},
                    disable_progbar=True)
        mcmc.run()
    reference = mcmc.get_samples()["w"][None]  # [1, 400, D]
    ours = torch.stack([c.draws for c in chains])
    ours_ess, reference_ess = torch.from_numpy(ess(ours)), torch.from_numpy(ess(reference))
    flat_ours, flat_ref = ours.reshape(-1, ours.shape[-1]).double(), reference[0].double()
    sd = flat_ref.std(0)
    error = (sd**2 / ours_ess + sd**2 / reference_ess).sqrt()
    assert (flat_ours.mean(0) - flat_ref.mean(0)).abs().le(4 * error).all(), (flat_ours.mean(0), flat_ref.mean(0), error)
    ratio = flat_ours.std(0) / sd  # the sd of a standard deviation estimate: sd / sqrt(2 ESS)
    assert ((ratio - 1).abs() < 4 * (1 / (2 * ours_ess) + 1 / (2 * reference_ess)).sqrt()).all(), ratio


def test_diagnostics_equal_arviz_on_the_chains(logistic):
    """The predictive R-hat, ESS and E-BFMI of the chains (as the runner computes them from
    ``chain_predictions`` and the chains' energies) equal ArviZ's on the same numbers."""
    method, chains = logistic
    images, labels = toy_data(12)
    report = predictive_convergence(method.chain_predictions(chains, images), labels)
    model = method.potential.model
    probs = []
    for chain in chains:
        samples = method.chain_samples(chain)
        with torch.no_grad():
            probs.append(torch.stack([torch.softmax(torch.func.functional_call(model, {k: v[i] for k, v in samples.items()},
                                                                               (images,)), -1)
                                      for i in range(len(chain.draws))]))
    probs = torch.stack(probs).double().numpy()  # [chains, draws, N, classes], as metrics.mcmc passes them
    loglik = np.log(np.take_along_axis(probs, labels.numpy()[None, None, :, None], 3)[..., 0]).mean(-1)
    assert report["rhat_loglik"] == az.rhat(loglik, method="rank")
    softmax = np.array([az.rhat(probs[:, :, i, k], method="rank") for i in range(12) for k in range(3)])
    assert report["rhat_softmax_median"] == np.median(softmax)
    assert list(report["ess_loglik"]) == [az.ess(loglik[i : i + 1], method="bulk") for i in range(len(chains))]
    energy = np.array([c.energies for c in chains])
    assert list(bfmi(energy)) == list(az.bfmi(energy))
    assert report["rhat_loglik"] < 1.1 and report["softmax_converged"] > 0.9  # an easy posterior mixes
    summary = chains[0].summary()
    assert 0.5 < summary["accept_prob"] <= 1 and summary["kept"] == 120 and summary["divergences"] == []


def test_network_potential_is_the_summed_cross_entropy_plus_the_prior(tiny_exp, tiny_bases):
    """OptuNet through the stacked (numba) networks: U and its gradient equal the plain model's
    sum of cross-entropies + N wd / 2 |w|^2, chain by chain."""
    method = build(tiny_exp, "hmc")
    images, labels = tiny_exp.train_tensors
    assert method.prior_precision == pytest.approx(len(labels) * tiny_exp.recipe.weight_decay)
    bases = [base for _, base in tiny_bases[:3]]
    q = torch.stack([method.potential.flatten(base) for base in bases])
    value, gradient = method.potential(q)
    model = tiny_exp.model()
    for i, base in enumerate(bases):
        params = {k: v.clone().requires_grad_() for k, v in base.items()}
        logits = torch.func.functional_call(model, params, (images,))
        u = F.cross_entropy(logits, labels, reduction="sum") + 0.5 * method.prior_precision * sum((p**2).sum() for p in params.values())
        keys = [name for name, _ in model.named_parameters()]  # the order of q (a checkpoint's keys are sorted)
        grads = torch.autograd.grad(u, [params[k] for k in keys])
        assert float(value[i]) == pytest.approx(float(u.detach()), rel=1e-5)
        torch.testing.assert_close(gradient[i], torch.cat([g.reshape(-1) for g in grads]), rtol=1e-4, atol=1e-3)
    assert torch.equal(method.potential.unflatten(q[1])["fc2.weight"], bases[1]["fc2.weight"])


def test_batchnorm_and_dropout_are_refused_before_any_work(tiny_resnet):
    resnet = tiny_resnet()
    with pytest.raises(MethodConfigError, match=r"method=hmc: HMC needs a fixed likelihood.*BatchNorm2d"):
        build(resnet, "hmc").check("one")
    images, labels = toy_data()
    data = TrainingData(train=None, train_tensors=(images, labels), check=None)
    recipe = resnet.recipe
    with_dropout = lambda dropout=0.0: nn.Sequential(nn.Flatten(), nn.Dropout(0.3), nn.Linear(2, 3))  # noqa: E731
    method = HMCMethod(with_dropout, data, HMCSettings(), recipe=recipe)
    with pytest.raises(MethodConfigError, match=r"Dropout\(p=0.3\) \(random masks\)"):
        method.check("multi")
    with pytest.raises(MethodConfigError, match="BatchNorm1d"):
        NetworkPotential(nn.Sequential(nn.Flatten(), nn.BatchNorm1d(2), nn.Linear(2, 3)), images, labels, 1.0)
    HMCMethod(logistic_factory, data, HMCSettings(), recipe=recipe).check("one")  # a fixed likelihood passes


class StiffAfterWarmup:
    """A standard normal until ``stiffen()``; then N(0, 1e-4 I) (or NaN everywhere with ``nan``)."""

    def __init__(self, nan: bool = False) -> None:
        self.scale, self.nan = 1.0, nan

    def stiffen(self) -> None:
        self.scale = 1e4

    def __call__(self, q):
        if self.nan and self.scale > 1:
            return torch.full(q.shape[:1], math.nan), torch.full_like(q, math.nan)
        return 0.5 * self.scale * (q * q).sum(-1), self.scale * q


@pytest.mark.parametrize("nan", [False, True])
def test_a_divergence_restarts_the_chain_with_a_smaller_step_and_is_reported(nan):
    potential = StiffAfterWarmup(nan)
    kernel = StackedHMC(potential, KernelSettings(trajectory_length=1.0, warmup=30, max_restarts=2, restart_step_factor=0.5))
    chains = [new_chain(f"c{i}", torch.full((3,), 0.5), i) for i in range(2)]
    kernel.run(chains, 0, warmup_only=True)
    warm_steps = [c.step_size for c in chains]
    potential.stiffen()  # the curvature grows 10^4-fold after warm-up: the adapted step now diverges
    kernel.run(chains, 20)
    for chain, warm in zip(chains, warm_steps):
        first = chain.divergences[0]
        assert first["step_size"] == warm and first["iteration"] == 0 and first["restarted"]
        assert first["energy_error"] > 1000
        if nan:  # diverges again after each restart: reported, then stopped
            assert chain.phase == DIVERGED and chain.restarts == 2
            assert [d["restarted"] for d in chain.divergences] == [True, True, False]
            assert chain.divergences[1]["step_size"] <= 0.5 * warm
        else:  # restarted from its start, warmed up again under the cap, then sampled the stiff normal
            assert chain.restarts == 1 and chain.phase == SAMPLING and len(chain.draws) == 20
            assert chain.step_size <= 0.5 * warm and len(chain.divergences) == 1
            assert float(chain.draws.std()) < 0.05
    summary = chains[0].summary()
    assert summary["restarts"] == chains[0].restarts and summary["divergences"] == chains[0].divergences


def small_method(**changes) -> HMCMethod:
    images, labels = toy_data()
    data = TrainingData(train=None, train_tensors=(images, labels), check=None)
    recipe = Recipe(epochs=1, batch_size=8, lr=0.1, weight_decay=0.05)
    settings = HMCSettings(**({"trajectory_length": 1.0, "warmup": 25, "thinning": 2, "max_leapfrog_steps": 20, "save_every": 1,
                               "descent_steps": 100} | changes))
    return HMCMethod(logistic_factory, data, settings, recipe=recipe)


class Killed(Exception):
    """Stands for the process being killed between two iterations."""


def test_a_killed_chain_resumes_bit_for_bit(tmp_path, monkeypatch):
    method = small_method()
    uninterrupted = method.run_chains(method.start_chains([3, 4]), 6, progress=False)
    calls = {"n": 0}
    original = StackedHMC.iterate

    def iterate_then_die(self, chains):
        calls["n"] += 1
        if calls["n"] > 31:  # in the sampling phase, with draws kept already
            raise Killed
        original(self, chains)

    monkeypatch.setattr(StackedHMC, "iterate", iterate_then_die)
    with pytest.raises(Killed):
        method.run_chains(method.start_chains([3, 4]), 6, files=ChainFiles(tmp_path), progress=False)
    monkeypatch.setattr(StackedHMC, "iterate", original)
    saved = ChainState.load(tmp_path / "seed_000003.safetensors")
    assert saved.phase == SAMPLING and 0 < len(saved.draws) < 6, "killed mid-sampling"
    resumed = method.run_chains(method.start_chains([3, 4]), 6, files=ChainFiles(tmp_path), progress=False)
    for a, b in zip(uninterrupted, resumed):
        assert torch.equal(a.draws, b.draws) and torch.equal(a.position, b.position)
        assert a.accept_probs == b.accept_probs and a.energies == b.energies and a.step_size == b.step_size
        assert torch.equal(a.inverse_mass, b.inverse_mass) and a.n_leapfrog == b.n_leapfrog
    other = small_method(trajectory_length=0.5)
    with pytest.raises(ValueError, match="seed_000003.safetensors: saved under other HMC settings"):
        other.run_chains(other.start_chains([3]), 6, files=ChainFiles(tmp_path), progress=False)


def test_a_chain_does_not_depend_on_the_chains_beside_it_and_matches_the_sample_protocol():
    method = small_method()
    together = method.run_chains(method.start_chains([3, 4, 5]), 4, progress=False)
    alone = method.run_chains(method.start_chains([4]), 4, progress=False)
    assert torch.equal(together[1].draws, alone[0].draws)
    with torch.random.fork_rng():
        method.fit({}, 4)  # start=init: the base is not used
        samples = method.sample(4, torch.Generator().manual_seed(4))
    expected = method.chain_samples(alone[0])
    assert list(samples) == ["1.weight", "1.bias"] and all(torch.equal(samples[k], expected[k]) for k in samples)
    own = method.predict_own(toy_data(5)[0], 4, torch.Generator().manual_seed(4))
    assert own.shape == (4, 5, 3)
    assert sampling_seed(4) == int(torch.randint(0, 2**62, (1,), generator=torch.Generator().manual_seed(4)))
    diagnostics = method.diagnostics(*toy_data(12))
    assert diagnostics["leapfrog_per_draw"] > 0 and diagnostics["divergences"] == 0


def test_start_base_starts_at_the_base_and_bad_settings_are_refused():
    method = small_method(start="base")
    base = {"1.weight": torch.full((3, 2), 0.25), "1.bias": torch.zeros(3)}
    chain = method.start_chains([1], [base])[0]
    assert torch.equal(chain.start, torch.cat([base["1.weight"].reshape(-1), base["1.bias"]]))
    with pytest.raises(ValueError, match="start=base: a chain needs its base network"):
        method.start_chains([1])
    with pytest.raises(SettingsError, match="start='middle': expected one of init, base"):
        HMCSettings(start="middle")
    with pytest.raises(SettingsError, match="target_accept=1.0"):
        HMCSettings(target_accept=1.0)


def test_the_forward_implementations_agree():
    images, labels = toy_data()
    q = torch.randn(5, 9, generator=torch.Generator().manual_seed(0))
    results = [NetworkPotential(logistic_factory(), images, labels, 1.5, implementation=name)(q)
               for name in ("packed", "vmap", "loop")]
    for value, gradient in results[1:]:
        torch.testing.assert_close(value, results[0][0])
        torch.testing.assert_close(gradient, results[0][1])
    with pytest.raises(SettingsError, match="forward='cuda'"):
        HMCSettings(forward="cuda")


def test_the_sample_protocol_resumes_saved_chains_and_restarts_stale_or_damaged_ones(tmp_path, caplog):
    method = small_method()
    expected = method.run_chains(method.start_chains([4]), 4, progress=False)[0]
    method.use_chain_states(ChainFiles(tmp_path))
    assert not method.chain_finished(ChainFiles(tmp_path), 4, 4)
    with torch.random.fork_rng():
        method.fit({}, 4)
        first = method.sample(4, torch.Generator().manual_seed(4))
    assert method.chain_finished(ChainFiles(tmp_path), 4, 4) and not method.chain_finished(ChainFiles(tmp_path), 4, 5)
    assert torch.equal(ChainState.load(tmp_path / "seed_000004.safetensors").draws, expected.draws)
    assert all(torch.equal(first[k], v) for k, v in method.chain_samples(expected).items())
    other = small_method(trajectory_length=0.5)  # other settings: the saved chain is stale
    assert not other.chain_finished(ChainFiles(tmp_path), 4, 4)
    assert other.run_chains_in(ChainFiles(tmp_path), [4], lambda seed: {}, 4, should_stop=lambda: False)
    assert "saved under other HMC settings" in caplog.text and other.chain_finished(ChainFiles(tmp_path), 4, 4)
    path = tmp_path / "seed_000004.safetensors"
    path.write_bytes(path.read_bytes()[:-8])  # truncated
    assert not other.chain_finished(ChainFiles(tmp_path), 4, 4)
    assert other.run_chains_in(ChainFiles(tmp_path), [4], lambda seed: {}, 4, should_stop=lambda: False)
    assert "unreadable" in caplog.text and other.chain_finished(ChainFiles(tmp_path), 4, 4)
    stopped = small_method(warmup=30)
    assert not stopped.run_chains_in(ChainFiles(tmp_path / "b"), [5], lambda seed: {}, 4, should_stop=lambda: True)  # a lost claim
    assert ChainState.load(tmp_path / "b" / "seed_000005.safetensors").iteration == 1  # saved, then stopped


@pytest.mark.parametrize("chains", [1, 5, 16, 17, 33])
def test_packed_potential_equals_autograd_over_the_packed_and_plain_networks(tiny_exp, chains):
    """The packed kernels' fused full-batch step (``PackedChain.loss_and_grads``) gives U and dU/dq
    of every chain equal, to float32 rounding, to autograd over the packed forward and to autograd
    over the plain model chain by chain, for stacks that fill, spill over and pad the 16 lanes,
    with a prior and a temperature that weigh in (chains near the origin: the prior's share of the
    gradient is not negligible)."""
    images, labels = tiny_exp.train_tensors
    packed = NetworkPotential(tiny_exp.model(), images, labels, prior_precision=40.0, temperature=0.7,
                              implementation="packed")
    plain = NetworkPotential(tiny_exp.model(), images, labels, prior_precision=40.0, temperature=0.7,
                             implementation="loop")
    assert isinstance(packed.net, PackedChain) and plain.net is None
    starts = []
    for seed in range(chains):  # each chain its own initialisation, the same whatever ran before
        with seeded(seed):
            starts.append(packed.flatten(tiny_exp.model().state_dict()))
    q = torch.stack(starts)
    value, gradient = packed(q)
    for reference in (packed._autograd_potential(q), plain(q)):
        torch.testing.assert_close(value, reference[0], rtol=1e-5, atol=1e-3)
        scale = reference[1].abs().amax(1, keepdim=True)
        assert ((gradient - reference[1]).abs() <= 1e-5 * scale + 1e-4 * reference[1].abs()).all()
    prior = 40.0 * q / 0.7
    assert (prior.norm(dim=1) > 0.02 * gradient.norm(dim=1)).all()  # the prior's term is larger than the tolerance
    assert value.shape == (chains,) and gradient.shape == q.shape


def test_the_fisher_diagonal_is_the_class_weighted_squared_log_probability_gradients(tiny_exp, tiny_bases):
    """``sum_i sum_c p_ic (d log p_ic / dw)^2`` on OptuNet, against autograd image by image and
    class by class; the initial ``M^-1`` is ``1 / (Fisher + prior precision)``."""
    method = build(tiny_exp, "hmc")
    base = tiny_bases[0][1]
    q = method.potential.flatten(base)[None]
    images = method.potential.images[:6]
    subset = NetworkPotential(tiny_exp.model(), images, method.potential.labels[:6], 0.7)
    got = subset.fisher_diagonal(q)[0].double()
    model = tiny_exp.model()
    model.load_state_dict(method.potential.unflatten(q[0]))
    expected = torch.zeros_like(got)
    for image in images:
        log_probs = torch.log_softmax(model(image[None])[0], -1)
        for c in range(log_probs.numel()):
            grads = torch.autograd.grad(log_probs[c], list(model.parameters()), retain_graph=True)
            expected += float(log_probs[c].detach().exp()) * torch.cat([g.reshape(-1) for g in grads]).double() ** 2
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-9)
    torch.testing.assert_close(subset.curvature_inverse_mass(q)[0].double(), 1 / (expected + 0.7), rtol=1e-4, atol=1e-9)
    chain = small_method(initial_mass="fisher").start_chains([2])[0]
    assert torch.equal(chain.inverse_mass, chain.initial_inverse_mass) and not torch.equal(
        chain.inverse_mass, torch.ones_like(chain.inverse_mass))


def test_init_starts_descend_and_a_start_below_the_accuracy_floor_is_drawn_again(monkeypatch, caplog):
    """start=init: each chain initialises under its own seed (never a zoo seed), descends, and is
    drawn again from the next initialisation while its training accuracy is below the floor; all
    attempts failing stops the chain with MethodFitError, never a silent bad start."""
    method = small_method(descent_steps=40, start_min_accuracy=0.5, start_attempts=4)
    chain = method.start_chains([7])[0]
    with seeded(init_seed(7, 0)):
        init = method.potential.flatten(logistic_factory().state_dict())
    assert torch.equal(chain.start, method.descend(init[None])[0]) and chain.origin == {"init_seed": init_seed(7, 0), "attempt": 0}
    assert method.potential(chain.start[None])[0] < method.potential(init[None])[0]  # the descent went down
    assert init_seed(7, 1) - init_seed(7, 0) == 1_000_000 and init_seed(0) > 999_999
    floors = {init_seed(7, a): 0.0 for a in range(3)}  # attempts 0-2 of chain 7 stay below the floor

    def accuracy(self, q):
        starts = {int(s): self.descend(self.chain_start(7, attempt=a)[None])[0] for a, s in enumerate(map(init_seed, [7] * 4, range(4)))}
        return torch.tensor([next((floors.get(s, 1.0) for s, start in starts.items() if torch.equal(start, row)), 1.0)
                             for row in q], dtype=torch.float64)

    monkeypatch.setattr(HMCMethod, "train_accuracy", accuracy)
    with caplog.at_level("INFO"):
        chains = method.start_chains([7, 8])
    assert chains[0].origin == {"init_seed": init_seed(7, 3), "attempt": 3} and chains[1].origin["attempt"] == 0
    assert caplog.text.count("below start_min_accuracy") == 3
    floors[init_seed(7, 3)] = 0.0
    with pytest.raises(MethodFitError, match="seed_000007: none of its 4 initialisations reached 50%"):
        method.start_chains([7])


def test_a_resumed_chain_does_not_redo_its_start(tmp_path, monkeypatch):
    method = small_method(descent_steps=20)
    assert method.run_chains_in(ChainFiles(tmp_path), [3], lambda seed: {}, 2, should_stop=lambda: False)
    calls = {"n": 0}
    original = HMCMethod.descend

    def counted(self, q, progress=False):
        calls["n"] += 1
        return original(self, q, progress)

    monkeypatch.setattr(HMCMethod, "descend", counted)
    assert method.run_chains_in(ChainFiles(tmp_path), [3, 4], lambda seed: {}, 2, should_stop=lambda: False)
    assert calls["n"] == 1  # chain 4's start only
    assert ChainState.load(tmp_path / "seed_000004.safetensors").origin == {"init_seed": init_seed(4), "attempt": 0}


def test_saved_chains_are_keyed_by_their_unit_and_the_code_and_a_stale_one_is_never_resumed(tmp_path, monkeypatch):
    """Issue #30, item 3: the chains' key was hand-written (settings, data size, layout): after a fix
    to ``methods/hmc_kernel.py`` the old states were still accepted. They are named by the store
    (``ChainFiles.path``), carry the unit's key, and the method's fingerprint holds its code and data."""
    import methods.hmc as hmc

    method = small_method(warmup=4)
    files = ChainFiles(tmp_path, key="unit-key-a")
    assert method.run_chains_in(files, [3], lambda seed: {}, 2, should_stop=lambda: False)
    assert [p.name for p in files.saved()] == [files.path(3).name] and method.chain_finished(files, 3, 2)
    assert files.stale() == {}
    other = ChainFiles(tmp_path, key="unit-key-b")  # the unit's key changed: code, settings, data or zoo
    assert not method.chain_finished(other, 3, 2)
    assert list(other.stale()) == [files.path(3)] and "run under key unit-key-a" in other.stale()[files.path(3)]
    before = method.fingerprint()
    monkeypatch.setattr(hmc, "code_fingerprint", lambda roots: "edited")  # a fix in methods/hmc*.py
    assert method.fingerprint() != before
    images, labels = toy_data()
    relabelled = HMCMethod(logistic_factory, TrainingData(train=None, train_tensors=(images, labels.roll(1)), check=None),
                           method.settings, recipe=method.recipe)
    assert relabelled.fingerprint() != method.fingerprint()  # same size, other data


class PerStepSyncHMC(StackedHMC):
    """A leapfrog loop that syncs with the host after every step (it asks ``alive.any()``): the reference
    ``StackedHMC``'s loop must match draw for draw."""

    def _leapfrog(self, q, p, grad, u, inverse_mass, step, steps, start_energy):
        from methods.hmc_kernel import _kinetic
        threshold = self.settings.divergence_threshold
        half = step[:, None] / 2
        alive = steps > 0
        taken = torch.zeros_like(steps)
        worst = torch.zeros(len(q), dtype=torch.float64, device=q.device)
        for _ in range(int(steps.max())):
            live = alive[:, None]
            p_half = torch.where(live, p - half * grad, p)
            q_new = torch.where(live, q + step[:, None] * (inverse_mass * p_half), q)
            u_new, g_new = self.potential(q_new)
            p_new = torch.where(live, p_half - half * g_new, p)
            q, p = q_new, p_new
            grad, u = torch.where(live, g_new, grad), torch.where(alive, u_new.to(u.dtype), u)
            error = u.double() + _kinetic(p, inverse_mass) - start_energy
            error = torch.where(torch.isnan(error), torch.full_like(error, math.inf), error)
            worst = torch.where(alive, torch.maximum(worst, error), worst)
            taken = taken + alive.long()
            alive = alive & (taken < steps) & (error <= threshold)
            if not bool(alive.any()):
                break
        return q, p, grad, u, worst, taken


@pytest.mark.parametrize("threshold", [1000.0, 2.0])  # 2.0: divergences (restarts) in the sampling phase too
def test_the_leapfrog_without_per_step_synchronisation_gives_the_same_draws_bit_for_bit(threshold):
    """Chains of step counts 1-40 (not multiples of SYNC_EVERY), some stopping early by divergence:
    the same draws, energies, step sizes and leapfrog counts as the loop that synchronised every step."""
    mean = torch.tensor([1.0, -2.0, 0.5])
    precision = torch.diag(torch.tensor([1.0, 30.0, 400.0]))
    settings = KernelSettings(trajectory_length=0.7, warmup=15, max_leapfrog_steps=40, divergence_threshold=threshold,
                              max_restarts=5)
    runs = []
    for kernel_type in (StackedHMC, PerStepSyncHMC):
        states = [new_chain(f"c{i}", torch.full((3,), 0.1 * i), i, inverse_mass=torch.tensor([1.0, 1.0, 0.05 * (i + 1)]))
                  for i in range(5)]
        kernel_type(gaussian_potential(mean, precision), settings).run(states, 25)
        runs.append(states)
    steps = [s.n_leapfrog for s in runs[0]]
    assert len(set(steps)) > 1
    for new, old in zip(*runs):
        assert torch.equal(new.draws, old.draws) and new.energies == old.energies
        assert (new.step_size, new.n_leapfrog, new.restarts, new.truncated) == (old.step_size, old.n_leapfrog,
                                                                                old.restarts, old.truncated)
    if threshold < 10:
        assert sum(s.warmup_divergences + len(s.divergences) for s in runs[0]) > 0


def test_iterations_the_leapfrog_cap_cuts_short_are_counted(tmp_path):
    """A trajectory of length 20 on a unit Gaussian (adapted steps ~1) needs ~20 leapfrog steps: a
    cap of 4 cuts every sampling iteration short, a cap of 1000 none; saved and loaded, the count stays."""
    potential = gaussian_potential(torch.zeros(2), torch.eye(2))
    for cap, expected in ((4, 1.0), (1000, 0.0)):
        states = [new_chain("c", torch.zeros(2), 0)]
        StackedHMC(potential, KernelSettings(trajectory_length=20.0, warmup=20, max_leapfrog_steps=cap)).run(states, 12)
        summary = states[0].summary()
        assert 20.0 / states[0].step_size > 4
        assert summary["truncated"] == round(expected * summary["sampling_iterations"])
        assert summary["truncated_fraction"] == expected
        states[0].save(tmp_path / "c.safetensors")
        assert ChainState.load(tmp_path / "c.safetensors").truncated == summary["truncated"]


def test_chains_per_start_share_a_start_and_mass_but_not_their_random_streams():
    """chains_per_start=2: seeds 4 and 5 start where seed 4 alone starts (its descended
    initialisation and M^-1), seeds 6 and 7 where seed 6 does; each chain draws on its own stream."""
    alone = small_method().start_chains([4, 6])
    method = small_method(chains_per_start=2)
    chains = method.start_chains([4, 5, 6, 7])
    for pair, single in zip((chains[:2], chains[2:]), alone):
        for chain in pair:
            assert torch.equal(chain.start, single.start)
            assert torch.equal(chain.initial_inverse_mass, single.initial_inverse_mass)
            assert chain.origin["start_seed"] == int(single.name.removeprefix("seed_"))
    assert not torch.equal(chains[2].start, chains[0].start)
    run = method.run_chains(chains, 4, progress=False)
    assert not torch.equal(run[0].draws, run[1].draws)
    assert start_seed(7, 2) == 6 and start_seed(7, 1) == 7 and start_seed(9, 5) == 5
    with pytest.raises(SettingsError, match="chains_per_start=2: expected 1 with start=base"):
        HMCSettings(chains_per_start=2, start="base")


def test_the_gpu_override_set_samples_the_logistic_posterior_as_pyros_nuts():
    """conf/methods/hmc_gpu.yaml's settings as they are (Stan's 1000-iteration windowed mass warm-up,
    un-truncated trajectories, thinning 20, two chains per start), only the descent shortened, on
    the toy logistic regression: no trajectory cut by the cap, the chains agree (R-hat < 1.1), and the posterior means and standard deviations are Pyro's NUTS's within Monte
    Carlo error (bulk ESS of each side by ArviZ)."""
    from dataclasses import fields

    from omegaconf import OmegaConf
    from pyro.infer.mcmc import MCMC, NUTS

    from tests.conftest import compose_config

    node = OmegaConf.to_container(compose_config(["methods@methods.hmc=hmc_gpu"]).methods.hmc, resolve=True)
    settings = HMCSettings(**({f.name: node[f.name] for f in fields(HMCSettings) if f.name in node} | {"descent_steps": 100}))
    assert (settings.warmup, settings.max_leapfrog_steps, settings.adapt_mass, settings.chains_per_start) == (1000, 1024, True, 2)
    images, labels = toy_data()
    data = TrainingData(train=None, train_tensors=(images, labels), check=None)
    method = HMCMethod(logistic_factory, data, settings, recipe=Recipe(epochs=1, batch_size=8, lr=0.1, weight_decay=0.05))
    with torch.random.fork_rng():
        chains = method.run_chains(method.start_chains(list(range(8))), 20, progress=False)
    assert all(c.truncated == 0 and c.summary()["sampling_iterations"] == 400 for c in chains)
    ours = torch.stack([c.draws for c in chains])  # [8, 20, D]
    assert float(rhat(ours).max()) < 1.1  # 4 starts x 2 chains of 20 draws: converged (2 x 20 alone is too noisy)
    with seeded(0):
        mcmc = MCMC(NUTS(potential_fn=pyro_potential(method), adapt_mass_matrix=True), num_samples=400, warmup_steps=200,
                    initial_params={"w": chains[0].start.clone()}, disable_progbar=True)
        mcmc.run()
    reference = mcmc.get_samples()["w"][None]
    ours_ess, reference_ess = torch.from_numpy(ess(ours)), torch.from_numpy(ess(reference))
    flat_ours, flat_ref = ours.reshape(-1, ours.shape[-1]).double(), reference[0].double()
    sd = flat_ref.std(0)
    error = (sd**2 / ours_ess + sd**2 / reference_ess).sqrt()
    assert (flat_ours.mean(0) - flat_ref.mean(0)).abs().le(4 * error).all(), (flat_ours.mean(0), flat_ref.mean(0), error)
    ratio = flat_ours.std(0) / sd
    assert ((ratio - 1).abs() < 4 * (1 / (2 * ours_ess) + 1 / (2 * reference_ess)).sqrt()).all(), ratio
