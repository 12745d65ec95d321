"""Scaling normalisation, sorting, softmax-additive and the canonical (symmetry-free) form."""
from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmark.core.models import mlp, optunet, resnet18
from metrics.symmetries import (
    SORT_KEYS, canonicalize, center_logit_bias, normalize_scales, permute, random_permutations, random_scales,
    rescale, sort_units, spec_for_model,
)
from tests.metrics.symmetries.nets import (
    assert_same_function, assert_same_weights, drawn_weights, random_sample_set, small_networks,
)


def _symmetric_copy(weights, spec, seed, spread=1.0):
    generator = torch.Generator().manual_seed(seed)
    samples = next(iter(weights.values())).shape[0]
    scales = random_scales(spec, samples, spread, generator)
    return permute(rescale(weights, spec, scales), spec, random_permutations(spec, samples, generator))


@settings(max_examples=15, deadline=None)
@given(small_networks(), st.sampled_from(["scale", "sort", "softmax"]))
def test_every_step_keeps_the_function(network, step):
    factory, weights, spec, _ = drawn_weights(network)
    out, _ = canonicalize(weights, spec, steps=[step])
    assert_same_function(factory(), weights, out)


@settings(max_examples=15, deadline=None)
@given(small_networks())
def test_permuted_and_rescaled_network_has_the_same_canonical_form(network):
    factory, weights, spec, seed = drawn_weights(network)
    moved = _symmetric_copy(weights, spec, seed + 1)
    assert_same_function(factory(), weights, moved)
    canonical, _ = canonicalize(weights, spec)
    assert_same_weights(canonical, canonicalize(moved, spec)[0])
    assert_same_function(factory(), weights, canonical)


@pytest.mark.parametrize("key", [k for k in SORT_KEYS if k != "bias"])
def test_every_sort_key_removes_permutations_and_keeps_the_function(key):
    factory = optunet
    weights = random_sample_set(factory, 4, 7)
    spec = spec_for_model(factory())
    moved = permute(weights, spec, random_permutations(spec, 4, torch.Generator().manual_seed(3)))
    sorted_weights, perms = sort_units(weights, spec, key)
    assert_same_weights(sorted_weights, sort_units(moved, spec, key)[0])
    assert_same_function(factory(), weights, sorted_weights)
    assert set(perms) == {"conv1", "conv2", "fc1"} and perms["conv2"].shape == (4, 10)


def test_first_weight_sort_orders_units_ascending():
    """After sorting, each hidden layer's first incoming weights are ascending (the paper's rule)."""
    weights = random_sample_set(lambda: mlp(3, [6, 5], 2), 3, 0)
    spec = spec_for_model(mlp(in_features=3, hidden=[6, 5], num_classes=2))
    out, _ = sort_units(weights, spec, "first")
    for key in ("fc1.weight", "fc2.weight"):
        first = out[key][:, :, 0]
        assert bool((first[:, 1:] >= first[:, :-1]).all()), key


def test_bias_ordering_sorts_biases_and_needs_a_bias():
    weights = random_sample_set(lambda: mlp(3, [6], 2), 2, 1)
    spec = spec_for_model(mlp(in_features=3, hidden=[6], num_classes=2))
    out, perms = sort_units(weights, spec, "bias")
    torch.testing.assert_close(out["fc1.bias"], weights["fc1.bias"].sort(dim=1).values)
    assert_same_function(mlp(3, [6], 2), weights, out)
    with pytest.raises(ValueError, match="group 'conv1' has no bias"):
        sort_units(random_sample_set(optunet, 1, 0), spec_for_model(optunet()), "bias")


def test_lexicographic_sort_matches_python_tuple_sort():
    """NodeSort (seed 004): ties on the first weight are broken by the next ones."""
    spec = spec_for_model(mlp(in_features=3, hidden=[5], num_classes=2))
    w = {k: torch.randn(1, *s, dtype=torch.float64) for k, s in spec.shapes.items()}
    w["fc1.weight"][0, :, 0] = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0], dtype=torch.float64)
    out, _ = sort_units(w, spec, "lexicographic")
    expected = sorted(map(tuple, w["fc1.weight"][0].tolist()))
    assert list(map(tuple, out["fc1.weight"][0].tolist())) == expected


