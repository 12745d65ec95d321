"""Softmax additive symmetry (paper appendix C.1.3): adding one constant to every logit
leaves the softmax unchanged, so the last layer's biases can be shifted to a fixed sum."""
from __future__ import annotations

from typing import Mapping

import torch

from metrics.symmetries.engine import SampleSet
from metrics.symmetries.spec import SymmetrySpec, check_sample_set


def center_logit_bias(
    sample_set: Mapping[str, torch.Tensor], spec: SymmetrySpec, total: float = 0.0
) -> tuple[SampleSet, dict[str, torch.Tensor]]:
    """Shift the last layer's biases ``[S, K]`` so that they sum to ``total`` in every sample.

    Returns the new sample set and ``{"shift": [S]}``, the constant added to every logit.
    Raises ``ValueError`` when the architecture's last layer has no bias.
    """
    check_sample_set(spec, sample_set)
    return shift_logit_bias(sample_set, spec, total)


def shift_logit_bias(
    sample_set: Mapping[str, torch.Tensor], spec: SymmetrySpec, total: float = 0.0
) -> tuple[SampleSet, dict[str, torch.Tensor]]:
    """``center_logit_bias`` without validating the sample set (for callers that already did)."""
    key = spec.logit_bias
    if key is None:
        raise ValueError(f"{spec.architecture}: the last layer has no bias, the softmax additive step needs one")
    bias = sample_set[key]
    shift = total / bias.shape[1] - bias.mean(dim=1)
    return {**sample_set, key: bias + shift[:, None]}, {"shift": shift}
