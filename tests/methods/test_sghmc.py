"""SGHMC: the chain on a 2-D Gaussian against its closed form, the method's samples and
predictions, the ResNet-18 path, bad input."""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from benchmark.core.data import InMemoryImageDataset
from benchmark.core.models import predict_with_weights
from benchmark.core.training import NonFiniteError, seeded
from methods.base import MethodConfigError
from methods.sghmc import Chain, SGHMCMethod, SGHMCSettings, network_log_posterior
from tests.conftest import one_thread
from tests.methods.conftest import build

MEAN = torch.tensor([1.0, -2.0])
COV = torch.tensor([[1.0, 0.6], [0.6, 0.5]])  # curvatures 0.71 and 10: one stiff direction


def gaussian_log_density(params, batch):
    """Unnormalised log N(MEAN, COV) summed over independent chains ``params["x"]`` ``[C, 2]``."""
    d = params["x"] - MEAN
    return -0.5 * ((d @ torch.linalg.inv(COV)) * d).sum(), torch.empty(0)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_chain_on_a_2d_gaussian_matches_the_closed_form(temperature):
    """1000 chains from the origin; target exp(log N / T) = N(MEAN, T * COV)."""
    chain = Chain(gaussian_log_density, lr=0.3, friction=1.5, temperature=temperature)
    batches = itertools.repeat(None)
    with seeded(0):
        state = chain.run(chain.start({"x": torch.zeros(1000, 2)}), batches, 100, "gaussian burn-in")
        kept = torch.cat([s["x"] for s in chain.thinned(state, batches, 8, 12, "gaussian")])
    torch.testing.assert_close(kept.mean(0), MEAN, atol=0.05, rtol=0)
    torch.testing.assert_close(torch.cov(kept.T), temperature * COV, atol=0.06 * temperature, rtol=0)


def test_network_log_posterior_is_minus_mean_nll_minus_l2(tiny_exp, tiny_bases):
    _, base = tiny_bases[0]
    model = tiny_exp.model()
    model.load_state_dict(base)
    images, labels = tiny_exp.test_tensors[0][:50], tiny_exp.test_tensors[1][:50]
    params = dict(model.named_parameters())
    value, _ = network_log_posterior(model, {}, 0.01)(params, (images, labels))
    with torch.no_grad():
        l2 = sum(float((p.double() ** 2).sum()) for p in params.values())
        expected = -float(F.cross_entropy(model(images).double(), labels)) - 0.005 * l2
    assert float(value.detach()) == pytest.approx(expected, abs=1e-5)


@pytest.fixture(scope="module")
def fitted(tiny_exp, tiny_bases) -> SGHMCMethod:
    """A chain burnt in for ~9 steps from the first base; kept states ~5 steps apart."""
    method = build(tiny_exp, "sghmc", burn_in_epochs=0.2, thinning_epochs=0.1)
    method.check("one")
    seed, base = tiny_bases[0]
    with one_thread(), tiny_exp.backends():
        method.fit(base, seed)
    return method


def test_samples_are_keyed_like_the_plain_model_and_predict_like_predict_own(fitted, tiny_exp, tiny_bases):
    images = tiny_exp.test_tensors[0][:200]
    g_sample, g_predict = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    samples = fitted.sample(4, g_sample)
    assert list(samples) == list(tiny_exp.model().state_dict())
    assert {k: tuple(v.shape[1:]) for k, v in samples.items()} == tiny_exp.shapes()
    base = tiny_bases[0][1]
    w = samples["conv1.weight"]
    assert not torch.equal(w[0], w[1]) and not torch.equal(w[0], base["conv1.weight"]), "the chain must move"
    own = fitted.predict_own(images, 4, g_predict)
    torch.testing.assert_close(own, predict_with_weights(tiny_exp.model(), samples, images), atol=1e-5, rtol=0)
    assert torch.equal(g_sample.get_state(), g_predict.get_state())
    again = fitted.sample(4, torch.Generator().manual_seed(3))
    other = fitted.sample(4, torch.Generator().manual_seed(4))
    assert all(torch.equal(again[k], samples[k]) for k in samples), "a chain is fixed by its generator"
    assert not torch.equal(other["fc2.weight"], samples["fc2.weight"])


