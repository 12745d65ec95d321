"""Laplace: GGN backend, sample covariance vs the posterior, MAP keys, consistency, ResNet-18 KFAC path, refusals."""
from __future__ import annotations

import warnings

import pytest
import torch
from laplace import Laplace
from torch.utils.data import DataLoader, TensorDataset

from benchmark.config import ConfigError
from benchmark.experiment import Experiment
from benchmark.core.models import predict_with_weights
from methods.base import MethodConfigError
from methods.laplace import LaplaceMethod, per_sample_jacobian_ggn
from tests.methods.conftest import build

pytestmark = pytest.mark.slow  # trains networks (bases, vBNNs, chains): make test, not make test-fast


def _fitted(exp: Experiment, base: dict, mode: str = "one") -> LaplaceMethod:
    method = build(exp, "laplace")
    method.check(mode)
    method.fit(base, 0)
    return method


def _assert_consistent(method: LaplaceMethod, exp: Experiment, images: torch.Tensor, n: int) -> dict:
    samples = method.sample(n, torch.Generator().manual_seed(5))
    own = method.predict_own(images, n, torch.Generator().manual_seed(5))
    torch.testing.assert_close(predict_with_weights(exp.model(), samples, images), own, rtol=0, atol=1e-5)
    return samples


def test_per_sample_jacobian_ggn_equals_curvlinops(tiny_exp, tiny_bases) -> None:
    model = tiny_exp.model()
    model.load_state_dict(tiny_bases[0][1])
    images, labels = tiny_exp.train_tensors
    loader = DataLoader(TensorDataset(images[:48], labels[:48]), batch_size=24)
    hessians = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for backend in ({}, {"backend": per_sample_jacobian_ggn()}):
            la = Laplace(model, "classification", subset_of_weights="all", hessian_structure="full", **backend)
            la.fit(loader)
            hessians.append(la.H)
    assert hessians[0].shape == (355, 355)
    torch.testing.assert_close(hessians[1], hessians[0], rtol=1e-4, atol=1e-5 * float(hessians[0].abs().max()))


def test_full_laplace_samples_have_the_posterior_covariance(tiny_exp, tiny_bases) -> None:
    seed, base = tiny_bases[0]
    method = _fitted(tiny_exp, base)
    la = method._la
    assert float(la.prior_precision) != 1.0  # optimised by the marginal likelihood
    samples = method.sample(20000, torch.Generator().manual_seed(0))
    flat = torch.cat([samples[k].flatten(1) for k in method._keys], dim=1).double()
    assert method._keys == [k for k, _ in tiny_exp.model().named_parameters()]
    covariance = la.posterior_covariance.double()
    scale = float(covariance.diagonal().max())
    torch.testing.assert_close(flat.mean(0), la.mean.double(), rtol=0, atol=5 * (scale / 20000) ** 0.5)
    # covariance entries have standard error <= sqrt(2 / n) * max variance = 0.01 * scale
    torch.testing.assert_close(torch.cov(flat.T), covariance, rtol=0, atol=0.05 * scale)


def test_full_laplace_consistency(tiny_exp, tiny_bases) -> None:
    method = _fitted(tiny_exp, tiny_bases[1][1])
    samples = _assert_consistent(method, tiny_exp, tiny_exp.test_tensors[0][:64], 4)
    assert not torch.equal(samples["conv1.weight"][0], tiny_bases[1][1]["conv1.weight"])


def test_resnet18_last_layer_kfac_keeps_the_map_elsewhere(tiny_resnet) -> None:
    exp = tiny_resnet()
    assert exp.method_settings("laplace").hessian_structure == "kron"
    base = exp.model().state_dict()
    method = _fitted(exp, base, mode="multi")
    assert method._keys == ["fc.weight", "fc.bias"]
    samples = _assert_consistent(method, exp, exp.test_tensors[0], 3)
    for key, value in samples.items():
        if key in method._keys:
            assert not torch.equal(value[0], value[1]), key
        else:
            assert torch.equal(value, base[key][None].expand_as(value)), key


def test_full_hessian_on_resnet18_is_refused_before_training(tiny_resnet) -> None:
    exp = tiny_resnet("methods.laplace.subset_of_weights=all", "methods.laplace.hessian_structure=full")
    with pytest.raises(MethodConfigError) as err:
        build(exp, "laplace").check("one")
    message = str(err.value)
    assert "does not fit" in message and "BatchNorm" in message
    assert "methods.laplace.subset_of_weights=last_layer methods.laplace.hessian_structure=kron" in message


@pytest.mark.parametrize(
    ("override", "message"),
    [("methods.laplace.hessian_structure=lowrankish", "methods.laplace.hessian_structure: Invalid value 'lowrankish', expected one of [full, kron, diag]"),
     ("methods.laplace.subset_of_weights=some", "methods.laplace.subset_of_weights: Invalid value 'some', expected one of [all, last_layer]"),
     ("methods.laplace.prior_optimization=grid", "methods.laplace.prior_optimization: Invalid value 'grid', expected one of [marglik]"),
     ("methods.laplace.marglik_steps=0", "methods.laplace.marglik_steps=0: expected a positive integer")],
)
def test_bad_settings_are_refused_by_the_schema(tmp_path, override, message) -> None:
    from benchmark.cli import check_command_line

    assert check_command_line([override, f"store={tmp_path}"]) == message
