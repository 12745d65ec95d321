"""predict_samples: the packed kernels' probabilities equal one sample after another's, in chunks of networks and images."""
from __future__ import annotations

import pytest
import torch

import benchmark.core.training.predict as predict
from benchmark.core.models import build_model, predict_with_weights
from benchmark.core.store import stack_state_dicts
from benchmark.core.training import seeded
from benchmark.core.training.predict import predict_samples


def samples_of(factory, count: int) -> dict[str, torch.Tensor]:
    states = []
    for seed in range(count):
        with seeded(seed):
            states.append(factory().state_dict())
    return stack_state_dicts(states)


@pytest.fixture(autouse=True)
def one_thread():
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def test_packed_probabilities_equal_one_sample_after_another(monkeypatch) -> None:
    factory = lambda: build_model("optunet", num_classes=10, in_channels=1)  # noqa: E731
    samples = samples_of(factory, 21)
    images = torch.randn(70, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    want = predict_with_weights(factory(), samples, images)
    monkeypatch.setattr(predict, "NETWORKS", 8)  # 21 samples in three passes
    monkeypatch.setattr(predict, "EVAL_ELEMENTS", 28 * 28 * 16 * 20)  # 20 images per chunk: four chunks
    got = predict_samples(factory(), samples, images)
    assert got.shape == want.shape == (21, 70, 10) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6)
    assert not torch.equal(got[0], got[1])


def test_an_architecture_the_kernels_do_not_run_goes_one_sample_after_another() -> None:
    factory = lambda: build_model("resnet18", num_classes=10, in_channels=1, width=4)  # noqa: E731
    samples = samples_of(factory, 2)
    images = torch.randn(3, 1, 8, 8, generator=torch.Generator().manual_seed(1))
    assert torch.equal(predict_samples(factory(), samples, images), predict_with_weights(factory(), samples, images))
