"""Convergence diagnostics of Markov chains, computed by ArviZ: rank-normalised split R-hat and
bulk effective sample size (Vehtari, Gelman, Simpson, Carpenter & Buerkner 2021), E-BFMI
(Betancourt 2016), and the predictive R-hat of a Bayesian network's chains (Izmailov et al. 2021).

Draws are laid out ``[chains, draws, *shape]`` (ArviZ's order); every function returns one value
per scalar of ``shape``, computed by ArviZ on that scalar's ``[chains, draws]`` array, so the
numbers are ArviZ's own (``effective_sample_size`` takes one chain as ``[draws, d]``). Inputs may be
NumPy arrays or torch tensors.
"""
from __future__ import annotations

import functools
import warnings
from typing import Any, Callable

import numpy as np

RHAT_CONVERGED = 1.1  # Izmailov et al. 2021 (and Gelman & Rubin's rule of thumb): R-hat below it counts as converged


@functools.cache
def _arviz() -> Any:
    """ArviZ, imported on first use (it takes seconds) without its refactoring notice."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        import arviz

    return arviz


def _as_array(draws: Any) -> np.ndarray:
    if hasattr(draws, "detach"):  # a torch tensor
        draws = draws.detach().cpu().double().numpy()
    return np.asarray(draws, dtype=np.float64)


def _per_scalar(function: Callable[[np.ndarray], float], draws: Any, name: str) -> np.ndarray:
    """``function`` on each scalar's ``[chains, draws]`` array of ``draws [chains, draws, *shape]``."""
    array = _as_array(draws)
    if array.ndim < 2:
        raise ValueError(f"{name}: draws must be [chains, draws, ...], got shape {tuple(array.shape)}")
    chains, n, *shape = array.shape
    flat = array.reshape(chains, n, -1)
    out = np.array([function(flat[:, :, j]) for j in range(flat.shape[2])], dtype=np.float64)
    return out.reshape(shape)


def rhat(draws: Any) -> np.ndarray:
    """Rank-normalised split R-hat ``[*shape]`` of ``draws [chains, draws, *shape]`` (ArviZ's
    ``rhat(method="rank")``: the larger of the bulk and the folded-tail R-hat of the split chains).
    NaN where ArviZ gives none: fewer than 2 chains or 4 draws, or a scalar constant in every draw."""
    az = _arviz()
    return _per_scalar(lambda x: float(az.rhat(x, method="rank")), draws, "rhat")


def ess(draws: Any) -> np.ndarray:
    """Bulk effective sample size ``[*shape]`` of ``draws [chains, draws, *shape]`` over all the
    chains together (ArviZ's ``ess(method="bulk")``; rank-normalised split chains). One chain's
    ESS: pass ``draws[c : c + 1]``. NaN with fewer than 4 draws; a constant scalar gives chains x draws."""
    az = _arviz()
    return _per_scalar(lambda x: float(az.ess(x, method="bulk")), draws, "ess")


def effective_sample_size(draws: Any) -> np.ndarray:
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


def ess_per_chain(draws: Any) -> np.ndarray:
    """Bulk ESS ``[chains, *shape]`` of each chain of ``draws [chains, draws, *shape]`` on its own."""
    array = _as_array(draws)
    return np.stack([ess(array[c : c + 1]) for c in range(array.shape[0])])


def bfmi(energy: Any) -> np.ndarray:
    """E-BFMI ``[chains]`` of the Hamiltonian ``energy [chains, iterations]`` of HMC chains (ArviZ's
    ``bfmi``): below about 0.3 the momentum resampling explores the energy levels poorly."""
    array = _as_array(energy)
    if array.ndim != 2:
        raise ValueError(f"bfmi: energy must be [chains, iterations], got shape {tuple(array.shape)}")
    return np.asarray(_arviz().bfmi(array), dtype=np.float64).reshape(array.shape[0])


def predictive_convergence(probs: Any, labels: Any) -> dict[str, Any]:
    """Convergence of the predictive of a network's chains, as Izmailov et al. (2021) judge HMC.

    ``probs [chains, draws, N, classes]``: softmax outputs of each kept draw on ``N`` test images;
    ``labels [N]``. Returns

    - ``rhat_loglik``: R-hat of the test log-likelihood (mean over the images of log p(y | x, w));
    - ``rhat_softmax_median``, ``rhat_softmax_max``, ``softmax_converged``: median, maximum, and the
      fraction below ``RHAT_CONVERGED``, of the R-hats of the ``N x classes`` softmax outputs (NaN
      R-hats, outputs constant in every draw, are left out);
    - ``ess_loglik``: bulk ESS ``[chains]`` of each chain's test log-likelihood.

    One chain (``chains == 1``) is judged by its two halves taken as two chains (ArviZ then splits
    each again), which only detects drift within the chain.
    """
    array = _as_array(probs)
    if array.ndim != 4:
        raise ValueError(f"predictive_convergence: probs must be [chains, draws, N, classes], got {tuple(array.shape)}")
    labels = _as_array(labels).astype(np.int64)
    chains, n = array.shape[:2]
    picked = np.take_along_axis(array, labels[None, None, :, None], axis=3)[..., 0]
    loglik = np.log(np.clip(picked, 1e-30, None)).mean(-1)  # [chains, draws]
    per_chain = ess_per_chain(loglik)
    if chains == 1:
        half = n // 2
        array, loglik = array[0, : 2 * half].reshape(2, half, *array.shape[2:]), loglik[0, : 2 * half].reshape(2, half)
    softmax = rhat(array)
    finite = softmax[np.isfinite(softmax)]
    return {
        "rhat_loglik": float(rhat(loglik)),
        "rhat_softmax_median": float(np.median(finite)) if finite.size else float("nan"),
        "rhat_softmax_max": float(finite.max()) if finite.size else float("nan"),
        "softmax_converged": float((finite < RHAT_CONVERGED).mean()) if finite.size else float("nan"),
        "ess_loglik": per_chain,
    }
