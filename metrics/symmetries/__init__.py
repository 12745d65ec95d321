"""Weight-space symmetries of ReLU networks, applied to sample sets ``{key: [S, ...]}``.

A declarative per-architecture ``SymmetrySpec`` (``spec_for_model``) says which tensor axes
share a permutation and a positive scale; one engine applies them batched over samples.
Transforms (each returns the new sample set and what it applied): ``normalize_scales``,
``sort_units``, ``center_logit_bias``, ``min_mass`` (its cvxpy reference, ``min_mass_cvxpy``, is
``bench/minmass_cvxpy.py``: cvxpy is a test dependency),
``weight_matching``; ``canonicalize`` chains them into the symmetry-free form used by the
NS MMD column, ``align_to_anchor`` into the weight-matched form of the WM MMD column;
``log10_permutation_modes`` counts the modes permutations make of a network (appendix D.1).
"""
from metrics.symmetries.architectures import (
    chain_spec, layer_chain_spec, optunet_spec, resnet_spec, sequential_spec, spec_for_model,
)
from metrics.symmetries.canonical import DEFAULT_STEPS, STEPS, align_to_anchor, canonicalize
from metrics.symmetries.engine import (
    check_permutations, compose, permute, random_permutations, random_scales, rescale,
)
from metrics.symmetries.modes import log10_permutation_modes
from metrics.symmetries.minmass import (
    DegenerateMinMassError, check_min_mass_defined, mass, mass_terms, min_mass,
)
from metrics.symmetries.rebasin import number_of_transpositions, weight_matching
from metrics.symmetries.scaling import normalize_scales
from metrics.symmetries.softmax import center_logit_bias
from metrics.symmetries.sorting import SORT_KEYS, sort_units
from metrics.symmetries.spec import Axis, RunningStats, Scaling, SymmetrySpec, UnitGroup, check_sample_set

__all__ = [
    "chain_spec", "layer_chain_spec", "optunet_spec", "resnet_spec", "sequential_spec", "spec_for_model",
    "DEFAULT_STEPS", "STEPS", "align_to_anchor", "canonicalize", "log10_permutation_modes", "check_permutations",
    "compose", "permute", "random_permutations",
    "random_scales", "rescale", "DegenerateMinMassError", "check_min_mass_defined", "mass", "mass_terms", "min_mass",
    "number_of_transpositions", "weight_matching", "normalize_scales", "center_logit_bias",
    "SORT_KEYS", "sort_units", "Axis", "RunningStats", "Scaling", "SymmetrySpec", "UnitGroup", "check_sample_set",
]
