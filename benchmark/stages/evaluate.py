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
into the spread. So does a reference zoo trained under another model, data or recipe config than
this run's (``OtherRecipeError``, naming the fields that differ, the command that retrains it and
``evaluate.allow_other_recipe=true``, which accepts it: metrics.csv's ``reference_recipe`` then
says so; ``reference_config_hash`` always names the zoo's recipe). Every class of problem found
(an incomplete reference, another recipe, missing or stale repetitions) is named in one error.

Beside the methods, the baseline rows of ``evaluate.baselines`` (``benchmark.baselines``: the
prior, untrained networks, Gaussians fitted to the raw and the symmetry-free zoo, a second zoo of
the same recipe) are drawn and scored the same way over ``evaluate.baseline_repetitions``
repetitions, as rows of mode ``baseline`` (cached in ``eval/baseline_<name>_r<k>.json``); every row
carries what the zoo is (``Reference.description``: the spread of its training potential).

The reference and its forms are cached by ``benchmark.references``; each repetition's numbers are
cached in ``store/<experiment>/eval/``, keyed by the files they were computed from, the reference's
caches, the settings and the scoring code (``Reference.numbers_key``), so a second run recomputes
nothing and a fix in the scoring code recomputes everything. A damaged reference checkpoint stops
the stage with one error naming the files and the command that heals the zoo, never a table of
failed rows. Damaged caches (a number cache or a reference form: NaN, bit flip, truncation, a
directory or a dangling symlink in its place) are named and recomputed.

