"""Scaling normalisation (Neyshabur et al. 2015; paper appendix C.2): every hidden unit's
incoming weights get unit L2 norm, the factor is pushed into the next layer.

For a unit behind a BatchNorm the incoming weights are the BatchNorm's gamma (norm |gamma|,
or the L2 norm of all gammas producing a residual-stream channel) and the conv feeding the
BatchNorm is normalised separately, its factor absorbed by the running statistics.
Dead units (zero incoming weights) keep scale 1, and so does a conv channel whose running
variance is too small to absorb the factor exactly (``s^2 (var + eps) < eps``): never NaN.
"""
from __future__ import annotations

from typing import Mapping

import torch

from metrics.symmetries.engine import SampleSet, rescale, unit_slices
from metrics.symmetries.spec import Scaling, SymmetrySpec, UnitGroup, check_sample_set, topological


def scaling_order(spec: SymmetrySpec) -> list[tuple[UnitGroup, Scaling]]:
    """Scalings in an order where each comes after every scaling whose outgoing axes touch
    the weights it normalises (forward order through the network)."""
    pairs = {sc.name: (g, sc) for g, sc in spec.scalings()}
    edges = [
        (a.name, b.name)
        for _, a in spec.scalings() for _, b in spec.scalings()
        if {ax.key for ax in a.outgoing} & set(b.norm_keys)
    ]
    return [pairs[n] for n in topological(pairs, edges, f"{spec.architecture} scalings")]


def unit_norms(sample_set: Mapping[str, torch.Tensor], group: UnitGroup, scaling: Scaling) -> torch.Tensor:
    """L2 norm ``[S, n]`` of each unit's incoming weights (the scaling's ``norm_keys``)."""
    incoming = {ax.key: ax for ax in scaling.incoming}
    norms = [torch.linalg.vector_norm(unit_slices(sample_set[k], incoming[k], group.size), dim=2) for k in scaling.norm_keys]
    return torch.linalg.vector_norm(torch.stack(norms), dim=0)


def normalize_scales(sample_set: Mapping[str, torch.Tensor], spec: SymmetrySpec) -> tuple[SampleSet, dict[str, torch.Tensor]]:
    """Give every unit's incoming weights unit L2 norm, in forward order, without changing the
    function. Returns the new sample set and the factor ``s [S, n]`` applied by each scaling
    (incoming weights were multiplied by ``s``)."""
    check_sample_set(spec, sample_set)
    return unit_norm_scaling(sample_set, spec)


def unit_norm_scaling(sample_set: Mapping[str, torch.Tensor], spec: SymmetrySpec) -> tuple[SampleSet, dict[str, torch.Tensor]]:
    """``normalize_scales`` without validating the sample set (for callers that already did)."""
    out = dict(sample_set)
    applied: dict[str, torch.Tensor] = {}
    for group, scaling in scaling_order(spec):
        norms = unit_norms(out, group, scaling)
        factor = torch.where(norms > 0, 1.0 / torch.where(norms > 0, norms, 1.0), 1.0)
        if scaling.stats is not None:
            eps = scaling.stats.eps
            feasible = factor**2 * (out[scaling.stats.var] + eps) >= eps
            factor = torch.where(feasible, factor, 1.0)
        out = rescale(out, spec, {scaling.name: factor})
        applied[scaling.name] = factor
    return out, applied
