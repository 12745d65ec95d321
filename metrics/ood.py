"""Out-of-distribution detection from a predictive's uncertainty.

Each input gets an uncertainty score (higher = more likely OOD); OOD inputs are the
positive class. Scores (``OOD_SCORES``):

- ``"msp"``: ``1 - max_c p_c`` of the predictive (max softmax probability, the default);
- ``"entropy"``: predictive entropy ``H(p)`` in nats;
- ``"mi"``: mutual information ``H(mean_s p_s) - mean_s H(p_s)`` in nats (computed by the caller).

Detection metrics, thresholding ``score >= t`` as "OOD" and treating tied scores as one
threshold (so ties are resolved the same way whatever the input order):

- AUPR: average precision, ``sum_k (R_k - R_{k-1}) P_k`` over decreasing distinct thresholds
  (scikit-learn's ``average_precision_score``);
- FPR95: fraction of ID inputs scored ``>= t`` at the largest threshold ``t`` whose TPR (fraction
  of OOD inputs scored ``>= t``) reaches 95%.
"""
from __future__ import annotations

import numpy as np
from scipy.stats import entropy
from sklearn.metrics import average_precision_score, roc_curve

OOD_SCORES = ("msp", "entropy", "mi")


def ood_scores(predictive: np.ndarray, mutual_info: np.ndarray, kind: str = "msp") -> np.ndarray:
    """Uncertainty scores ``[N]`` (higher = more OOD) of one kind from ``OOD_SCORES``.

    predictive: ``[N, C]`` probabilities (mean over weight samples); mutual_info: ``[N]``
    nats per input, used when ``kind == "mi"``.
    """
    if kind not in OOD_SCORES:
        raise ValueError(f"ood_score: expected one of {list(OOD_SCORES)}, got {kind!r}")
    predictive = np.asarray(predictive, dtype=np.float64)
    if kind == "msp":
        return 1.0 - predictive.max(axis=1)
    if kind == "entropy":
        return entropy(predictive, axis=1)
    mutual_info = np.asarray(mutual_info, dtype=np.float64)
    if mutual_info.shape != predictive.shape[:1]:
        raise ValueError(
            f"mutual_info: expected shape {predictive.shape[:1]} (one value per input), got {mutual_info.shape}"
        )
    return mutual_info


def ood_average_precision(scores_id, scores_ood) -> float:
    """Average precision in [0, 1] with OOD as positive; scores ``[N]`` (ID) and ``[M]`` (OOD)."""
    labels, scores = _binary_problem(scores_id, scores_ood)
    return float(average_precision_score(labels, scores))


def fpr_at_tpr(scores_id, scores_ood, tpr: float = 0.95) -> float:
    """False-positive rate in [0, 1] at the largest threshold whose TPR reaches ``tpr``.

    scores_id ``[N]``, scores_ood ``[M]``; OOD is positive and ``score >= threshold`` flags OOD.
    """
    if not 0.0 < tpr <= 1.0:
        raise ValueError(f"tpr: expected a rate in (0, 1], got {tpr!r}")
    labels, scores = _binary_problem(scores_id, scores_ood)
    # roc_curve's thresholds are the distinct scores, decreasing, so TPR is non-decreasing.
    fprs, tprs, _ = roc_curve(labels, scores, drop_intermediate=False)
    return float(fprs[np.searchsorted(tprs, tpr, side="left")])


def _binary_problem(scores_id, scores_ood) -> tuple[np.ndarray, np.ndarray]:
    """Labels (1 = OOD) and scores ``[N + M]`` after checking both score vectors."""
    parts = []
    for name, scores in (("scores_id", scores_id), ("scores_ood", scores_ood)):
        array = np.asarray(scores, dtype=np.float64)
        if array.ndim != 1 or array.size == 0:
            raise ValueError(f"{name}: expected a non-empty 1-D array of scores, got shape {array.shape}")
        if not np.isfinite(array).all():
            raise ValueError(f"{name}: scores contain NaN or Inf")
        parts.append(array)
    labels = np.concatenate([np.zeros(parts[0].size), np.ones(parts[1].size)])
    return labels, np.concatenate(parts)
