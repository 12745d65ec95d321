"""Predictive metrics of a sampled posterior.

Inputs are per-sample class probabilities ``probs[S, N, C]`` (S weight samples, N inputs,
C classes; float16/32/64, numpy or torch) and integer labels ``[N]``. The method's
*predictive* is the mean over the S samples, ``[N, C]``. All metrics are computed in
float64 and returned as fractions (not percentages); entropies and mutual information are
in nats. Definitions:

- accuracy: fraction of inputs whose predictive argmax (first index on ties) is the label;
- NLL: mean over inputs of ``-log max(p_y, NLL_EPSILON)``;
- Brier: mean over inputs of ``sum_c (p_c - onehot_c)^2`` (range [0, 2]; scikit-learn's
  multiclass ``brier_score_loss``; the paper's Table 1 prints it x100, e.g. 26.1 = 0.261);
- ECE: top-label binned calibration error, 15 equal-width bins, as torchmetrics
  ``MulticlassCalibrationError(norm="l1")``;
- mutual information (epistemic): ``H(mean_s p_s) - mean_s H(p_s)`` per input, averaged;
- agreement / total variation (seed 002) against a reference predictive ``q``: fraction of
  inputs with ``argmax p == argmax q``, and mean over inputs of ``0.5 * sum_c |p_c - q_c|``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from scipy.special import entr

from metrics.columns import keys
from metrics.ood import OOD_SCORES, fpr_at_tpr, ood_average_precision, ood_scores

NLL_EPSILON = 1e-12
"""Probabilities of the true class are clamped to at least this before the log (NLL <= 27.6)."""

ECE_BINS = 15

PROB_ATOL = 1e-2
"""Tolerance on [0, 1] bounds and on per-row sums to 1 (float16 softmax over 200 classes)."""

METRIC_KEYS = keys("predictive")
"""The keys of ``predictive_metrics``' dict, in metrics.csv's order (``metrics.columns``)."""

# At most this many float64 elements are materialised at once when reducing over samples
# (64 MiB), so S=100 x N=10,000 x C=200 inputs are never copied whole to float64.
_CHUNK_ELEMENTS = 1 << 23


@dataclass(frozen=True)
class PredictiveSummary:
    """What every metric needs from per-sample probabilities, reduced over samples.

    mean: ``[N, C]`` float64, the predictive (mean over samples of the probabilities).
    expected_entropy: ``[N]`` float64, mean over samples of each sample's entropy (nats).
    """

    mean: np.ndarray
    expected_entropy: np.ndarray

    @property
    def mutual_information(self) -> np.ndarray:
        """``[N]`` nats: ``H(mean) - expected_entropy``, clipped at 0 against rounding."""
        return np.maximum(entropy(self.mean) - self.expected_entropy, 0.0)


def entropy(probs: np.ndarray) -> np.ndarray:
    """Shannon entropy in nats over the last (class) axis, with ``0 log 0 = 0``; ``[..., C] -> [...]``."""
    return entr(probs).sum(axis=-1)


def summarize_samples(probs, name: str = "probs") -> PredictiveSummary:
    """Reduce per-sample probabilities ``[S, N, C]`` to a :class:`PredictiveSummary`.

    Validates while streaming over chunks of samples (each chunk cast to float64): raises
    ValueError naming ``name`` for a wrong rank, an empty axis, NaN/Inf, values outside
    [0, 1] or rows not summing to 1 (both within ``PROB_ATOL``).
    """
    array = _as_float_array(probs, name)
    if array.ndim != 3:
        raise ValueError(f"{name}: expected per-sample probabilities [S, N, C], got shape {array.shape}")
    n_samples, n_inputs, n_classes = array.shape
    if min(n_samples, n_inputs) < 1 or n_classes < 2:
        raise ValueError(f"{name}: expected S >= 1, N >= 1 and C >= 2, got shape {array.shape}")
    chunk = max(1, _CHUNK_ELEMENTS // (n_inputs * n_classes))
    total = np.zeros((n_inputs, n_classes))
    total_entropy = np.zeros(n_inputs)
    for start in range(0, n_samples, chunk):
        block = np.asarray(array[start : start + chunk], dtype=np.float64)
        _check_probabilities(block, f"{name}[{start}:{start + len(block)}]")
        total += block.sum(axis=0)
        total_entropy += entropy(block).sum(axis=0)
    return PredictiveSummary(mean=total / n_samples, expected_entropy=total_entropy / n_samples)


def as_predictive(probs, name: str = "probs") -> np.ndarray:
    """A predictive ``[N, C]`` float64 from ``[N, C]`` (already averaged) or ``[R, N, C]`` (averaged here).

    Raises ValueError naming ``name`` for other ranks or invalid probabilities.
    """
    array = _as_float_array(probs, name)
    if array.ndim == 3:
        return summarize_samples(array, name).mean
    if array.ndim != 2:
        raise ValueError(f"{name}: expected a predictive [N, C] or samples [R, N, C], got shape {array.shape}")
    return summarize_samples(array[None], name).mean


def accuracy(predictive, labels) -> float:
    """Fraction in [0, 1] of inputs whose predictive ``[N, C]`` argmax equals the label ``[N]``."""
    p, y = _predictive_and_labels(predictive, labels)
    return float(np.mean(p.argmax(axis=1) == y))


def negative_log_likelihood(predictive, labels) -> float:
    """Mean over inputs of ``-log max(p[n, y_n], NLL_EPSILON)`` in nats; predictive ``[N, C]``, labels ``[N]``."""
    p, y = _predictive_and_labels(predictive, labels)
    p_true = p[np.arange(len(y)), y]
    return float(np.mean(-np.log(np.maximum(p_true, NLL_EPSILON))))


def brier_score(predictive, labels) -> float:
    """Mean over inputs of ``sum_c (p_c - onehot(y)_c)^2``, in [0, 2]; predictive ``[N, C]``, labels ``[N]``."""
    p, y = _predictive_and_labels(predictive, labels)
    squared = np.square(p).sum(axis=1)
    p_true = p[np.arange(len(y)), y]
    # sum_c (p_c - onehot_c)^2 = sum_c p_c^2 - 2 p_y + 1, without building the one-hot matrix.
    return float(np.mean(squared - 2.0 * p_true + 1.0))


def expected_calibration_error(predictive, labels, n_bins: int = ECE_BINS) -> float:
    """Top-label binned ECE in [0, 1]: ``sum_b (n_b / N) |acc_b - conf_b|``.

    Confidence = max predictive probability ``[N]``; bins ``[k/n_bins, (k+1)/n_bins)``. As in
    torchmetrics ``MulticlassCalibrationError(norm="l1")``, a confidence of exactly 1.0 falls
    in a bin of its own.
    """
    if not isinstance(n_bins, (int, np.integer)) or isinstance(n_bins, bool) or n_bins < 1:
        raise ValueError(f"n_bins: expected a positive integer, got {n_bins!r}")
    p, y = _predictive_and_labels(predictive, labels)
    confidence = p.max(axis=1)
    correct = (p.argmax(axis=1) == y).astype(np.float64)
    edges = np.linspace(0.0, 1.0, n_bins + 1)
    bins = np.searchsorted(edges, confidence, side="right") - 1
    gap = np.abs(
        np.bincount(bins, weights=correct, minlength=n_bins + 1)
        - np.bincount(bins, weights=confidence, minlength=n_bins + 1)
    )
    # (n_b / N) |acc_b - conf_b| = |sum_b correct - sum_b confidence| / N.
    return float(gap.sum() / len(y))


def mutual_information(probs, name: str = "probs") -> float:
    """Mean over inputs of ``H(mean_s p_s) - mean_s H(p_s)`` in nats, from samples ``[S, N, C]``."""
    return float(np.mean(summarize_samples(probs, name).mutual_information))


def agreement(predictive, reference) -> float:
    """Fraction in [0, 1] of inputs where the argmaxes of ``predictive`` and ``reference`` agree.

    Both are ``[N, C]`` predictives, or ``[R, N, C]`` samples averaged first (seed 002, eq. 1).
    """
    p, q = _predictive_pair(predictive, reference)
    return float(np.mean(p.argmax(axis=1) == q.argmax(axis=1)))


def total_variation(predictive, reference) -> float:
    """Mean over inputs of ``0.5 * sum_c |p_c - q_c|``, in [0, 1].

    Both are ``[N, C]`` predictives, or ``[R, N, C]`` samples averaged first. Seed 002's
    eq. 2 omits the 0.5; we use the standard definition, bounded by 1.
    """
    p, q = _predictive_pair(predictive, reference)
    return float(np.mean(0.5 * np.abs(p - q).sum(axis=1)))


def predictive_metrics(probs_id, labels, probs_ood, reference_id=None, ood_score: str = "msp") -> dict[str, float]:
    """All predictive metrics of one method, as a dict with keys ``METRIC_KEYS``.

    probs_id ``[S, N, C]`` and probs_ood ``[S', M, C]`` are per-sample probabilities on the
    ID test set and the OOD set; labels ``[N]`` integers in [0, C). reference_id is the
    reference predictive on the ID set, ``[N, C]`` or ``[R, N, C]``; without it agreement
    and tv are NaN. OOD detection treats OOD as the positive class, scored by ``ood_score``
    (one of ``OOD_SCORES``): aupr = average precision, fpr95 = FPR at 95% TPR. Fractions in
    [0, 1]; nll, id_mi, ood_mi in nats. Raises ValueError naming the offending input.
    """
    if ood_score not in OOD_SCORES:
        raise ValueError(f"ood_score: expected one of {list(OOD_SCORES)}, got {ood_score!r}")
    id_summary = summarize_samples(probs_id, "probs_id")
    n_inputs, n_classes = id_summary.mean.shape
    y = _labels(labels, n_inputs, n_classes)
    ood_summary = summarize_samples(probs_ood, "probs_ood")
    if ood_summary.mean.shape[1] != n_classes:
        raise ValueError(
            f"probs_ood: expected C={n_classes} classes like probs_id, got {ood_summary.mean.shape[1]}"
        )
    id_mi = id_summary.mutual_information
    ood_mi = ood_summary.mutual_information
    scores_id = ood_scores(id_summary.mean, id_mi, ood_score)
    scores_ood = ood_scores(ood_summary.mean, ood_mi, ood_score)
    result = {
        "acc": accuracy(id_summary.mean, y),
        "nll": negative_log_likelihood(id_summary.mean, y),
        "brier": brier_score(id_summary.mean, y),
        "ece": expected_calibration_error(id_summary.mean, y),
        "aupr": ood_average_precision(scores_id, scores_ood),
        "fpr95": fpr_at_tpr(scores_id, scores_ood, 0.95),
        "id_mi": float(np.mean(id_mi)),
        "ood_mi": float(np.mean(ood_mi)),
        "agreement": float("nan"),
        "tv": float("nan"),
    }
    if reference_id is not None:
        reference = _checked_reference(reference_id, id_summary.mean.shape, "reference_id")
        result["agreement"] = agreement(id_summary.mean, reference)
        result["tv"] = total_variation(id_summary.mean, reference)
    return result


def _as_float_array(x, name: str) -> np.ndarray:
    """A numpy view of a numpy array or torch tensor with a floating dtype (no float64 copy)."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        if x.dtype == torch.bfloat16:  # numpy has no bfloat16
            x = x.float()
        x = x.numpy()
    array = np.asarray(x)
    if not np.issubdtype(array.dtype, np.floating):
        raise ValueError(f"{name}: expected floating-point probabilities, got dtype {array.dtype}")
    return array


def _check_probabilities(block: np.ndarray, name: str) -> None:
    if not np.isfinite(block).all():
        raise ValueError(f"{name}: probabilities contain NaN or Inf")
    if block.min() < -PROB_ATOL or block.max() > 1.0 + PROB_ATOL:
        raise ValueError(
            f"{name}: probabilities must lie in [0, 1], got range [{block.min():.4g}, {block.max():.4g}]"
        )
    worst = np.abs(block.sum(axis=-1) - 1.0).max()
    if worst > PROB_ATOL:
        raise ValueError(
            f"{name}: probabilities must sum to 1 over classes (got a row off by {worst:.4g}; logits?)"
        )


def _labels(labels, n_inputs: int, n_classes: int) -> np.ndarray:
    if isinstance(labels, torch.Tensor):
        labels = labels.detach().cpu().numpy()
    y = np.asarray(labels)
    if not np.issubdtype(y.dtype, np.integer):
        raise ValueError(f"labels: expected integer class indices, got dtype {y.dtype}")
    if y.shape != (n_inputs,):
        raise ValueError(f"labels: expected shape ({n_inputs},) to match N of the probabilities, got {y.shape}")
    if n_inputs and (y.min() < 0 or y.max() >= n_classes):
        raise ValueError(f"labels: expected values in [0, {n_classes}), got range [{y.min()}, {y.max()}]")
    return y.astype(np.int64)


def _predictive_and_labels(predictive, labels) -> tuple[np.ndarray, np.ndarray]:
    p = _as_2d_predictive(predictive, "predictive")
    return p, _labels(labels, *p.shape)


def _as_2d_predictive(predictive, name: str) -> np.ndarray:
    array = _as_float_array(predictive, name)
    if array.ndim != 2:
        raise ValueError(f"{name}: expected a predictive [N, C], got shape {array.shape}")
    return as_predictive(array, name)


def _predictive_pair(predictive, reference) -> tuple[np.ndarray, np.ndarray]:
    p = as_predictive(predictive, "predictive")
    return p, _checked_reference(reference, p.shape)


def _checked_reference(reference, shape: tuple[int, int], name: str = "reference") -> np.ndarray:
    q = as_predictive(reference, name)
    if q.shape != shape:
        raise ValueError(f"{name}: expected predictive shape {shape} (N, C) like the method's, got {q.shape}")
    return q
