"""Batched Kendall's tau against scipy.stats.kendalltau (tau-b), for permutations and ties."""
import numpy as np
import pytest
import torch
from scipy import stats

from metrics.kendall import kendall_tau, rank_agreement, successive_kendall_tau


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


def test_rank_agreement_of_row_means_matches_scipy_and_its_bootstrap_interval_is_a_recomputation():
    """tau of the rows' means is scipy's; the interval is the percentile interval of tau over
    repetitions resampled the same way under both references (recomputed here by hand)."""
    generator = np.random.default_rng(3)
    a = [generator.normal(i, 1.0, 3) for i in range(6)]
    b = [x + generator.normal(0, 2.0, 3) for x in a]  # the same repetitions, noisily re-scored
    got = rank_agreement(a, b, draws=500, seed=7)
    means_a, means_b = [x.mean() for x in a], [y.mean() for y in b]
    assert got.tau == pytest.approx(stats.kendalltau(means_a, means_b).statistic, rel=1e-12)
    assert got.p_value == pytest.approx(stats.kendalltau(means_a, means_b).pvalue, rel=1e-12)
    picks = np.random.default_rng(7)
    boot_a, boot_b = np.empty((500, 6)), np.empty((500, 6))
    for i in range(6):
        index = picks.integers(0, 3, size=(500, 3))
        boot_a[:, i], boot_b[:, i] = a[i][index].mean(1), b[i][index].mean(1)
    taus = [stats.kendalltau(x, y).statistic for x, y in zip(boot_a, boot_b)]
    assert (got.low, got.high) == pytest.approx(tuple(np.nanpercentile(taus, [2.5, 97.5])), rel=1e-12)
    assert got.rows == 6 and got.pairs == 15
    assert got.discordant == sum((means_a[i] - means_a[j]) * (means_b[i] - means_b[j]) < 0
                                 for i in range(6) for j in range(i + 1, 6))


def test_rank_agreement_of_identical_and_reversed_rankings():
    rows = [np.array([i, i + 0.1, i - 0.1]) for i in range(5)]
    same = rank_agreement(rows, rows, draws=200)
    assert same.tau == 1.0 and same.low == 1.0 and same.high == 1.0 and same.discordant == 0
    reversed_ = rank_agreement(rows, [-r for r in rows], draws=200)
    assert reversed_.tau == -1.0 and reversed_.high == -1.0 and reversed_.discordant == 10
    with pytest.raises(ValueError, match="row 1"):
        rank_agreement(rows[:2], [rows[0], rows[1][:2]])
