"""Pairwise mutual information between members, against the ensemble MI of each pair computed
directly, and the pair selection."""
import math

import numpy as np
import pytest
import torch

from metrics.collapse import MAX_PAIR_MI, pairs_to_use, pairwise_mutual_information
from metrics.predictive import mutual_information


def _probs(members, inputs, classes, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.softmax(3 * torch.randn(members, inputs, classes, generator=generator), dim=-1)


def test_pairwise_mi_is_each_pairs_ensemble_mi():
    probs = _probs(6, 40, 5)
    pairs = pairs_to_use(6, 100, np.random.default_rng(0))
    got = pairwise_mutual_information(probs, pairs)
    expected = [mutual_information(probs[[i, j]]) for i, j in pairs]
    np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-12)
    assert len(pairs) == 15 and (pairs[:, 0] < pairs[:, 1]).all()


def test_identical_members_have_zero_mi_and_disjoint_ones_log2():
    one_hot = torch.eye(3)[[0, 1, 2, 0]][None]  # 4 inputs, 3 classes
    other = torch.eye(3)[[1, 2, 0, 1]][None]
    probs = torch.cat([one_hot, one_hot, other])
    got = pairwise_mutual_information(probs, np.array([[0, 1], [0, 2]]))
    assert got[0] == pytest.approx(0.0, abs=1e-12) and got[1] == pytest.approx(MAX_PAIR_MI) and MAX_PAIR_MI == math.log(2)


def test_chunking_does_not_change_the_result(monkeypatch):
    import metrics.collapse as module

    probs = _probs(5, 30, 4, seed=1)
    pairs = pairs_to_use(5, 100, np.random.default_rng(0))
    whole = pairwise_mutual_information(probs, pairs)
    monkeypatch.setattr(module, "_CHUNK_ELEMENTS", 30 * 4)  # one pair per chunk
    np.testing.assert_allclose(pairwise_mutual_information(probs, pairs), whole, rtol=0, atol=0)


def test_a_bounded_number_of_distinct_pairs_is_drawn():
    pairs = pairs_to_use(100, 300, np.random.default_rng(3))
    assert pairs.shape == (300, 2) and len({tuple(p) for p in pairs}) == 300
    assert (pairs[:, 0] < pairs[:, 1]).all() and pairs.max() < 100
    again = pairs_to_use(100, 300, np.random.default_rng(3))
    assert np.array_equal(pairs, again)


@pytest.mark.parametrize("members, max_pairs, pairs, message", [
    (1, 10, None, "at least 2 members"),
    (3, 0, None, "max_pairs must be a positive integer"),
    (3, 10, np.array([[0, 3]]), r"index pairs \[P, 2\] into 3 members"),
])
def test_bad_input_is_refused(members, max_pairs, pairs, message):
    with pytest.raises(ValueError, match=message):
        if pairs is None:
            pairs_to_use(members, max_pairs, np.random.default_rng(0))
        else:
            pairwise_mutual_information(_probs(members, 2, 2), pairs)
