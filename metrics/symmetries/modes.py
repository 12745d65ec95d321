"""How many modes the permutation symmetries make of one network (paper appendix D.1).

If the identifiable (symmetry-free) posterior were a Dirac at a network, the posterior of the
network with its symmetries would have one mode per distinct weight vector in the orbit of
that network under the allowed permutations: ``|allowed permutations| / |those leaving it
unchanged|``. Per unit group of ``n`` units that is ``n! / prod_k m_k!``, where ``m_k`` are the
multiplicities of (nearly) identical units (the same incoming weights, bias and outgoing
weights, compared at ``sorting.TIE_RTOL`` of the largest entry).

Grouped convolutions (appendix D.4.2). A group whose ``n`` units feed a convolution with ``G``
groups is cut into ``G`` blocks of ``b = n / G`` units. Units may be permuted within their
block (``(b!)^G``), and the ``G`` blocks may be moved as wholes, together with the blocks of the
grouped convolution's output channels (the follower group), which is also a symmetry (the
spec's ``blocks``/``follows``; ``G!``). With ``block_moves=True`` the leader counts ``G! (b!)^G``
(every permutation the symmetry engine allows); with ``block_moves=False`` it counts the
paper's intra-group ``(b!)^G`` only. A follower counts ``(b!)^G`` either way (its block moves are
its leader's). Identical units are only counted within a block, and identical whole blocks
are not detected, so the count is exact for networks whose units are distinct and an upper
bound otherwise. Counts are returned as log10 (ResNet-18: thousands of digits).
"""
from __future__ import annotations

import math
from typing import Mapping

import numpy as np
import torch

from metrics.symmetries.engine import unit_slices
from metrics.symmetries.sorting import TIE_RTOL, _quantized
from metrics.symmetries.spec import SymmetrySpec, UnitGroup, check_sample_set


def log10_factorial(n: int) -> float:
    """``log10(n!)``."""
    return math.lgamma(n + 1) / math.log(10)


def unit_vectors(sample_set: Mapping[str, torch.Tensor], group: UnitGroup) -> torch.Tensor:
    """Every parameter of each unit of ``group`` (incoming weights and bias, outgoing weights,
    BatchNorm entries): ``[S, n, d]`` float64."""
    parts = []
    for ax in group.axes():
        t = sample_set[ax.key].to(torch.float64)
        if ax.groups:  # row o of a grouped conv reads unit (o // (rows / G)) * b + j at position j
            s, rows, b = t.shape[:3]
            blocks = t.reshape(s, ax.groups, rows // ax.groups, b, -1).permute(0, 1, 3, 2, 4)
            parts.append(blocks.reshape(s, group.size, -1))
        else:
            parts.append(unit_slices(t, ax, group.size))
    return torch.cat(parts, dim=2)


def group_log10_modes(sample_set: Mapping[str, torch.Tensor], group: UnitGroup, block_moves: bool = True) -> torch.Tensor:
    """``[S]``: log10 of the number of distinct weight vectors the permutations of ``group``
    make of each sample (see the module doc for blocks and identical units)."""
    b, blocks = group.block_size, group.blocks
    allowed = blocks * log10_factorial(b)
    if blocks > 1 and group.follows is None and block_moves:
        allowed += log10_factorial(blocks)
    vectors = unit_vectors(sample_set, group)
    rtol = TIE_RTOL.get(next(iter(sample_set.values())).dtype, 1e-9)
    keys = _quantized(vectors, rtol).numpy()
    out = np.full(keys.shape[0], allowed)
    for s in range(keys.shape[0]):
        for g in range(blocks):
            _, counts = np.unique(keys[s, g * b : (g + 1) * b], axis=0, return_counts=True)
            out[s] -= sum(log10_factorial(int(m)) for m in counts if m > 1)
    return torch.from_numpy(out)


def log10_permutation_modes(
    sample_set: Mapping[str, torch.Tensor], spec: SymmetrySpec, block_moves: bool = True
) -> dict[str, torch.Tensor]:
    """Per unit group, and in ``"total"`` their sum: log10 of the number of modes the allowed
    permutations make of each sample ``[S]`` (appendix D.1; module doc)."""
    check_sample_set(spec, sample_set)
    out = {g.name: group_log10_modes(sample_set, g, block_moves) for g in spec.groups}
    out["total"] = sum(out.values()) if out else torch.zeros(next(iter(sample_set.values())).shape[0], dtype=torch.float64,
                                                              device=next(iter(sample_set.values())).device)
    return out
