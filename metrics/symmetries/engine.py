"""The one engine: apply permutations and positive scalings described by a ``SymmetrySpec``
to whole sample sets ``[S, ...]`` at once.

Conventions: a permutation of a group is a ``LongTensor [S, n]`` used as a gather index,
``new[i] = old[perm[i]]``; a scaling is a positive ``Tensor [S, n]``. Functions never modify
their inputs and return new dicts (untouched tensors are shared, not copied).
"""
from __future__ import annotations

import math
from typing import Mapping

import torch

from metrics.symmetries.spec import Axis, SymmetrySpec

SampleSet = dict[str, torch.Tensor]
Perms = dict[str, torch.Tensor]


def unit_slices(tensor: torch.Tensor, axis: Axis, units: int) -> torch.Tensor:
    """The per-unit slices of a batched ``tensor [S, ...]`` along a non-grouped ``axis``:
    ``[S, units, d]`` with ``d`` = every other entry (``inner`` included), C order."""
    moved = tensor.movedim(axis.axis + 1, 1)
    return moved.reshape(moved.shape[0], units, -1)


def _around(tensor: torch.Tensor, axis: Axis, units: int) -> torch.Tensor:
    """View of a batched tensor as ``[S, A, units, B]``: A = entries before the axis, B = after
    (``inner`` included). A view, not a copy, for contiguous tensors."""
    shape = tensor.shape
    before = math.prod(shape[1 : axis.axis + 1])
    return tensor.reshape(shape[0], before, units, -1)


def _gather_units(tensor: torch.Tensor, axis: Axis, perm: torch.Tensor) -> torch.Tensor:
    perm = perm.to(tensor.device)
    view = _around(tensor, axis, perm.shape[1])
    out = torch.empty_like(view)
    for s in range(view.shape[0]):  # per-sample index_select: 2-3x faster than a batched gather on CPU
        torch.index_select(view[s], 1, perm[s], out=out[s])
    return out.reshape(tensor.shape)


