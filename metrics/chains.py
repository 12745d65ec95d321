"""Effective sample size of one sequence of draws (a Markov chain's kept states): the name
``effective_sample_size`` kept for its callers, computed by ArviZ through ``metrics.mcmc.ess``
(rank-normalised split-chain bulk ESS, Vehtari et al. 2021)."""
from __future__ import annotations

import numpy as np

from metrics.mcmc import ess


def effective_sample_size(draws: np.ndarray) -> np.ndarray:
    """Bulk ESS ``[d]`` of ``draws [n, d]`` (``n`` consecutive draws of ``d`` scalars of one chain;
    ``[n]`` is one scalar), ArviZ's ``ess(method="bulk")`` on each scalar. A scalar constant in
    every draw gets ``n`` (nothing to estimate). Raises ``ValueError`` with fewer than 4 draws."""
    x = np.asarray(draws, dtype=np.float64)
    if x.ndim == 1:
        x = x[:, None]
    if x.ndim != 2:
        raise ValueError(f"effective_sample_size: draws must be [n, d], got shape {tuple(x.shape)}")
    n = x.shape[0]
    if n < 4:
        raise ValueError(f"effective_sample_size: need at least 4 draws, got {n}")
    out = np.full(x.shape[1], float(n))
    varying = np.nonzero(x.std(0) > 0)[0]
    if varying.size:
        out[varying] = ess(x[None, :, varying])
    return out
