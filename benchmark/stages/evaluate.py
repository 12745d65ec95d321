"""Evaluate stage: for every method x mode in the store, raw and symmetry-free (NS) MMD against
the reference zoo plus the predictive metrics, into ``results/<experiment>/metrics.csv``; with
``evaluate.weight_matching`` also WM MMD (the NS steps with the permutations removed by weight
matching every network, zoo and samples, to one anchor: the lowest converged reference seed).

Each of the ``sample.repetitions`` repetitions of a row is scored on its own
(``Reference.score``) and the row holds their mean and 95% half-width (``metrics.uncertainty``);
the first repetition also gets MMDAgg's test per layer and the MMD of
``evaluate.reference_resamples`` halves of the reference, whose spread is the standard error due
to the finite zoo. Every repetition's own numbers, with the base seeds it was drawn around (its
samples' metadata), go to ``results/<experiment>/repetitions.csv``: the paired comparisons of
the findings read them. Raw and NS MMD are also measured with one bandwidth grid per layer
shared by every row (``mmd_shared_median``, ``ns_mmd_shared_median``; ``Reference.shared_bandwidths``). A repetition that is missing or stale (settings or code changed since it was
drawn) stops the stage with the files named and the command that redoes them: it is never mixed
into the spread.

The reference and its forms are cached by ``benchmark.reference``; each repetition's numbers are
cached in ``store/<experiment>/eval/``, keyed by the files they were computed from, the reference's
caches, the settings and the scoring code (``Reference.numbers_key``), so a second run recomputes
nothing and a fix in the scoring code recomputes everything. A damaged reference checkpoint stops
the stage with one error naming the files and the command that heals the zoo, never a table of
failed rows. Damaged caches are recomputed.
"""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import pandas as pd
from tqdm.auto import tqdm

from benchmark.core.store import (
    CheckpointError, SampleSetMetadata, StoreError, Unit, atomic_write_text, read_metadata, sealed_json, unsealed_json,
)
from benchmark.experiment import Experiment
from benchmark.inventory import (
    MissingInputsError, StaleSamplesError, available_rows, describe_store, incomplete_range, reference_seeds,
    reap_results_litter, require_inputs, row_label, row_units,
)
from benchmark.reference import Reference
from benchmark.results import MEASURED, MMD_COLUMNS, half_width, repetition_rows, write_metrics, write_repetitions
from metrics.uncertainty import interval

log = logging.getLogger(__name__)
NAME = "evaluate"


def needs(exp: Experiment) -> frozenset[str]:
    """The reference zoo and the methods' samples."""
    return frozenset({"reference", "samples"})


def produces(exp: Experiment) -> frozenset[str]:
    """``results/<experiment>/metrics.csv`` (and ``repetitions.csv`` beside it)."""
    return frozenset({"metrics"})


def check(exp: Experiment, made: frozenset[str] = frozenset()) -> None:
    """The data on disk, and the store inputs no earlier stage of this run makes."""
    exp.check_data()
    require_inputs(exp, needs(exp) - made, f"stage={NAME}")
    if "reference" not in made:
        require_complete_reference(exp)


def require_complete_reference(exp: Experiment) -> None:
    """Refuse (``MissingInputsError``) a reference range with seeds not trained yet, naming how
    many and the command that trains them, unless ``evaluate.allow_partial`` (then one warning)."""
    problem = incomplete_range(exp, exp.reference)
    if problem is None:
        return
    present = len(reference_seeds(exp))
    if exp.config.evaluate.allow_partial:
        log.warning("%s; evaluating with the %d converged checkpoints present (evaluate.allow_partial=true)",
                    problem, present)
        return
    raise MissingInputsError(f"stage={NAME} needs the whole reference zoo: {problem}; or pass "
                             f"evaluate.allow_partial=true to evaluate with the {present} converged checkpoints present")


def combine(row: dict[str, Any], repetitions: list[dict[str, Any]]) -> dict[str, Any]:
    """The metrics.csv row of ``row``'s unit from its repetitions' numbers: each measured value's
    mean and 95% half-width (the MMD ones widened by the reference's standard error)."""
    failed = [rep["failed"] for rep in repetitions if "failed" in rep]
    if failed:
        return {**row, "status": "failed", "reason": failed[0]}
    first = repetitions[0]
    row = {**row, "n_samples": first["n_samples"], "n_repetitions": len(repetitions),
           "mmd_reject": first.get("mmd_reject", math.nan), "ns_mmd_reject": first.get("ns_mmd_reject", math.nan)}
    for column in MEASURED:
        extra = first.get(f"{column}_ref_sd", math.nan) if column in MMD_COLUMNS else math.nan
        row[column], row[half_width(column)] = interval([rep[column] for rep in repetitions], extra)
    return row