``reference=<name>`` (``benchmark.references``, ``conf/reference/<name>.yaml``) scores every row a
second time, against that reference, with the same machinery (``Reference.against(unit)``: what
each unit is scored against, e.g. a reference drawn by a method leaves that unit's own draws
out), plus, where the reference ``scores_zoo``, one row for the zoo itself (repetition k is the
k-th block of ``sample.per_method`` converged reference checkpoints, in seed order, scored as a
method's samples would be). Every row against every reference goes to the one ``metrics.csv`` and
``repetitions.csv``, told apart by their ``reference`` column (``benchmark.results``).
"""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any, Callable

import pandas as pd
import torch
from tqdm.auto import tqdm

from benchmark.baselines import BASELINES, selected as selected_baselines
from benchmark.results import BASELINE_MODE
from benchmark.core.fingerprint import stable_hash
from benchmark.core.training.predict import predict_samples
from benchmark.core.store import (
    CheckpointError, SampleSetMetadata, StoreError, Unit, atomic_write_text, clear_non_file, load_checkpoints_as_sample_set,
    read_metadata, sealed_json, unsealed_json,
)
from benchmark.experiment import Experiment
from benchmark.inventory import (
    MissingInputsError, ReferenceRecipe, StaleSamplesError, available_rows, describe_store, incomplete_range,
    reference_recipe, reference_seeds, require_inputs, row_label, row_units,
)
from benchmark.inventory.actions import reap_results_litter
from benchmark.references import REFERENCES, ZOO_ROW, Reference, ZooReference, evaluated, problems as reference_problems
from benchmark.results import (
    MEASURED, MMD_COLUMNS, half_width, layer_rows, layers_path, metrics_path, repetition_rows,
    repetitions_path, write_layers, write_metrics, write_repetitions,
)
from metrics.row import PER_LAYER
from metrics.uncertainty import interval

log = logging.getLogger(__name__)
NAME = "evaluate"
ZOO_LABEL = "Zoo (reference)"


class OtherRecipeError(StoreError):
    """The reference checkpoints were trained under another model, data or recipe config than this
    run's; the message names the differing fields, the command that retrains them and the override
    that accepts them (``evaluate.allow_other_recipe``)."""


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
        problem = reference_recipe(exp).problem(exp)
        if problem is not None and not exp.config.evaluate.allow_other_recipe:  # the warning comes with run
            raise OtherRecipeError(f"stage={NAME}: {problem}")
    drawn = frozenset(name for name in evaluated(exp) if "samples" in made and REFERENCES[name].drawn_by(exp))
    problems = reference_problems(exp, skip=drawn)
    if problems:
        raise MissingInputsError(f"stage={NAME} " + " | ".join(problems))


def require_complete_reference(exp: Experiment) -> None:
    """Refuse (``MissingInputsError``) a reference range with seeds not trained yet, naming how
    many and the command that trains them, unless ``evaluate.allow_partial`` (then one warning)."""
    problem = incomplete_reference(exp)
    if problem is not None:
        raise MissingInputsError(problem)


def incomplete_reference(exp: Experiment) -> str | None:
    """Why the reference range cannot be evaluated against (seeds not trained yet, the command that
    trains them), or ``None``; with ``evaluate.allow_partial`` one warning instead."""
    problem = incomplete_range(exp, exp.reference)
    if problem is None:
        return None
    present = len(reference_seeds(exp))
    if exp.config.evaluate.allow_partial:
        log.warning("%s; evaluating with the %d converged checkpoints present (evaluate.allow_partial=true)",
                    problem, present)
        return None
    return (f"stage={NAME} needs the whole reference zoo: {problem}; or pass "
            f"evaluate.allow_partial=true to evaluate with the {present} converged checkpoints present")


def other_recipe(exp: Experiment, recipe: ReferenceRecipe) -> str | None:
    """Why the reference cannot be used (trained under another recipe: ``ReferenceRecipe.problem``),
    or ``None``; with ``evaluate.allow_other_recipe`` one warning instead."""
    if recipe.other and exp.config.evaluate.allow_other_recipe:
        log.warning("%s; evaluating against them (evaluate.allow_other_recipe=true)", recipe.describe(exp))
        return None
    problem = recipe.problem(exp)
    return None if problem is None else f"stage={NAME}: {problem}"


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
    """Evaluate every (method, mode) present in the store against every evaluated reference
    (``benchmark.references.evaluated``: the zoo, and ``reference=<name>``'s); write
    ``results/<exp>/metrics.csv`` and ``results/<exp>/repetitions.csv`` (``reference`` column:
    which one each row is against); return the metrics.csv frame."""
    reap_results_litter(exp)
    rows = available_rows(exp)
    if not rows:
        raise StoreError(f"nothing to evaluate for {exp.name}: no sample set with predictions; the store holds: {describe_store(exp)}")
    problems: list[tuple[type[StoreError], str]] = []  # every class of problem, named before any work
    incomplete = incomplete_reference(exp)
    if incomplete is not None:
        problems.append((MissingInputsError, incomplete))
    other = other_recipe(exp, reference_recipe(exp))
    if other is not None:
        problems.append((OtherRecipeError, other))
    problems += [(MissingInputsError, f"stage={NAME} {problem}") for problem in reference_problems(exp)]
    units = {}
    for method, mode in rows:  # every missing or stale repetition
        try:
            units[(method, mode)] = row_units(exp, method, mode)
        except StaleSamplesError as err:
            problems.append((StaleSamplesError, str(err)))
    if problems:
        raise problems[0][0](" | ".join(message for _, message in problems))
    zoo = ZooReference(exp)
    out, per_repetition, per_layer = [], [], []
    for name in evaluated(exp):
        got, got_repetitions, got_layers = _score_against(exp, units, zoo,
                                                          zoo if name == zoo.name else REFERENCES[name].build(exp))
        out += got
        per_repetition += got_repetitions
        per_layer += got_layers
    write_repetitions(per_repetition, repetitions_path(exp.results_dir))
    write_layers(per_layer, layers_path(exp.results_dir))
    path = metrics_path(exp.results_dir)
    frame = write_metrics(out, path)
    log.info("wrote %s (%d rows, against %s)", path, len(frame), " and ".join(evaluated(exp)))
    return frame


def _baseline_rows(exp: Experiment, zoo: ZooReference, against: Reference) -> "Rows":
    """The baseline rows of ``evaluate.baselines`` (``benchmark.baselines``), drawn from ``zoo`` and
    scored against ``against`` over ``baseline_repetitions`` (the first in full), each as
    ``(row, numbers per repetition, repetitions, seeds)``; a baseline the store cannot supply
    (``second_zoo`` without its held-out networks) is left out with one warning."""
    out = []
    names = selected_baselines(exp)
    count = baseline_repetitions(exp)
    bar = tqdm(total=sum(count(name) for name in names), desc=f"evaluate {exp.name}: baselines against the {against.name}",
               unit="repetition", dynamic_ncols=True, disable=not names)
    for name in names:
        numbers, seeds = [], []
        repetitions = range(count(name))
        try:
            for k in repetitions:
                got, used = _baseline_numbers(exp, zoo, against, name, k, full=k == 0)
                numbers.append(got)
                seeds.append(used)
                bar.update()
        except ValueError as err:
            log.warning("%s; the row is left out", err)
            continue
        row = _row(exp, name, BASELINES[name].label, BASELINE_MODE, against)
        out.append((row, numbers, list(repetitions), seeds))
    bar.close()
    return out


def baseline_repetitions(exp: Experiment) -> Callable[[str], int]:
    """How many repetitions each baseline gets (``Design.baseline_repetitions``):
    ``evaluate.baseline_repetitions`` (null: the design's repetitions), one that reads held-out
    networks (``Baseline.held_out``) at most the design's repetitions (the second zoo: one held-out
    block each) or its ``most`` (the copies of the bases: ``Baseline.reach``)."""
    design, wanted = exp.design, exp.config.evaluate.baseline_repetitions
    return lambda name: design.baseline_repetitions(wanted, held_out=BASELINES[name].held_out, reach=BASELINES[name].reach)


def _baseline_numbers(exp: Experiment, zoo: ZooReference, against: Reference, name: str, repetition: int, full: bool
                      ) -> tuple[dict[str, Any], list[int] | None]:
    """Repetition ``repetition`` of baseline ``name`` scored against ``against`` (cached, keyed by the
    baseline, the repetition, its size, the networks it reads and the scoring key), and the seeds
    of the networks it holds (None for draws)."""
    per_method = exp.design.per_method
    baseline = BASELINES[name]
    networks = baseline.networks(exp, repetition, per_method)
    inputs = {"baseline": name, "repetition": repetition, "n": per_method, "full": full,
              "zoo": [zoo.key(c) for c in ("zoo", "canonical")], "recipe": exp.config_hash}
    key = stable_hash({"numbers": against.files_numbers_key(exp.store.checkpoint_paths(networks)), "inputs": inputs},
                      length=20)
    cached = exp.store.baseline_eval_path(name, repetition, against.name)
    hit = _cached_numbers(cached, key)
    if hit is None:
        samples, _ = baseline.draw(exp, zoo, per_method, repetition)
        preds = {"id": predict_samples(exp.model(), samples, exp.test_tensors[0]),
                 "ood": predict_samples(exp.model(), samples, exp.ood_tensors[0])}
        bad = [split for split, probs in preds.items() if not bool(torch.isfinite(probs).all())]
        if bad:  # e.g. a deep network under a broad prior overflows float32: the row says so, as a method's would
            hit = {"failed": f"baseline {name}: non-finite predictions on the {' and '.join(bad)} set(s) (the networks' "
                             "outputs overflow float32)"}
            log.error("%s, repetition %d: marked failed", hit["failed"], repetition)
        else:
            hit = against.score_samples(samples, preds, full=full, weight_matching=False)
        _store_numbers(cached, key, hit)
    return hit, networks or None


Rows = list[tuple[dict[str, Any], list[dict[str, Any]], list[int], list[list[int] | None]]]
"""Scored rows, each ``(row, numbers per repetition, repetitions, base seeds per repetition)``."""


def _score_rows(exp: Experiment, units: dict[tuple[str, str], list[Unit]], reference: Reference, extra: Rows = ()
                ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """Score every unit of ``units`` against ``reference.against(unit)`` and add the ``extra`` rows;
    return the metrics.csv rows, the repetitions.csv rows and the layers.csv rows (each with
    ``reference`` = its name)."""
    against = reference.name
    out, per_repetition, per_layer = [], [], []
    bar = tqdm(total=sum(len(u) for u in units.values()), desc=f"evaluate {exp.name} against the {against}",
               unit="repetition", dynamic_ncols=True)
    for (method, mode), row_of in units.items():
        numbers = []
        for unit in row_of:
            numbers.append(_numbers(exp, reference.against(unit), unit, full=unit == row_of[0]))
            bar.update()
        row = _row(exp, method, row_label(exp, method, mode), mode, reference.against(row_of[0]))
        row["ess"] = _mean_diagnostic(exp, row_of, "ess")
        row["stationary"] = _mean_diagnostic(exp, row_of, "stationary")
        out.append(combine(row, numbers))
        per_repetition += repetition_rows(row, numbers, [int(u.repetition) for u in row_of],
                                          [_base_seeds(exp, u) for u in row_of])
        per_layer += layer_rows(row, numbers[0].get(PER_LAYER) or [])
    bar.close()
    for row, numbers, repetitions, seeds in extra:
        out.append(combine(row, numbers))
        per_repetition += repetition_rows(row, numbers, repetitions, seeds)
        per_layer += layer_rows(row, numbers[0].get(PER_LAYER) or [])
    return out, per_repetition, per_layer


def _row(exp: Experiment, method: str, label: str, mode: str, ref: Reference) -> dict[str, Any]:
    """The identifying columns of a metrics row scored against ``ref`` (and what the reference is:
    ``Reference.description``)."""
    recipe = ref.recipe  # a zoo's (None for a reference that is not a trained zoo)
    return {**ref.description(), "experiment": exp.name, "experiment_label": exp.display_name, "method": method, "method_label": label,
            "mode": mode, "reference": ref.name, "status": "ok", "reason": "", "ns_steps": "+".join(ref.steps),
            "wm_anchor": "" if ref.anchor_seed is None else f"seed {ref.anchor_seed}", "n_reference": ref.size,
            "reference_config_hash": " ".join(recipe.config_hashes) if recipe else "",
            "reference_recipe": recipe.note() if recipe else ""}


def _score_against(exp: Experiment, units: dict[tuple[str, str], list[Unit]], zoo: ZooReference, reference: Reference
                   ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """Every row against ``reference`` (each unit against ``reference.against(unit)``), the baseline
    rows (drawn from ``zoo``) and, where ``reference.scores_zoo``, the zoo's row (``zoo_blocks``);
    the metrics.csv, repetitions.csv and layers.csv rows."""
    health = reference.health()
    if health is not None:
        log.info("%s", health)
    extra: Rows = []
    if reference.scores_zoo:
        blocks = zoo_blocks(exp, zoo)
        numbers, seeds = [], []
        for k, block in enumerate(tqdm(blocks, desc=f"evaluate {exp.name}: the zoo against the {reference.name}",
                                       unit="block", dynamic_ncols=True)):
            numbers.append(_zoo_block_numbers(exp, reference, zoo, k, block, full=k == 0))
            seeds.append(block)
        extra.append((_row(exp, ZOO_ROW[0], ZOO_LABEL, ZOO_ROW[1], reference), numbers, list(range(len(blocks))), seeds))
    return _score_rows(exp, units, reference, [*extra, *_baseline_rows(exp, zoo, reference)])


def zoo_blocks(exp: Experiment, zoo: ZooReference) -> list[list[int]]:
    """The zoo row's repetitions (``Design.reference_blocks``): the design's repetitions as disjoint
    blocks of the converged reference seeds, in seed order, of ``sample.per_method`` each (the size
    of a method's sample set), or of an equal share of the zoo when it is smaller; ``StoreError``
    with fewer than 2 per block."""
    design = exp.design
    blocks = design.reference_blocks(zoo.seeds)
    if len(blocks[0]) < 2:
        raise StoreError(f"the zoo's own row (against reference={exp.config.reference.name}) needs {design.repetitions} "
                         f"blocks of at least 2 converged reference checkpoints, the store has {len(zoo.seeds)}")
    return blocks


def _zoo_block_numbers(exp: Experiment, against: Reference, zoo: ZooReference, k: int, seeds: list[int], full: bool
                       ) -> dict[str, Any]:
    """The numbers of the zoo's block ``k`` (checkpoints ``seeds``) against ``against`` (a reference
    with ``scores_zoo``), cached as a unit's are."""
    paths = exp.store.checkpoint_paths(seeds)
    key = against.files_numbers_key(paths)
    cached = _cache_path(exp, exp.store.sample_unit(*ZOO_ROW, k), against.name)
    hit = _cached_numbers(cached, key)
    if hit is not None:
        return hit
    checked = set(zoo.checked_paths())  # validated whole once (checksums, keys, shapes, finite)
    samples = load_checkpoints_as_sample_set(paths, validated=all(p in checked for p in paths))
    model = exp.model()
    preds = {"id": predict_samples(model, samples, exp.test_tensors[0]),
             "ood": predict_samples(model, samples, exp.ood_tensors[0])}
    numbers = against.score_samples(samples, preds, full=full)
    _store_numbers(cached, key, numbers)
    return numbers


def _numbers(exp: Experiment, ref: Reference, unit: Unit, full: bool) -> dict[str, Any]:
    """The numbers of ``unit`` against ``ref``: from its cache when the key matches, else scored and cached."""
    key = ref.numbers_key(unit)
    cached = _cache_path(exp, unit, ref.name)
    hit = _cached_numbers(cached, key)
    if hit is not None:
        return hit
    numbers = ref.score(unit, full=full)
    _store_numbers(cached, key, numbers)
    return numbers


def _cache_path(exp: Experiment, unit: Unit, against: str) -> Path:
    """``eval/<unit>.json`` for the numbers against the zoo, ``eval/<unit>.<reference>.json`` otherwise."""
    path = exp.store.eval_path(unit)
    return path if against == "zoo" else path.with_suffix(f".{against}.json")


def _store_numbers(path: Path, key: str, numbers: dict[str, Any]) -> None:
    removed = clear_non_file(path)  # a directory or a dangling symlink in its place
    if removed:
        log.warning("%s; writing these numbers there", removed)
    payload = json.loads(json.dumps({"key": key, "numbers": numbers}, default=_jsonable))
    atomic_write_text(path, sealed_json(payload))


def _base_seeds(exp: Experiment, unit: Unit) -> list[int] | None:
    """The base seeds ``unit``'s samples were drawn around (their metadata); ``None`` when not
    recorded (an external sample set)."""
    seeds = SampleSetMetadata.decode(read_metadata(exp.store.samples_path(unit))).base_seeds
    return [int(s) for s in seeds] if seeds else None


def _mean_diagnostic(exp: Experiment, units: list[Unit], name: str) -> float:
    """The mean over ``units`` of the diagnostic ``name`` their samples recorded (e.g. the Markov-chain
    methods' ``ess``, SGHMC's ``stationary`` flag); NaN where none did."""
    values = [SampleSetMetadata.decode(read_metadata(exp.store.samples_path(u))).diagnostics or {} for u in units]
    found = [float(v[name]) for v in values if v.get(name) is not None and not math.isnan(float(v[name]))]
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
