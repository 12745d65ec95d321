"""SWAG: moments and draws against the SWAG formulas, the schedule, consistency, ResNet-18 path, bad input."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from benchmark.config import ConfigError
from benchmark.experiment import Experiment
from benchmark.core.models import predict_with_weights
from benchmark.core.training import NonFiniteError
from methods.base import MethodConfigError
from methods.swag import SwagMoments, SWAGMethod, swag_draw
from tests.methods.conftest import build

pytestmark = pytest.mark.slow  # trains networks (bases, vBNNs, chains): make test, not make test-fast

SMALL = ("methods.swag.epochs_factor=1", "methods.swag.snapshots=4", "methods.swag.rank=3")


def _moments_of(snapshots: np.ndarray, rank: int) -> SwagMoments:
    moments = SwagMoments(rank=rank)
    for theta in snapshots:
        moments.collect(torch.from_numpy(theta))
    return moments


def test_moments_follow_the_swag_definitions() -> None:
    snapshots = np.random.default_rng(0).normal(size=(6, 5))
    moments = _moments_of(snapshots, rank=4)
    running_means = np.cumsum(snapshots, axis=0) / np.arange(1, 7)[:, None]
    np.testing.assert_allclose(moments.mean.numpy(), snapshots.mean(0), rtol=1e-12)
    np.testing.assert_allclose(moments.variance.numpy(), snapshots.var(0), rtol=1e-10)
    # deviations from the running mean after each snapshot, last `rank` of them (reference code)
    np.testing.assert_allclose(moments.deviation_matrix.numpy(), (snapshots - running_means)[-4:].T, rtol=1e-12)


def test_draw_is_the_swag_formula() -> None:
    snapshots = np.random.default_rng(1).normal(size=(5, 4))
    moments, scale = _moments_of(snapshots, rank=5), 0.1
    theta = swag_draw(*moments.gaussian(torch.float64), scale, torch.Generator().manual_seed(3))
    g = torch.Generator().manual_seed(3)
    z1, z2 = torch.randn(4, generator=g, dtype=torch.float64), torch.randn(5, generator=g, dtype=torch.float64)
    d = (snapshots - np.cumsum(snapshots, 0) / np.arange(1, 6)[:, None]).T
    expected = snapshots.mean(0) + math.sqrt(scale) * (np.sqrt(snapshots.var(0)) * z1.numpy() + d @ z2.numpy() / 2)
    np.testing.assert_allclose(theta.numpy(), expected, rtol=1e-12)


def test_draws_have_the_swag_authors_mean_and_covariance() -> None:
    """Cov = scale * (Sigma_diag + D D^T / (K - 1)), as the SWAG authors' ``sample(scale, cov=True)``."""
    snapshots = np.random.default_rng(2).normal(size=(4, 3)) * [1.0, 2.0, 0.5]
    moments, scale, n = _moments_of(snapshots, rank=4), 0.1, 40000
    g = torch.Generator().manual_seed(0)
    gaussian = moments.gaussian(torch.float64)
    draws = torch.stack([swag_draw(*gaussian, scale, g) for _ in range(n)]).numpy()
    d = (snapshots - np.cumsum(snapshots, 0) / np.arange(1, 5)[:, None]).T
    covariance = scale * (np.diag(snapshots.var(0)) + d @ d.T / 3)
    tolerance = 5 * np.sqrt(np.diag(covariance).max() ** 2 * 2 / n)  # ~5 standard errors of a covariance entry
    np.testing.assert_allclose(draws.mean(0), snapshots.mean(0), atol=5 * np.sqrt(np.diag(covariance).max() / n))
    np.testing.assert_allclose(np.cov(draws.T), covariance, atol=tolerance)


def test_schedule_ramps_then_collects_over_the_second_half(compose_tiny, tmp_path) -> None:
    exp = Experiment(compose_tiny(tmp_path, "methods.swag.snapshots=5", "methods.swag.lr=0.2"))
    plan = build(exp, "swag").schedule()
    steps_per_epoch = math.ceil(len(exp.train_set) / 32)
    assert plan.total_steps == 2 * 2 * steps_per_epoch
    assert len(plan.snapshot_steps) == 5 and max(plan.snapshot_steps) == plan.total_steps
    assert min(plan.snapshot_steps) > plan.total_steps // 2 >= plan.ramp_steps
    lrs = [plan.lr(s) for s in range(plan.total_steps)]
    assert lrs[0] > plan.lr_start == exp.recipe.lr * 0.5 ** 0 and lrs[plan.ramp_steps - 1] == pytest.approx(0.2)
    assert np.all(np.diff(lrs[: plan.ramp_steps]) > 0) and set(lrs[plan.ramp_steps :]) == {0.2}


def test_snapshots_at_a_fixed_interval_end_the_run(compose_tiny, tmp_path) -> None:
    exp = Experiment(compose_tiny(tmp_path, "methods.swag.snapshots=3", "methods.swag.snapshot_interval_epochs=1"))
    plan = build(exp, "swag").schedule()
    steps_per_epoch = math.ceil(len(exp.train_set) / 32)
    assert sorted(plan.snapshot_steps) == [plan.total_steps - i * steps_per_epoch for i in (2, 1, 0)]
    far = Experiment(compose_tiny(tmp_path, "methods.swag.snapshots=3", "methods.swag.snapshot_interval_epochs=10"))
    with pytest.raises(MethodConfigError, match="snapshot_interval_epochs=10.0: 3 snapshots that far apart do not fit"):
        build(far, "swag").check("one")


