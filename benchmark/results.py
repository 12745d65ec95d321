"""``results/<experiment>/metrics.csv``: the one schema of a result row, written by the
evaluate stage and read by the report.

One row per (experiment, method, mode). Labels are the display names the tables print (the
experiment's ``display_name``, the method's ``label``), so a report can be rendered from the
CSV files alone. Values are raw: fractions for accuracy, ECE, AUPR, FPR95; MMD^2 unitless;
MI in nats; NaN where a metric does not apply.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import pandas as pd

from benchmark.store import atomic_path

STATUSES = ("ok", "failed")


@dataclass
class ResultRow:
    """One row of metrics.csv (see the module doc for units)."""

    experiment: str
    experiment_label: str
    method: str
    method_label: str
    mode: str  # one | multi
    status: str  # ok | failed
    reason: str = ""  # why the row failed
    n_samples: float = np.nan
    mmd_median: float = np.nan  # raw MMD^2 over layers (parameter-weighted) of the median over 20 kernels
    mmd_mean: float = np.nan
    mmd_max: float = np.nan
    ns_mmd_median: float = np.nan  # the same after removing the symmetries (evaluate.canonical_steps)
    ns_mmd_mean: float = np.nan
    ns_mmd_max: float = np.nan
    acc: float = np.nan
    nll: float = np.nan
    brier: float = np.nan
    ece: float = np.nan
    aupr: float = np.nan
    fpr95: float = np.nan
    id_mi: float = np.nan
    ood_mi: float = np.nan
    agreement: float = np.nan  # with the zoo ensemble's predictive (seed 002)
    tv: float = np.nan  # total variation to the zoo ensemble's predictive


COLUMNS: list[str] = [f.name for f in fields(ResultRow)]
KEY_COLUMNS = ["experiment", "method", "mode"]
TEXT_COLUMNS = ["experiment", "experiment_label", "method", "method_label", "mode", "status", "reason"]
VALUE_COLUMNS = [c for c in COLUMNS if c not in TEXT_COLUMNS]


def write_metrics(rows: list[dict], path: Path) -> pd.DataFrame:
    """Write ``rows`` (dicts with ``ResultRow``'s fields) to ``path`` atomically; return the frame."""
    frame = pd.DataFrame([ResultRow(**row).__dict__ for row in rows], columns=COLUMNS)
    with atomic_path(path) as tmp:
        frame.to_csv(tmp, index=False, float_format="%.8g")
    return frame


def check_metrics(frame: pd.DataFrame, source: str = "metrics.csv") -> pd.DataFrame:
    """Validate a metrics frame (columns, statuses, modes, unique keys, numeric values); return
    it with typed columns. Errors name ``source`` and the column."""
    if not isinstance(frame, pd.DataFrame):
        raise ValueError(f"{source}: expected a pandas DataFrame, got {type(frame).__name__}")
    missing = [c for c in COLUMNS if c not in frame.columns]
    if missing:
        raise ValueError(f"{source}: missing columns {missing}; expected the columns of benchmark.results.ResultRow")
    frame = frame[COLUMNS].copy()
    for column in TEXT_COLUMNS:
        frame[column] = frame[column].fillna("").astype(str)
    for column, allowed in (("mode", ("one", "multi")), ("status", STATUSES)):
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
