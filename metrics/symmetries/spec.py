"""Declarative symmetry spec: which tensor axes share a permutation and a positive scale.

A spec lists *unit groups* (the hidden neurons of a Linear layer, the channels of a Conv2d,
a residual stream). All axes of a group are permuted together. A group carries one or more
*scalings*: positive factors ``s`` per unit that multiply the group's incoming axes, divide
its outgoing axes, and (for a Conv2d feeding a BatchNorm) are absorbed by the BatchNorm's
running statistics. One engine (``metrics.symmetries.engine``) applies permutations and
scalings to whole sample sets ``[S, ...]`` from this description, like a git-re-basin
permutation spec extended with scales.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Iterator, Mapping

import torch


@dataclass(frozen=True)
class Axis:
    """One axis of one state-dict tensor that carries the units of a group.

    ``axis`` counts in the unbatched tensor (the sample axis is not counted). Each unit
    occupies ``inner`` consecutive entries along the axis (a Linear after ``Flatten`` of a
    ``[C, H, W]`` map has ``inner = H * W``). ``groups > 0`` marks axis 1 of a grouped Conv2d
    weight ``[C_out, C_in / groups, kh, kw]``: it indexes the input channel *within the group
    of each output row*, so entry ``(o, j)`` belongs to unit ``(o // (C_out / groups)) *
    (C_in / groups) + j``.
    """

    key: str
    axis: int
    inner: int = 1
    groups: int = 0


@dataclass(frozen=True)
class RunningStats:
    """BatchNorm running statistics that absorb a scaling of the layer feeding the BatchNorm.

    In eval mode ``BN(x) = gamma (x - mean) / sqrt(var + eps) + beta``; with ``x -> s x`` the
    output is unchanged when ``mean -> s mean`` and ``var -> s^2 (var + eps) - eps`` (exact,
    eps included).
    """

    batchnorm: str
    mean: str
    var: str
    eps: float


@dataclass(frozen=True)
class Scaling:
    """One positive scale per unit of its group.

    ``incoming`` axes are multiplied by ``s`` (weights and biases producing the units);
    ``norm_keys`` are the incoming weights whose per-unit L2 norm the scaling normalisation
    sets to 1 (never biases); ``outgoing`` axes are divided by ``s`` (the next layer's
    input axis); ``stats``, when set, are the BatchNorm running statistics absorbing ``s``
    (then ``outgoing`` is empty: the BatchNorm renormalises the scale away).
    """

    name: str
    incoming: tuple[Axis, ...]
    norm_keys: tuple[str, ...]
    outgoing: tuple[Axis, ...] = ()
    stats: RunningStats | None = None

    def axes(self) -> Iterator[tuple[Axis, int]]:
        """Every axis with its power: +1 incoming, -1 outgoing (running stats excluded)."""
        yield from ((ax, 1) for ax in self.incoming)
        yield from ((ax, -1) for ax in self.outgoing)


@dataclass(frozen=True)
class UnitGroup:
    """Units that share one permutation.

    ``sort_key`` names the incoming weight tensor whose axis-0 slices are the units' incoming
    weights (the sorting key); ``bias`` the units' bias, if any (bias ordering). With
    ``blocks > 1`` the units form ``blocks`` equal blocks (they feed a grouped conv): an
    allowed permutation moves whole blocks and permutes within blocks. A group that
    ``follows`` a leader (the output channels of a grouped conv) moves its blocks exactly as
    the leader does and only chooses the order within blocks.
    """

    name: str
    size: int
    scalings: tuple[Scaling, ...]
    sort_key: str
    bias: str | None = None
    blocks: int = 1
    follows: str | None = None

    @property
    def block_size(self) -> int:
        return self.size // self.blocks

    def axes(self) -> list[Axis]:
        """Every permuted axis of the group: its scalings' axes and running statistics."""
        out: list[Axis] = []
        for sc in self.scalings:
            out.extend(ax for ax, _ in sc.axes())
            if sc.stats is not None:
                out.extend((Axis(sc.stats.mean, 0), Axis(sc.stats.var, 0)))
        return list(dict.fromkeys(out))


@dataclass(frozen=True)
class SymmetrySpec:
    """The symmetries of one architecture.

    ``shapes``: every state-dict key with its unbatched shape (sample sets must match it
    exactly); ``groups`` in declaration order; ``logit_bias``: the last layer's bias (softmax
    additive symmetry), if any; ``mass_keys``: the weights counted by the min-mass problem
    (Linear/Conv weights and BatchNorm gammas, no biases); ``buffers``: keys that are not
    parameters (left out of re-basin's matching objective).
    """

    architecture: str
    shapes: Mapping[str, tuple[int, ...]]
    groups: tuple[UnitGroup, ...]
    logit_bias: str | None
    mass_keys: tuple[str, ...]
    buffers: frozenset[str] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        _validate_spec(self)

    def group(self, name: str) -> UnitGroup:
        """The unit group called ``name``."""
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(f"{self.architecture} spec: no unit group {name!r}; groups: {[g.name for g in self.groups]}")

    def scalings(self) -> Iterator[tuple[UnitGroup, Scaling]]:
        """Every scaling with the group it belongs to, in declaration order."""
        for g in self.groups:
            for sc in g.scalings:
                yield g, sc

    def followers(self, leader: str) -> list[UnitGroup]:
        """Groups whose block permutation is dictated by ``leader``."""
        return [g for g in self.groups if g.follows == leader]


def topological(names: Iterable[str], edges: Iterable[tuple[str, str]], what: str) -> list[str]:
    """``names`` ordered so that for every edge ``(a, b)``, ``a`` comes before ``b``.

    Ties keep the order of ``names``; a cycle raises ``ValueError`` naming ``what`` and the cycle.
    """
    names = list(names)
    preds: dict[str, set[str]] = {n: set() for n in names}
    for a, b in edges:
        if a != b:
            preds[b].add(a)
    order, done = [], set()
    while len(order) < len(names):
        ready = [n for n in names if n not in done and preds[n] <= done]
        if not ready:
            raise ValueError(f"{what}: dependency cycle among {[n for n in names if n not in done]}")
        order.append(ready[0])
        done.add(ready[0])
    return order


def check_sample_set(spec: SymmetrySpec, sample_set: Mapping[str, torch.Tensor], source: str = "sample set") -> int:
    """Check that ``sample_set`` has exactly the spec's keys, each ``[S, *shape]``, floating
    where the symmetries act and finite; returns S. Errors name the key and the expected shape."""
    missing = [k for k in spec.shapes if k not in sample_set]
    if missing:
        raise ValueError(
            f"{source}: missing key {missing[0]!r} (expected shape [S, {', '.join(map(str, spec.shapes[missing[0]]))}]) "
            f"for the {spec.architecture} symmetry spec; {len(missing)} key(s) missing in all"
        )
    extra = [k for k in sample_set if k not in spec.shapes]
    if extra:
        raise ValueError(f"{source}: key {extra[0]!r} is not part of the {spec.architecture} symmetry spec")
    counts = set()
    acted = {ax.key for g in spec.groups for ax in g.axes()} | ({spec.logit_bias} - {None})
    for key, shape in spec.shapes.items():
        value = sample_set[key]
        if value.dim() != len(shape) + 1 or tuple(value.shape[1:]) != tuple(shape):
            raise ValueError(
                f"{source}: key {key!r} has shape {list(value.shape)}, expected [S, {', '.join(map(str, shape))}] "
                f"for the {spec.architecture} symmetry spec"
            )
        counts.add(int(value.shape[0]))
        if key in acted and not value.is_floating_point():
            raise ValueError(f"{source}: key {key!r} has dtype {value.dtype}, expected a floating dtype")
        if value.is_floating_point() and value.numel() and not all(map(bool, map(torch.isfinite, torch.aminmax(value)))):
            raise ValueError(f"{source}: key {key!r} contains NaN or Inf values")
    if len(counts) != 1:
        raise ValueError(f"{source}: tensors disagree on the sample count S: {sorted(counts)}")
    return counts.pop()


def _validate_spec(spec: SymmetrySpec) -> None:
    """Check the spec against its own shapes; errors name the key and the expected shape."""
    arch = spec.architecture
    names = [g.name for g in spec.groups]
    if len(set(names)) != len(names):
        raise ValueError(f"{arch} spec: duplicate unit group names in {names}")
    scaling_names = [sc.name for _, sc in spec.scalings()]
    if len(set(scaling_names)) != len(scaling_names):
        raise ValueError(f"{arch} spec: duplicate scaling names in {scaling_names}")
    for key in [*spec.mass_keys, *([spec.logit_bias] if spec.logit_bias else [])]:
        if key not in spec.shapes:
            raise ValueError(f"{arch} spec: key {key!r} is not in the state dict")
    for g in spec.groups:
        if g.size < 1 or g.blocks < 1 or g.size % g.blocks:
            raise ValueError(f"{arch} spec: group {g.name!r} has {g.size} units, not divisible into {g.blocks} blocks")
        if g.follows is not None:
            leader = spec.group(g.follows)
            if leader.follows is not None or leader.blocks != g.blocks:
                raise ValueError(
                    f"{arch} spec: group {g.name!r} follows {leader.name!r}, which must be a leader with the same "
                    f"number of blocks ({g.blocks}), got {leader.blocks}"
                )
        if not g.scalings:
            raise ValueError(f"{arch} spec: group {g.name!r} has no scaling")
        incoming = {ax.key for sc in g.scalings for ax in sc.incoming}
        if g.sort_key not in incoming:
            raise ValueError(f"{arch} spec: group {g.name!r} sorts on {g.sort_key!r}, which is not one of its incoming tensors")
        if g.bias is not None and g.bias not in incoming:
            raise ValueError(f"{arch} spec: group {g.name!r} bias {g.bias!r} is not one of its incoming tensors")
        for sc in g.scalings:
            if not set(sc.norm_keys) <= {ax.key for ax in sc.incoming}:
                raise ValueError(f"{arch} spec: scaling {sc.name!r} norm keys {sc.norm_keys} must be incoming tensors")
            for ax, power in sc.axes():
                if ax.groups and power > 0:
                    raise ValueError(f"{arch} spec: scaling {sc.name!r}: a grouped-conv input axis cannot be incoming")
            if sc.stats is not None:
                if sc.outgoing:
                    raise ValueError(f"{arch} spec: scaling {sc.name!r} is absorbed by {sc.stats.batchnorm!r} and cannot have outgoing axes")
        for ax in g.axes():
            _check_axis(spec, g, ax)


def _check_axis(spec: SymmetrySpec, g: UnitGroup, ax: Axis) -> None:
    arch = spec.architecture
    if ax.key not in spec.shapes:
        raise ValueError(f"{arch} spec: group {g.name!r} refers to key {ax.key!r}, which is not in the state dict")
    shape = spec.shapes[ax.key]
    if not 0 <= ax.axis < len(shape):
        raise ValueError(f"{arch} spec: key {ax.key!r} with shape {list(shape)} has no axis {ax.axis} (group {g.name!r})")
    if ax.groups:
        if ax.axis != 1 or len(shape) < 2:
            raise ValueError(f"{arch} spec: grouped axis of {ax.key!r} must be axis 1 of a conv weight")
        if shape[0] % ax.groups:
            raise ValueError(
                f"{arch} spec: key {ax.key!r} has {shape[0]} output channels, not divisible by groups={ax.groups}; "
                f"expected shape [{ax.groups}*k, {g.size // ax.groups}, ...]"
            )
        if shape[1] * ax.groups != g.size or g.blocks != ax.groups:
            raise ValueError(
                f"{arch} spec: key {ax.key!r} has shape {list(shape)}; a conv with groups={ax.groups} reading the "
                f"{g.size} units of {g.name!r} (in {g.blocks} blocks) needs shape [C_out, {g.size // ax.groups}, ...] "
                f"and the group in {ax.groups} blocks"
            )
    elif shape[ax.axis] != g.size * ax.inner:
        expected = list(shape)
        expected[ax.axis] = g.size * ax.inner
        raise ValueError(
            f"{arch} spec: key {ax.key!r} has shape {list(shape)}, expected {expected} "
            f"(axis {ax.axis} carries the {g.size} units of {g.name!r} x {ax.inner})"
        )