def run(exp: Experiment) -> pd.DataFrame:
    """Evaluate every (method, mode) present in the store; write ``results/<exp>/metrics.csv`` and
    ``results/<exp>/repetitions.csv``."""
    reap_results_litter(exp)
    rows = available_rows(exp)
    if not rows:
        raise StoreError(f"nothing to evaluate for {exp.name}: no sample set with predictions; the store holds: {describe_store(exp)}")
    require_complete_reference(exp)
    units, stale = {}, []
    for method, mode in rows:  # every missing or stale repetition is named before any work
        try:
            units[(method, mode)] = row_units(exp, method, mode)
        except StaleSamplesError as err:
            stale.append(str(err))
    if stale:
        raise StaleSamplesError(" | ".join(stale))
    ref = Reference(exp)
    out, per_repetition = [], []
    bar = tqdm(total=sum(len(u) for u in units.values()), desc=f"evaluate {exp.name}", unit="repetition",
               dynamic_ncols=True)
    for (method, mode), row_of in units.items():
        numbers = []
        for unit in row_of:
            numbers.append(_numbers(exp, ref, unit, full=unit == row_of[0]))
            bar.update()
        row = {"experiment": exp.name, "experiment_label": exp.display_name, "method": method,
               "method_label": row_label(exp, method, mode), "mode": mode, "status": "ok", "reason": "",
               "ns_steps": "+".join(ref.steps), "wm_anchor": "" if ref.anchor_seed is None else f"seed {ref.anchor_seed}",
               "n_reference": len(ref.seeds)}
        row["ess"] = _mean_ess(exp, row_of)
        out.append(combine(row, numbers))
        per_repetition += repetition_rows(row, numbers, [int(u.repetition) for u in row_of],
                                          [_base_seeds(exp, u) for u in row_of])
    bar.close()
    write_repetitions(per_repetition, exp.results_dir / "repetitions.csv")
    path = exp.results_dir / "metrics.csv"
    frame = write_metrics(out, path)
    log.info("wrote %s (%d rows, reference of %d checkpoints)", path, len(frame), len(ref.seeds))
    return frame


def _numbers(exp: Experiment, ref: Reference, unit: Unit, full: bool) -> dict[str, Any]:
    """The numbers of ``unit``: from its cache when the key matches, else scored and cached."""
    key = ref.numbers_key(unit)
    cached = exp.store.eval_path(unit)
    hit = _cached_numbers(cached, key)
    if hit is not None:
        return hit
    numbers = ref.score(unit, full=full)
    payload = json.loads(json.dumps({"key": key, "numbers": numbers}, default=_jsonable))
    atomic_write_text(cached, sealed_json(payload))
    return numbers


def _base_seeds(exp: Experiment, unit: Unit) -> list[int] | None:
    """The base seeds ``unit``'s samples were drawn around (their metadata); ``None`` when not
    recorded (an external sample set)."""
    seeds = SampleSetMetadata.decode(read_metadata(exp.store.samples_path(unit))).base_seeds
    return [int(s) for s in seeds] if seeds else None


def _mean_ess(exp: Experiment, units: list[Unit]) -> float:
    """The mean over ``units`` of the ``ess`` diagnostic their samples recorded (Markov-chain
    methods); NaN where none did."""
    values = [SampleSetMetadata.decode(read_metadata(exp.store.samples_path(u))).diagnostics or {} for u in units]
    found = [float(v["ess"]) for v in values if v.get("ess") is not None and not math.isnan(float(v["ess"]))]
    return sum(found) / len(found) if found else math.nan


def _cached_numbers(path: Path, key: str) -> dict[str, Any] | None:
    """The cached numbers at ``path`` if they were computed for ``key`` and match their checksum
    (``store.sealed_json``); a damaged cache is recomputed, with one log line."""
    try:
        text = path.read_text()
    except OSError:
        return None
    try:
        cached = unsealed_json(text, str(path))
        if cached.get("key") != key:
            return None
        return _from_json(dict(cached["numbers"]))
    except (CheckpointError, KeyError, AttributeError, TypeError, ValueError) as err:
        log.warning("%s; recomputing these numbers", err)
        return None


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return None
    return float(value)


def _from_json(numbers: dict[str, Any]) -> dict[str, Any]:
    return {k: math.nan if v is None else v for k, v in numbers.items()}
