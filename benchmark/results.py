"""``results/<experiment>/metrics.csv``: the one schema of a result row, written by the
evaluate stage and read by the report.

One row per (experiment, method, mode, reference). Labels are the display names the tables print (the
experiment's ``display_name``, the method's ``label``), so a report can be rendered from the
CSV files alone. Values are raw: fractions for accuracy, ECE, AUPR, FPR95; MMD^2 unitless; MI in
nats; NaN where a metric does not apply. Each value is the mean over ``n_repetitions``
independent repetitions of the sample stage, and ``<value>_hw`` the half-width of its 95%
interval (``metrics.uncertainty.interval``: the spread over repetitions, and for MMD also the
standard error due to the finite reference zoo; NaN for a single repetition). ``mmd_reject``/``ns_mmd_reject``: the fraction of layers
whose MMDAgg test rejects "same distribution" at level 0.05 (first repetition). ``ns_steps``:
the symmetries removed for the NS columns (``scale+sort`` ...). ``wm_mmd_*``: MMD with the
permutations removed by weight matching every network to one anchor instead of sorting
(``wm_anchor`` names it, e.g. ``seed 0``; empty and NaN with ``evaluate.weight_matching=false``).
``n_reference``: the number of converged reference checkpoints the row was scored against (the
whole ``seeds.reference`` range less its failed seeds, unless ``evaluate.allow_partial``); NaN
in a metrics.csv written before the column existed. ``ess``: for a method whose samples are states
of one Markov chain (the SGHMC rows: a sampler that records an ``ess`` diagnostic), the effective
sample size of its kept states as the sampler measured it, mean over repetitions; NaN for the
others and in older files; ``stationary``: for a sampler that records whether its chains passed its
stationarity check (SGHMC: split R-hat of the training log-likelihood between each chain's halves
below 1.05), the fraction of repetitions whose chains did; NaN otherwise. ``reference_config_hash``: the config hash(es) the reference
checkpoints were trained under (``Experiment.config_hash``; ``unrecorded`` for imported ones);
``reference_recipe``: empty, or what ``evaluate.allow_other_recipe=true`` accepted (a reference
trained under another recipe, with the fields that differ); both empty in older files.
``reference_potential_p05``/``_median``/``_p95``: the 5th, 50th and 95th percentiles over the zoo's
checkpoints of their training potential (summed training cross-entropy plus the recipe's L2 prior
term, nats; ``ZooReference.training_potential``), ``reference_train_acc`` their median training
accuracy and ``reference_potential_n`` how many checkpoints these describe: what kind of reference
the zoo is (an SGD ensemble whose members differ by hundreds of nats, not draws from the T = 1
posterior); the same on every row scored against the zoo, NaN against other references and in older files.

Rows of ``mode`` ``baseline`` are baseline rows (``benchmark.baselines``: the prior, untrained
networks, Gaussians fitted to the zoo, a second zoo), scored like a method's samples over the same
repetitions and never ranked among the methods.

``mmd_shared_median``/``ns_mmd_shared_median``: MMD and NS MMD (median over the 20 kernels) with
one bandwidth grid per layer shared by every row of the experiment, chosen from the reference
alone (``metrics.mmd.reference_bandwidths``), so that rows are on one scale. Only the median
(the statistic Table 1, Table 3 and the claims rank rows by): the question these columns answer
is whether that ranking depends on per-row bandwidths.

``energy``/``ns_energy``: the energy coefficient of the raw and symmetry-free weights
(``metrics.mmd.energy``: the distance kernel's MMD, which has no bandwidth to follow the sample, so a
sample of copies of one network does not sit at a ceiling as the Gaussian and Laplace MMDs do), per
layer, then the mean over layers weighted by parameter count; unitless, 0 for the reference's own
distribution; NaN in older files.

``results/<experiment>/repetitions.csv``: the numbers behind each metrics.csv row, one row per
(experiment, method, mode, reference, repetition): the repetition's base seeds (space-separated, empty when
unknown, e.g. an external sample set), its status, every measured column, ``<column>_ref_sd``
for the MMD columns (the reference zoo's standard error from its halves; first repetition only,
NaN elsewhere) and the test columns. The paired comparisons of the findings read it.

``results/<experiment>/layers.csv``: the layers behind the first repetition of each row (the one
scored in full): per (experiment, method, mode, reference, form, layer) its ``n_params`` and the
median, mean and max over the 20 kernels and the energy coefficient (raw, unscaled), for the
diagnostics' per-layer table.

``reference`` (the column): the name of the reference the row was scored against (a registered
reference, ``benchmark.references``): ``zoo`` (every run: the
rows of the tables and the findings) or the name of another registered reference
(``reference=<name>``: ``n_reference`` counts its draws, ``agreement``/``tv`` are against its
predictive, the WM columns are empty where it has no weight-matched form, and where it scores the
zoo there is also a ``zoo`` row: blocks of ``sample.per_method`` reference checkpoints scored as a
method would be); a row is keyed by (experiment, method, mode, reference), in both files.
``rows_against`` selects one reference's rows.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd

from benchmark.core.store import MODES, atomic_path
from metrics.columns import keys

STATUSES = ("ok", "failed")
BASELINE_MODE = "baseline"
"""The ``mode`` (table group) of the baseline rows (``benchmark.baselines``)."""
RESULT_MODES = (*MODES, BASELINE_MODE)
"""A row's ``mode``: a method's (``one``, ``multi``) or ``BASELINE_MODE``."""
KEY_COLUMNS = ["experiment", "method", "mode", "reference"]
TEXT_COLUMNS = ["experiment", "experiment_label", "method", "method_label", "mode", "reference", "status", "reason", "ns_steps",
                "wm_anchor", "reference_config_hash", "reference_recipe"]
COUNT_COLUMNS = ["n_samples", "n_repetitions", "n_reference", "ess", "stationary"]
REFERENCE_COLUMNS = ["reference_potential_p05", "reference_potential_median", "reference_potential_p95",
                     "reference_train_acc", "reference_potential_n"]
ENERGY_COLUMNS = ("energy", "ns_energy")
ADDED_COLUMNS = ("n_reference", "ess", "stationary", *REFERENCE_COLUMNS, *ENERGY_COLUMNS,
                 *(f"{c}_hw" for c in ENERGY_COLUMNS))  # absent from older metrics.csv files: read as NaN
ADDED_REPETITION_COLUMNS = (*ENERGY_COLUMNS, *(f"{c}_ref_sd" for c in ENERGY_COLUMNS))  # absent from older repetitions.csv: NaN
ADDED_TEXT_COLUMNS = ("reference_config_hash", "reference_recipe")  # absent from older files: read as ""
MMD_COLUMNS = list(keys("weight"))  # the weight-space distances (metrics.columns: one definition per column)
METRIC_COLUMNS = list(keys("predictive"))
MEASURED = MMD_COLUMNS + METRIC_COLUMNS  # the columns that get an interval
TEST_COLUMNS = list(keys("test"))




def metrics_path(results_dir: Path) -> Path:
    """``results/<experiment>/metrics.csv``: every row against every evaluated reference."""
    return Path(results_dir) / "metrics.csv"


def figures_dir(results_dir: Path) -> Path:
    """``results/<experiment>/figures/``: the figures of the analyses and the report's zoo curves."""
    return results_dir / "figures"


