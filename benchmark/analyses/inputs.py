"""What the analyses read from the store, and the errors that say what to run first."""
from __future__ import annotations

from pathlib import Path

import torch

from benchmark.experiment import Experiment
from benchmark.stages.evaluate import Reference, available_rows, reference_seeds
from benchmark.core.store import StoreError, load_sample_set, validate_tensors


class MissingInputsError(StoreError):
    """An analysis needs something the store lacks; the message names the command that makes it."""


class NotApplicableError(ValueError):
    """An analysis that does not apply to this experiment's model (with the reason)."""


def figures_dir(exp: Experiment) -> Path:
    """``results/<experiment>/figures/``."""
    return exp.results_dir / "figures"


def require_reference(exp: Experiment, analysis: str) -> list[int]:
    """The converged reference seeds (at least 2); ``MissingInputsError`` naming the zoo command otherwise."""
    seeds = reference_seeds(exp)
    if len(seeds) < 2:
        raise MissingInputsError(
            f"analysis={analysis} needs the reference zoo: {len(seeds)} converged checkpoint(s) in "
            f"seeds.reference={[exp.reference.start, exp.reference.stop]} under {exp.store.zoo_dir}, at least 2 needed; "
            f"run python -m benchmark stage=zoo experiment={exp.name} zoo.range=reference first"
        )
    return seeds


def require_samples(exp: Experiment, analysis: str) -> list[tuple[str, str]]:
    """The (method, mode) rows with a first repetition in the store; ``MissingInputsError``
    naming the sample command when there is none."""
    rows = [(m, mode) for m, mode in available_rows(exp) if exp.store.samples_path(m, mode, 0).is_file()]
    if not rows:
        raise MissingInputsError(
            f"analysis={analysis} compares the zoo with the methods' samples, and {exp.store.samples_dir} holds none; "
            f"run python -m benchmark stage=sample experiment={exp.name} first"
        )
    return rows


def reference(exp: Experiment) -> Reference:
    """The evaluate stage's reference (zoo weights and their symmetry-free form, cached in the store)."""
    return Reference(exp, [step.value for step in exp.config.evaluate.canonical_steps])


def first_repetition(exp: Experiment, method: str, mode: str) -> dict[str, torch.Tensor]:
    """The validated sample set of repetition 0 of ``method``/``mode``."""
    path = exp.store.samples_path(method, mode, 0)
    samples = load_sample_set(path)
    validate_tensors(samples, exp.model(), source=str(path), leading=1)
    return samples
