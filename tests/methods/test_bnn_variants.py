"""The symmetry-breaking vBNNs: ordered hidden biases (seed 000) and fixed semi-orthogonal skips
(seed 001). Transform and Jacobian against autograd, function-preserving initial sort, the
ordered constraint in every draw, the skips' orthogonality, their absence from the samples, the
skip network's function against a hand-written forward pass, and refusals."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from benchmark.core.models import mlp, optunet, predict_with_weights
from benchmark.core.training import FailRule, RecipeOverrides, seeded
from methods.base import MethodConfigError
from methods.bnn import BNNMethod
from methods.bnn_ordered import (
    OrderedBiasLinear, OrderedBNNSettings, log_abs_det_jacobian, ordered, ordered_layers, ordered_moments, sort_units_by_bias, unordered,
)
from methods.bnn_skip import SkipChain, semi_orthogonal, skip_matrices
from tests.conftest import one_thread
from tests.methods.conftest import build

pytestmark = pytest.mark.slow  # trains networks (bases, vBNNs, chains): make test, not make test-fast


def _variant(exp, name):
    return build(exp, name, train=RecipeOverrides(epochs=1, milestones=[], fail_rule=FailRule()))


@pytest.fixture(scope="module")
def fitted(tiny_exp, tiny_bases):
    """Both variants trained for one epoch from the first base's seed."""
    seed, base = tiny_bases[0]
    out = {}
    with one_thread(), tiny_exp.backends():
        for name in ("bnn_ordered", "bnn_skip"):
            method = _variant(tiny_exp, name)
            method.check("one")
            method.fit(base, seed)
            out[name] = method
    return out


