"""Effective sample size of a sequence of draws (a Markov chain's kept states)."""
from __future__ import annotations

import numpy as np


def effective_sample_size(draws: np.ndarray) -> np.ndarray:
    """ESS ``[d]`` of ``draws [n, d]`` (n consecutive draws of d scalars), by Geyer's initial
    monotone sequence estimator: ``n / (1 + 2 sum_k rho_k)`` with the autocorrelations summed in
    consecutive pairs while the pair sums stay positive, made non-increasing. Constant series
    get ESS n (nothing to estimate); the result is capped at ``n * log10(n)`` as in ArviZ."""
    x = np.asarray(draws, dtype=np.float64)
    if x.ndim == 1:
        x = x[:, None]
    n = x.shape[0]
    if n < 4:
        raise ValueError(f"effective_sample_size: need at least 4 draws, got {n}")
    centred = x - x.mean(0)
    variance = (centred**2).mean(0)
    size = 2 ** int(np.ceil(np.log2(2 * n)))
    spectrum = np.fft.rfft(centred, n=size, axis=0)
    autocovariance = np.fft.irfft(spectrum * np.conj(spectrum), n=size, axis=0)[:n] / n
    out = np.full(x.shape[1], float(n))
    for j in np.nonzero(variance > 0)[0]:
        rho = autocovariance[:, j] / autocovariance[0, j]
        pairs = rho[: n - n % 2].reshape(-1, 2).sum(1)  # Gamma_k = rho_2k + rho_2k+1, Gamma_0 includes rho_0 = 1
        positive = np.nonzero(pairs <= 0)[0]
        pairs = pairs[: positive[0]] if len(positive) else pairs
        pairs = np.minimum.accumulate(pairs)
        tau = -1.0 + 2.0 * pairs.sum()
        out[j] = min(n / max(tau, 1e-12), n * np.log10(n))
    return out
