"""MC Dropout: mask/weight equivalence, the 1/(1-p) scaling, consistency, ResNet-18 path, bad input."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from benchmark.config import ConfigError
from benchmark.experiment import Experiment
from benchmark.core.models import predict_with_weights
from benchmark.core.training import NonFiniteError
from methods.base import MethodFitError
from methods.dropout import DropoutMethod, DropoutSettings, draw_masks, masked_weights
from tests.methods.conftest import build

pytestmark = pytest.mark.slow  # trains networks (bases, vBNNs, chains): make test, not make test-fast


def test_masked_weights_equal_dropping_the_inputs() -> None:
    generator = torch.Generator().manual_seed(0)
    layer = nn.Linear(6, 4)
    x = torch.randn(5, 6, generator=generator)
    masks = draw_masks(3, 6, 0.5, generator)
    weights = masked_weights(layer.weight.detach(), masks, 0.5)
    for mask, weight in zip(masks, weights):
        by_inputs = layer(x * mask / 0.5)  # inverted dropout of the inputs
        by_weights = x @ weight.T + layer.bias
        torch.testing.assert_close(by_weights, by_inputs, rtol=0, atol=1e-6)
        dropped = mask == 0
        assert torch.all(weight[:, dropped] == 0)
        torch.testing.assert_close(weight[:, ~dropped], layer.weight.detach()[:, ~dropped] * 2.0)


def test_masks_keep_each_unit_with_probability_one_minus_p() -> None:
    masks = draw_masks(20000, 3, 0.2, torch.Generator().manual_seed(1))
    assert set(masks.unique().tolist()) <= {0.0, 1.0}
    # binomial standard error sqrt(0.16 / 20000) = 0.0028: 5 sigma
    torch.testing.assert_close(masks.mean(0), torch.full((3,), 0.8), rtol=0, atol=0.014)


def _fitted(exp: Experiment, seed: int) -> DropoutMethod:
    method = build(exp, "dropout")
    method.check("one")
    method.fit({}, seed)
    return method


def _assert_consistent(method: DropoutMethod, exp: Experiment, images: torch.Tensor, n: int) -> dict:
    samples = method.sample(n, torch.Generator().manual_seed(7))
    own = method.predict_own(images, n, torch.Generator().manual_seed(7))
    by_weights = predict_with_weights(exp.model(), samples, images)
    assert own.shape == by_weights.shape == (n, len(images), exp.info.num_classes)
    torch.testing.assert_close(by_weights, own, rtol=0, atol=1e-5)
    return samples


def test_optunet_samples_are_the_dropout_network_with_masked_last_layer(tiny_exp, tiny_bases) -> None:
    seed = tiny_bases[0][0]
    method = _fitted(tiny_exp, seed)
    assert method.p == tiny_exp.config.methods.dropout.p == 0.2
    samples = _assert_consistent(method, tiny_exp, tiny_exp.test_tensors[0][:64], 6)
    trained = method._weights
    for key, value in samples.items():
        if key != "fc2.weight":
            assert torch.equal(value, trained[key][None].expand_as(value)), key
    kept = samples["fc2.weight"] != 0  # [S, C, 3]; whole columns are dropped or kept
    assert torch.equal(kept, kept[:, :1, :].expand_as(kept))
    ratio = samples["fc2.weight"][kept] / trained["fc2.weight"][None].expand_as(kept)[kept]
    torch.testing.assert_close(ratio, torch.full_like(ratio, 1 / 0.8))
    # the dropout network is retrained from the base's seed, not copied from the base checkpoint
    assert not torch.equal(trained["conv1.weight"], dict(tiny_bases)[seed]["conv1.weight"])


def test_resnet18_last_layer_dropout(tiny_resnet) -> None:
    exp = tiny_resnet()
    method = _fitted(exp, 3)
    assert method.p == 0.5
    samples = _assert_consistent(method, exp, exp.test_tensors[0], 2)
    assert samples["fc.weight"].shape == (2, 10, 64)
    assert torch.equal(samples["layer4.1.bn2.running_var"][0], method._weights["layer4.1.bn2.running_var"])


@pytest.mark.parametrize("p", [0.0, 1.0, 1.5])
def test_bad_rate_is_refused_by_the_schema(compose_tiny, tmp_path, p) -> None:
    with pytest.raises(ConfigError, match=rf"methods.dropout.p={p}: expected a dropout rate in \(0, 1\)"):
        Experiment(compose_tiny(tmp_path, f"methods.dropout.p={p}"))
    with pytest.raises(ValueError, match=rf"p={p}: expected a dropout rate"):
        DropoutSettings(p=p)


def test_retraining_depends_only_on_the_seed(tiny_exp) -> None:
    torch.manual_seed(123)  # the global RNG state must not matter (dropout masks during training)
    first = _fitted(tiny_exp, 100001)._weights
    torch.rand(5)
    second = _fitted(tiny_exp, 100001)._weights
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_non_converged_retraining_is_a_fit_error(compose_tiny, tmp_path) -> None:
    exp = Experiment(compose_tiny(tmp_path, "train.fail_rule.epoch=1", "train.fail_rule.min_accuracy=1.01"))
    with pytest.raises(MethodFitError, match="seed 5 failed: held-out accuracy"):
        _fitted(exp, 5)
    with pytest.raises(RuntimeError, match="call fit"):
        build(exp, "dropout").sample(1, torch.Generator())


def test_nan_during_training_stops_the_fit(compose_tiny, tmp_path) -> None:
    exp = Experiment(compose_tiny(tmp_path, "train.lr=1e30", "train.epochs=1"))
    with pytest.raises(NonFiniteError, match="dropout seed 5"):
        _fitted(exp, 5)
