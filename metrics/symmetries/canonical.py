"""The symmetry-free ("NS") form of a sample set, compared by the MMD's NS column."""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch

from metrics.symmetries.engine import SampleSet
from metrics.symmetries.minmass import min_mass
from metrics.symmetries.scaling import normalize_scales
from metrics.symmetries.softmax import center_logit_bias
from metrics.symmetries.sorting import sort_units
from metrics.symmetries.spec import SymmetrySpec, check_sample_set

DEFAULT_STEPS = ("scale", "sort", "softmax")
STEPS: dict[str, Callable[..., tuple[SampleSet, Any]]] = {
    "scale": normalize_scales,
    "minmass": min_mass,
    "sort": sort_units,
    "softmax": center_logit_bias,
}


def canonicalize(
    sample_set: Mapping[str, torch.Tensor],
    spec: SymmetrySpec,
    steps: Sequence[str] = DEFAULT_STEPS,
    sort_key: str = "first",
) -> tuple[SampleSet, dict[str, Any]]:
    """Remove the symmetries of every sample of ``sample_set`` (``{key: [S, ...]}``) by applying
    ``steps`` in order: ``scale`` (unit-norm incoming weights), ``minmass`` (minimum-mass
    scaling, instead of ``scale``), ``sort`` (units sorted by ``sort_key``), ``softmax`` (last
    biases summed to 0). Returns a sample set with exactly the input's keys, shapes and dtypes,
    and what each step applied (``{step: its scales / permutations / shift}``)."""
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        raise ValueError(f"canonicalize: unknown step {unknown[0]!r}; expected steps among {', '.join(STEPS)}")
    check_sample_set(spec, sample_set)
    out = dict(sample_set)
    applied: dict[str, Any] = {}
    for step in steps:
        out, applied[step] = sort_units(out, spec, sort_key) if step == "sort" else STEPS[step](out, spec)
    return out, applied