def repetitions_path(results_dir: Path) -> Path:
    """The per-repetition numbers beside ``metrics_path``: ``repetitions.csv``."""
    return Path(results_dir) / "repetitions.csv"


def rows_against(frame: pd.DataFrame, reference: str) -> pd.DataFrame:
    """The rows of a metrics or repetitions frame scored against ``reference`` (its ``reference``
    column), index reset; empty when there are none."""
    if "reference" not in frame.columns:
        raise ValueError(f"rows_against: the frame has no 'reference' column (columns: {list(frame.columns)[:8]} ...)")
    return frame[frame["reference"] == reference].reset_index(drop=True)


def half_width(column: str) -> str:
    """The metrics.csv column holding the 95% half-width of ``column``."""
    return f"{column}_hw"


def reference_sd(column: str) -> str:
    """The repetitions.csv column holding the reference zoo's standard error of MMD ``column``."""
    return f"{column}_ref_sd"


COLUMNS: list[str] = TEXT_COLUMNS + COUNT_COLUMNS + REFERENCE_COLUMNS + MEASURED + [half_width(c) for c in MEASURED] + TEST_COLUMNS
VALUE_COLUMNS = [c for c in COLUMNS if c not in TEXT_COLUMNS]

REPETITION_KEY_COLUMNS = KEY_COLUMNS + ["repetition"]
REPETITION_TEXT_COLUMNS = ["experiment", "method", "mode", "reference", "status", "reason", "base_seeds"]
REPETITION_COLUMNS: list[str] = (["experiment", "method", "mode", "reference", "repetition", "status", "reason", "base_seeds",
                                  "n_samples"]
                                 + MEASURED + [reference_sd(c) for c in MMD_COLUMNS] + TEST_COLUMNS)
REPETITION_VALUE_COLUMNS = [c for c in REPETITION_COLUMNS if c not in REPETITION_TEXT_COLUMNS + ["repetition"]]


