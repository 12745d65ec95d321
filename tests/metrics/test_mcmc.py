"""Chain diagnostics: equal to ArviZ called directly on stored chains, and right on chains whose
answer is known in closed form (AR(1) processes, chains stuck at different means)."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from metrics.mcmc import RHAT_CONVERGED, bfmi, ess, ess_per_chain, predictive_convergence, rhat

with warnings.catch_warnings():
    warnings.simplefilter("ignore", FutureWarning)
    import arviz as az


def ar1(rho: float, chains: int, draws: int, dims: int, seed: int, offsets=None) -> np.ndarray:
    """``[chains, draws, dims]`` stationary AR(1) chains with unit marginal variance."""
    rng = np.random.default_rng(seed)
    x = np.empty((chains, draws, dims))
    x[:, 0] = rng.normal(size=(chains, dims))
    noise = rng.normal(size=(chains, draws, dims)) * np.sqrt(1 - rho**2)
    for t in range(1, draws):
        x[:, t] = rho * x[:, t - 1] + noise[:, t]
    return x if offsets is None else x + np.asarray(offsets)[:, None, None]


@pytest.fixture(scope="module")
def stored(tmp_path_factory) -> torch.Tensor:
    """Chains written to and read back from a safetensors file ``[4 chains, 300 draws, 2, 3]``."""
    path = tmp_path_factory.mktemp("chains") / "chains.safetensors"
    draws = np.concatenate([ar1(rho, 4, 300, 2, seed) for seed, rho in enumerate((0.0, 0.6, 0.95))], axis=2)
    draws[:, :, 5] += np.arange(4)[:, None] * 0.5  # one scalar whose chains disagree
    save_file({"draws": torch.from_numpy(draws.reshape(4, 300, 2, 3).copy())}, str(path))
    return load_file(str(path))["draws"]


def test_rhat_and_ess_equal_arviz_on_stored_chains(stored):
    array = stored.numpy()
    flat = array.reshape(4, 300, -1)
    expected_rhat = np.array([az.rhat(flat[:, :, j], method="rank") for j in range(6)]).reshape(2, 3)
    expected_ess = np.array([az.ess(flat[:, :, j], method="bulk") for j in range(6)]).reshape(2, 3)
    np.testing.assert_array_equal(rhat(stored), expected_rhat)
    np.testing.assert_array_equal(ess(stored), expected_ess)
    dataset = az.convert_to_dataset({"w": array})  # ArviZ's own multi-dimensional path agrees too
    np.testing.assert_array_equal(rhat(array), az.rhat(dataset, method="rank")["w"].values)
    np.testing.assert_array_equal(ess(array), az.ess(dataset, method="bulk")["w"].values)
    per_chain = ess_per_chain(stored)
    assert per_chain.shape == (4, 2, 3)
    np.testing.assert_array_equal(per_chain[2], np.array([az.ess(flat[2:3, :, j], method="bulk") for j in range(6)]).reshape(2, 3))


def test_rhat_flags_chains_at_different_means_and_passes_mixed_ones(stored):
    values = rhat(stored).reshape(-1)
    assert (values[:4] < 1.02).all() and (values[4] < RHAT_CONVERGED), values  # mixed (rho = 0.95: slower)
    assert values[5] > RHAT_CONVERGED  # chain means 0, 0.5, 1, 1.5 with unit-variance noise


@pytest.mark.parametrize("rho", [0.0, 0.5, 0.9])
def test_bulk_ess_of_an_ar1_process_is_n_times_1_minus_rho_over_1_plus_rho(rho):
    x = ar1(rho, 4, 5000, 2, seed=1)
    expected = 4 * 5000 * (1 - rho) / (1 + rho)
    np.testing.assert_allclose(ess(x), expected, rtol=0.2)  # the estimator's own spread


def test_bfmi_equals_arviz_and_is_2_for_independent_energies():
    energy = np.random.default_rng(0).normal(size=(3, 4000))
    np.testing.assert_array_equal(bfmi(energy), az.bfmi(energy))
    np.testing.assert_allclose(bfmi(energy), 2.0, rtol=0.05)  # E[(E_t - E_t-1)^2] / Var E = 2 without correlation
    slow = ar1(0.9, 2, 4000, 1, seed=2)[..., 0]
    np.testing.assert_allclose(bfmi(slow), 2 * (1 - 0.9), rtol=0.15)


def test_predictive_convergence_of_agreeing_and_disagreeing_chains():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(1, 1, 30, 4)) + 0.3 * rng.normal(size=(4, 200, 30, 4))
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    labels = rng.integers(0, 4, size=30)
    agree = predictive_convergence(probs, labels)
    assert agree["rhat_loglik"] < 1.05 and agree["rhat_softmax_median"] < 1.05 and agree["softmax_converged"] > 0.9
    assert agree["ess_loglik"].shape == (4,)
    np.testing.assert_array_equal(
        agree["ess_loglik"][1], ess(np.log(np.take_along_axis(probs[1:2], labels[None, None, :, None], 3)[..., 0]).mean(-1)))
    shifted = probs.copy()
    shifted[2:] = np.roll(probs[2:], 1, axis=-1)  # two chains predict another class
    disagree = predictive_convergence(shifted, labels)
    assert disagree["rhat_softmax_median"] > 1.5 and disagree["softmax_converged"] < 0.5
    one = predictive_convergence(torch.from_numpy(probs[:1]), torch.from_numpy(labels))  # halves of one chain
    expected = rhat(np.log(np.take_along_axis(probs[0], labels[None, :, None], 2)[..., 0]).mean(-1).reshape(2, 100))
    assert one["rhat_loglik"] == float(expected)
    with pytest.raises(ValueError, match=r"\[chains, draws, N, classes\]"):
        predictive_convergence(probs[0], labels)


# --- chains as chains: the ESS of independent chains, whatever order their draws are stored in --------
def test_chain_ess_does_not_depend_on_the_storage_order():
    """50 chains x 4 draws of AR(1) (rho 0.9) and 50 x 4 of independent draws, stored round-robin,
    chain after chain and shuffled, with each sample's chain and position: the same ESS every time.
    The ESS of one sequence of the round-robin storage (the old ``ess``) reads the correlated
    chains as nearly independent; chains as chains do not."""
    from metrics.mcmc import as_chains, chain_ess, effective_sample_size

    correlated, independent = ar1(0.9, 50, 4, 6, seed=3), ar1(0.0, 50, 4, 6, seed=4)
    chain, position = np.repeat(np.arange(50), 4), np.tile(np.arange(4), 50)
    for draws in (correlated, independent):
        flat = draws.reshape(200, 6)  # chain-major storage
        expected = chain_ess(draws)
        order = np.random.default_rng(0).permutation(200)
        assert chain_ess(as_chains(flat[order], chain[order], position[order])) == expected
        robin = np.lexsort((chain, position))  # round-robin storage
        assert chain_ess(as_chains(flat[robin], chain[robin], position[robin])) == expected
    # Round-robin as one sequence: neighbours are different chains, so the correlation is invisible.
    robin = correlated.transpose(1, 0, 2).reshape(200, 6)
    assert np.median(effective_sample_size(robin)) > 150
    # Chains as chains: the ESS of the mean sees it (AR(1) at 0.9 over 4 draws: 4 / (1 + 2 sum_k (1 - k/4) 0.9^k)
    # = 1.13 per chain, 56 for 50 chains; independent: 200). ArviZ's per-chain ESS cannot at 4 draws per
    # chain: it gives the same for both (the split chains have 2 draws each).
    assert chain_ess(correlated)["of_mean"] == pytest.approx(56.4, rel=0.1)
    assert chain_ess(independent)["of_mean"] == pytest.approx(200, rel=0.1)
    assert chain_ess(correlated)["total"] == chain_ess(independent)["total"]


def test_chain_ess_of_independent_ar1_chains_adds_up():
    """10 chains x 400 draws of AR(1) at rho 0.5: each chain's ESS ~ 400 (1 - rho) / (1 + rho) = 133,
    the total ~ 10 x that, each chain ArviZ's own ``ess`` of that chain."""
    from metrics.mcmc import chain_ess

    draws = ar1(0.5, 10, 400, 20, seed=5)
    result = chain_ess(draws)
    assert result["total"] == pytest.approx(1333, rel=0.1)
    assert 90 < result["chain_min"] < 133
    per_chain = np.stack([ess(draws[c : c + 1]) for c in range(10)])
    assert result["total"] == pytest.approx(float(np.median(per_chain.sum(0))), rel=1e-12)
    assert np.isnan(chain_ess(draws[:, :3])["total"])  # ArviZ's split chains need 4 draws
    many = ar1(0.5, 40, 100, 20, seed=9)  # the ESS of the mean from 40 chain means: 40 x 100 / (1 + 2 sum (1 - k/100) 0.5^k)
    exact = 40 * 100 / (1 + 2 * sum((1 - k / 100) * 0.5**k for k in range(1, 100)))
    assert chain_ess(many)["of_mean"] == pytest.approx(exact, rel=0.15)
    two = ar1(0.97, 50, 2, 20, seed=8)  # the review's layout: 50 chains x 2 states correlated at 0.97
    assert chain_ess(two)["of_mean"] == pytest.approx(50 * 2 / 1.97, rel=0.1) and np.isnan(chain_ess(two)["total"])


def test_split_rhat_flags_a_drifting_chain_and_passes_stationary_ones():
    from metrics.mcmc import RHAT_STATIONARY, split_rhat

    stationary = ar1(0.3, 10, 100, 1, seed=6)[..., 0]
    assert split_rhat(stationary) < RHAT_STATIONARY
    drifting = stationary + np.linspace(0, 3, 100)[None]  # every chain still moving: first half != second half
    assert split_rhat(drifting) > 1.2
    one = ar1(0.3, 1, 400, 1, seed=7)[..., 0]
    assert split_rhat(one) < RHAT_STATIONARY and split_rhat(one + np.linspace(0, 3, 400)) > 1.2
    assert np.isnan(split_rhat(stationary[:, :3]))
    with pytest.raises(ValueError, match="chains of unequal length"):
        from metrics.mcmc import as_chains
        as_chains(np.zeros((5, 2)), np.array([0, 0, 0, 1, 1]), np.arange(5))
