"""Permutation removal by sorting the units of every group (paper appendix C.2).

Keys: ``first`` (the paper: the unit's first incoming weight, the top-left kernel entry of
the first input channel for convs), ``max``, ``mean``, ``lexicographic`` (NodeSort, seed 004:
incoming weight vectors in lexicographic order) and ``bias`` (bias ordering, seed 000).
Groups are sorted in forward order so that "first input" is itself already canonical. In a
grouped structure the units are sorted within each block and the blocks by their smallest
key; followers take their leader's block order. Keys equal up to rounding (relative
``TIE_RTOL`` of the sample's largest key: a unit with a single input has normalised weight
+-1 up to an ulp) are ties, broken lexicographically by the unit's whole incoming weights,
then its bias (compared at the same precision); units equal in all of these keep their
order (stable sort), so only such exactly redundant units are left ambiguous.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np
import torch

from metrics.symmetries.engine import SampleSet, compose, complete_followers, identity_permutations, permute, unit_slices
from metrics.symmetries.spec import SymmetrySpec, UnitGroup, check_sample_set, topological

SORT_KEYS = ("first", "max", "mean", "lexicographic", "bias")
TIE_RTOL = {torch.float64: 1e-9, torch.float32: 1e-6, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def sort_order(spec: SymmetrySpec) -> list[UnitGroup]:
    """Groups in an order where leaders and every group owning an axis of a group's sort-key
    tensor (its inputs) come first."""
    edges = [(g.follows, g.name) for g in spec.groups if g.follows]
    for g in spec.groups:
        edges += [(h.name, g.name) for h in spec.groups if h is not g and any(ax.key == g.sort_key for ax in h.axes())]
    names = topological([g.name for g in spec.groups], edges, f"{spec.architecture} sorting")
    return [spec.group(n) for n in names]


def _quantized(values: torch.Tensor, rtol: float) -> torch.Tensor:
    """``values`` (float64) rounded to a grid of ``rtol`` times their largest |value| along every
    axis but the first (per sample)."""
    dims = tuple(range(1, values.dim()))
    step = values.abs().amax(dim=dims, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny) * rtol
    return torch.round(values / step)


def _primary_key(rows: torch.Tensor, bias: torch.Tensor | None, group: UnitGroup, key: str) -> torch.Tensor:
    """Per-unit key ``[S, n]`` on the device of ``rows``."""
    if key == "bias":
        if bias is None:
            raise ValueError(f"sort key 'bias': group {group.name!r} has no bias; use one of first, max, mean, lexicographic")
        return bias
    if key == "first":
        return rows[:, :, 0]
    if key == "max":
        return rows.amax(dim=2)
    if key == "mean":
        return rows.mean(dim=2)
    if key == "lexicographic":
        return torch.zeros(rows.shape[:2], dtype=rows.dtype, device=rows.device)
    raise ValueError(f"unknown sort key {key!r}; expected one of {', '.join(SORT_KEYS)}")


def unit_keys(sample_set: Mapping[str, torch.Tensor], group: UnitGroup, key: str = "first") -> torch.Tensor:
    """Sorting key ``[S, n]`` (float64) of each unit of ``group``, rounded to ``TIE_RTOL``. In
    samples with ties the key is replaced by the unit's rank with every run of tied units put in
    lexicographic order of (incoming weights, bias); ``lexicographic`` is that rank alone."""
    incoming = next(ax for sc in group.scalings for ax in sc.incoming if ax.key == group.sort_key)
    weights = sample_set[group.sort_key]
    rtol = TIE_RTOL.get(weights.dtype, 1e-9)
    rows = unit_slices(weights, incoming, group.size)
    bias = sample_set[group.bias] if group.bias is not None else None
    primary = _quantized(_primary_key(rows, bias, group, key).to(torch.float64), rtol)
    order = primary.argsort(dim=1, stable=True)
    ordered = torch.gather(primary, 1, order)
    tied = ordered[:, 1:] == ordered[:, :-1]
    if not bool(tied.any()):
        return primary
    ranks = primary.clone()
    for s in tied.any(dim=1).nonzero().flatten().tolist():
        final = order[s].clone()
        starts = torch.cat([torch.ones(1, dtype=torch.bool, device=tied.device), ~tied[s]])  # first of every run of equal keys
        bounds = [*starts.nonzero().flatten().tolist(), group.size]
        for a, b in zip(bounds[:-1], bounds[1:]):
            if b - a < 2:
                continue
            units = order[s, a:b]
            columns = rows[s, units].to(torch.float64)
            if bias is not None:
                columns = torch.cat([columns, bias[s, units, None].to(torch.float64)], dim=1)
            within = np.lexsort(_quantized(columns[None], rtol)[0].cpu().numpy().T[::-1])
            final[a:b] = units[torch.from_numpy(within).to(units.device)]
        ranks[s, final] = torch.arange(group.size, dtype=torch.float64, device=ranks.device)
    return ranks


def sorting_permutation(keys: torch.Tensor, group: UnitGroup) -> torch.Tensor:
    """The allowed permutation ``[S, n]`` that sorts ``keys [S, n]`` ascending within each block
    and (for a leader) orders the blocks by their smallest key; a follower keeps its blocks."""
    s, b = keys.shape[0], group.block_size
    blocked = keys.reshape(s, group.blocks, b)
    within = blocked.argsort(dim=2, stable=True)
    if group.follows is None:
        sigma = torch.gather(blocked, 2, within[:, :, :1]).squeeze(2).argsort(dim=1, stable=True)
    else:
        sigma = torch.arange(group.blocks, device=keys.device).expand(s, -1)
    moved = torch.gather(within, 1, sigma[:, :, None].expand(-1, -1, b))
    return (sigma[:, :, None] * b + moved).reshape(s, group.size)


def sort_units(
    sample_set: Mapping[str, torch.Tensor], spec: SymmetrySpec, key: str = "first"
) -> tuple[SampleSet, dict[str, torch.Tensor]]:
    """Sort the units of every group by ``key`` without changing the function. Returns the new
    sample set and each group's total permutation ``[S, n]`` (``new[i] = old[perm[i]]``)."""
    check_sample_set(spec, sample_set)
    return sort_unchecked(sample_set, spec, key)


def sort_unchecked(
    sample_set: Mapping[str, torch.Tensor], spec: SymmetrySpec, key: str = "first"
) -> tuple[SampleSet, dict[str, torch.Tensor]]:
    """``sort_units`` without validating the sample set (for callers that already did)."""
    if key not in SORT_KEYS:
        raise ValueError(f"unknown sort key {key!r}; expected one of {', '.join(SORT_KEYS)}")
    first = next(iter(sample_set.values()))
    out = dict(sample_set)
    totals = identity_permutations(spec, first.shape[0], first.device)
    for group in sort_order(spec):
        step = complete_followers(spec, {group.name: sorting_permutation(unit_keys(out, group, key), group)})
        out = permute(out, spec, step)
        for name, perm in step.items():
            totals[name] = compose(totals[name], perm)
    return out, totals
