"""Score weight samples from Python: ``from benchmark import score``.

``score(samples, reference, model=..., data=...)`` gives one row of the tables for one
repetition, computed by the evaluate stage's own scoring function (``metrics.row.score_row``) on
sample sets in memory: raw MMD and NS MMD (MMDAgg's 20 kernels per layer, median / mean /
max, the mean over layers weighted by parameter count; ``metrics.mmd.mmd``) after removing the
symmetries (``metrics.symmetries.canonicalize``; by default scaling then permutation, as the
paper's Table 1), the reference's standard error from its random halves, MMDAgg's test per layer,
their medians with the bandwidths of the reference (``mmd_shared_median``, ``ns_mmd_shared_median``:
every row compared with this reference on one scale), and, with ``data``, the predictive metrics of the samples (``metrics.predictive``) with
agreement and total variation against the reference's ensemble predictive.

``samples`` and ``reference`` are each a list of state dicts, a sample set ``{key: [S, ...]}``,
or the path of a safetensors sample-set file (the format ``method=external`` reads);
``reference`` may also be a store's zoo, ``store_zoo(experiment, store)``: the converged
checkpoints of ``seeds.reference``, which bring their model and the experiment's test and OOD
data. Nothing is written.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence, Union

import pandas as pd
import torch
from torch import nn

from benchmark.config import EvaluateConfig
from benchmark.loader import compose_config
from benchmark.core.models import build_model
from benchmark.core.training.predict import predict_samples
from benchmark.core.store import load_sample_set, stack_state_dicts, validate_tensors
from benchmark.experiment import Experiment
from benchmark.references.zoo import ZooReference
from metrics.mmd import PermutationTestConfig, ReferenceResampling, reference_bandwidths
from metrics.row import Forms, ScoreOptions, score_row
from metrics.symmetries import align_to_anchor, canonicalize, spec_for_model

Weights = Union[str, os.PathLike, Mapping[str, torch.Tensor], Sequence[Mapping[str, torch.Tensor]]]
"""A sample set ``{key: [S, ...]}``, a list of S state dicts, or a safetensors sample-set file."""
Data = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""``(ID test images [N, C, H, W], their labels [N], OOD images [M, C, H, W])``, normalised as for training."""


@dataclass
class StoreZoo:
    """The reference zoo of a store (``store_zoo``): its experiment gives the weights, the model
    and the test and OOD data."""

    experiment: Experiment

    def weights(self) -> dict[str, torch.Tensor]:
        """The converged reference checkpoints as a sample set ``{key: [R, ...]}`` (validated)."""
        return ZooReference(self.experiment).weights()

    def data(self) -> Data:
        exp = self.experiment
        return exp.test_tensors[0], exp.test_tensors[1], exp.ood_tensors[0]


def store_zoo(experiment: str = "digits_optunet", store: str | os.PathLike = "store", overrides: Sequence[str] = ()) -> StoreZoo:
    """The zoo of ``store/<experiment>/`` (its converged ``seeds.reference`` checkpoints), with
    the experiment's model and data; ``overrides`` as on the command line (``dataset.data_dir=...``,
    ``'seeds.reference=[0,500]'``). Raises ``StoreError`` when the store holds fewer than 2."""
    return StoreZoo(Experiment(compose_config([f"experiment={experiment}", f"store={store}", *overrides])))


@dataclass
class Score:
    """One row for one repetition. ``row``: the ``metrics.csv`` columns the evaluate stage writes
    for it (``mmd_median``, ``ns_mmd_median`` ..., ``<column>_ref_sd``, ``mmd_reject``,
    ``ns_mmd_reject``, ``mmd_shared_median``, ``ns_mmd_shared_median``, and with data ``n_samples``, ``acc``, ``ece`` ...: fractions, nats;
    the tables print MMD, NS MMD, Acc, ECE, Brier, AUPR, FPR95, MI x100). ``layers``: per layer
    (``layer``, ``n_params``) and form (``mmd`` raw, ``ns_mmd`` symmetry-free), the median, mean and
    max over the 20 kernels and MMDAgg's decision ``reject`` (level 0.05)."""

    row: dict[str, float]
    layers: pd.DataFrame = field(repr=False)

    @property
    def mmd(self) -> float:
        """Table 1's MMD (/100): per layer the median over the kernels, weighted mean over layers."""
        return self.row["mmd_median"]

    @property
    def ns_mmd(self) -> float:
        """Table 1's NS MMD (/100): the same after removing the symmetries."""
        return self.row["ns_mmd_median"]


