"""Variational BNN: BLiTZ conversion, draws, consistency with the plain model, ResNet-18 path, bad input."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from blitz.modules import BayesianConv2d, BayesianLinear
from torch import nn

import methods.bnn as bnn_module
from benchmark.loader import compose_config
from benchmark.core.data import InMemoryImageDataset
from benchmark.experiment import Experiment
from benchmark.core.models import optunet, predict_with_weights, resnet18
from benchmark.core.training import FailRule, NonFiniteError, RecipeOverrides, TrainingData, seeded
from methods.base import MethodConfigError
from methods.bayesian_layers import bayesian_layer_names, check_convertible, to_bayesian
from methods.bnn import BNNMethod
from tests.conftest import one_thread
from tests.methods.conftest import build

pytestmark = pytest.mark.slow  # trains networks (bases, vBNNs, chains): make test, not make test-fast


def tiny_bnn(exp: Experiment, elbo_samples: int = 3, **train) -> BNNMethod:
    """The experiment's vBNN with its recipe changed by ``train`` and no convergence rule (tiny runs)."""
    overrides = RecipeOverrides(fail_rule=FailRule(), **train)
    return build(exp, "bnn", train=overrides, elbo_samples=elbo_samples)


@pytest.fixture(scope="module")
def fitted(tiny_exp, tiny_bases) -> BNNMethod:
    """A vBNN trained for one epoch from the first base's seed."""
    method = tiny_bnn(tiny_exp, epochs=1, milestones=[])
    method.check("one")
    seed, base = tiny_bases[0]
    with one_thread(), tiny_exp.backends():
        method.fit(base, seed)
    return method


# --- conversion --------------------------------------------------------------------------------
def test_conversion_keeps_shapes_groups_bias_and_function():
    with seeded(3):
        plain = optunet()
    net = to_bayesian(plain, "all")
    conv2 = net.model.conv2
    assert isinstance(conv2, BayesianConv2d) and conv2.groups == 2
    assert conv2.weight_mu.shape == plain.conv2.weight.shape == (10, 1, 5, 5)
    assert not hasattr(conv2, "bias_mu"), "a bias-free plain conv must stay bias-free"
    assert isinstance(net.model.fc2, BayesianLinear)
    assert set(net.samplers) == set(plain.state_dict()) and net.plain_keys == tuple(plain.state_dict())
    for key, sampler in net.samplers.items():
        assert torch.equal(sampler.mu, plain.state_dict()[key])
    # With sigma -> 0 every draw is the mean: the BLiTZ network must compute the plain function.
    with torch.no_grad():
        for sampler in net.samplers.values():
            sampler.rho.fill_(-40.0)
    images = torch.randn(6, 1, 28, 28)
    with torch.no_grad():
        assert torch.allclose(net.model(images), plain(images), atol=1e-6)
    assert isinstance(plain.conv2, nn.Conv2d), "the plain model must be left untouched"


def test_last_layer_conversion_only_touches_the_last_linear():
    net = to_bayesian(optunet(), "last_layer")
    assert set(net.samplers) == {"fc2.weight", "fc2.bias"}
    assert type(net.model.conv1) is nn.Conv2d and type(net.model.fc1) is nn.Linear
    assert bayesian_layer_names(resnet18(num_classes=10), "last_layer") == ["fc"]


def test_conversion_refuses_what_blitz_cannot_represent():
    with pytest.raises(ValueError, match="'middle' is not a valid BNNLayers"):
        bayesian_layer_names(optunet(), "middle")
    model = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1, padding_mode="reflect"), nn.Flatten(), nn.Linear(2, 2))
    with pytest.raises(ValueError, match="padding_mode='reflect'"):
        check_convertible(model, "all")


