"""Marginal weight distributions of a layer and two-sample Kolmogorov-Smirnov tests between
them (paper appendix D.3).

A layer's marginal is the distribution of its entries pooled over units and samples: under the
permutation symmetry every unit of a layer has the same marginal (the corollary of the paper's
Proposition 1), so pooling loses nothing for a symmetric posterior. ``unit_values`` gives one
unit's incoming weights over the samples, to test that claim unit against unit.

The KS test assumes independent draws; entries of one network are not independent, so its
p-values are a descriptive scale here, not calibrated error rates.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np
import torch
from scipy import stats


@dataclass(frozen=True)
class KSResult:
    """Two-sample KS statistic ``D`` (sup distance of the empirical CDFs, in [0, 1]), its p-value,
    and the sizes of the two samples."""

    statistic: float
    pvalue: float
    n_x: int
    n_y: int


def layer_values(sample_set: Mapping[str, torch.Tensor], key: str) -> np.ndarray:
    """Every entry of tensor ``key`` of every sample, pooled: ``[S * numel]`` float64."""
    return sample_set[key].detach().reshape(-1).to(torch.float64).cpu().numpy()


def unit_values(sample_set: Mapping[str, torch.Tensor], key: str, unit: int) -> np.ndarray:
    """Unit ``unit``'s entries (index ``unit`` along axis 0 of tensor ``key``: a unit's incoming
    weights) over every sample, pooled: ``[S * numel / n]`` float64."""
    return sample_set[key][:, unit].detach().reshape(-1).to(torch.float64).cpu().numpy()


def ks_test(x: np.ndarray, y: np.ndarray) -> KSResult:
    """Two-sample KS test of ``x`` and ``y`` (1-D; ``scipy.stats.ks_2samp``, exact p-value for
    small samples, asymptotic otherwise)."""
    x, y = np.asarray(x, dtype=np.float64).ravel(), np.asarray(y, dtype=np.float64).ravel()
    if x.size < 1 or y.size < 1:
        raise ValueError(f"ks_test: both samples need values, got {x.size} and {y.size}")
    result = stats.ks_2samp(x, y)
    return KSResult(float(result.statistic), float(result.pvalue), int(x.size), int(y.size))