def _sample_set(weights: Weights, what: str) -> dict[str, torch.Tensor]:
    if isinstance(weights, (str, os.PathLike)):
        return load_sample_set(Path(weights))
    if isinstance(weights, Mapping):
        return {k: torch.as_tensor(v) for k, v in weights.items()}
    if isinstance(weights, Sequence) and weights and all(isinstance(w, Mapping) for w in weights):
        first = weights[0]
        for i, state in enumerate(weights):
            if set(state) != set(first):
                odd = sorted(set(state) ^ set(first))[0]
                raise ValueError(f"score: {what}[{i}] and {what}[0] differ in key {odd!r}")
            for key, value in state.items():
                if tuple(value.shape) != tuple(first[key].shape):
                    raise ValueError(f"score: {what}[{i}][{key!r}] has shape {tuple(value.shape)}, {what}[0]'s "
                                     f"{tuple(first[key].shape)}")
        return stack_state_dicts(list(weights))
    raise TypeError(f"score: {what} must be a list of state dicts, a sample set {{key: [S, ...]}} or a safetensors "
                    f"file, got {type(weights).__name__}")


def score(samples: Weights, reference: Weights | StoreZoo, model: nn.Module | str | None = None, data: Data | None = None,
          *, canonical_steps: Sequence[str] | None = None, weight_matching: bool = False,
          reference_resamples: int | None = None, test_permutations: int | None = None,
          device: torch.device | str = "cpu") -> Score:
    """Score ``samples`` (S networks) against ``reference`` (R networks): see the module docstring.

    ``model``: the architecture (a module, or a model name such as ``"optunet"``; a store zoo
    brings its own); ``data``: ``(test images, test labels, OOD images)`` for the predictive
    columns (a store zoo brings its experiment's; None with other references: no predictive
    columns); ``canonical_steps``: the symmetries NS MMD removes (``evaluate.canonical_steps``);
    ``weight_matching``: also the WM MMD columns, weight-matched to the first reference network;
    ``reference_resamples``: random halves of the reference for the ``*_ref_sd`` columns (0: none);
    ``test_permutations``: MMDAgg's relabellings B1 = B2 per layer (0: no test). None: the evaluate
    stage's defaults (``EvaluateConfig``: scaling then permutation, 20 halves, 500). Raises ``ValueError`` naming the key and shape when a sample set does
    not fit the model, ``TypeError`` for an input of another kind.
    """
    if isinstance(reference, StoreZoo):
        exp = reference.experiment
        model = exp.model() if model is None else model
        data = reference.data() if data is None else data
        zoo = reference.weights()
    else:
        zoo = _sample_set(reference, "reference")
    if model is None:
        raise ValueError("score: model is needed with a reference that is not a store zoo (a module or a name such as 'optunet')")
    if isinstance(model, str):
        model = build_model(model)  # the factory's defaults; pass a module for other widths or classes
    ys = _sample_set(samples, "samples")
    for name, weights in (("reference", zoo), ("samples", ys)):
        validate_tensors(weights, model, source=name, leading=1)
    defaults = EvaluateConfig()
    steps = [str(getattr(s, "value", s)) for s in (defaults.canonical_steps if canonical_steps is None else canonical_steps)]
    reference_resamples = defaults.reference_resamples if reference_resamples is None else reference_resamples
    test_permutations = defaults.test_permutations if test_permutations is None else test_permutations
    spec = spec_for_model(model)
    options = ScoreOptions(
        device=device, resampling=ReferenceResampling(count=reference_resamples) if reference_resamples else None,
        permutation_test=PermutationTestConfig(b1=test_permutations, b2=test_permutations) if test_permutations else None)
    canonical = canonicalize(zoo, spec, steps, device=device)[0]
    aligned = None
    if weight_matching:
        anchor = {k: v[:1] for k, v in zoo.items()}
        aligned = (align_to_anchor(zoo, spec, anchor, steps)[0], align_to_anchor(ys, spec, anchor, steps)[0])
    preds = predictive = labels = None
    if data is not None:
        images, labels, ood = data
        model = model.to(device)
        predictive = predict_samples(model, zoo, images).double().sum(0) / next(iter(zoo.values())).shape[0]
        preds = {"id": predict_samples(model, ys, images), "ood": predict_samples(model, ys, ood)}
    shared = {"mmd": reference_bandwidths(zoo, device=device), "ns_mmd": reference_bandwidths(canonical, device=device)}
    reference_forms = Forms(zoo, canonical, aligned[0] if aligned else None, predictive, shared)
    sample_forms = Forms(ys, canonicalize(ys, spec, steps, device=device)[0], aligned[1] if aligned else None)
    scored = score_row(reference_forms, sample_forms, options, preds, labels)
    return Score(scored.row, scored.layers())