# --- the fitted method ---------------------------------------------------------------------------
def test_sample_is_keyed_like_the_plain_model_and_predicts_like_predict_own(fitted, tiny_exp, monkeypatch):
    monkeypatch.setattr(bnn_module, "PREDICT_BATCH", 128)  # several batches must share one draw
    images = tiny_exp.test_tensors[0][:300]
    g_sample, g_predict = torch.Generator().manual_seed(11), torch.Generator().manual_seed(11)
    samples = fitted.sample(5, g_sample)
    assert {k: tuple(v.shape[1:]) for k, v in samples.items()} == tiny_exp.shapes()
    assert list(samples) == list(tiny_exp.model().state_dict())
    assert all(v.shape[0] == 5 for v in samples.values())
    assert not torch.equal(samples["fc1.weight"][0], samples["fc1.weight"][1]), "draws must differ"
    own = fitted.predict_own(images, 5, g_predict)
    plain = predict_with_weights(tiny_exp.model(), samples, images)
    assert own.shape == (5, 300, 10)
    torch.testing.assert_close(own, plain, atol=1e-5, rtol=0)
    assert torch.equal(g_sample.get_state(), g_predict.get_state()), "sample and predict_own must consume the generator alike"


def test_draws_have_blitz_mean_and_softplus_rho_std(fitted):
    n = 1000
    samples = fitted.sample(n, torch.Generator().manual_seed(5))
    for key, sampler in fitted.network.samplers.items():
        mu, sigma = sampler.mu.detach(), F.softplus(sampler.rho.detach())
        mean, std = samples[key].mean(0), samples[key].std(0)
        assert ((mean - mu).abs() <= 5 * sigma / n**0.5).all(), key
        assert ((std / sigma - 1).abs() <= 0.12).all(), key  # relative s.e. of a std ~ 1/sqrt(2n) = 2.2%


def test_sample_before_fit_and_bad_counts_are_refused(tiny_exp, fitted):
    with pytest.raises(RuntimeError, match="call fit"):
        tiny_bnn(tiny_exp).sample(2, torch.Generator())
    with pytest.raises(ValueError, match="positive integer"):
        fitted.sample(0, torch.Generator())