def test_kept_states_are_thinning_steps_apart(fitted, tiny_exp):
    """Sample i of a longer request is sample i of a shorter one: the same chain, cut later."""
    short = fitted.sample(2, torch.Generator().manual_seed(8))
    long = fitted.sample(3, torch.Generator().manual_seed(8))
    assert all(torch.equal(long[k][:2], short[k]) for k in short)


def test_resnet18_chain_keeps_the_base_batchnorm_statistics(tiny_resnet):
    exp = tiny_resnet()
    with seeded(0):
        base = exp.model().state_dict()
    base["layer1.0.bn1.running_mean"] += 0.5  # trained-looking statistics that must survive unchanged
    method = build(exp, "sghmc", burn_in_epochs=1, thinning_epochs=0.5, batch_size=4)
    method.check("one")
    method.fit(base, 0)  # 2 burn-in steps, then 1 step per kept state
    samples = method.sample(2, torch.Generator().manual_seed(0))
    assert {k: tuple(v.shape[1:]) for k, v in samples.items()} == {k: tuple(v.shape) for k, v in base.items()}
    for key in ("layer1.0.bn1.running_mean", "layer1.0.bn1.running_var", "bn1.num_batches_tracked"):
        assert all(torch.equal(s, base[key]) for s in samples[key]), key
    assert not torch.equal(samples["fc.weight"][0], base["fc.weight"])


# --- bad input -----------------------------------------------------------------------------------
def test_multi_mode_is_refused_with_the_reason(tiny_exp):
    with pytest.raises(MethodConfigError, match="one chain from one trained checkpoint.*use mode=one"):
        build(tiny_exp, "sghmc").check("multi")


@pytest.mark.parametrize(
    "override, match",
    [
        ("methods.sghmc.lr=0", "methods.sghmc.lr=0.0: expected a positive number"),
        ("methods.sghmc.friction=-1.0", "methods.sghmc.friction=-1.0: expected a positive number"),
        ("methods.sghmc.thinning_epochs=0", "methods.sghmc.thinning_epochs=0.0: expected a positive number"),
        ("methods.sghmc.burn_in_epochs=null", "methods.sghmc.burn_in_epochs: field 'methods.sghmc.burn_in_epochs' is not Optional"),
        ("methods.sghmc.batch_size=2.5", "methods.sghmc.batch_size: Value '2.5' of type 'float' could not be converted to Integer"),
        ("methods.sghmc.temperature=hot", "methods.sghmc.temperature: Value 'hot' of type 'str' could not be converted to Float"),
    ],
)
def test_bad_settings_are_refused_by_the_schema(tmp_path, override, match):
    from benchmark.cli import check_command_line

    assert check_command_line([override, f"store={tmp_path}"]) == match
    with pytest.raises(ValueError, match="lr=0: expected a positive number"):
        SGHMCSettings(lr=0)


def test_nan_during_the_chain_stops_with_non_finite_error(tiny_exp, tiny_bases):
    seed, base = tiny_bases[0]
    method = build(tiny_exp, "sghmc", lr=1e6, burn_in_epochs=1)
    with pytest.raises(NonFiniteError, match="sghmc seed .* burn-in"):
        method.fit(base, seed)
    with pytest.raises(RuntimeError, match="call fit"):
        method.sample(1, torch.Generator())


def test_a_base_of_another_model_and_bad_counts_are_refused(tiny_exp, tiny_bases, fitted):
    method = build(tiny_exp, "sghmc")
    with pytest.raises(ValueError, match="the base checkpoint does not fit the model"):
        method.fit({"fc.weight": torch.zeros(3, 3)}, 0)
    with pytest.raises(ValueError, match="positive integer"):
        fitted.sample(0, torch.Generator())


def test_chain_refuses_non_finite_targets():
    chain = Chain(lambda p, b: (p["x"].sum() * float("nan"), torch.empty(0)), lr=0.1, friction=1.0, temperature=1.0)
    with pytest.raises(NonFiniteError, match="toy: log posterior became nan at step 1"):
        chain.run(chain.start({"x": torch.zeros(2)}), itertools.repeat(None), 3, "toy")


def test_train_data_are_the_unaugmented_split(tiny_exp):
    data = build(tiny_exp, "sghmc")._train_data()
    assert isinstance(data, InMemoryImageDataset) and not data.augment
    assert torch.equal(data.images, tiny_exp.train_tensors[0])