# --- ordered biases ------------------------------------------------------------------------------
def test_ordered_transform_inverse_and_jacobian_against_autograd():
    y = torch.randn(5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    b = ordered(y)
    assert (b[1:] > b[:-1]).all() and b[0] == y[0]
    torch.testing.assert_close(unordered(b), y)
    jacobian = torch.autograd.functional.jacobian(ordered, y)
    assert torch.logdet(jacobian).item() == pytest.approx(float(log_abs_det_jacobian(y)))
    with pytest.raises(ValueError, match="strictly ascending"):
        unordered(torch.tensor([0.0, 0.0, 1.0]))


def test_ordered_layer_kl_term_is_the_bias_densitys_change_of_variables():
    torch.manual_seed(0)
    layer = OrderedBiasLinear(4, 3)
    out = layer(torch.randn(2, 4))
    sampler = layer.bias_sampler
    y, b = sampler.y, sampler.w
    assert torch.equal(b, ordered(y)) and out.shape == (2, 3)
    expected_prior = layer.weight_prior_dist.log_prior(layer.weight_sampler.w) + layer.bias_prior_dist.log_prior(b) + y[1:].sum()
    torch.testing.assert_close(layer.log_prior, expected_prior)
    # the density of y, not of b (BLiTZ's log_posterior carries a constant -1/2 per entry)
    q_y = torch.distributions.Normal(sampler.mu, F.softplus(sampler.rho)).log_prob(y).sum() - 0.5 * y.numel()
    torch.testing.assert_close(layer.log_variational_posterior - layer.weight_sampler.log_posterior(), q_y)


def test_sorting_units_by_bias_keeps_the_function():
    torch.manual_seed(3)
    model = mlp(4, [5, 3], 2)
    pairs = ordered_layers(model)
    assert pairs == [("fc1", "fc2"), ("fc2", "fc3")]
    x = torch.randn(7, 4)
    before = model(x)
    sort_units_by_bias(model, pairs)
    assert (model.fc1.bias.diff() > 0).all() and (model.fc2.bias.diff() > 0).all()
    torch.testing.assert_close(model(x), before)
    assert ordered_layers(optunet()) == [("fc1", "fc2")]


def test_ordered_draws_are_ascending_plain_keyed_and_predict_as_the_plain_model(fitted, tiny_exp):
    method = fitted["bnn_ordered"]
    samples = method.sample(20, torch.Generator().manual_seed(1))
    assert list(samples) == list(tiny_exp.model().state_dict())
    assert (samples["fc1.bias"].diff(dim=1) > 0).all(), "every draw's hidden biases must ascend"
    images = tiny_exp.test_tensors[0][:50]
    own = method.predict_own(images, 20, torch.Generator().manual_seed(1))
    torch.testing.assert_close(own, predict_with_weights(tiny_exp.model(), samples, images), atol=1e-5, rtol=0)
    torch.testing.assert_close(method.predict_weights(samples, images), own, atol=1e-5, rtol=0)


def test_the_ordered_vbnn_starts_where_the_plain_one_starts_reordered(tiny_exp):
    ordered_method, plain_method = _variant(tiny_exp, "bnn_ordered"), _variant(tiny_exp, "bnn")
    with seeded(7):
        net = ordered_method.variational_network()
    with seeded(7):
        plain = plain_method.variational_network()
    order = plain.samplers["fc1.bias"].mu.detach().argsort()
    torch.testing.assert_close(ordered(net.samplers["fc1.bias"].mu.detach()), plain.samplers["fc1.bias"].mu.detach()[order])
    torch.testing.assert_close(net.samplers["fc2.weight"].mu, plain.samplers["fc2.weight"].mu[:, order])
    assert torch.equal(net.samplers["conv1.weight"].mu, plain.samplers["conv1.weight"].mu)


def test_ordered_moments_against_monte_carlo():
    generator = torch.Generator().manual_seed(0)
    mu = torch.tensor([0.3, -1.0, 0.5, -2.0], dtype=torch.float64)
    sigma = torch.tensor([0.2, 0.4, 0.1, 0.8], dtype=torch.float64)
    draws = ordered(mu + sigma * torch.randn(400_000, 4, generator=generator, dtype=torch.float64))
    mean, std = ordered_moments(mu, sigma)
    torch.testing.assert_close(mean, draws.mean(dim=0), rtol=5e-3, atol=0)
    torch.testing.assert_close(std, draws.std(dim=0), rtol=1e-2, atol=0)


def test_ordered_vbnn_diagnostics_describe_the_biases_not_their_log_gaps(fitted):
    method = fitted["bnn_ordered"]
    diagnostics = method.diagnostics(None, None)
    draws = method.sample(800, torch.Generator().manual_seed(2))["fc1.bias"].double()
    empirical = float((draws.std(dim=0) / draws.mean(dim=0).abs()).mean())
    assert diagnostics["sigma_over_mu.fc1.bias"] == pytest.approx(empirical, rel=0.1)
    log_gaps = BNNMethod.diagnostics(method, None, None)["sigma_over_mu.fc1.bias"]
    assert log_gaps != pytest.approx(empirical, rel=0.1), "the plain vBNN's number (on y) is another quantity"
    sigmas = method.network.sigma_mean()
    sigmas["fc1.bias"] = float(draws.std(dim=0).mean())
    assert diagnostics["sigma_mean"] == pytest.approx(sum(sigmas.values()) / len(sigmas), rel=1e-2)
    assert diagnostics["sigma_over_mu.fc1.weight"] == BNNMethod.diagnostics(method, None, None)["sigma_over_mu.fc1.weight"]


# --- orthogonal skips ------------------------------------------------------------------------------
def test_skip_matrices_are_semi_orthogonal_per_layer_and_group():
    q = semi_orthogonal(3, 10, torch.Generator().manual_seed(0))
    torch.testing.assert_close(q @ q.T, torch.eye(3), atol=1e-6, rtol=0)
    q = semi_orthogonal(10, 3, torch.Generator().manual_seed(0))
    torch.testing.assert_close(q.T @ q, torch.eye(3), atol=1e-6, rtol=0)
    skips = skip_matrices(optunet(), seed=0)
    assert set(skips) == {"conv1", "conv2", "fc1", "fc2"}
    conv2 = skips["conv2"]
    assert conv2.weight.shape == (10, 1, 5, 5) and conv2.conv["groups"] == 2
    for g in range(2):
        block = conv2.weight[5 * g : 5 * (g + 1)].reshape(5, 25)
        torch.testing.assert_close(block @ block.T, torch.eye(5), atol=1e-6, rtol=0)
    again = skip_matrices(optunet(), seed=0)
    assert all(torch.equal(skips[k].weight, again[k].weight) for k in skips), "fixed by the seed alone"


def test_skip_network_is_the_seeds_layer_rule(tiny_exp):
    """h_l = W_l relu(h_{l-1}) + b_l + O_l h_{l-1}, written out by hand for OptuNet."""
    torch.manual_seed(2)
    model = optunet()
    skips = skip_matrices(model, seed=1, gain=0.5)
    chain = SkipChain(model, skips)
    x = tiny_exp.test_tensors[0][:6]
    o = {k: v.weight for k, v in skips.items()}
    h1 = F.conv2d(x, model.conv1.weight) + F.conv2d(x, o["conv1"])
    p1 = F.max_pool2d(h1, 3)
    h2 = F.conv2d(torch.relu(p1), model.conv2.weight, groups=2) + F.conv2d(p1, o["conv2"], groups=2)
    a2, m2 = torch.relu(h2).mean(dim=(2, 3)), h2.mean(dim=(2, 3))
    h3 = model.fc1(a2) + m2 @ o["fc1"].T
    h4 = model.fc2(torch.relu(h3)) + h3 @ o["fc2"].T
    with torch.no_grad():
        torch.testing.assert_close(chain(x), h4, atol=1e-5, rtol=1e-5)
    assert set(chain.state_dict()) == set(model.state_dict()), "the skips are not part of the state dict"


def test_skip_samples_are_plain_keyed_and_predicted_with_the_skips(fitted, tiny_exp):
    method = fitted["bnn_skip"]
    samples = method.sample(10, torch.Generator().manual_seed(2))
    assert list(samples) == list(tiny_exp.model().state_dict())
    images = tiny_exp.test_tensors[0][:50]
    own = method.predict_own(images, 10, torch.Generator().manual_seed(2))
    torch.testing.assert_close(method.predict_weights(samples, images), own, atol=1e-5, rtol=0)
    plain = predict_with_weights(tiny_exp.model(), samples, images)
    assert (plain - own).abs().max() > 1e-2, "the plain network with these weights computes another function"


def test_the_skip_vbnn_has_the_plain_vbnns_initialisation(tiny_exp):
    with seeded(5):
        net = _variant(tiny_exp, "bnn_skip").variational_network()
    with seeded(5):
        plain = _variant(tiny_exp, "bnn").variational_network()
    assert all(torch.equal(net.samplers[k].mu, plain.samplers[k].mu) for k in plain.samplers)


# --- refusals --------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, match", [
    ("bnn_ordered", "not a chain of layers"),
    ("bnn_skip", "not a chain of layers"),
])
def test_resnets_are_refused_before_any_training(tiny_resnet, name, match):
    exp = tiny_resnet()
    with pytest.raises(MethodConfigError, match=match):
        build(exp, name).check("one")