# --- ResNet-18 -------------------------------------------------------------------------------------
def test_resnet18_one_step_and_draws_keyed_like_the_plain_model(tiny_resnet):
    exp = tiny_resnet()
    method = tiny_bnn(exp, elbo_samples=1, epochs=1, milestones=[], batch_size=8)  # one step
    method.check("multi")
    with seeded(0):
        plain = exp.model()
    untrained = plain.state_dict()
    method.fit({}, 0)
    net = method.network
    layers = [(n, m) for n, m in plain.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    assert set(net.samplers) == {f"{n}.{p}" for n, m in layers for p in ("weight", "bias") if getattr(m, p) is not None}
    samples = method.sample(2, torch.Generator().manual_seed(1))
    assert {k: tuple(v.shape[1:]) for k, v in samples.items()} == {k: tuple(v.shape) for k, v in untrained.items()}
    bn_key = "layer1.0.bn1.running_var"
    trained = net.model.state_dict()[bn_key]
    assert not torch.allclose(trained, untrained[bn_key]), "BatchNorm statistics must have been trained"
    assert torch.equal(samples[bn_key][0], trained) and torch.equal(samples[bn_key][1], trained)
    images = exp.test_tensors[0]
    own = method.predict_own(images, 2, torch.Generator().manual_seed(1))
    torch.testing.assert_close(own, predict_with_weights(exp.model(), samples, images), atol=1e-5, rtol=0)


# --- bad input -----------------------------------------------------------------------------------
def test_tinyimagenet_is_refused_before_any_training(tmp_path: Path, monkeypatch):
    exp = Experiment(compose_config(["experiment=tinyimagenet_resnet18", "device=cpu", f"store={tmp_path}"]))
    images, labels = torch.zeros(2, 3, 64, 64), torch.zeros(2, dtype=torch.long)
    data = TrainingData(InMemoryImageDataset(images, labels), (images, labels), (images, labels))
    method = BNNMethod(exp.model, data, exp.method_settings("bnn"), recipe=exp.recipe)
    monkeypatch.setattr(bnn_module, "train_network", lambda *a, **k: pytest.fail("training started"))
    with pytest.raises(MethodConfigError, match="did not manage to train vBNNs on TinyImageNet"):
        method.check("one")


@pytest.mark.parametrize("experiment", ["mnist_optunet", "cifar100_resnet18"])
def test_the_kl_weight_is_one_over_the_experiments_own_training_split(tmp_path: Path, experiment):
    # The paper's recipe (the exact per-example ELBO); only digits deviates, in its own config.
    exp = Experiment(compose_config([f"experiment={experiment}", "device=cpu", f"store={tmp_path}"]))
    assert exp.method_settings("bnn").kl_weight is None
    images, labels = torch.zeros(7, 1, 28, 28), torch.zeros(7, dtype=torch.long)
    data = TrainingData(InMemoryImageDataset(images, labels), (images, labels), (images, labels))
    method = BNNMethod(exp.model, data, exp.method_settings("bnn"), recipe=exp.recipe)
    assert method.kl_weight() == 1 / 7


@pytest.mark.parametrize(
    "override, match",
    [
        ("methods.bnn.elbo_samples=0", "methods.bnn.elbo_samples=0: expected a positive integer"),
        ("methods.bnn.kl_weight=-1.0", "methods.bnn.kl_weight=-1.0: expected a number >= 0"),
        ("methods.bnn.train.epoch=3", "methods.bnn.train.epoch: Key 'epoch' not in 'RecipeOverrides'"),
        ("+methods.bnn.train.epoch=3", "methods.bnn.train.epoch: not a key of RecipeOverrides; expected one of batch_size"),
        ("methods.bnn.layers=middle", "methods.bnn.layers: Invalid value 'middle', expected one of [all, last_layer]"),
    ],
)
def test_bad_settings_are_refused_by_the_schema(tmp_path, override, match):
    from benchmark.cli import check_command_line

    assert match in check_command_line([override, f"store={tmp_path}"])


def test_a_bad_recipe_override_is_refused_before_training(tiny_exp):
    with pytest.raises(ValueError, match="train.lr=-1.0: expected a positive number"):
        tiny_bnn(tiny_exp, lr=-1.0).check("one")


def test_nan_during_fitting_stops_with_non_finite_error(tiny_exp, tiny_bases):
    method = tiny_bnn(tiny_exp, epochs=1, milestones=[], lr=1e12)
    seed, base = tiny_bases[0]
    with pytest.raises(NonFiniteError, match="bnn seed"):
        method.fit(base, seed)
    with pytest.raises(RuntimeError, match="call fit"):
        method.sample(1, torch.Generator())


def test_the_papers_variance_barely_moves_and_the_learned_one_does(tiny_exp, tiny_bases):
    """BLiTZ's rho ~ -7 under SGD: sigma stays at its init (the gradient on rho is scaled by
    sigmoid(rho) ~ 1e-3); a separate Adam on rho from rho_init -5 moves it (VarianceSettings)."""
    from methods.bnn import VarianceSettings

    seed = tiny_bases[0][0]
    changes = {}
    for variance in (VarianceSettings(), VarianceSettings(rho_init=-5.0, optimizer="adam", lr=0.05)):
        method = build(tiny_exp, "bnn", variance=variance, train=RecipeOverrides(epochs=1, milestones=[], fail_rule=FailRule()))
        with seeded(seed):
            start = to_bayesian(tiny_exp.model(), "all", variance.rho_init).sigma_mean()
        with one_thread(), tiny_exp.backends():
            method.fit({}, seed)
        end = method.network.sigma_mean()
        changes[variance.optimizer.value] = max(abs(end[k] / start[k] - 1) for k in start)
        assert all(v > 0 for v in method.network.sigma_over_mu().values())
    assert changes["sgd"] < 0.01 < 0.2 < changes["adam"], changes


def test_bad_variance_settings_are_refused():
    from benchmark.cli import check_command_line

    assert check_command_line(["methods.bnn.variance.rho_init=9"]).startswith("methods.bnn.variance.rho_init=9.0: expected")
    assert "Invalid value 'rmsprop'" in check_command_line(["methods.bnn.variance.optimizer=rmsprop"])
