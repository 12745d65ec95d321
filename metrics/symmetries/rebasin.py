"""Weight matching to a reference network (git re-basin, Ainsworth et al. 2023; seed 002) and
the number of transpositions (NoT) of a permutation.

Weight matching maximises ``sum_k <reference[k], permuted[k]>`` over the parameters (buffers
left out) by coordinate ascent: one group at a time, a linear assignment
(``scipy.optimize.linear_sum_assignment``) of its units given all other groups, repeated
until no group changes. For a group with blocks (grouped convs) the blocks are first
assigned as wholes, moving the followers' blocks with them, then units within blocks.
Every step is an exact maximisation over a subgroup and is kept only if it strictly
improves, so the objective never decreases and the loop ends.
"""
from __future__ import annotations

import random
from typing import Mapping

import numpy as np
import scipy.sparse
import scipy.sparse.csgraph
import torch
from scipy.optimize import linear_sum_assignment

from metrics.symmetries.engine import (
    SampleSet, complete_followers, compose, identity_permutations, lift_block_permutation, permute, unit_slices,
)
from metrics.symmetries.spec import Axis, SymmetrySpec, UnitGroup, check_sample_set


def number_of_transpositions(perm: torch.Tensor) -> torch.Tensor:
    """Minimal number of transpositions composing each permutation ``[..., n]``: ``n`` minus its
    number of cycles. Returns a LongTensor ``[...]``."""
    n = perm.shape[-1]
    flat = perm.reshape(-1, n).cpu().numpy()
    if not np.array_equal(np.sort(flat, axis=1), np.broadcast_to(np.arange(n), flat.shape)):
        raise ValueError(f"number_of_transpositions: expected permutations of 0..{n - 1} along the last axis")
    m = flat.shape[0]
    offsets = (np.arange(m) * n)[:, None]
    source = (offsets + np.arange(n)).ravel()
    graph = scipy.sparse.csr_matrix((np.ones(m * n), (source, (flat + offsets).ravel())), shape=(m * n, m * n))
    count, labels = scipy.sparse.csgraph.connected_components(graph, directed=True, connection="weak")
    component_row = np.empty(count, dtype=np.int64)
    component_row[labels] = np.repeat(np.arange(m), n)
    cycles = np.bincount(component_row, minlength=m)
    return torch.from_numpy(n - cycles).reshape(perm.shape[:-1])


def _parameter_axes(spec: SymmetrySpec, group: UnitGroup) -> list[Axis]:
    return [ax for ax in group.axes() if ax.key not in spec.buffers]


