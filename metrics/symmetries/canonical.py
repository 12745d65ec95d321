"""The symmetry-free ("NS") form of a sample set, compared by the MMD's NS column."""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch

from metrics.symmetries.engine import SampleSet
from metrics.symmetries.minmass import min_mass
from metrics.symmetries.rebasin import weight_matching
from metrics.symmetries.scaling import unit_norm_scaling
from metrics.symmetries.softmax import shift_logit_bias
from metrics.symmetries.sorting import SORT_KEYS, sort_unchecked
from metrics.symmetries.spec import SymmetrySpec, check_sample_set

DEFAULT_STEPS = ("scale", "sort", "softmax")
# Steps run on an already validated sample set (canonicalize checks it once).
STEPS: dict[str, Callable[..., tuple[SampleSet, Any]]] = {
    "scale": unit_norm_scaling,
    "minmass": min_mass,
    "sort": sort_unchecked,
    "softmax": shift_logit_bias,
}


def canonicalize(
    sample_set: Mapping[str, torch.Tensor],
    spec: SymmetrySpec,
    steps: Sequence[str] = DEFAULT_STEPS,
    sort_key: str = "first",
    device: torch.device | str | None = None,
) -> tuple[SampleSet, dict[str, Any]]:
    """Remove the symmetries of every sample of ``sample_set`` (``{key: [S, ...]}``) by applying
    ``steps`` in order: ``scale`` (unit-norm incoming weights), ``minmass`` (minimum-mass
    scaling, instead of ``scale``), ``sort`` (units sorted by ``sort_key``), ``softmax`` (last
    biases summed to 0). Returns a sample set with exactly the input's keys, shapes, dtypes and
    device, and what each step applied (``{step: its scales / permutations / shift}``).
    ``device``: where the steps run (e.g. a GPU; None = where the sample set is)."""
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        raise ValueError(f"canonicalize: unknown step {unknown[0]!r}; expected steps among {', '.join(STEPS)}")
    if sort_key not in SORT_KEYS:
        raise ValueError(f"canonicalize: unknown sort key {sort_key!r}; expected one of {', '.join(SORT_KEYS)}")
    check_sample_set(spec, sample_set)
    home = next(iter(sample_set.values())).device
    out = {k: v.to(device) for k, v in sample_set.items()} if device is not None else dict(sample_set)
    applied: dict[str, Any] = {}
    for step in steps:
        out, applied[step] = sort_unchecked(out, spec, sort_key) if step == "sort" else STEPS[step](out, spec)
    return {k: v.to(home) for k, v in out.items()}, applied


def align_to_anchor(
    sample_set: Mapping[str, torch.Tensor],
    spec: SymmetrySpec,
    anchor: Mapping[str, torch.Tensor],
    steps: Sequence[str] = DEFAULT_STEPS,
) -> tuple[SampleSet, dict[str, Any]]:
    """The weight-matched ("WM") form of ``sample_set``: ``canonicalize`` with the permutation
    step (``sort``) replaced by weight matching (``weight_matching``, git re-basin) to ``anchor``
    (one network, unbatched or ``[1, ...]``, taken through the same steps before the matching);
    without a ``sort`` step the matching comes after every step. Returns the aligned sample set
    and ``{step: what it applied, "match": weight_matching's info}``."""
    steps = list(steps)
    cut = steps.index("sort") if "sort" in steps else len(steps)
    before, after = steps[:cut], steps[cut + 1 :]
    check_sample_set(spec, sample_set)
    batched = {k: v if v.dim() == len(spec.shapes[k]) + 1 else v.unsqueeze(0) for k, v in anchor.items()}
    if check_sample_set(spec, batched, source="anchor") != 1:
        raise ValueError("align_to_anchor: the anchor must be one network (unbatched or [1, ...])")
    out, applied = canonicalize(sample_set, spec, before) if before else (dict(sample_set), {})
    reference = canonicalize(batched, spec, before)[0] if before else batched
    out, applied["match"] = weight_matching(out, reference, spec)
    if after:
        out, later = canonicalize(out, spec, after)
        applied.update(later)
    return out, applied
