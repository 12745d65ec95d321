"""Predictive metrics against closed forms, brute-force loops, torchmetrics and scikit-learn."""
import math

import numpy as np
import pytest
import torch
from scipy.stats import entropy as scipy_entropy
from sklearn.metrics import brier_score_loss, log_loss
from torchmetrics.classification import MulticlassAccuracy, MulticlassCalibrationError

import metrics.predictive as predictive
from metrics.ood import fpr_at_tpr, ood_average_precision
from metrics.predictive import (
    METRIC_KEYS,
    NLL_EPSILON,
    accuracy,
    agreement,
    as_predictive,
    brier_score,
    expected_calibration_error,
    mutual_information,
    negative_log_likelihood,
    predictive_metrics,
    summarize_samples,
    total_variation,
)

C = 10


def softmax(logits):
    e = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True)).astype(np.float32)


@pytest.fixture
def data():
    """ID: confident, mostly right, samples close to each other; OOD: flat on average, samples disagree."""
    rng = np.random.default_rng(0)
    labels = rng.integers(0, C, size=300)
    logits_id = rng.normal(size=(300, C)) * 1.5
    logits_id[np.arange(300), labels] += 3.0
    probs_id = softmax(logits_id + 0.5 * rng.normal(size=(8, 300, C)))
    probs_ood = softmax(0.5 * rng.normal(size=(200, C)) + 1.5 * rng.normal(size=(8, 200, C)))
    reference = softmax(logits_id + 1.0 * rng.normal(size=(5, 300, C)))
    return probs_id, labels, probs_ood, reference


def test_accuracy_matches_torchmetrics_and_loop(data):
    probs, labels, _, _ = data
    mean = probs.astype(np.float64).mean(axis=0)
    expected = MulticlassAccuracy(num_classes=C, average="micro")(torch.from_numpy(mean), torch.from_numpy(labels))
    loop = sum(int(np.argmax(row) == y) for row, y in zip(mean, labels)) / len(labels)
    assert accuracy(mean, labels) == pytest.approx(float(expected), abs=1e-6)  # torchmetrics: float32
    assert accuracy(mean, labels) == pytest.approx(loop, abs=1e-12)
    assert 0.5 < loop < 1.0  # the fixture is informative, so the check is not vacuous


def test_nll_matches_sklearn_and_clamps_at_epsilon(data):
    probs, labels, _, _ = data
    mean = probs.astype(np.float64).mean(axis=0)
    assert negative_log_likelihood(mean, labels) == pytest.approx(log_loss(labels, mean, labels=range(C)), rel=1e-9)
    certain_wrong = np.array([[1.0, 0.0], [0.5, 0.5]])
    expected = (-math.log(NLL_EPSILON) + math.log(2.0)) / 2
    assert negative_log_likelihood(certain_wrong, np.array([1, 0])) == pytest.approx(expected, rel=1e-12)


def test_brier_matches_sklearn_multiclass_and_closed_forms(data):
    probs, labels, _, _ = data
    mean = probs.astype(np.float64).mean(axis=0)
    expected = brier_score_loss(labels, mean, labels=list(range(C)), scale_by_half=False)
    assert brier_score(mean, labels) == pytest.approx(expected, rel=1e-12)
    assert brier_score(np.eye(C), np.arange(C)) == pytest.approx(0.0, abs=1e-15)
    assert brier_score(np.full((4, C), 1.0 / C), np.arange(4)) == pytest.approx((C - 1) / C, rel=1e-12)
    assert brier_score(np.eye(C)[[1, 2]], np.array([0, 0])) == pytest.approx(2.0, rel=1e-12)


@pytest.mark.parametrize("one_hot_rows", [0, 40])
def test_ece_matches_torchmetrics(data, one_hot_rows):
    probs, labels, _, _ = data
    mean = probs.astype(np.float64).mean(axis=0)
    # Rows with confidence exactly 1.0 exercise the torchmetrics edge bin.
    mean[:one_hot_rows] = np.eye(C)[(labels[:one_hot_rows] + np.arange(one_hot_rows) % 2) % C]
    metric = MulticlassCalibrationError(num_classes=C, n_bins=15, norm="l1")
    expected = float(metric(torch.from_numpy(mean), torch.from_numpy(labels)))
    assert expected > 0.01
    # torchmetrics accumulates in float32.
    assert expected_calibration_error(mean, labels) == pytest.approx(expected, abs=1e-6)


