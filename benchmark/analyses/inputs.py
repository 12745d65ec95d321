"""What the analyses read from the store (through the query layer), and where they write."""
from __future__ import annotations

from pathlib import Path

import torch

from benchmark.core.store import load_sample_set, validate_tensors
from benchmark.experiment import Experiment
from benchmark.inventory import MissingInputsError, available_rows, reference_seeds, require_inputs
from benchmark.references import ZooReference
from benchmark.results import figures_dir as results_figures_dir

__all__ = ["MissingInputsError", "NotApplicableError", "figures_dir", "first_repetition", "reference",
           "require_reference", "require_samples"]


class NotApplicableError(ValueError):
    """An analysis that does not apply to this experiment's model (with the reason)."""


def figures_dir(exp: Experiment) -> Path:
    """``results/<experiment>/figures/`` (``benchmark.results.figures_dir``)."""
    return results_figures_dir(exp.results_dir)


def require_reference(exp: Experiment, analysis: str) -> list[int]:
    """The converged reference seeds (at least 2); ``MissingInputsError`` naming the zoo command otherwise."""
    require_inputs(exp, {"reference"}, f"analysis={analysis}")
    return reference_seeds(exp)


def require_samples(exp: Experiment, analysis: str) -> list[tuple[str, str]]:
    """The (method, mode) rows with a first repetition in the store; ``MissingInputsError``
    naming the sample command when there is none."""
    require_inputs(exp, {"samples"}, f"analysis={analysis}")
    return [(m, mode) for m, mode in available_rows(exp)
            if exp.store.samples_path(exp.store.sample_unit(m, mode, 0)).is_file()]


def reference(exp: Experiment) -> ZooReference:
    """The reference zoo with its cached forms (``benchmark.references``), shared with the evaluate stage."""
    return ZooReference(exp)


def first_repetition(exp: Experiment, method: str, mode: str) -> dict[str, torch.Tensor]:
    """The validated sample set of repetition 0 of ``method``/``mode``."""
    path = exp.store.samples_path(exp.store.sample_unit(method, mode, 0))
    samples = load_sample_set(path)
    validate_tensors(samples, exp.model(), source=str(path), leading=1)
    return samples