def test_ordered_biases_need_variational_hidden_layers_and_modes_are_one(tiny_exp):
    with pytest.raises(MethodConfigError, match="layers=last_layer leaves the hidden layers \\['fc1'\\] deterministic"):
        build(tiny_exp, "bnn_ordered", layers="last_layer").check("one")
    with pytest.raises(MethodConfigError, match="method=bnn_skip mode=multi: this method supports mode=one"):
        build(tiny_exp, "bnn_skip").check("multi")


def test_the_variants_take_the_plain_vbnns_settings_in_every_experiment():
    from benchmark.loader import compose_config
    from benchmark.experiment import Experiment

    for experiment in ("digits_optunet", "mnist_optunet"):
        exp = Experiment(compose_config([f"experiment={experiment}"]))
        plain = dataclasses.asdict(exp.method_settings("bnn"))
        for name in ("bnn_ordered", "bnn_skip"):
            settings = dataclasses.asdict(exp.method_settings(name))
            assert {k: settings[k] for k in plain} == plain, (experiment, name)
    for experiment in ("cifar100_resnet18", "tinyimagenet_resnet18"):
        exp = Experiment(compose_config([f"experiment={experiment}"]))
        assert exp.method_settings("bnn_ordered").unavailable and exp.method_settings("bnn_skip").unavailable


def test_a_command_line_override_of_the_plain_vbnn_reaches_the_variants_and_theirs_only_them():
    """The variants' settings follow methods.bnn (``PosteriorMethod.follows``): an override of the
    plain vBNN reaches both variants, one of a variant changes that variant alone, nested keys too."""
    from benchmark.loader import compose_config
    from benchmark.experiment import Experiment

    both = Experiment(compose_config(["methods.bnn.kl_weight=0.001", "methods.bnn.train.epochs=4"]))
    for name in ("bnn", "bnn_ordered", "bnn_skip"):
        settings = both.method_settings(name)
        assert settings.kl_weight == 0.001 and settings.train.epochs == 4 and settings.train.fail_rule.epoch == 3, name
    one = Experiment(compose_config(["methods.bnn_ordered.kl_weight=0.002", "methods.bnn_skip.train.epochs=3",
                                     "methods.bnn_skip.variance.lr=0.5"]))
    plain, ordered, skip = (one.method_settings(n) for n in ("bnn", "bnn_ordered", "bnn_skip"))
    assert ordered.kl_weight == 0.002 and plain.kl_weight == skip.kl_weight != 0.002
    assert skip.train.epochs == 3 and skip.train.fail_rule == plain.train.fail_rule and plain.train.epochs is None
    assert skip.variance.lr == 0.5 and plain.variance.lr is None and ordered.variance.lr is None
    assert isinstance(ordered, OrderedBNNSettings) and isinstance(skip.train, type(plain.train))


def test_the_sample_stage_stores_the_skip_networks_predictions(fitted, tiny_exp):
    from benchmark.stages.sample import predictions

    method = fitted["bnn_skip"]
    samples = method.sample(3, torch.Generator().manual_seed(4))
    stored = predictions(tiny_exp, samples, method)
    torch.testing.assert_close(stored["id"], method.predict_weights(samples, tiny_exp.test_tensors[0]))
    torch.testing.assert_close(stored["ood"], method.predict_weights(samples, tiny_exp.ood_tensors[0]))
    plain = predictions(tiny_exp, samples, fitted["bnn_ordered"])  # any other method: the plain model
    torch.testing.assert_close(plain["id"], predict_with_weights(tiny_exp.model(), samples, tiny_exp.test_tensors[0]))