def test_ece_closed_forms():
    # Two inputs at confidence 0.6 (one bin), one right one wrong: |0.5 - 0.6| = 0.1.
    p = np.array([[0.6, 0.4], [0.6, 0.4]])
    assert expected_calibration_error(p, np.array([0, 1])) == pytest.approx(0.1, abs=1e-12)
    # Bins [0.6, 0.667) and [0.933, 1): gaps 0.6 (all wrong) and 0.05 (all right), weights 1/2.
    p = np.array([[0.6, 0.4], [0.95, 0.05]])
    assert expected_calibration_error(p, np.array([1, 0])) == pytest.approx((0.6 + 0.05) / 2, abs=1e-12)
    # Same two inputs with one bin over [0, 1]: |0.5 - 0.775|.
    assert expected_calibration_error(p, np.array([1, 0]), n_bins=1) == pytest.approx(0.275, abs=1e-12)
    with pytest.raises(ValueError, match="n_bins"):
        expected_calibration_error(p, np.array([1, 0]), n_bins=0)


def test_mutual_information_closed_forms_and_loop(data):
    probs, _, _, _ = data
    identical = np.repeat(probs[:1], 5, axis=0)
    assert mutual_information(identical) == pytest.approx(0.0, abs=1e-6)
    disagree = np.stack([np.eye(3)[[0, 1]], np.eye(3)[[1, 2]]])  # [S=2, N=2, C=3] one-hot
    assert mutual_information(disagree) == pytest.approx(math.log(2.0), rel=1e-12)
    p = probs[:, :60].astype(np.float64)
    p /= p.sum(axis=-1, keepdims=True)  # scipy's entropy renormalises; give both exact sums
    loop = np.mean(
        [scipy_entropy(p[:, n].mean(axis=0)) - np.mean([scipy_entropy(s) for s in p[:, n]]) for n in range(p.shape[1])]
    )
    assert mutual_information(p) == pytest.approx(loop, rel=1e-9)


def test_agreement_and_total_variation_against_loops(data):
    probs, _, _, reference = data
    p = probs.astype(np.float64).mean(axis=0)
    q = reference.astype(np.float64).mean(axis=0)
    agree = np.mean([np.argmax(a) == np.argmax(b) for a, b in zip(p, q)])
    tv = np.mean([0.5 * sum(abs(x - y) for x, y in zip(a, b)) for a, b in zip(p, q)])
    assert agreement(probs, reference) == pytest.approx(agree, abs=1e-12)
    assert agreement(p, q) == pytest.approx(agree, abs=1e-12)
    assert total_variation(probs, reference) == pytest.approx(tv, rel=1e-6)
    assert total_variation(np.eye(3), np.eye(3)[[1, 2, 0]]) == pytest.approx(1.0, abs=1e-15)
    assert total_variation(p, p) == 0.0 and agreement(p, p) == 1.0


def test_running_reduction_matches_one_shot_float64(data, monkeypatch):
    probs, _, _, _ = data
    monkeypatch.setattr(predictive, "_CHUNK_ELEMENTS", 2 * 300 * C + 1)  # chunks of 2 samples
    summary = summarize_samples(probs)
    p = probs.astype(np.float64)
    np.testing.assert_allclose(summary.mean, p.mean(axis=0), rtol=1e-12)
    np.testing.assert_allclose(summary.expected_entropy, scipy_entropy(p, axis=-1).mean(axis=0), rtol=1e-6)


def test_torch_and_float16_inputs_agree_with_numpy(data):
    probs_id, labels, probs_ood, reference = data
    expected = predictive_metrics(probs_id, labels, probs_ood, reference)
    from_torch = predictive_metrics(
        torch.from_numpy(probs_id), torch.from_numpy(labels), torch.from_numpy(probs_ood), torch.from_numpy(reference)
    )
    assert from_torch == pytest.approx(expected, rel=1e-12)
    half = predictive_metrics(
        probs_id.astype(np.float16), labels, probs_ood.astype(np.float16), reference.astype(np.float16)
    )
    # ECE moves inputs near bin edges between bins, so it gets a looser absolute tolerance.
    assert {k: v for k, v in half.items() if k != "ece"} == pytest.approx(
        {k: v for k, v in expected.items() if k != "ece"}, rel=1e-2, abs=1e-3
    )
    assert half["ece"] == pytest.approx(expected["ece"], abs=1e-2)


