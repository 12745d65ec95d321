"""Weight matching (re-basin) and the number of transpositions."""
from __future__ import annotations

import itertools
from collections import deque

import pytest
import torch
from hypothesis import given, settings

from benchmark.core.models import mlp, optunet
from metrics.symmetries import number_of_transpositions, permute, random_permutations, spec_for_model, weight_matching
from tests.metrics.symmetries.nets import assert_same_function, assert_same_weights, drawn_weights, random_sample_set, small_networks


def _transposition_distances(n: int) -> dict[tuple[int, ...], int]:
    """Breadth-first search over S_n from the identity, one transposition per edge."""
    start = tuple(range(n))
    distance = {start: 0}
    queue = deque([start])
    while queue:
        p = queue.popleft()
        for i, j in itertools.combinations(range(n), 2):
            q = list(p)
            q[i], q[j] = q[j], q[i]
            q = tuple(q)
            if q not in distance:
                distance[q] = distance[p] + 1
                queue.append(q)
    return distance


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6])
def test_number_of_transpositions_matches_brute_force(n):
    distance = _transposition_distances(n)
    perms = list(distance)
    got = number_of_transpositions(torch.tensor(perms).reshape(len(perms), n))
    assert got.tolist() == [distance[p] for p in perms]


def test_number_of_transpositions_keeps_leading_axes_and_rejects_non_permutations():
    perms = torch.tensor([[[1, 0, 2], [1, 2, 0]], [[0, 1, 2], [2, 1, 0]]])
    assert number_of_transpositions(perms).tolist() == [[1, 2], [0, 1]]
    with pytest.raises(ValueError, match="expected permutations of 0..2"):
        number_of_transpositions(torch.tensor([[0, 0, 2]]))


@pytest.mark.parametrize("factory", [optunet, lambda: mlp(5, [6, 4], 3)], ids=["optunet", "mlp"])
def test_weight_matching_undoes_a_random_permutation(factory):
    """The reference permuted at random is matched back exactly; the permutations found invert the
    applied ones, so their NoT are equal."""
    reference = random_sample_set(factory, 1, 3)
    spec = spec_for_model(factory())
    copies = {k: v.expand(6, *v.shape[1:]).clone() for k, v in reference.items()}
    applied = random_permutations(spec, 6, torch.Generator().manual_seed(0))
    matched, info = weight_matching(permute(copies, spec, applied), {k: v[0] for k, v in reference.items()}, spec)
    assert_same_weights(copies, matched, rtol=1e-12)
    for name, perm in applied.items():
        assert torch.equal(info["transpositions"][name], number_of_transpositions(perm))
        assert torch.equal(torch.gather(perm, 1, info["perms"][name]), torch.arange(perm.shape[1]).expand_as(perm))
    torch.testing.assert_close(info["objective_after"], info["objective_before"].new_full((6,), float(sum(
        v.square().sum() for k, v in reference.items() if k not in spec.buffers))))


@settings(max_examples=10, deadline=None)
@given(small_networks())
def test_weight_matching_keeps_the_function_and_never_lowers_the_objective(network):
    factory, weights, spec, seed = drawn_weights(network)
    reference = random_sample_set(factory, 1, seed + 1)
    matched, info = weight_matching(weights, reference, spec)
    assert_same_function(factory(), weights, matched)
    assert bool((info["objective_after"] >= info["objective_before"] - 1e-9).all())
    assert torch.equal(info["total_transpositions"], sum(number_of_transpositions(p) for p in info["perms"].values()))


def test_weight_matching_rejects_a_batched_reference():
    spec = spec_for_model(optunet())
    weights = random_sample_set(optunet, 2, 0)
    with pytest.raises(ValueError, match="the reference must be one network"):
        weight_matching(weights, weights, spec)
    with pytest.raises(ValueError, match="reference: missing key 'fc2.bias'"):
        weight_matching(weights, {k: v[0] for k, v in weights.items() if k != "fc2.bias"}, spec)
