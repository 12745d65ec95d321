"""table_hmc's chain diagnostics on synthetic chains whose answer is known: chains that share a start
and draw from one distribution agree within it (R-hat near 1, every softmax output below 1.1), starts
whose log-likelihoods sit apart show an across-start R-hat far above 1.1; the numbers are ArviZ's
(``metrics.mcmc.predictive_convergence``) on the right chains."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from benchmark.report.hmc import reading, start_groups, summarised
from metrics.mcmc import predictive_convergence


def synthetic(starts: int, per_start: int, draws: int, n: int = 12, classes: int = 3, seed: int = 0) -> torch.Tensor:
    """``[starts x per_start, draws, n, classes]`` softmax outputs: every chain of start ``s`` draws its
    logits i.i.d. around a mean of its start (starts 4 logit units apart on the true class)."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % classes
    chains = []
    for s in range(starts):
        mean = torch.zeros(n, classes)
        mean[torch.arange(n), labels] = 4.0 * s
        for _ in range(per_start):
            logits = mean + 0.5 * torch.randn(draws, n, classes, generator=generator)
            chains.append(logits.softmax(-1))
    return torch.stack(chains), labels


def start_convergence(probs, labels, groups):
    """``summarised`` with each start's ``predictive_convergence``, as the report computes it."""
    return summarised(probs, labels, groups, [predictive_convergence(probs[group], labels) for group in groups])


def test_start_groups_follow_the_start_seed():
    assert start_groups([10, 11, 12, 13, 15], 2) == [[0, 1], [2, 3], [4]]
    assert start_groups([10, 11, 12], 1) == [[0], [1], [2]]


def test_chains_sharing_a_start_agree_and_the_starts_spread_between_modes():
    probs, labels = synthetic(starts=3, per_start=4, draws=200)
    groups = start_groups(list(range(12)), 4)
    found = start_convergence(probs, labels, groups)
    assert found["within_rhat_loglik"] < 1.02 and found["within_softmax_converged"] == 1.0
    assert found["across_rhat_loglik"] > 2.0 and found["across_softmax_median"] > 1.5
    assert (found["starts"], found["chains_per_start"]) == (3.0, 4.0)
    assert 100 < found["ess_chain_min"] <= found["ess_chain_median"]  # i.i.d. draws: ESS near the 200 draws
    # the numbers are ArviZ's on the right chains
    second = predictive_convergence(probs[4:8], labels)
    each = [predictive_convergence(probs[g], labels)["rhat_loglik"] for g in groups]
    assert found["within_rhat_loglik"] == pytest.approx(np.median(each))
    assert found["within_rhat_loglik_max"] == pytest.approx(max(each)) and found["within_unconverged"] == 0.0
    assert second["rhat_loglik"] < 1.02
    across = predictive_convergence(probs[[0, 4, 8]], labels)
    assert found["across_rhat_loglik"] == across["rhat_loglik"]


def test_a_start_with_one_chain_is_judged_by_its_halves_and_drift_is_caught():
    probs, labels = synthetic(starts=2, per_start=1, draws=200)
    drifting = probs.clone()
    drifting[1, 100:] = synthetic(starts=3, per_start=1, draws=100, seed=1)[0][2]  # the second half in another mode
    steady = start_convergence(probs, labels, [[0], [1]])
    drifted = start_convergence(drifting, labels, [[0], [1]])
    assert steady["within_rhat_loglik"] < 1.05
    assert drifted["within_rhat_loglik"] > steady["within_rhat_loglik"]
    assert drifted["within_rhat_loglik_max"] > 1.1 and drifted["within_unconverged"] == 0.5  # the drifting start
    halves = predictive_convergence(drifting[1:2], labels)["rhat_loglik"]
    assert halves > 1.5
    assert drifted["within_rhat_loglik"] == pytest.approx(np.median([predictive_convergence(drifting[:1], labels)["rhat_loglik"],
                                                                     halves]))


def test_the_caption_labels_unconverged_chains_as_a_local_reference():
    assert "local, unconverged reference" in reading(2.1) and "2.10" in reading(2.1)
    assert "not measured" in reading(math.nan)
    assert reading(1.03, 1.08, 0.0, 20).startswith("The HMC reference converged within its starts")
    assert "every one of its 20 starts (largest 1.08, median 1.03)" in reading(1.03, 1.08, 0.0, 20)
    mixed = reading(1.03, 1.4, 0.1, 20)  # the median converged, one start in ten not: not converged
    assert mixed.startswith("The HMC reference did NOT converge") and "in 10% of its 20 starts (largest 1.40" in mixed
