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

RHAT_STATIONARY = 1.05  # split R-hat below it: the chains' halves agree (Vehtari et al. 2021 recommend 1.01; 1.05 for the
# few draws per chain of the benchmark's rows, where 1.01 is within the estimator's own noise; even 1.05 is at
# 10 chains x 20 draws: stationary AR(1) chains at rho 0.3 gave 1.064 for one seed, tests/metrics/test_mcmc.py)
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


def chain_ess(draws: Any) -> dict[str, float]:
    """Effective sample size of independent chains ``draws [chains, draws, d]``, chains as chains
    (storage order plays no part: each chain's draws are read in their chain order). Returns

    - ``total``: median over the ``d`` scalars of the sum over chains of each chain's own bulk ESS
      (ArviZ's ``ess(method="bulk")`` on that chain alone; independent chains' ESS add up); NaN
      below 4 draws per chain (ArviZ's split chains need 2 draws each). Short chains overstate it:
      on AR(1) chains at rho 0.97 (true ESS 0.015 per draw) ArviZ gives 0.6 per draw at 10 draws
      per chain and 0.2 at 25, which ``of_mean`` does not;
    - ``chain_min``: the smallest over chains of the chain's median-over-scalars ESS (NaN likewise);
    - ``of_mean``: median over scalars of the ESS of the mean from the chain means (batch means
      with the chains as batches, valid because the chains are independent): ``chains x draws x
      s^2 / (draws x s_means^2)`` with ``s^2`` the variance within chains (pooled) plus that of the
      chain means, ``s_means^2`` the variance of the chain means over chains: ``chains x draws``
      for independent draws, ``chains`` when each chain's draws are equal. Needs no autocorrelation
      estimate, so it holds at 2 draws per chain; NaN below 2 chains. A scalar constant in every draw
      is left out (all-constant: NaN)."""
    array = _as_array(draws)
    if array.ndim != 3:
        raise ValueError(f"chain_ess: draws must be [chains, draws, d], got shape {tuple(array.shape)}")
    chains, n, _ = array.shape
    out = {"total": float("nan"), "chain_min": float("nan"), "of_mean": float("nan")}
    moving = array.reshape(chains * n, -1).std(0) > 0
    if chains >= 2 and n >= 1 and moving.any():
        x = array[:, :, moving]
        means = x.mean(1)  # [chains, d]
        between = means.var(0, ddof=1)
        within = x.var(1, ddof=1).mean(0) if n >= 2 else np.zeros_like(between)
        with np.errstate(divide="ignore", invalid="ignore"):
            of_mean = chains * (within * (n - 1) / n + between) / between
        out["of_mean"] = float(np.median(np.where(between > 0, of_mean, chains * n)))
    if n >= 4 and chains >= 1:
        per_chain = np.stack([effective_sample_size(array[c]) for c in range(chains)])  # [chains, d]
        out["total"] = float(np.median(per_chain.sum(0)))
        out["chain_min"] = float(np.median(per_chain, axis=1).min())
    return out


def as_chains(samples: Any, chain: Any, position: Any) -> np.ndarray:
    """Stored samples ``[n, d]`` as chains ``[chains, draws, d]``: sample ``i`` is draw
    ``position[i]`` of chain ``chain[i]`` (any storage order). Every chain must hold the same number
    of draws; a chain's draws are ordered by ``position``, chains by their index."""
    x, chain, position = _as_array(samples), np.asarray(chain), np.asarray(position)
    if x.ndim != 2 or chain.shape != (len(x),) or position.shape != (len(x),):
        raise ValueError(f"as_chains: samples [n, d] with chain [n] and position [n], got {x.shape}, {chain.shape}, "
                         f"{position.shape}")
    order = np.lexsort((position, chain))
    labels, counts = np.unique(chain, return_counts=True)
    if len(set(counts.tolist())) != 1:
        raise ValueError(f"as_chains: chains of unequal length {dict(zip(labels.tolist(), counts.tolist()))}")
    return x[order].reshape(len(labels), counts[0], x.shape[1])


def split_rhat(values: Any) -> float:
    """Stationarity of ``values [chains, draws]`` (one scalar per draw, e.g. the log-likelihood):
    ArviZ's rank-normalised split R-hat over every chain's two halves (one chain: between its
    halves). About 1 when the halves and the chains agree; above ``RHAT_STATIONARY``, some chain's
    first half differs from its second or from the other chains (still drifting). NaN below 4 draws."""
    array = _as_array(values)
    if array.ndim != 2:
        raise ValueError(f"split_rhat: values must be [chains, draws], got shape {tuple(array.shape)}")
    if array.shape[1] < 4:
        return float("nan")
    if array.shape[0] == 1:  # ArviZ needs 2 chains: the halves as two (each split again, as predictive_convergence)
        half = array.shape[1] // 2
        array = array[0, : 2 * half].reshape(2, half)
    return float(rhat(array[:, :, None])[0])


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