def _within_block_cost(spec, group, reference, current) -> torch.Tensor:
    """``[S, G, b, b]``: entry (g, i, j) is the objective's part linear in putting current unit
    ``g*b + j`` at place ``g*b + i``."""
    s, blocks, b = current[group.sort_key].shape[0], group.blocks, group.block_size
    cost = torch.zeros(s, blocks, b, b, dtype=torch.float64, device=current[group.sort_key].device)
    for ax in _parameter_axes(spec, group):
        ref, cur = reference[ax.key].to(torch.float64), current[ax.key].to(torch.float64)
        if ax.groups:
            rows = cur.shape[1]
            ref_blocks = ref.reshape(1, ax.groups, rows // ax.groups, b, -1)
            cur_blocks = cur.reshape(s, ax.groups, rows // ax.groups, b, -1)
            cost += torch.einsum("zgaiy,sgajy->sgij", ref_blocks, cur_blocks)
        else:
            full = unit_slices(ref, ax, group.size) @ unit_slices(cur, ax, group.size).transpose(1, 2)
            cost += torch.diagonal(full.reshape(s, blocks, b, blocks, b), dim1=1, dim2=3).permute(0, 3, 1, 2)
    return cost


def _block_cost(spec, leader, reference, current) -> torch.Tensor:
    """``[S, G, G]``: entry (g, h) is the objective's part from moving old block ``h`` of the leader
    and of its followers (whole, inner order kept) to block ``g``."""
    s = current[leader.sort_key].shape[0]
    cost = torch.zeros(s, leader.blocks, leader.blocks, dtype=torch.float64, device=current[leader.sort_key].device)
    family = [leader, *spec.followers(leader.name)]
    seen: set[str] = set()
    for group in family:
        for ax in _parameter_axes(spec, group):
            if ax.groups:  # tied to the rows of its conv, which belong to a follower
                continue
            if ax.key in seen:
                raise ValueError(f"weight matching: tensor {ax.key!r} has two axes in the block family of {leader.name!r}")
            seen.add(ax.key)
            ref = unit_slices(reference[ax.key].to(torch.float64), ax, group.size).reshape(1, leader.blocks, -1)
            cur = unit_slices(current[ax.key].to(torch.float64), ax, group.size).reshape(s, leader.blocks, -1)
            cost += ref @ cur.transpose(1, 2)
    return cost


def _assign(cost: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Best assignment of each square matrix ``[..., k, k]`` (new place -> old index) and whether
    it strictly beats keeping the identity (on the device of ``cost``; solved on the CPU)."""
    flat = cost.reshape(-1, cost.shape[-1], cost.shape[-1]).cpu().numpy()
    k = flat.shape[-1]
    result = np.tile(np.arange(k), (flat.shape[0], 1))
    improved = np.zeros(flat.shape[0], dtype=bool)
    for i, matrix in enumerate(flat):
        _, cols = linear_sum_assignment(matrix, maximize=True)
        gain = matrix[np.arange(k), cols].sum() - np.trace(matrix)
        if gain > 1e-12 * max(1.0, np.abs(matrix).sum()):
            result[i], improved[i] = cols, True
    return (torch.from_numpy(result).reshape(cost.shape[:-1]).to(cost.device),
            torch.from_numpy(improved).reshape(cost.shape[:-2]).to(cost.device))


def weight_matching(
    sample_set: Mapping[str, torch.Tensor],
    reference: Mapping[str, torch.Tensor],
    spec: SymmetrySpec,
    max_iter: int = 100,
    seed: int = 0,
) -> tuple[SampleSet, dict]:
    """Permute every sample of ``sample_set`` (``[S, ...]``) to best match ``reference`` (one
    state dict, unbatched or ``[1, ...]``) without changing its function.

    Returns the matched sample set and ``{"perms": {group: [S, n]}, "transpositions": {group:
    [S]}, "total_transpositions": [S], "objective_before": [S], "objective_after": [S],
    "sweeps": int}`` (``new[i] = old[perm[i]]``).
    """
    samples = check_sample_set(spec, sample_set)
    batched_ref = {k: v if v.dim() == len(spec.shapes[k]) + 1 else v.unsqueeze(0) for k, v in reference.items()}
    if check_sample_set(spec, batched_ref, source="reference") != 1:
        raise ValueError("weight matching: the reference must be one network (unbatched or [1, ...])")
    current = dict(sample_set)
    totals = identity_permutations(spec, samples, next(iter(sample_set.values())).device)
    order = list(spec.groups)
    rng = random.Random(seed)
    before = _matching_objective(spec, batched_ref, current)
    for sweep in range(1, max_iter + 1):
        rng.shuffle(order)
        changed = False
        for group in order:
            if group.blocks > 1 and group.follows is None:
                sigma, improved = _assign(_block_cost(spec, group, batched_ref, current))
                if bool(improved.any()):
                    step = {group.name: lift_block_permutation(sigma, group.size)}
                    current, changed = _apply(spec, current, step, totals), True
            within, improved = _assign(_within_block_cost(spec, group, batched_ref, current))
            if bool(improved.any()):
                blocks = torch.arange(group.blocks, device=within.device)[None, :, None] * group.block_size
                current = _apply(spec, current, {group.name: (within + blocks).reshape(samples, group.size)}, totals)
                changed = True
        if not changed:
            break
    nots = {name: number_of_transpositions(p) for name, p in totals.items()}
    return current, {
        "perms": totals,
        "transpositions": nots,
        "total_transpositions": sum(nots.values()),
        "objective_before": before,
        "objective_after": _matching_objective(spec, batched_ref, current),
        "sweeps": sweep,
    }


def _apply(spec, current, step, totals) -> SampleSet:
    """Permute ``current`` by ``step`` (followers completed) and record it in ``totals``."""
    step = complete_followers(spec, step)
    for name, perm in step.items():
        totals[name] = compose(totals[name], perm)
    return permute(current, spec, step)


def _matching_objective(spec: SymmetrySpec, reference, current) -> torch.Tensor:
    """``sum_k <reference[k], current[k]>`` over the parameters ``[S]``."""
    keys = [k for k in spec.shapes if k not in spec.buffers and current[k].is_floating_point()]
    return sum((reference[k].to(torch.float64) * current[k].to(torch.float64)).flatten(1).sum(dim=1) for k in keys)
