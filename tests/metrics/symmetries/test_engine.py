"""The engine: permutations and scalings applied to sample sets keep every network's function."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

from benchmark.core.models import mlp, optunet, resnet18
from metrics.symmetries import compose, permute, random_permutations, random_scales, rescale, spec_for_model
from metrics.symmetries.engine import check_permutations, lift_block_permutation
from tests.metrics.symmetries.nets import assert_same_function, drawn_weights, random_sample_set, small_networks


@settings(max_examples=12, deadline=None)
@given(small_networks())
def test_random_permutation_and_scaling_keep_the_function(network):
    factory, weights, spec, seed = drawn_weights(network)
    generator = torch.Generator().manual_seed(seed)
    perms = random_permutations(spec, 3, generator)
    check_permutations(spec, perms, 3)
    moved = permute(rescale(weights, spec, random_scales(spec, 3, generator=generator)), spec, perms)
    assert {k: v.shape for k, v in moved.items()} == {k: v.shape for k, v in weights.items()}
    assert_same_function(factory(), weights, moved)


def test_optunet_group_swap_moves_conv2_blocks_explicitly():
    """Swapping conv1's two channels must swap conv2's two blocks of 5 output channels (each block
    reads one conv1 channel) and fc1's matching input columns: checked entry by entry."""
    spec = spec_for_model(optunet())
    w = random_sample_set(optunet, 1, 0)
    swapped = permute(w, spec, {"conv1": torch.tensor([[1, 0]])})
    torch.testing.assert_close(swapped["conv1.weight"], w["conv1.weight"][:, [1, 0]])
    order = [5, 6, 7, 8, 9, 0, 1, 2, 3, 4]
    torch.testing.assert_close(swapped["conv2.weight"], w["conv2.weight"][:, order])
    torch.testing.assert_close(swapped["fc1.weight"], w["fc1.weight"][:, :, order])
    assert_same_function(optunet(), w, swapped)


def test_batchnorm_running_stats_absorb_the_scale_exactly():
    """Eval-mode BatchNorm with eps: mean -> s mean, var -> s^2 (var + eps) - eps (closed form)."""
    spec = spec_for_model(resnet18(num_classes=10))
    shapes = {k: torch.zeros(1, *v, dtype=torch.float64) for k, v in spec.shapes.items()}
    shapes["bn1.running_mean"] = torch.full((1, 64), 2.0, dtype=torch.float64)
    shapes["bn1.running_var"] = torch.full((1, 64), 3.0, dtype=torch.float64)
    out = rescale(shapes, spec, {"conv1->bn1": torch.full((1, 64), 0.5, dtype=torch.float64)})
    torch.testing.assert_close(out["bn1.running_mean"], torch.full((1, 64), 1.0, dtype=torch.float64))
    torch.testing.assert_close(out["bn1.running_var"], torch.full((1, 64), 0.25 * (3.0 + 1e-5) - 1e-5, dtype=torch.float64))


def test_compose_matches_applying_twice():
    spec = spec_for_model(mlp(in_features=3, hidden=[6], num_classes=2))
    w = {k: torch.randn(4, *s, dtype=torch.float64) for k, s in spec.shapes.items()}
    generator = torch.Generator().manual_seed(1)
    p, q = random_permutations(spec, 4, generator)["fc1"], random_permutations(spec, 4, generator)["fc1"]
    twice = permute(permute(w, spec, {"fc1": p}), spec, {"fc1": q})
    once = permute(w, spec, {"fc1": compose(p, q)})
    assert all(torch.equal(twice[k], once[k]) for k in w)


def test_invalid_permutations_and_scales_are_rejected():
    spec = spec_for_model(optunet())
    w = {k: torch.randn(2, *s, dtype=torch.float64) for k, s in spec.shapes.items()}
    with pytest.raises(ValueError, match="group 'fc1' is not a permutation of 0..2"):
        permute(w, spec, {"fc1": torch.tensor([[0, 0, 1], [0, 1, 2]])})
    with pytest.raises(ValueError, match=r"group 'fc1': expected a LongTensor \[2, 3\]"):
        permute(w, spec, {"fc1": torch.tensor([[0, 1, 2]])})
    with pytest.raises(ValueError, match="group 'conv2' splits one of its 2 blocks"):
        permute(w, spec, {"conv2": torch.tensor([[5, 1, 2, 3, 4, 0, 6, 7, 8, 9]] * 2)})
    block_swap = lift_block_permutation(torch.tensor([[1, 0]] * 2), 10)
    with pytest.raises(ValueError, match="group 'conv2' must move its blocks as its leader 'conv1'"):
        permute(w, spec, {"conv2": block_swap})
    with pytest.raises(ValueError, match="scaling 'fc1': expected finite positive factors"):
        rescale(w, spec, {"fc1": torch.tensor([[1.0, -1.0, 1.0]] * 2, dtype=torch.float64)})
    with pytest.raises(ValueError, match="no scaling 'fc9'"):
        rescale(w, spec, {"fc9": torch.ones(2, 3)})
