"""One repetition's row of the tables, from a reference's forms and a sample set's: the suite's one
scoring function. The evaluate stage (a method's repetition, a baseline's, the zoo's own row
against another reference) and ``benchmark.score`` all call ``score_row``; what differs between
them is only where the forms come from (a store's cached reference, a sample set in memory).

What you give:

- ``reference``: ``Forms`` of the R reference networks: ``raw`` weights, the symmetry-free form
  (``canonical``: the NS steps removed, ``metrics.symmetries.canonicalize``) and the
  weight-matched form (``aligned``, ``metrics.symmetries.align_to_anchor``; ``None``: no WM
  columns), each a sample set ``{key: [R, ...]}`` or a column source that ``metrics.mmd.mmd``
  streams (``metrics.mmd.sources``); ``predictive``, the reference's ensemble predictive on the ID
  test split ``[N, C]`` (probabilities; ``None``: no predictive columns); ``shared``, the
  bandwidth grids shared by every row per form (``{"mmd": {layer: {...}}, "ns_mmd": ...}``,
  ``metrics.mmd.reference_bandwidths``; ``None``: no shared columns).
- ``samples``: ``Forms`` of the S samples in the same coordinates (``aligned`` where the
  reference has one; ``predictive`` and ``shared`` unused).
- ``options``: ``ScoreOptions``: the device, the reference's random halves (``*_ref_sd``) and
  MMDAgg's test per layer (``*_reject``), each ``None`` for none.
- ``preds`` and ``labels``: the samples' softmax outputs ``{"id": [S, N, C], "ood": [S, M, C]}``
  and the ID labels ``[N]`` (``None``: no predictive columns).

What you get: ``Scored``: ``row``, metrics.csv's numbers of one repetition (``n_samples`` and
``metrics.predictive.predictive_metrics``' columns with agreement and TV against the reference's
predictive; ``{form}_{median,mean,max}`` for ``form`` in ``mmd``, ``ns_mmd``, ``wm_mmd`` (NaN
without an aligned form), each with ``_ref_sd`` under resampling; ``energy`` and ``ns_energy``, the
parameter-weighted energy coefficient of the raw and symmetry-free forms (``metrics.mmd.energy``:
the distance kernel's MMD, no bandwidth), with ``_ref_sd`` under resampling; ``mmd_reject`` and
``ns_mmd_reject`` under a test; ``{form}_shared_median`` (and its ``_ref_sd``) with shared
grids); ``results``: each form's ``metrics.mmd.MMDResult`` (per layer and kernel).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import pandas as pd
import torch

from metrics.mmd import MMDResult, PermutationTestConfig, ReferenceResampling, mmd
from metrics.mmd.sources import Source, as_column_source
from metrics.mmd.table import ENERGY, SUMMARIES  # the summaries over a layer's kernels each MMD column is given in
from metrics.predictive import predictive_metrics


PER_LAYER = "per_layer"
"""The key of ``Scored.numbers`` holding the per-layer records (not a metrics.csv column)."""


@dataclass(frozen=True)
class Forms:
    """A sample set in the coordinates the row compares (see the module docstring)."""

    raw: Source
    canonical: Source
    aligned: Source | None = None
    predictive: torch.Tensor | None = None
    shared: Mapping[str, Mapping[str, Mapping[str, torch.Tensor]]] | None = None


@dataclass(frozen=True)
class ScoreOptions:
    """How the MMD is measured: ``device`` (where the distances are computed), ``resampling`` (the
    reference's halves for the ``*_ref_sd`` columns; ``None``: none) and ``permutation_test``
    (MMDAgg's test per layer for the ``*_reject`` columns; ``None``: none)."""

    device: torch.device | str = "cpu"
    resampling: ReferenceResampling | None = None
    permutation_test: PermutationTestConfig | None = None


@dataclass(frozen=True)
class Scored:
    """``row``: the numbers of one repetition; ``results``: ``{form: MMDResult}`` for the forms compared."""

    row: dict[str, Any]
    results: dict[str, MMDResult] = field(repr=False)

    def numbers(self, with_layers: bool) -> dict[str, Any]:
        """``row``, and with ``with_layers`` also ``per_layer``: the records of ``layers()`` (form,
        layer, n_params, median, mean, max, energy), as the evaluate stage caches a repetition."""
        if not with_layers:
            return dict(self.row)
        columns = ["form", "layer", "n_params", *SUMMARIES, ENERGY]
        return {**self.row, PER_LAYER: self.layers()[columns].to_dict("records")}

    def layers(self) -> pd.DataFrame:
        """Per layer (``layer``, ``n_params``) and form (``form``: ``mmd``, ``ns_mmd``, ``wm_mmd``), the
        median, mean and max over the 20 kernels and MMDAgg's decision ``reject``."""
        return pd.concat([result.per_layer.assign(form=form) for form, result in self.results.items()],
                         ignore_index=True)


def score_row(reference: Forms, samples: Forms, options: ScoreOptions,
              preds: Mapping[str, torch.Tensor] | None = None, labels: torch.Tensor | None = None) -> Scored:
    """The row of ``samples`` scored against ``reference`` (see the module docstring). Raises
    ``ValueError`` when ``samples`` lack the aligned form the reference has, or when only one of
    ``preds``, ``labels`` and ``reference.predictive`` is given."""
    if reference.aligned is not None and samples.aligned is None:
        raise ValueError("score_row: the reference has an aligned (WM) form, the samples have none")
    predictive = (preds is not None, labels is not None, reference.predictive is not None)
    if any(predictive) and not all(predictive):
        raise ValueError("score_row: preds, labels and reference.predictive are given together or not at all; got "
                         f"preds {'set' if preds is not None else 'None'}, labels {'set' if labels is not None else 'None'}, "
                         f"reference.predictive {'set' if reference.predictive is not None else 'None'}")
    row: dict[str, Any] = {}
    if preds is not None:
        count = next(iter(as_column_source(samples.raw).shapes().values()))[0]
        row["n_samples"] = int(count)
        row |= predictive_metrics(preds["id"], labels, preds["ood"], reference_id=reference.predictive)
    common: dict[str, Any] = {"device": options.device, "resampling": options.resampling}
    shared = reference.shared or {}
    results = {
        "mmd": mmd(reference.raw, samples.raw, **common, permutation_test=options.permutation_test,
                   shared_bandwidths=shared.get("mmd")),
        "ns_mmd": mmd(reference.canonical, samples.canonical, **common, permutation_test=options.permutation_test,
                      shared_bandwidths=shared.get("ns_mmd")),
    }
    if reference.aligned is not None:
        results["wm_mmd"] = mmd(reference.aligned, samples.aligned, **common)  # no test column for WM
    row |= {f"wm_mmd_{name}": math.nan for name in SUMMARIES}
    for form, result in results.items():
        for name in SUMMARIES:
            row[f"{form}_{name}"] = result.aggregate[name]
            if result.resampled:
                row[f"{form}_{name}_ref_sd"] = float(result.resampled[name].std())
        if form != "wm_mmd":
            column = ENERGY if form == "mmd" else f"ns_{ENERGY}"
            row[column] = result.aggregate[ENERGY]
            if ENERGY in result.resampled:
                row[f"{column}_ref_sd"] = float(result.resampled[ENERGY].std())
        if options.permutation_test is not None and form != "wm_mmd":
            row[f"{form}_reject"] = result.reject_fraction
        if result.shared is not None:
            row[f"{form}_shared_median"] = result.shared.aggregate["median"]
            if result.shared.resampled:
                row[f"{form}_shared_median_ref_sd"] = float(result.shared.resampled["median"].std())
    return Scored(row, results)
