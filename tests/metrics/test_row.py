"""``metrics.row.score_row``, the suite's one scoring function: each MMD column against plain loops
over pairs (``tests/metrics/mmd/brute_force.py``) on the forms it is given, the predictive columns
against ``predictive_metrics`` called directly, and which columns each option adds."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from metrics.mmd import PermutationTestConfig, ReferenceResampling, reference_bandwidths
from metrics.predictive import predictive_metrics
from metrics.row import Forms, ScoreOptions, score_row
from tests.metrics.mmd.brute_force import mmd_values_by_loops


def sample_set(n: int, seed: int, shift: float = 0.0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(n, 3, generator=generator, dtype=torch.float64) + shift,
            "b.weight": torch.randn(n, 2, generator=generator, dtype=torch.float64)}


def median_by_loops(x: dict[str, torch.Tensor], y: dict[str, torch.Tensor]) -> float:
    """Table 1's number by hand: per layer the median of the 20 values (the mean of the two middle
    ones), then the mean over layers weighted by their parameter counts."""
    total, weight = 0.0, 0
    for layer in ("a", "b"):
        values, _ = mmd_values_by_loops(x[f"{layer}.weight"].numpy(), y[f"{layer}.weight"].numpy())
        ordered = sorted(values)
        size = x[f"{layer}.weight"].shape[1]
        total += size * (ordered[9] + ordered[10]) / 2
        weight += size
    return total / weight


def probabilities(s: int, n: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(s, n, 4, generator=generator), dim=-1)


def test_each_mmd_column_is_the_loops_number_on_its_form():
    reference, samples = sample_set(7, 0), sample_set(5, 1, shift=0.7)
    canonical_reference, canonical_samples = sample_set(7, 2), sample_set(5, 3, shift=0.2)
    aligned_reference, aligned_samples = sample_set(7, 4), sample_set(5, 5, shift=1.5)
    scored = score_row(Forms(reference, canonical_reference, aligned_reference),
                       Forms(samples, canonical_samples, aligned_samples), ScoreOptions())
    row = scored.row
    assert row["mmd_median"] == pytest.approx(median_by_loops(reference, samples), rel=1e-9)
    assert row["ns_mmd_median"] == pytest.approx(median_by_loops(canonical_reference, canonical_samples), rel=1e-9)
    assert row["wm_mmd_median"] == pytest.approx(median_by_loops(aligned_reference, aligned_samples), rel=1e-9)
    assert row["wm_mmd_median"] > row["mmd_median"] > row["ns_mmd_median"]  # the shifts chosen above
    assert not any(k.endswith(("_ref_sd", "_reject", "_shared_median")) or k == "n_samples" for k in row)
    layers = scored.layers()
    assert sorted(set(layers["form"])) == ["mmd", "ns_mmd", "wm_mmd"] and len(layers) == 6


def test_without_an_aligned_form_the_wm_columns_are_nan_and_options_add_their_columns():
    reference, samples = sample_set(8, 0), sample_set(6, 1, shift=0.5)
    shared = {"mmd": reference_bandwidths(reference), "ns_mmd": reference_bandwidths(reference)}
    options = ScoreOptions(resampling=ReferenceResampling(count=3), permutation_test=PermutationTestConfig(b1=100, b2=100))
    row = score_row(Forms(reference, reference, shared=shared), Forms(samples, samples), options).row
    assert all(math.isnan(row[f"wm_mmd_{name}"]) for name in ("median", "mean", "max"))
    assert row["mmd_median"] == row["ns_mmd_median"] == pytest.approx(median_by_loops(reference, samples), rel=1e-9)
    assert {"mmd_median_ref_sd", "ns_mmd_max_ref_sd", "mmd_reject", "ns_mmd_reject", "mmd_shared_median",
            "ns_mmd_shared_median_ref_sd"} <= set(row)
    assert 0 <= row["mmd_reject"] <= 1 and row["mmd_median_ref_sd"] > 0
    with pytest.raises(ValueError, match="aligned"):
        score_row(Forms(reference, reference, reference), Forms(samples, samples), ScoreOptions())


def test_the_predictive_columns_are_predictive_metrics_against_the_references_predictive():
    reference, samples = sample_set(6, 0), sample_set(4, 1)
    preds = {"id": probabilities(4, 30, 7), "ood": probabilities(4, 20, 8)}
    labels = torch.as_tensor(np.arange(30) % 4)
    predictive = probabilities(6, 30, 9).double().mean(0)
    row = score_row(Forms(reference, reference, predictive=predictive), Forms(samples, samples), ScoreOptions(),
                    preds, labels).row
    expected = predictive_metrics(preds["id"], labels, preds["ood"], reference_id=predictive)
    assert row["n_samples"] == 4 and {k: row[k] for k in expected} == expected
    with pytest.raises(ValueError, match="together or not at all"):
        score_row(Forms(reference, reference), Forms(samples, samples), ScoreOptions(), preds, labels)
