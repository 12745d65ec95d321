"""Kendall's rank correlation between the rows of two tensors, batched (paper section 5.2: how
much the sorting permutation of a layer changes between successive training steps).

``kendall_tau`` is tau-b, as ``scipy.stats.kendalltau`` computes it by default: ``(C - D) /
sqrt((n0 - T_a) (n0 - T_b))`` with ``C``/``D`` the concordant/discordant pairs, ``n0 = n (n - 1) /
2`` and ``T_a``/``T_b`` the pairs tied in each row. For two permutations (no ties) it is
``1 - 2 D / n0``: 1 when they are equal, -1 when one is the other reversed.
"""
from __future__ import annotations

import torch

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