def _gather_grouped(tensor: torch.Tensor, axis: Axis, perm: torch.Tensor) -> torch.Tensor:
    # Row o of the grouped conv (block g = o // rows_per_block) reads unit g*b + j at position j;
    # block-structured perm[g*b + j] = sigma[g]*b + tau_g[j], so the position gather is tau_g = perm % b.
    s, rows, b = tensor.shape[:3]
    tau = (perm.to(tensor.device) % b).reshape(s, axis.groups, b).repeat_interleave(rows // axis.groups, dim=1)
    flat = tensor.reshape(s, rows, b, -1)
    return torch.gather(flat, 2, tau[..., None].expand(-1, -1, -1, flat.shape[3])).reshape(tensor.shape)


def _scale_units(tensor: torch.Tensor, axis: Axis, factor: torch.Tensor) -> torch.Tensor:
    factor = factor.to(tensor.device, tensor.dtype)
    if axis.groups:
        s, rows, b = tensor.shape[:3]
        per_entry = factor.reshape(s, axis.groups, b).repeat_interleave(rows // axis.groups, dim=1)
        return (tensor.reshape(s, rows, b, -1) * per_entry[..., None]).reshape(tensor.shape)
    return (_around(tensor, axis, factor.shape[1]) * factor[:, None, :, None]).reshape(tensor.shape)


def block_permutation(perm: torch.Tensor, blocks: int) -> torch.Tensor:
    """The block part ``sigma [S, blocks]`` of a block-structured ``perm [S, n]``:
    new block ``g`` holds old block ``sigma[g]``."""
    s, n = perm.shape
    return perm.reshape(s, blocks, n // blocks)[:, :, 0] // (n // blocks)


def lift_block_permutation(sigma: torch.Tensor, size: int) -> torch.Tensor:
    """The permutation ``[S, size]`` that moves whole blocks by ``sigma [S, G]`` and keeps
    the order within blocks."""
    s, blocks = sigma.shape
    b = size // blocks
    return (sigma[:, :, None] * b + torch.arange(b, device=sigma.device)).reshape(s, size)


def compose(first: torch.Tensor, then: torch.Tensor) -> torch.Tensor:
    """The single gather index equal to applying ``first`` and then ``then`` (both ``[S, n]``)."""
    return torch.gather(first, 1, then)


def identity_permutations(spec: SymmetrySpec, samples: int, device: torch.device | str | None = None) -> Perms:
    """The identity permutation ``[S, n]`` of every group (on ``device``)."""
    return {g.name: torch.arange(g.size, device=device).expand(samples, g.size).clone() for g in spec.groups}


def complete_followers(spec: SymmetrySpec, perms: Mapping[str, torch.Tensor]) -> Perms:
    """Add, for every follower group missing from ``perms`` whose leader is present, the lift of
    the leader's block permutation (follower blocks move with the leader's, inner order kept)."""
    out = dict(perms)
    for g in spec.groups:
        if g.follows in perms and g.name not in perms:
            leader = spec.group(g.follows)
            out[g.name] = lift_block_permutation(block_permutation(perms[leader.name], leader.blocks), g.size)
    return out


def check_permutations(spec: SymmetrySpec, perms: Mapping[str, torch.Tensor], samples: int) -> None:
    """Raise ``ValueError`` unless every ``perms[name]`` is a ``[S, n]`` permutation allowed by the
    spec: block-structured for groups with blocks, and moving a follower's blocks like its leader."""
    for name, perm in perms.items():
        g = spec.group(name)
        if perm.shape != (samples, g.size) or perm.dtype != torch.long:
            raise ValueError(f"permutation of group {name!r}: expected a LongTensor [{samples}, {g.size}], got {perm.dtype} {list(perm.shape)}")
        if not torch.equal(perm.sort(dim=1).values, torch.arange(g.size, device=perm.device).expand(samples, -1)):
            raise ValueError(f"permutation of group {name!r} is not a permutation of 0..{g.size - 1}")
        b = g.block_size
        blocks = perm.reshape(samples, g.blocks, b) // b
        if not bool((blocks == blocks[:, :, :1]).all()):
            raise ValueError(f"permutation of group {name!r} splits one of its {g.blocks} blocks of {b} units")
        if g.follows is not None:
            leader = perms.get(g.follows)
            sigma = (block_permutation(leader, g.blocks).to(perm.device) if leader is not None
                     else torch.arange(g.blocks, device=perm.device).expand(samples, -1))
            if not torch.equal(block_permutation(perm, g.blocks), sigma):
                raise ValueError(f"permutation of group {name!r} must move its blocks as its leader {g.follows!r} does")


def permute(sample_set: Mapping[str, torch.Tensor], spec: SymmetrySpec, perms: Mapping[str, torch.Tensor]) -> SampleSet:
    """Apply one permutation per group (``perms[name]: LongTensor [S, n]``; groups left out stay
    in place) to every axis of the group, in a sample set ``{key: [S, ...]}``. Followers of a
    permuted leader are completed with the leader's block moves. The function is unchanged."""
    samples = next(iter(sample_set.values())).shape[0]
    perms = complete_followers(spec, perms)
    check_permutations(spec, perms, samples)
    out = dict(sample_set)
    grouped: list[tuple[Axis, torch.Tensor]] = []
    for g in spec.groups:
        if g.name not in perms:
            continue
        for ax in g.axes():
            if ax.groups:
                grouped.append((ax, perms[g.name]))
            else:
                out[ax.key] = _gather_units(out[ax.key], ax, perms[g.name])
    # Grouped-conv input axes last: their gather depends on the (already moved) row blocks.
    for ax, perm in grouped:
        out[ax.key] = _gather_grouped(out[ax.key], ax, perm)
    return out


def rescale(sample_set: Mapping[str, torch.Tensor], spec: SymmetrySpec, scales: Mapping[str, torch.Tensor]) -> SampleSet:
    """Apply positive scalings (``scales[scaling name]: [S, n] > 0``; others stay 1): incoming axes
    times ``s``, outgoing axes divided by ``s``, BatchNorm running stats ``mean * s`` and
    ``s^2 (var + eps) - eps``. The function is unchanged (BatchNorm in eval mode)."""
    known = {sc.name: (g, sc) for g, sc in spec.scalings()}
    out = dict(sample_set)
    for name, factor in scales.items():
        if name not in known:
            raise ValueError(f"{spec.architecture} spec: no scaling {name!r}; scalings: {sorted(known)}")
        g, sc = known[name]
        if factor.shape != (out[g.sort_key].shape[0], g.size) or not bool((factor > 0).all() & torch.isfinite(factor).all()):
            raise ValueError(f"scaling {name!r}: expected finite positive factors [S, {g.size}], got {list(factor.shape)}")
        for ax, power in sc.axes():
            out[ax.key] = _scale_units(out[ax.key], ax, factor if power > 0 else 1.0 / factor)
        if sc.stats is not None:
            st, f = sc.stats, factor.to(out[sc.stats.var].device, out[sc.stats.var].dtype)
            out[st.mean] = out[st.mean] * f
            out[st.var] = f**2 * (out[st.var] + st.eps) - st.eps
    return out


def random_permutations(spec: SymmetrySpec, samples: int, generator: torch.Generator | None = None) -> Perms:
    """Uniformly random allowed permutations ``[S, n]`` of every group (followers move their
    blocks with their leader and permute freely within blocks)."""
    perms: Perms = {}
    for g in spec.groups:
        b = g.block_size
        within = torch.rand(samples, g.blocks, b, generator=generator).argsort(dim=2)
        if g.follows is None:
            sigma = torch.rand(samples, g.blocks, generator=generator).argsort(dim=1)
        else:
            sigma = block_permutation(perms[g.follows], g.blocks)
        perms[g.name] = (sigma[:, :, None] * b + torch.gather(within, 1, sigma[:, :, None].expand(-1, -1, b))).reshape(samples, g.size)
    return perms


def random_scales(
    spec: SymmetrySpec, samples: int, spread: float = 1.0, generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float64,
) -> dict[str, torch.Tensor]:
    """Log-normal positive factors ``exp(spread * N(0, 1))`` ``[S, n]`` for every scaling."""
    return {
        sc.name: torch.exp(spread * torch.randn(samples, g.size, generator=generator, dtype=dtype))
        for g, sc in spec.scalings()
    }
