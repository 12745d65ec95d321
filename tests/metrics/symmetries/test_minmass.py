"""Min-mass: the batched torch Newton solver against cvxpy, closed forms and optimality."""
from __future__ import annotations

import random

import pytest
import torch

from benchmark.core.models import mlp, optunet, resnet18
from metrics.symmetries import (
    DegenerateMinMassError, canonicalize, mass, min_mass, permute, random_permutations,
    random_scales, rescale, spec_for_model,
)
from bench.minmass_cvxpy import min_mass_cvxpy
from tests.metrics.symmetries.nets import assert_same_function, assert_same_weights, conv_chain, random_sample_set


def _relative_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a - b).abs() / b).max())


def _unbalanced(factory, samples, seed):
    """Random nets pushed far from their min-mass scaling by random log-normal rescaling."""
    weights = random_sample_set(factory, samples, seed)
    spec = spec_for_model(factory())
    return rescale(weights, spec, random_scales(spec, samples, 1.0, torch.Generator().manual_seed(seed))), spec


def test_torch_matches_cvxpy_on_100_random_mlps_and_optunets():
    """50 OptuNets and 50 MLPs (10 random architectures x 5 nets): objective within 1e-6."""
    cases = [(optunet, 50)]
    rng = random.Random(0)
    for _ in range(10):
        sizes = (rng.randint(1, 6), [rng.randint(1, 6) for _ in range(rng.randint(1, 3))], rng.randint(2, 4))
        cases.append((lambda sizes=sizes: mlp(*sizes), 5))
    solved = 0
    for i, (factory, samples) in enumerate(cases):
        weights, spec = _unbalanced(factory, samples, seed=i)
        fast, fast_info = min_mass(weights, spec)
        exact, exact_info = min_mass_cvxpy(weights, spec)
        assert _relative_gap(fast_info["mass_after"], exact_info["mass_after"]) <= 1e-6
        assert bool((fast_info["mass_after"] <= exact_info["mass_after"] * (1 + 1e-9)).all())
        torch.testing.assert_close(mass(fast, spec), fast_info["mass_after"], rtol=1e-10, atol=0)
        solved += samples
    assert solved == 100


def test_single_hidden_unit_has_the_closed_form_minimum():
    """One hidden unit: mass(s) = s^2 |w1|^2 + |w2|^2 / s^2, minimum 2 |w1| |w2| at s^2 = |w2| / |w1|."""
    weights = random_sample_set(lambda: mlp(3, [1], 2), 4, 1)
    spec = spec_for_model(mlp(in_features=3, hidden=[1], num_classes=2))
    out, info = min_mass(weights, spec)
    a, b = weights["fc1.weight"].flatten(1).norm(dim=1), weights["fc2.weight"].flatten(1).norm(dim=1)
    torch.testing.assert_close(info["mass_after"], 2 * a * b, rtol=1e-10, atol=0)
    torch.testing.assert_close(info["scales"]["fc1"][:, 0] ** 2, b / a, rtol=1e-8, atol=0)
    torch.testing.assert_close(info["mass_before"], a**2 + b**2, rtol=1e-12, atol=0)


def test_minimum_is_balanced_function_preserving_and_independent_of_the_start():
    """At the optimum every hidden unit's incoming squared norm equals its outgoing one (zero
    gradient); rescaled copies of a net reach the same weights."""
    factory = lambda: mlp(4, [5, 3], 3)  # noqa: E731
    weights = random_sample_set(factory, 3, 2)
    spec = spec_for_model(factory())
    out, _ = min_mass(weights, spec)
    assert_same_function(factory(), weights, out)
    for layer, nxt in (("fc1", "fc2"), ("fc2", "fc3")):
        incoming = out[f"{layer}.weight"].square().sum(dim=2)
        outgoing = out[f"{nxt}.weight"].square().sum(dim=1)
        torch.testing.assert_close(incoming, outgoing, rtol=1e-7, atol=0)
    moved = rescale(weights, spec, random_scales(spec, 3, 1.5, torch.Generator().manual_seed(5)))
    assert_same_weights(out, min_mass(moved, spec)[0], rtol=1e-7)


def test_optunet_min_mass_keeps_the_function_and_canonical_form_is_invariant():
    weights, spec = _unbalanced(optunet, 4, 3)
    out, info = min_mass(weights, spec)
    assert_same_function(optunet(), weights, out)
    assert bool((info["mass_after"] < info["mass_before"]).all())
    generator = torch.Generator().manual_seed(8)
    moved = permute(rescale(weights, spec, random_scales(spec, 4, 1.0, generator)), spec, random_permutations(spec, 4, generator))
    steps = ("minmass", "sort", "softmax")
    assert_same_weights(canonicalize(weights, spec, steps)[0], canonicalize(moved, spec, steps)[0], rtol=1e-7)


def test_dead_unit_is_left_at_scale_one_and_both_solvers_agree():
    factory = lambda: mlp(3, [4, 3], 2)  # noqa: E731
    weights = random_sample_set(factory, 2, 4)
    weights["fc1.weight"][0, 2] = 0.0  # unit 2 of fc1 has no incoming weight in sample 0
    spec = spec_for_model(factory())
    out, info = min_mass(weights, spec)
    exact, exact_info = min_mass_cvxpy(weights, spec)
    assert bool(info["fixed"][0, 2]) and int(info["fixed"].sum()) == 1
    assert float(info["scales"]["fc1"][0, 2]) == 1.0
    assert all(bool(torch.isfinite(v).all()) for v in out.values())
    assert _relative_gap(info["mass_after"], exact_info["mass_after"]) <= 1e-6
    assert_same_function(factory(), weights, out)


@pytest.mark.parametrize("model", ["resnet18", "chain"])
def test_batchnorm_makes_min_mass_degenerate_and_it_says_so(model):
    spec = spec_for_model(resnet18(num_classes=10)) if model == "resnet18" else spec_for_model(conv_chain())
    weights = {k: torch.randn(1, *s, dtype=torch.float64) for k, s in spec.shapes.items()}
    weights = {k: v.abs() if k.endswith("running_var") else v for k, v in weights.items()}
    with pytest.raises(DegenerateMinMassError, match="absorbed by BatchNorm .* lowers the mass without bound"):
        min_mass(weights, spec)
    with pytest.raises(DegenerateMinMassError, match="absorbed by BatchNorm"):
        min_mass_cvxpy(weights, spec)


def test_newton_that_runs_out_of_iterations_raises():
    weights, spec = _unbalanced(optunet, 2, 6)
    with pytest.raises(RuntimeError, match=r"did not converge in 1 iterations for samples \[0, 1\]"):
        min_mass(weights, spec, max_iter=1)