def _assert_consistent(method: SWAGMethod, exp: Experiment, images: torch.Tensor, n: int) -> dict:
    samples = method.sample(n, torch.Generator().manual_seed(4))
    own = method.predict_own(images, n, torch.Generator().manual_seed(4))
    torch.testing.assert_close(predict_with_weights(exp.model(), samples, images), own, rtol=0, atol=1e-5)
    return samples


def test_optunet_consistency_and_spread(compose_tiny, tiny_exp, tiny_bases) -> None:
    exp = Experiment(compose_tiny(tiny_exp.store.root, *SMALL))
    method = build(exp, "swag")
    method.check("one")
    seed, base = tiny_bases[0]
    method.fit(base, seed)
    assert method._moments.count == 4 and method._moments.deviation_matrix.shape == (355, 3)
    samples = _assert_consistent(method, exp, exp.test_tensors[0][:64], 3)
    assert not torch.equal(samples["fc2.weight"][0], samples["fc2.weight"][1])
    assert not torch.equal(samples["conv1.weight"][0], base["conv1.weight"])


def test_resnet18_draws_recompute_batchnorm_statistics(tiny_resnet) -> None:
    exp = tiny_resnet("methods.swag.snapshots=2", "methods.swag.rank=2", "methods.swag.bn_update_batches=1")
    method = build(exp, "swag")
    method.check("multi")
    base = exp.model().state_dict()
    method.fit(base, 0)
    samples = _assert_consistent(method, exp, exp.test_tensors[0], 2)
    # running statistics come from one batch pass (cumulative average) with the drawn weights
    assert samples["bn1.num_batches_tracked"].tolist() == [1, 1]
    assert not torch.equal(samples["layer1.0.bn1.running_mean"][0], samples["layer1.0.bn1.running_mean"][1])


@pytest.mark.parametrize(
    ("override", "key"),
    [("methods.swag.snapshots=1", "snapshots"), ("methods.swag.rank=1", "rank"), ("methods.swag.scale=-1", "scale"),
     ("methods.swag.ramp_fraction=0.7", "ramp_fraction"), ("methods.swag.bn_update_batches=0", "bn_update_batches")],
)
def test_bad_settings_are_refused_by_the_schema(compose_tiny, tmp_path, override, key) -> None:
    with pytest.raises(ConfigError, match=f"methods.swag.{key}="):
        Experiment(compose_tiny(tmp_path, override))


def test_more_snapshots_than_steps_are_refused_before_training(compose_tiny, tmp_path) -> None:
    exp = Experiment(compose_tiny(tmp_path, "methods.swag.snapshots=100000"))
    with pytest.raises(MethodConfigError, match="methods.swag.snapshots=100000: the second half of the SWAG run"):
        build(exp, "swag").check("one")


def test_nan_during_swag_training_stops_the_fit(compose_tiny, tiny_exp, tiny_bases) -> None:
    exp = Experiment(compose_tiny(tiny_exp.store.root, "methods.swag.lr=1e30", *SMALL))
    method = build(exp, "swag")
    with pytest.raises(NonFiniteError, match="swag seed"):
        method.fit(tiny_bases[0][1], tiny_bases[0][0])
    with pytest.raises(RuntimeError, match="call fit"):
        method.sample(1, torch.Generator())


def _one_at_a_time(method: SWAGMethod) -> SWAGMethod:
    method._stacking = ("the test's one-at-a-time reference",)
    return method


def test_the_stacked_fit_follows_the_one_at_a_time_fit(compose_tiny, tiny_exp, tiny_bases) -> None:
    """Over SWAG's whole schedule on the tiny zoo (2 epochs, 4 snapshots) in float32: the packed
    kernels sum in another order than PyTorch's convolutions, so equal up to the rounding that
    ~80 SGD steps grow."""
    exp = Experiment(compose_tiny(tiny_exp.store.root, *SMALL))
    (seed, base), *_ = tiny_bases
    stacked, alone = build(exp, "swag"), _one_at_a_time(build(exp, "swag"))
    assert stacked.stacking_problem() is None
    stacked.fit(base, seed)
    alone.fit(base, seed)
    assert stacked._moments.count == alone._moments.count == 4
    for ours, theirs in zip(stacked._gaussian, alone._gaussian):
        torch.testing.assert_close(ours, theirs, rtol=1e-3, atol=1e-4)


def test_a_base_gets_the_same_fit_whatever_the_bases_stacked_with_it(compose_tiny, tiny_exp, tiny_bases) -> None:
    exp = Experiment(compose_tiny(tiny_exp.store.root, *SMALL))
    bases = dict(tiny_bases[:3])
    seeds = list(bases)
    together = build(exp, "swag")
    together.prefit(seeds, bases.__getitem__)
    together.fit(bases[seeds[1]], seeds[1])
    alone = build(exp, "swag")
    alone.fit(bases[seeds[1]], seeds[1])
    reversed_ = build(exp, "swag")
    reversed_.prefit([seeds[2], seeds[1]], bases.__getitem__)
    reversed_.fit(bases[seeds[1]], seeds[1])
    for other in (alone, reversed_):
        assert all(torch.equal(a, b) for a, b in zip(together._gaussian, other._gaussian))
        draws = [m.sample(2, torch.Generator().manual_seed(9)) for m in (together, other)]
        assert all(torch.equal(draws[0][k], draws[1][k]) for k in draws[0])