def test_scale_normalisation_gives_unit_norms_pushes_factors_forward_and_keeps_dead_units():
    spec = spec_for_model(mlp(in_features=4, hidden=[3, 2], num_classes=2))
    weights = random_sample_set(lambda: mlp(4, [3, 2], 2), 2, 5)
    weights["fc1.weight"][0, 1] = 0.0  # a dead unit: zero incoming weights
    weights["fc1.bias"][0, 1] = 0.0
    out, factors = normalize_scales(weights, spec)
    assert all(bool(torch.isfinite(v).all()) for v in out.values())
    norms = out["fc1.weight"].norm(dim=2)
    torch.testing.assert_close(norms[1], torch.ones(3, dtype=torch.float64))
    torch.testing.assert_close(norms[0, [0, 2]], torch.ones(2, dtype=torch.float64))
    assert float(factors["fc1"][0, 1]) == 1.0 and float(norms[0, 1]) == 0.0
    torch.testing.assert_close(out["fc2.weight"].norm(dim=2), torch.ones(2, 2, dtype=torch.float64))
    # by hand: layer 1 divided by its row norms, layer 2's columns multiplied by them
    n1 = weights["fc1.weight"][1].norm(dim=1)
    by_hand = weights["fc2.weight"][1] * n1
    torch.testing.assert_close(out["fc2.weight"][1], by_hand / by_hand.norm(dim=1, keepdim=True))
    assert_same_function(mlp(4, [3, 2], 2), weights, out)
    canonical, _ = canonicalize(weights, spec)
    assert all(bool(torch.isfinite(v).all()) for v in canonical.values())


def test_softmax_step_sets_the_bias_sum():
    weights = random_sample_set(optunet, 3, 2)
    spec = spec_for_model(optunet())
    out, info = center_logit_bias(weights, spec, total=1.0)
    torch.testing.assert_close(out["fc2.bias"].sum(dim=1), torch.ones(3, dtype=torch.float64))
    torch.testing.assert_close(out["fc2.bias"] - weights["fc2.bias"], info["shift"][:, None].expand(-1, 10))
    nobias = spec_for_model(torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2, bias=False)))
    with pytest.raises(ValueError, match="the last layer has no bias"):
        center_logit_bias({k: torch.ones(1, *s) for k, s in nobias.shapes.items()}, nobias)


def test_canonicalize_keeps_keys_shapes_dtypes_and_reports_steps():
    weights = {k: v.float() for k, v in random_sample_set(optunet, 2, 0).items()}
    spec = spec_for_model(optunet())
    out, applied = canonicalize(weights, spec)
    assert list(out) == list(weights)
    assert all(out[k].shape == weights[k].shape and out[k].dtype == weights[k].dtype for k in weights)
    assert set(applied) == {"scale", "sort", "softmax"}
    with pytest.raises(ValueError, match="unknown step 'rotate'"):
        canonicalize(weights, spec, steps=("scale", "rotate"))
    with pytest.raises(ValueError, match="unknown sort key 'median'"):
        canonicalize(weights, spec, sort_key="median")


@pytest.mark.slow  # every transform on a ResNet-18
def test_resnet18_transforms_keep_the_function_and_canonical_form_is_invariant():
    """ResNet-18 in eval mode with random BatchNorm statistics: residual streams, shortcut convs
    and BatchNorm scalings; two symmetric copies share one canonical form."""
    model = resnet18(num_classes=10)
    weights = random_sample_set(lambda: resnet18(num_classes=10), 1, 11)
    spec = spec_for_model(model)
    moved = _symmetric_copy(weights, spec, 4, spread=0.5)
    canonical, applied = canonicalize(weights, spec)
    assert_same_weights(canonical, canonicalize(moved, spec)[0])
    assert torch.equal(canonical["layer1.0.bn1.num_batches_tracked"], weights["layer1.0.bn1.num_batches_tracked"])
    assert set(applied["sort"]) == {g.name for g in spec.groups}
    variants = [moved, canonical, *(sort_units(weights, spec, key)[0] for key in ("max", "bias"))]
    stacked = {k: torch.cat([v[k] for v in variants]) for k in weights}
    assert_same_function(model, weights, stacked)


@pytest.mark.parametrize("steps", list(itertools.permutations(["scale", "sort"])))
def test_steps_compose_in_either_order_without_changing_the_function(steps):
    weights = random_sample_set(optunet, 2, 9)
    out, _ = canonicalize(weights, spec_for_model(optunet()), steps=steps)
    assert_same_function(optunet(), weights, out)
