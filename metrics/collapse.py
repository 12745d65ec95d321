"""Pairwise mutual information between ensemble members (paper section 5.1, appendix D.2).

For two members with predictive distributions ``p_i(x)`` and ``p_j(x)`` the mutual information
of the pair (the equal-weight mixture's epistemic term) is

    MI_ij(x) = H((p_i + p_j) / 2) - (H(p_i) + H(p_j)) / 2,

the Jensen-Shannon divergence of the two predictives, in nats (0 <= MI <= log 2). The statistic
of a pair is its mean over the inputs, the same quantity as the tables' ID MI / OOD MI for an
ensemble of two.
"""
from __future__ import annotations

import math

import numpy as np
import torch
from scipy.special import entr

_CHUNK_ELEMENTS = 1 << 23  # float64 elements materialised at once (64 MiB)


def pairs_to_use(members: int, max_pairs: int, generator: np.random.Generator) -> np.ndarray:
    """Index pairs ``[P, 2]`` (``i < j``) among ``members``: all ``members (members - 1) / 2`` of
    them when that is at most ``max_pairs``, else ``max_pairs`` distinct pairs drawn uniformly
    without replacement (sorted, so the result does not depend on the draw order)."""
    if members < 2:
        raise ValueError(f"pairwise MI needs at least 2 members, got {members}")
    if max_pairs < 1:
        raise ValueError(f"max_pairs must be a positive integer, got {max_pairs}")
    first, second = np.triu_indices(members, k=1)
    total = first.size
    if total <= max_pairs:
        chosen = np.arange(total)
    else:
        chosen = np.sort(generator.choice(total, size=max_pairs, replace=False))
    return np.stack([first[chosen], second[chosen]], axis=1)


def pairwise_mutual_information(probs, pairs: np.ndarray) -> np.ndarray:
    """Mean over inputs of the pairwise MI (nats) of each pair ``(i, j)`` of ``pairs [P, 2]``,
    from per-member probabilities ``probs [K, N, C]`` (torch or numpy, any float dtype;
    computed in float64). Returns ``[P]``."""
    p = probs.detach().cpu().numpy() if isinstance(probs, torch.Tensor) else np.asarray(probs)
    if p.ndim != 3 or min(p.shape) < 1:
        raise ValueError(f"probs: expected per-member probabilities [K, N, C], got shape {p.shape}")
    pairs = np.asarray(pairs, dtype=np.int64)
    if pairs.ndim != 2 or pairs.shape[1] != 2 or (pairs.size and (pairs.min() < 0 or pairs.max() >= p.shape[0])):
        raise ValueError(f"pairs: expected index pairs [P, 2] into {p.shape[0]} members, got shape {pairs.shape}")
    _, n, c = p.shape
    own = entr(p.astype(np.float64)).sum(axis=2)  # [K, N]
    out = np.empty(len(pairs))
    step = max(1, _CHUNK_ELEMENTS // (n * c))
    for start in range(0, len(pairs), step):
        i, j = pairs[start : start + step, 0], pairs[start : start + step, 1]
        mixture = 0.5 * (p[i].astype(np.float64) + p[j].astype(np.float64))
        mi = entr(mixture).sum(axis=2) - 0.5 * (own[i] + own[j])
        out[start : start + step] = np.maximum(mi, 0.0).mean(axis=1)
    return out


MAX_PAIR_MI = math.log(2.0)
"""Upper bound of the pairwise MI (nats): two members that never share a class."""
