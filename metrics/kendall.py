"""Kendall's rank correlation between the rows of two tensors, batched (paper section 5.2: how
much the sorting permutation of a layer changes between successive training steps).

``kendall_tau`` is tau-b, as ``scipy.stats.kendalltau`` computes it by default: ``(C - D) /
sqrt((n0 - T_a) (n0 - T_b))`` with ``C``/``D`` the concordant/discordant pairs, ``n0 = n (n - 1) /
2`` and ``T_a``/``T_b`` the pairs tied in each row. For two permutations (no ties) it is
``1 - 2 D / n0``: 1 when they are equal, -1 when one is the other reversed.

``rank_agreement``: whether two references rank the same rows (methods) alike: tau-b between the
rows' means under each, with a bootstrap interval over the rows' repetitions.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from scipy import stats

_CHUNK_ELEMENTS = 1 << 22


def kendall_tau(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Kendall's tau-b between ``a[t]`` and ``b[t]`` for every row ``t``: ``[T, n]`` x ``[T, n]``
    -> ``[T]`` float64 (NaN where a row is constant, as scipy)."""
    if a.shape != b.shape or a.dim() != 2:
        raise ValueError(f"kendall_tau: expected two [T, n] tensors of one shape, got {list(a.shape)} and {list(b.shape)}")
    t, n = a.shape
    if n < 2:
        raise ValueError(f"kendall_tau: rows need at least 2 entries, got n={n}")
    out = torch.empty(t, dtype=torch.float64, device=a.device)
    upper = torch.triu(torch.ones(n, n, dtype=torch.bool, device=a.device), diagonal=1)
    step = max(1, _CHUNK_ELEMENTS // (n * n))
    for start in range(0, t, step):
        x, y = a[start : start + step].to(torch.float64), b[start : start + step].to(torch.float64)
        sx = torch.sign(x[:, :, None] - x[:, None, :])[:, upper]
        sy = torch.sign(y[:, :, None] - y[:, None, :])[:, upper]
        numerator = (sx * sy).sum(dim=1)
        denominator = torch.sqrt((sx != 0).sum(dim=1).to(torch.float64) * (sy != 0).sum(dim=1).to(torch.float64))
        out[start : start + step] = torch.where(denominator > 0, numerator / denominator.clamp_min(1), torch.nan)
    return out


def successive_kendall_tau(perms: torch.Tensor) -> torch.Tensor:
    """Kendall's tau between each row of ``perms [T, n]`` and the next: ``[T - 1]`` float64."""
    if perms.dim() != 2 or perms.shape[0] < 2:
        raise ValueError(f"successive_kendall_tau: expected [T, n] with T >= 2, got {list(perms.shape)}")
    return kendall_tau(perms[:-1], perms[1:])


@dataclass(frozen=True)
class RankAgreement:
    """Kendall's tau-b between two orderings of ``rows`` rows (``rank_agreement``): ``tau`` of the
    rows' means, its bootstrap interval ``[low, high]`` at ``level``, scipy's two-sided ``p_value``
    of "no association" (the rows taken as the sample), and ``discordant`` of the ``pairs`` pairs."""

    tau: float
    low: float
    high: float
    level: float
    p_value: float
    rows: int
    discordant: int
    pairs: int


BOOTSTRAP_DRAWS = 4000


def rank_agreement(a: Sequence[Sequence[float]], b: Sequence[Sequence[float]], draws: int = BOOTSTRAP_DRAWS, seed: int = 0,
                   level: float = 0.95) -> RankAgreement:
    """How alike two references rank the same rows: ``a[i]`` and ``b[i]`` are row i's values in its
    repetitions (the same repetitions, in the same order) scored against reference A and B.

    ``tau``: tau-b between the rows' means under A and under B. Interval: percentile bootstrap over
    the repetitions, ``draws`` times (seeded by ``seed``): each row's repetitions resampled with
    replacement, the same draw for A and B (a repetition is one sample set scored twice), the
    means recomputed and tau-b taken again. It is the uncertainty due to the repetitions (which
    samples each method drew), given these rows and these references; with few repetitions the
    bootstrap distribution is coarse. ``p_value``: scipy's test of tau = 0 on the means."""
    if len(a) != len(b) or len(a) < 2:
        raise ValueError(f"rank_agreement: need the same rows (at least 2) under both references, got {len(a)} and {len(b)}")
    xs = [np.asarray(v, dtype=np.float64) for v in a]
    ys = [np.asarray(v, dtype=np.float64) for v in b]
    for i, (x, y) in enumerate(zip(xs, ys)):
        if x.shape != y.shape or x.ndim != 1 or x.size < 1 or not (np.isfinite(x).all() and np.isfinite(y).all()):
            raise ValueError(f"rank_agreement: row {i} needs finite values of the same repetitions under both "
                             f"references, got {x.tolist()} and {y.tolist()}")
    mean_a = np.array([x.mean() for x in xs])
    mean_b = np.array([y.mean() for y in ys])
    tau = float(kendall_tau(torch.from_numpy(mean_a)[None], torch.from_numpy(mean_b)[None])[0])
    generator = np.random.default_rng(seed)
    boot_a, boot_b = np.empty((draws, len(xs))), np.empty((draws, len(xs)))
    for i, (x, y) in enumerate(zip(xs, ys)):
        picks = generator.integers(0, x.size, size=(draws, x.size))
        boot_a[:, i], boot_b[:, i] = x[picks].mean(1), y[picks].mean(1)
    taus = kendall_tau(torch.from_numpy(boot_a), torch.from_numpy(boot_b)).numpy()
    low, high = np.nanpercentile(taus, [50 * (1 - level), 50 * (1 + level)])
    upper = np.triu_indices(len(xs), 1)
    signs = np.sign(mean_a[:, None] - mean_a[None, :])[upper] * np.sign(mean_b[:, None] - mean_b[None, :])[upper]
    return RankAgreement(tau=tau, low=float(low), high=float(high), level=level,
                         p_value=float(stats.kendalltau(mean_a, mean_b).pvalue), rows=len(xs),
                         discordant=int((signs < 0).sum()), pairs=len(upper[0]))
