"""Batched Kendall's tau against scipy.stats.kendalltau (tau-b), for permutations and ties."""
import numpy as np
import pytest
import torch
from scipy import stats

from metrics.kendall import kendall_tau, successive_kendall_tau


def test_permutations_match_scipy():
    generator = torch.Generator().manual_seed(0)
    a = torch.stack([torch.randperm(7, generator=generator) for _ in range(50)])
    b = torch.stack([torch.randperm(7, generator=generator) for _ in range(50)])
    got = kendall_tau(a, b)
    expected = [stats.kendalltau(x, y).statistic for x, y in zip(a.numpy(), b.numpy())]
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-12)


def test_ties_match_scipy_tau_b():
    generator = torch.Generator().manual_seed(1)
    a = torch.randint(0, 3, (40, 6), generator=generator)
    b = torch.randint(0, 3, (40, 6), generator=generator)
    got = kendall_tau(a, b).numpy()
    expected = np.array([stats.kendalltau(x, y).statistic for x, y in zip(a.numpy(), b.numpy())])
    np.testing.assert_allclose(got, expected, rtol=1e-12, equal_nan=True)
    assert np.isnan(kendall_tau(torch.zeros(1, 4), torch.arange(4.0)[None])[0])  # a constant row, as scipy


def test_successive_rows_identity_and_reversal():
    perms = torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3], [3, 2, 1, 0], [1, 0, 2, 3]])
    got = successive_kendall_tau(perms)
    assert got.tolist() == pytest.approx([1.0, -1.0, stats.kendalltau([3, 2, 1, 0], [1, 0, 2, 3]).statistic])


def test_chunks_give_the_same_numbers(monkeypatch):
    import metrics.kendall as module

    generator = torch.Generator().manual_seed(2)
    perms = torch.stack([torch.randperm(5, generator=generator) for _ in range(30)])
    whole = successive_kendall_tau(perms)
    monkeypatch.setattr(module, "_CHUNK_ELEMENTS", 25)  # one row per chunk
    assert torch.equal(successive_kendall_tau(perms), whole)


@pytest.mark.parametrize("a, b, message", [
    (torch.zeros(2, 3), torch.zeros(3, 3), "two \\[T, n\\] tensors of one shape"),
    (torch.zeros(2, 1), torch.zeros(2, 1), "at least 2 entries"),
])
def test_bad_shapes_are_refused(a, b, message):
    with pytest.raises(ValueError, match=message):
        kendall_tau(a, b)
    with pytest.raises(ValueError, match="T >= 2"):
        successive_kendall_tau(torch.zeros(1, 3))
