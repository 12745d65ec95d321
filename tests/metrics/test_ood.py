"""OOD detection metrics against brute-force threshold loops, scikit-learn and torchmetrics."""
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.metrics import average_precision_score
from torchmetrics.classification import BinaryAveragePrecision, BinaryROC

from metrics.ood import OOD_SCORES, fpr_at_tpr, ood_average_precision, ood_scores


def brute_force_fpr(scores_id, scores_ood, target=0.95):
    """FPR at the largest threshold t (over all observed scores) with TPR(t) >= target."""
    for t in sorted(set(scores_id) | set(scores_ood), reverse=True):
        tpr = sum(s >= t for s in scores_ood) / len(scores_ood)
        if tpr >= target:
            return sum(s >= t for s in scores_id) / len(scores_id)
    raise AssertionError("TPR never reached the target")


def brute_force_ap(scores_id, scores_ood):
    """sum over decreasing distinct thresholds of (recall gain) x precision, OOD positive."""
    ap, recall_before = 0.0, 0.0
    for t in sorted(set(scores_id) | set(scores_ood), reverse=True):
        tp = sum(s >= t for s in scores_ood)
        fp = sum(s >= t for s in scores_id)
        recall = tp / len(scores_ood)
        ap += (recall - recall_before) * tp / (tp + fp)
        recall_before = recall
    return ap


score_lists = st.lists(st.integers(0, 6), min_size=1, max_size=25)  # small ints: many ties


@settings(max_examples=60, deadline=None)
@given(scores_id=score_lists, scores_ood=score_lists)
def test_fpr95_and_aupr_match_brute_force_with_ties(scores_id, scores_ood):
    assert fpr_at_tpr(scores_id, scores_ood) == pytest.approx(brute_force_fpr(scores_id, scores_ood), abs=1e-12)
    assert ood_average_precision(scores_id, scores_ood) == pytest.approx(
        brute_force_ap(scores_id, scores_ood), abs=1e-12
    )


def test_against_torchmetrics_on_continuous_scores():
    rng = np.random.default_rng(3)
    scores_id, scores_ood = rng.normal(0.0, 1.0, 400), rng.normal(1.0, 1.0, 250)
    scores = torch.from_numpy(np.concatenate([scores_id, scores_ood]))
    target = torch.cat([torch.zeros(400, dtype=torch.long), torch.ones(250, dtype=torch.long)])
    fpr, tpr, _ = BinaryROC()(scores, target)
    expected_fpr = float(fpr[torch.nonzero(tpr >= 0.95)[0, 0]])
    expected_ap = float(BinaryAveragePrecision()(scores, target))
    assert fpr_at_tpr(scores_id, scores_ood) == pytest.approx(expected_fpr, abs=1e-6)
    assert ood_average_precision(scores_id, scores_ood) == pytest.approx(expected_ap, abs=1e-6)
    assert 0.1 < expected_fpr < 0.95 and 0.5 < expected_ap < 1.0


def test_closed_forms_and_input_order_independence():
    assert fpr_at_tpr([0.0, 0.1], [0.5, 0.9]) == 0.0
    assert ood_average_precision([0.0, 0.1], [0.5, 0.9]) == 1.0
    assert fpr_at_tpr([0.5, 0.9], [0.0, 0.1]) == 1.0
    assert fpr_at_tpr([0.3] * 4, [0.3] * 6) == 1.0  # all tied: one threshold flags everything
    assert ood_average_precision([0.3] * 4, [0.3] * 6) == pytest.approx(0.6)
    # 20 OOD inputs: the threshold 0.5 keeps 19 (TPR exactly 0.95) and one ID input of three.
    scores_ood = [1.0] * 19 + [0.0]
    assert fpr_at_tpr([0.5, 0.2, 0.1], scores_ood) == pytest.approx(0.0)
    assert fpr_at_tpr([0.5, 0.2, 0.1], [1.0] * 18 + [0.0, 0.0]) == pytest.approx(1.0)
    rng = np.random.default_rng(0)
    scores_id, scores_ood = rng.integers(0, 4, 50), rng.integers(1, 5, 30)
    for _ in range(3):
        assert fpr_at_tpr(rng.permutation(scores_id), rng.permutation(scores_ood)) == fpr_at_tpr(scores_id, scores_ood)
        assert ood_average_precision(rng.permutation(scores_id), scores_ood) == pytest.approx(
            average_precision_score(np.r_[np.zeros(50), np.ones(30)], np.r_[scores_id, scores_ood])
        )


def test_ood_scores_definitions():
    predictive = np.array([[1.0, 0.0, 0.0], [1 / 3, 1 / 3, 1 / 3], [0.5, 0.25, 0.25]])
    mutual_info = np.array([0.0, 0.2, 0.1])
    np.testing.assert_allclose(ood_scores(predictive, mutual_info, "msp"), [0.0, 2 / 3, 0.5])
    np.testing.assert_allclose(
        ood_scores(predictive, mutual_info, "entropy"), [0.0, math.log(3), 1.5 * math.log(2)], rtol=1e-12
    )
    np.testing.assert_array_equal(ood_scores(predictive, mutual_info, "mi"), mutual_info)
    assert OOD_SCORES == ("msp", "entropy", "mi")


def test_bad_inputs():
    with pytest.raises(ValueError, match=r"ood_score.*\['msp', 'entropy', 'mi'\].*'max'"):
        ood_scores(np.eye(2), np.zeros(2), "max")
    with pytest.raises(ValueError, match=r"mutual_info.*\(2,\)"):
        ood_scores(np.eye(2), np.zeros(3), "mi")
    with pytest.raises(ValueError, match="scores_id.*non-empty"):
        fpr_at_tpr([], [0.1])
    with pytest.raises(ValueError, match="scores_ood.*NaN"):
        ood_average_precision([0.1], [np.nan])
    with pytest.raises(ValueError, match="scores_ood.*1-D"):
        fpr_at_tpr([0.1], [[0.1, 0.2]])
    with pytest.raises(ValueError, match="tpr"):
        fpr_at_tpr([0.1], [0.2], tpr=1.5)
