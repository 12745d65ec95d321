"""Marginal weight distributions of a layer and two-sample Kolmogorov-Smirnov tests between
them (paper appendix D.3).

A layer's marginal is the distribution of its entries pooled over units and samples: under the
permutation symmetry every unit of a layer has the same marginal (the corollary of the paper's
Proposition 1), so pooling loses nothing for a symmetric posterior; one unit's incoming weights
over the samples test that claim unit against unit. A layer of a large zoo (ResNet-18: up to
2.4e9 entries over 1000 checkpoints) is read in column blocks and summarised by a fixed, seeded
uniform subsample of its entries (``subsample_indices``, ``gather``).

The KS test assumes independent draws; entries of one network are not independent, so its
p-values are a descriptive scale here, not calibrated error rates.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

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


def subsample_indices(rows: int, columns: int, max_values: int, seed: int | Sequence[int]) -> np.ndarray | None:
    """A fixed uniform subsample, without replacement, of ``max_values`` of the ``rows * columns``
    entries of a ``[rows, columns]`` matrix (e.g. a layer: samples x entries per sample), drawn by
    ``numpy.random.default_rng(seed)``: sorted flat indices, column-major (index ``j`` is row
    ``j % rows`` of column ``j // rows``), int64 ``[max_values]``; None when every entry fits."""
    if rows < 1 or columns < 1 or max_values < 1:
        raise ValueError(f"subsample_indices: rows, columns and max_values must be >= 1, "
                         f"got {rows}, {columns}, {max_values}")
    total = rows * columns
    if total <= max_values:
        return None
    return np.sort(np.random.default_rng(seed).choice(total, size=max_values, replace=False))


def gather(blocks: Iterable[torch.Tensor], indices: np.ndarray | None) -> np.ndarray:
    """The entries of a ``[rows, columns]`` matrix given as consecutive column blocks ``[rows,
    d_i]`` (any trailing shape is flattened into the block's columns): every entry when
    ``indices`` is None (block by block, row-major within a block), else those at ``indices``
    (``subsample_indices``' column-major flat indices, in their order). Float64 ``[k]``; only one
    block is held at a time, so a layer streamed from disk never has to fit in memory."""
    parts, start, rows = [], 0, None
    for block in blocks:
        block = block.detach().reshape(block.shape[0], -1)
        if rows is not None and block.shape[0] != rows:
            raise ValueError(f"gather: blocks disagree on the row count ({block.shape[0]} after {rows})")
        rows, width = block.shape
        if indices is None:
            parts.append(block.reshape(-1).to(torch.float64).cpu().numpy())
        else:
            low, high = np.searchsorted(indices, [start * rows, (start + width) * rows])
            local = torch.from_numpy(indices[low:high] - start * rows).to(block.device)
            parts.append(block[local % rows, local // rows].to(torch.float64).cpu().numpy())
        start += width
    if rows is None:
        raise ValueError("gather: no blocks given")
    if indices is not None and len(indices) and int(indices[-1]) >= start * rows:
        raise ValueError(f"gather: index {int(indices[-1])} beyond the {start * rows} entries of the blocks")
    return np.concatenate(parts)


def ks_test(x: np.ndarray, y: np.ndarray) -> KSResult:
    """Two-sample KS test of ``x`` and ``y`` (1-D; ``scipy.stats.ks_2samp``, exact p-value for
    small samples, asymptotic otherwise)."""
    x, y = np.asarray(x, dtype=np.float64).ravel(), np.asarray(y, dtype=np.float64).ravel()
    if x.size < 1 or y.size < 1:
        raise ValueError(f"ks_test: both samples need values, got {x.size} and {y.size}")
    result = stats.ks_2samp(x, y)
    return KSResult(float(result.statistic), float(result.pvalue), int(x.size), int(y.size))