LAYER_COLUMNS = ["experiment", "method", "mode", "reference", "form", "layer", "n_params", "median", "mean", "max",
                 "energy"]


def layers_path(results_dir: Path) -> Path:
    """The per-layer numbers beside ``metrics_path``: ``layers.csv``."""
    return Path(results_dir) / "layers.csv"


def layer_rows(row: Mapping[str, Any], records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The layers.csv rows of one metrics row (``row``: its keys) from the per-layer ``records`` of
    its first repetition (``metrics.row.Scored.numbers``)."""
    return [{**{k: row[k] for k in KEY_COLUMNS}, **{c: record.get(c, math.nan) for c in LAYER_COLUMNS[4:]}}
            for record in records]


def write_layers(rows: list[dict], path: Path) -> pd.DataFrame:
    """Write ``rows`` (keyed by ``LAYER_COLUMNS``) to ``path`` atomically; return the frame."""
    frame = pd.DataFrame(rows, columns=LAYER_COLUMNS)
    with atomic_path(path) as tmp:
        frame.to_csv(tmp, index=False, float_format="%.8g")
    return frame


def read_layers(path: Path) -> pd.DataFrame:
    """layers.csv at ``path``; ``ValueError`` naming a missing column."""
    frame = pd.read_csv(path)
    missing = [c for c in LAYER_COLUMNS if c not in frame.columns]
    if missing:
        raise ValueError(f"{path}: missing columns {missing}; expected benchmark.results.LAYER_COLUMNS")
    return frame[LAYER_COLUMNS]


def write_metrics(rows: list[dict], path: Path) -> pd.DataFrame:
    """Write ``rows`` (dicts keyed by ``COLUMNS``; missing values become NaN or "") to ``path``
    atomically; return the validated frame."""
    return _write(rows, path, COLUMNS, TEXT_COLUMNS, "metrics.csv", "COLUMNS", check_metrics)


def check_metrics(frame: pd.DataFrame, source: str = "metrics.csv") -> pd.DataFrame:
    """Validate a metrics frame (columns, among them ``reference``; statuses, modes, references
    named, unique (experiment, method, mode, reference) keys, numeric values); return it with typed
    columns. Errors name ``source`` and the column."""
    if isinstance(frame, pd.DataFrame):  # columns added later: NaN in older files
        frame = frame.assign(**{c: math.nan for c in ADDED_COLUMNS if c not in frame.columns},
                             **{c: "" for c in ADDED_TEXT_COLUMNS if c not in frame.columns})
    return _check(frame, source, COLUMNS, TEXT_COLUMNS, KEY_COLUMNS, VALUE_COLUMNS, "COLUMNS")


def read_metrics(path: Path) -> pd.DataFrame:
    """metrics.csv at ``path``, validated (``check_metrics``)."""
    return check_metrics(pd.read_csv(path, keep_default_na=True), source=str(path))


def repetition_rows(row: Mapping[str, Any], numbers: Sequence[Mapping[str, Any]], repetitions: Sequence[int],
                    base_seeds: Sequence[Sequence[int] | None]) -> list[dict[str, Any]]:
    """The repetitions.csv rows of one (method, mode) unit.

    ``row``: holds the unit's ``experiment``, ``method``, ``mode`` and ``reference`` (the metrics.csv row's keys);
    ``numbers[i]``: the numbers of repetition ``repetitions[i]`` as the evaluate stage computes
    them (``{"failed": reason}`` for an unusable one; keys outside ``REPETITION_COLUMNS`` are
    ignored, missing ones become NaN); ``base_seeds[i]``: its base seeds (``None``: unknown).
    """
    if not len(numbers) == len(repetitions) == len(base_seeds):
        raise ValueError(f"repetition_rows: {len(numbers)} numbers, {len(repetitions)} repetitions and "
                         f"{len(base_seeds)} base-seed lists given; expected one of each per repetition")
    out = []
    for values, repetition, seeds in zip(numbers, repetitions, base_seeds):
        failed = "failed" in values
        out.append({"experiment": row["experiment"], "method": row["method"], "mode": row["mode"],
                    "reference": row["reference"], "repetition": int(repetition), "status": "failed" if failed else "ok",
                    "reason": str(values["failed"]) if failed else "",
                    "base_seeds": " ".join(str(int(s)) for s in seeds) if seeds is not None else "",
                    **{c: values[c] for c in REPETITION_VALUE_COLUMNS if c in values}})
    return out


def parse_base_seeds(text: str) -> frozenset[int]:
    """The seeds of a ``base_seeds`` cell (space-separated integers; empty: none known)."""
    return frozenset(int(s) for s in str(text).split())


def write_repetitions(rows: list[dict], path: Path) -> pd.DataFrame:
    """Write ``rows`` (dicts keyed by ``REPETITION_COLUMNS``, e.g. from ``repetition_rows``;
    missing values become NaN or "") to ``path`` (``results/<experiment>/repetitions.csv``)
    atomically; return the validated frame."""
    return _write(rows, path, REPETITION_COLUMNS, REPETITION_TEXT_COLUMNS, "repetitions.csv", "REPETITION_COLUMNS",
                  check_repetitions)


def check_repetitions(frame: pd.DataFrame, source: str = "repetitions.csv") -> pd.DataFrame:
    """Validate a repetitions frame (columns, statuses, modes, references named, repetition numbers
    >= 0, base seeds, unique (experiment, method, mode, reference, repetition) keys, numeric values); return it with typed
    columns (``repetition`` int64). Errors name ``source`` and the column."""
    if isinstance(frame, pd.DataFrame):  # columns added later: NaN in older files
        frame = frame.assign(**{c: math.nan for c in ADDED_REPETITION_COLUMNS if c not in frame.columns})
    if isinstance(frame, pd.DataFrame) and "repetition" in frame.columns:
        numbers = pd.to_numeric(frame["repetition"], errors="coerce")
        bad = frame.loc[~(numbers.notna() & (numbers >= 0) & (numbers == numbers.round())), "repetition"]
        if len(bad):
            raise ValueError(f"{source}: column 'repetition' expects integers >= 0, got {sorted(map(str, bad))}")
        frame = frame.assign(repetition=numbers.astype(np.int64))
    frame = _check(frame, source, REPETITION_COLUMNS, REPETITION_TEXT_COLUMNS, REPETITION_KEY_COLUMNS,
                   REPETITION_VALUE_COLUMNS, "REPETITION_COLUMNS")
    seeds = frame["base_seeds"].str.fullmatch(r"\s*(-?\d+(\s+-?\d+)*)?\s*")
    if not seeds.all():
        raise ValueError(f"{source}: column 'base_seeds' expects space-separated integers, got "
                         f"{sorted(frame.loc[~seeds, 'base_seeds'])[:3]}")
    return frame


def read_repetitions(path: Path) -> pd.DataFrame:
    """repetitions.csv at ``path``, validated (``check_repetitions``)."""
    return check_repetitions(pd.read_csv(path, keep_default_na=True, dtype={"base_seeds": str}), source=str(path))


def _write(rows: list[dict], path: Path, columns: list[str], text: list[str], name: str, constant: str,
           check) -> pd.DataFrame:
    unknown = sorted({k for row in rows for k in row} - set(columns))
    if unknown:
        raise ValueError(f"{name.split('.')[0]} rows have columns {unknown} that {name} does not "
                         f"(benchmark.results.{constant})")
    filled = [{c: row.get(c, "" if c in text else math.nan) for c in columns} for row in rows]
    frame = check(pd.DataFrame(filled, columns=columns), source=str(path))
    with atomic_path(path) as tmp:
        frame.to_csv(tmp, index=False, float_format="%.8g")
    return frame


def _check(frame: pd.DataFrame, source: str, columns: list[str], text: list[str], keys: list[str],
           values: list[str], constant: str) -> pd.DataFrame:
    if not isinstance(frame, pd.DataFrame):
        raise ValueError(f"{source}: expected a pandas DataFrame, got {type(frame).__name__}")
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise ValueError(f"{source}: missing columns {missing}; expected the columns of benchmark.results.{constant}")
    frame = frame[columns].copy()
    for column in text:
        frame[column] = frame[column].fillna("").astype(str)
    for column, allowed in (("mode", RESULT_MODES), ("status", STATUSES)):
        bad = sorted(set(frame[column]) - set(allowed))
        if bad:
            raise ValueError(f"{source}: column {column!r} expects values in {list(allowed)}, got {bad}")
    unnamed = frame["reference"].str.strip() == ""
    if unnamed.any():
        raise ValueError(f"{source}: column 'reference' expects the name of what each row was scored against "
                         f"(e.g. 'zoo', 'hmc'), got an empty value in {int(unnamed.sum())} row(s)")
    duplicated = frame.duplicated(keys, keep=False)
    if duplicated.any():
        found = frame.loc[duplicated, keys].drop_duplicates()
        raise ValueError(f"{source}: duplicate ({', '.join(keys)}) rows: {found.values.tolist()}")
    for column in values:
        try:
            frame[column] = pd.to_numeric(frame[column]).astype(np.float64)
        except (ValueError, TypeError) as error:
            raise ValueError(f"{source}: column {column!r} expects numbers ({error})") from None
    return frame