def _regression(n=200, d=3, prior=0.05, seed=0):
    """Bayesian linear regression y = x w + N(0, 1): data and the exact posterior ``(mean [d], cov [d, d])``
    of ``exp(N * per-example log posterior)`` with the Gaussian prior of precision ``N * prior``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    y = x @ torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)[:d] + torch.randn(n, generator=g, dtype=torch.float64)
    precision = x.T @ x + n * prior * torch.eye(d, dtype=torch.float64)
    cov = torch.linalg.inv(precision)
    return x, y, cov @ x.T @ y, cov


def _run_regression_chains(noise_correction, chains=200, batch=10, lr=0.05, friction=1.0):
    x, y, mean, cov = _regression()
    n, prior = len(y), 0.05

    def log_posterior(params, minibatch):  # per-example: -mean over the batch of (y - x w)^2 / 2 - prior / 2 |w|^2
        xb, yb = minibatch  # [B, C, d], [B, C]: every chain its own batch
        w = params["w"]  # [C, d]
        residual = yb - (xb * w).sum(-1)
        return (-0.5 * (residual**2).mean(0) - 0.5 * prior * (w**2).sum(-1)).sum(), torch.empty(0)

    def batches(generator):
        while True:
            index = torch.stack([torch.randperm(n, generator=generator)[:batch] for _ in range(chains)], dim=1)
            yield x[index], y[index]

    chain = Chain(log_posterior, lr=lr, friction=friction, temperature=1.0 / n, noise_correction=noise_correction)
    stream = batches(torch.Generator().manual_seed(1))
    with seeded(2):
        state = chain.run(chain.start({"w": mean.expand(chains, -1).clone()}), stream, 400, "regression burn-in")
        kept = torch.cat([s["w"] for s in chain.thinned(state, stream, 60, 25, "regression")])
    return kept, mean, cov, state


def test_minibatch_chain_samples_the_exact_posterior_of_a_bayesian_linear_regression():
    """Minibatches of 10 of 200 points: the gradient noise is half the intended noise. With the
    correction, the kept states have the exact posterior's mean and covariance (within 10%);
    without it, the same chain's variances come out inflated (the test sees the difference)."""
    kept, mean, cov, state = _run_regression_chains(noise_correction=True)
    sd = cov.diagonal().sqrt()
    assert ((kept.mean(0) - mean).abs() < 0.1 * sd).all()
    ratio = torch.cov(kept.T).diagonal() / cov.diagonal()
    assert ((ratio - 1).abs() < 0.1).all(), ratio
    torch.testing.assert_close(torch.cov(kept.T), cov, rtol=0, atol=0.1 * float(cov.diagonal().max()))
    assert state.clamped_sum / state.steps < 0.01  # only while the running estimate settles
    hot, *_ = _run_regression_chains(noise_correction=False)
    assert (torch.cov(hot.T).diagonal() / cov.diagonal() > 1.25).all(), torch.cov(hot.T).diagonal() / cov.diagonal()


def test_the_gradient_noise_estimate_is_the_minibatch_variance():
    x, y, mean, _ = _regression()
    _, _, _, state = _run_regression_chains(noise_correction=True, chains=50)
    residual = y - x @ mean
    per_example = (residual[:, None] * x)  # gradients of -(y - x w)^2 / 2 at the mean
    expected = per_example.var(0) / 10  # of a mean over 10 examples
    estimated = state.noise_variance["w"].mean(0)
    assert ((estimated / expected - 1).abs() < 0.2).all(), (estimated, expected)


def test_a_diverging_burn_in_is_restarted_with_half_the_step(tiny_exp, tiny_bases):
    seed, base = tiny_bases[0]
    method = build(tiny_exp, "sghmc", lr=100.0, burn_in_epochs=1, thinning_epochs=0.1, step_halvings=12)
    with one_thread(), tiny_exp.backends():
        method.fit(base, seed)
        method.sample(2, torch.Generator().manual_seed(0))
    used = method.diagnostics(*tiny_exp.test_tensors)["lr"]
    assert used < 100.0 and any(used == 100.0 * 0.5**k for k in range(1, 13))
    with pytest.raises(NonFiniteError, match="burn-in at lr 100"):
        build(tiny_exp, "sghmc", lr=100.0, burn_in_epochs=1, step_halvings=0).fit(base, seed)