def test_predictive_metrics_matches_each_metric(data):
    probs_id, labels, probs_ood, reference = data
    result = predictive_metrics(probs_id, labels, probs_ood, reference_id=reference, ood_score="entropy")
    assert tuple(result) == METRIC_KEYS
    assert all(isinstance(v, float) for v in result.values())
    mean = probs_id.astype(np.float64).mean(axis=0)
    score_id = scipy_entropy(mean, axis=1)
    score_ood = scipy_entropy(probs_ood.astype(np.float64).mean(axis=0), axis=1)
    assert result["acc"] == accuracy(mean, labels)
    assert result["nll"] == pytest.approx(negative_log_likelihood(mean, labels), rel=1e-12)
    assert result["brier"] == pytest.approx(brier_score(mean, labels), rel=1e-12)
    assert result["ece"] == pytest.approx(expected_calibration_error(mean, labels), rel=1e-9)
    assert result["aupr"] == pytest.approx(ood_average_precision(score_id, score_ood), rel=1e-9)
    assert result["fpr95"] == pytest.approx(fpr_at_tpr(score_id, score_ood), rel=1e-9)
    assert result["id_mi"] == pytest.approx(mutual_information(probs_id), rel=1e-12)
    assert result["ood_mi"] == pytest.approx(mutual_information(probs_ood), rel=1e-12)
    assert result["agreement"] == agreement(mean, reference)
    assert result["tv"] == pytest.approx(total_variation(mean, reference), rel=1e-12)
    # OOD inputs here are flatter than ID ones, so every score separates them better than chance.
    for kind in ("msp", "entropy", "mi"):
        scored = predictive_metrics(probs_id, labels, probs_ood, ood_score=kind)
        assert scored["aupr"] > 0.9 and scored["fpr95"] < 0.3
        assert math.isnan(scored["agreement"]) and math.isnan(scored["tv"])


def test_reference_may_be_averaged_or_samples(data):
    probs_id, labels, probs_ood, reference = data
    a = predictive_metrics(probs_id, labels, probs_ood, reference_id=reference)
    b = predictive_metrics(probs_id, labels, probs_ood, reference_id=reference.astype(np.float64).mean(axis=0))
    assert a == pytest.approx(b, rel=1e-9)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda d: d.update(probs_id=_with(d["probs_id"], np.nan)), r"probs_id\[0:8\].*NaN or Inf"),
        (lambda d: d.update(probs_ood=_with(d["probs_ood"], np.inf)), r"probs_ood.*NaN or Inf"),
        (lambda d: d.update(probs_id=d["probs_id"] * 3), r"probs_id.*\[0, 1\]"),
        (lambda d: d.update(probs_id=d["probs_id"] * 0.5), r"probs_id.*sum to 1"),
        (lambda d: d.update(probs_id=d["probs_id"][0]), r"probs_id.*\[S, N, C\]"),
        (lambda d: d.update(probs_id=d["probs_id"][:, :0]), r"probs_id.*N >= 1"),
        (lambda d: d.update(probs_id=d["probs_id"].astype(np.int64)), r"probs_id.*floating"),
        (lambda d: d.update(labels=d["labels"][:-1]), r"labels.*\(300,\)"),
        (lambda d: d.update(labels=d["labels"].astype(np.float32)), r"labels.*integer"),
        (lambda d: d.update(labels=d["labels"] + C), r"labels.*\[0, 10\)"),
        (lambda d: d.update(probs_ood=d["probs_ood"][..., :5] / d["probs_ood"][..., :5].sum(-1, keepdims=True)),
         r"probs_ood.*C=10"),
        (lambda d: d.update(reference_id=d["reference_id"][:, :-1]), r"reference_id.*\(300, 10\)"),
        (lambda d: d.update(reference_id=_with(d["reference_id"], np.nan)), r"reference_id.*NaN"),
        (lambda d: d.update(ood_score="energy"), r"ood_score.*'msp', 'entropy', 'mi'.*energy"),
    ],
)
def test_bad_inputs_raise_naming_the_input(data, change, match):
    probs_id, labels, probs_ood, reference = data
    kwargs = dict(probs_id=probs_id, labels=labels, probs_ood=probs_ood, reference_id=reference)
    change(kwargs)
    with pytest.raises(ValueError, match=match):
        predictive_metrics(**kwargs)


def test_single_metric_functions_validate_their_inputs():
    with pytest.raises(ValueError, match=r"predictive.*\[N, C\]"):
        accuracy(np.full((2, 3, 4), 0.25), np.zeros(3, dtype=int))
    with pytest.raises(ValueError, match=r"reference.*\(2, 2\)"):
        total_variation(np.eye(2), np.eye(3))
    with pytest.raises(ValueError, match=r"probs.*\[N, C\] or samples"):
        as_predictive(np.ones(3), "probs")


def _with(array, value):
    array = array.copy()
    array[0, 0, 0] = value
    return array
