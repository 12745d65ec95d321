"""The WM form (``align_to_anchor``): the NS steps with the permutation removed by weight
matching to an anchor, checked against the steps done one by one."""
import pytest
import torch

from benchmark.core.models import optunet
from benchmark.core.store import unstack
from metrics.symmetries import (
    align_to_anchor, canonicalize, normalize_scales, permute, random_permutations, spec_for_model, weight_matching,
)
from tests.metrics.symmetries.nets import assert_same_function, random_sample_set


@pytest.fixture(scope="module")
def nets():
    samples = random_sample_set(optunet, 6, seed=4)
    return samples, spec_for_model(optunet())


def test_aligned_form_is_scaling_then_matching_to_the_scaled_anchor(nets):
    samples, spec = nets
    anchor = unstack(samples, 0)
    got, applied = align_to_anchor(samples, spec, anchor, ("scale", "sort"))
    scaled = normalize_scales(samples, spec)[0]
    expected = weight_matching(scaled, unstack(scaled, 0), spec)[0]
    assert all(torch.equal(got[k], expected[k]) for k in samples)
    assert set(applied) == {"scale", "match"} and int(applied["match"]["total_transpositions"][0]) == 0
    assert all(torch.equal(got[k][0], scaled[k][0]) for k in samples), "the anchor is aligned to itself"
    assert_same_function(optunet().double(), samples, got)


def test_steps_after_the_permutation_still_apply_and_no_sort_step_appends_the_matching(nets):
    samples, spec = nets
    anchor = unstack(samples, 1)
    with_softmax, applied = align_to_anchor(samples, spec, anchor, ("scale", "sort", "softmax"))
    assert "softmax" in applied and torch.allclose(with_softmax["fc2.bias"].sum(dim=1), torch.zeros(6, dtype=torch.float64))
    unscaled, applied = align_to_anchor(samples, spec, anchor, ())
    assert set(applied) == {"match"}
    assert all(torch.equal(unscaled[k], v) for k, v in weight_matching(samples, anchor, spec)[0].items())


def test_a_permuted_copy_of_the_anchor_is_brought_back(nets):
    samples, spec = nets
    anchor = unstack(samples, 2)
    copies = permute({k: v[None].expand(4, *v.shape).clone() for k, v in anchor.items()}, spec,
                     random_permutations(spec, 4, torch.Generator().manual_seed(0)))
    aligned = align_to_anchor(copies, spec, anchor, ("scale", "sort"))[0]
    scaled_anchor = canonicalize({k: v[None] for k, v in anchor.items()}, spec, ("scale",))[0]
    for k in anchor:
        torch.testing.assert_close(aligned[k], scaled_anchor[k].expand_as(aligned[k]))


def test_more_than_one_anchor_is_refused(nets):
    samples, spec = nets
    with pytest.raises(ValueError, match="the anchor must be one network"):
        align_to_anchor(samples, spec, samples)
