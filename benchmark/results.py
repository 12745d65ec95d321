"""``results/<experiment>/metrics.csv``: the one schema of a result row, written by the
evaluate stage and read by the report.

One row per (experiment, method, mode). Labels are the display names the tables print (the
experiment's ``display_name``, the method's ``label``), so a report can be rendered from the
CSV files alone. Values are raw: fractions for accuracy, ECE, AUPR, FPR95; MMD^2 unitless; MI in
nats; NaN where a metric does not apply. Each value is the mean over ``n_repetitions``
independent repetitions of the sample stage, and ``<value>_hw`` the half-width of its 95%
interval (``metrics.uncertainty``: the spread over repetitions, and for MMD also the standard
error due to the finite reference zoo). ``mmd_reject``/``ns_mmd_reject``: the fraction of layers
whose MMDAgg test rejects "same distribution" at level 0.05 (first repetition). ``ns_steps``:
the symmetries removed for the NS columns (``scale+sort`` ...). ``wm_mmd_*``: MMD with the
permutations removed by weight matching every network to one anchor instead of sorting
(``wm_anchor`` names it, e.g. ``seed 0``; empty and NaN with ``evaluate.weight_matching=false``).
``n_reference``: the number of converged reference checkpoints the row was scored against (the
whole ``seeds.reference`` range less its failed seeds, unless ``evaluate.allow_partial``); NaN
in a metrics.csv written before the column existed.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from benchmark.core.store import MODES, atomic_path

STATUSES = ("ok", "failed")
KEY_COLUMNS = ["experiment", "method", "mode"]
TEXT_COLUMNS = ["experiment", "experiment_label", "method", "method_label", "mode", "status", "reason", "ns_steps",
                "wm_anchor"]
COUNT_COLUMNS = ["n_samples", "n_repetitions", "n_reference"]
ADDED_COLUMNS = ("n_reference",)  # absent from older metrics.csv files: read as NaN
MMD_COLUMNS = ["mmd_median", "mmd_mean", "mmd_max", "ns_mmd_median", "ns_mmd_mean", "ns_mmd_max",
               "wm_mmd_median", "wm_mmd_mean", "wm_mmd_max"]
METRIC_COLUMNS = ["acc", "nll", "brier", "ece", "aupr", "fpr95", "id_mi", "ood_mi", "agreement", "tv"]
MEASURED = MMD_COLUMNS + METRIC_COLUMNS  # the columns that get an interval
TEST_COLUMNS = ["mmd_reject", "ns_mmd_reject"]


def half_width(column: str) -> str:
    """The metrics.csv column holding the 95% half-width of ``column``."""
    return f"{column}_hw"


COLUMNS: list[str] = TEXT_COLUMNS + COUNT_COLUMNS + MEASURED + [half_width(c) for c in MEASURED] + TEST_COLUMNS
VALUE_COLUMNS = [c for c in COLUMNS if c not in TEXT_COLUMNS]


def write_metrics(rows: list[dict], path: Path) -> pd.DataFrame:
    """Write ``rows`` (dicts keyed by ``COLUMNS``; missing values become NaN or "") to ``path``
    atomically; return the validated frame."""
    unknown = sorted({k for row in rows for k in row} - set(COLUMNS))
    if unknown:
        raise ValueError(f"metrics rows have columns {unknown} that metrics.csv does not (benchmark.results.COLUMNS)")
    filled = [{c: row.get(c, "" if c in TEXT_COLUMNS else math.nan) for c in COLUMNS} for row in rows]
    frame = check_metrics(pd.DataFrame(filled, columns=COLUMNS), source=str(path))
    with atomic_path(path) as tmp:
        frame.to_csv(tmp, index=False, float_format="%.8g")
    return frame


def check_metrics(frame: pd.DataFrame, source: str = "metrics.csv") -> pd.DataFrame:
    """Validate a metrics frame (columns, statuses, modes, unique keys, numeric values); return
    it with typed columns. Errors name ``source`` and the column."""
    if not isinstance(frame, pd.DataFrame):
        raise ValueError(f"{source}: expected a pandas DataFrame, got {type(frame).__name__}")
    missing = [c for c in COLUMNS if c not in frame.columns and c not in ADDED_COLUMNS]
    if missing:
        raise ValueError(f"{source}: missing columns {missing}; expected the columns of benchmark.results.COLUMNS")
    frame = frame.assign(**{c: math.nan for c in ADDED_COLUMNS if c not in frame.columns})
    frame = frame[COLUMNS].copy()
    for column in TEXT_COLUMNS:
        frame[column] = frame[column].fillna("").astype(str)
    for column, allowed in (("mode", MODES), ("status", STATUSES)):
        bad = sorted(set(frame[column]) - set(allowed))
        if bad:
            raise ValueError(f"{source}: column {column!r} expects values in {list(allowed)}, got {bad}")
    duplicated = frame.duplicated(KEY_COLUMNS, keep=False)
    if duplicated.any():
        keys = frame.loc[duplicated, KEY_COLUMNS].drop_duplicates()
        raise ValueError(f"{source}: duplicate (experiment, method, mode) rows: {keys.values.tolist()}")
    for column in VALUE_COLUMNS:
        try:
            frame[column] = pd.to_numeric(frame[column]).astype(np.float64)
        except (ValueError, TypeError) as error:
            raise ValueError(f"{source}: column {column!r} expects numbers ({error})") from None
    return frame


def read_metrics(path: Path) -> pd.DataFrame:
    """metrics.csv at ``path``, validated (``check_metrics``)."""
    return check_metrics(pd.read_csv(path, keep_default_na=True), source=str(path))
