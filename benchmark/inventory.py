"""What the store holds for an experiment, and whether it is usable: the query layer the stages,
the report and the analyses share (none of them asks another stage).

- the zoo: converged seeds of a range, the state of a range (checkpoints, failures, quarantined
  files, accuracies), what is wrong with one seed's files, the one error for damaged checkpoints;
- the sample units: which (method, mode, repetition) units a config asks for (repetitions always
  come from the repetition design, ``benchmark.design``), what a done unit's metadata must hold under the current
  settings and code (``sample_settings_hash``: narrowed to the method's own code) and which held-out
  seeds it must have read (``read_seeds``, ``moved_seeds``: not the range's bounds, so a range grown
  at its end keeps every unit drawn), the state of a unit's two files (missing, stale, corrupt), the
  rows present, the repetitions a row averages;
- ``quarantine_and_redo``: the one helper that moves damaged files aside, one log line each,
  used by the zoo, sample and verify stages.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

from benchmark.core.fingerprint import code_fingerprint, stable_hash
from benchmark.core.store import (
    MODES, CheckpointError, CheckpointMetadata, ExperimentStore, SampleSetMetadata, StoreError, Unit, broken_link, check_file,
    content_digest, quarantine, quarantined, read_metadata, stored_checksums,
)
from benchmark.design import Design
from benchmark.experiment import Experiment, SeedRange
from methods import PosteriorMethod, method_class, method_names, selected

log = logging.getLogger(__name__)


class CorruptZooError(StoreError):
    """Checkpoints a stage needs fail validation; the message names them and the command that heals them."""


class StaleSamplesError(StoreError):
    """A repetition of a row is missing or was drawn with other settings or code."""


class MissingInputsError(StoreError):
    """A stage or an analysis needs something the store lacks; the message names the command that makes it."""


def corrupt_zoo_error(exp: Experiment, problems: dict[Path, str], what: str = "zoo checkpoint(s)") -> CorruptZooError:
    """The one error for damaged checkpoints: each file and what is wrong, then how to heal the store."""
    details = "; ".join(problems.values())
    return CorruptZooError(
        f"{len(problems)} {what} of {exp.name} fail validation: {details}. Heal the store with "
        f"python -m benchmark stage=zoo experiment={exp.name} (quarantines and retrains them) or "
        f"python -m benchmark stage=verify experiment={exp.name} verify.repair=true (quarantines them)"
    )


# ---- the zoo -----------------------------------------------------------------------------------


def converged(exp: Experiment, seeds: SeedRange) -> list[int]:
    """Seeds of ``seeds`` with a checkpoint and no failure record (sorted)."""
    return exp.store.converged_seeds(seeds.start, seeds.stop)


def trained_prefix(exp: Experiment, seeds: SeedRange) -> tuple[list[int], int | None]:
    """The converged seeds of ``seeds`` before its first seed not trained yet (in seed order), and
    that seed (``None`` when every seed is trained): the converged seeds whose positions no later
    training can move. The sample stage takes its bases from them (``select_bases``), and a unit's
    held-out seeds are judged on them (``moved_seeds``), so neither needs the rest of the range."""
    untrained = untrained_seeds(exp, seeds)
    gap = untrained[0] if untrained else None
    return [s for s in converged(exp, seeds) if gap is None or s < gap], gap


def untrained_seeds(exp: Experiment, seeds: SeedRange) -> list[int]:
    """Seeds of ``seeds`` with neither a checkpoint nor a failure record (not trained yet, or in
    flight), sorted. Quarantined seeds count as untrained: the next zoo run retrains them."""
    store = exp.store
    done = set(store.completed_seeds()) | set(store.failed_seeds()) | set(store.unreadable_failure_records())
    return [s for s in range(seeds.start, seeds.stop) if s not in done]


def incomplete_range(exp: Experiment, seeds: SeedRange) -> str | None:
    """Why range ``seeds`` is not complete (how many seeds are not trained yet, and the command
    that trains them), or ``None`` when every seed has a checkpoint or a failure record."""
    missing = untrained_seeds(exp, seeds)
    if not missing:
        return None
    shown = ", ".join(map(str, missing[:5])) + (", ..." if len(missing) > 5 else "")
    return (f"{len(missing)} of the {len(seeds)} seeds of seeds.{seeds.role}={[seeds.start, seeds.stop]} are not "
            f"trained yet ({shown}); train them with python -m benchmark stage=zoo experiment={exp.name} "
            f"zoo.range={seeds.role}")


def reference_seeds(exp: Experiment) -> list[int]:
    """Converged zoo seeds of ``seeds.reference``: the reference posterior."""
    return converged(exp, exp.reference)


def seed_problem(exp: Experiment, seed: int, shapes: dict[str, tuple[int, ...]] | None = None) -> str | None:
    """What is wrong with the stored checkpoint (or failure record) of ``seed``; ``None`` if it is
    valid or absent. Reads the checkpoint whole (``store.check_file``)."""
    store = exp.store
    path = store.checkpoint_path(seed)
    broken = broken_link(path)
    if broken:
        return broken
    if path.exists():
        try:
            check_file(path, shapes or exp.shapes(), expect={"experiment": exp.name, "seed": str(seed)})
        except CheckpointError as err:
            return str(err)
        except OSError as err:
            return f"{path}: unreadable ({err.strerror or err})"
        return None
    return store.unreadable_failure_records().get(seed) if store.failed_path(seed).exists() else None


def quarantined_seeds(store: ExperimentStore) -> list[int]:
    """Seeds of the zoo's quarantined checkpoints and failure records (one entry per file)."""
    entries = quarantined(store.zoo_dir) + quarantined(store.failed_dir, suffix=".json")
    units = (store.unit_of(str(entry.record.get("file") or entry.path.name)) for entry in entries)
    return [u.seed for u in units if u is not None and u.is_seed]


@dataclass
class RangeState:
    """The state of one seed range in the store: test accuracy of each converged checkpoint,
    failure records, and files quarantined from it."""

    seeds: SeedRange
    accuracies: dict[int, float] = field(default_factory=dict)
    failed: int = 0
    quarantined: int = 0

    def describe(self) -> str:
        """One line: checkpoints, failures with the rate, quarantined files; then the accuracies."""
        n = len(self.seeds)
        line = (f"{self.seeds.role} seeds {self.seeds}: {len(self.accuracies)} checkpoints, {self.failed} failed "
                f"({self.failed / max(1, n):.1%} failure rate), {self.quarantined} quarantined")
        accs = list(self.accuracies.values())
        if accs:
            line += (f"; test accuracy of the checkpoints: mean {statistics.fmean(accs):.3f}, "
                     f"min {min(accs):.3f}, max {max(accs):.3f}")
        return line


def range_state(exp: Experiment, seeds: SeedRange, strict: bool = True) -> RangeState:
    """The ``RangeState`` of ``seeds``. A checkpoint whose header cannot be read raises
    ``CorruptZooError`` with ``strict``; otherwise (another shard's seed, left to its job) it is
    logged and left out."""
    store = exp.store
    state, problems = RangeState(seeds), {}
    for seed in converged(exp, seeds):
        path = store.checkpoint_path(seed)
        try:
            state.accuracies[seed] = CheckpointMetadata.decode(read_metadata(path)).test_accuracy
        except CheckpointError as err:
            problems[path] = str(err)
    if problems and strict:
        raise corrupt_zoo_error(exp, problems)
    for problem in problems.values():
        log.warning("%s; left for the zoo run of its shard (not counted here)", problem)
    state.failed = sum(s in seeds for s in store.failed_seeds())
    state.quarantined = sum(s in seeds for s in quarantined_seeds(store))
    return state


def checkpoint_staleness(exp: Experiment, path: Path) -> str | None:
    """Why a valid checkpoint is stale (trained with another model, data or recipe config, with
    the fields that differ), or ``None``. A checkpoint without ``config_hash`` (imported, or
    written by another tool) is not stale: nothing says it was trained with another config."""
    try:
        meta = CheckpointMetadata.decode(read_metadata(path))
    except CheckpointError as err:
        return str(err)
    if meta.config_hash is not None and meta.config_hash != exp.config_hash:
        return (f"{path}: trained with config_hash {meta.config_hash}, the current config's is {exp.config_hash} "
                f"({recipe_differences(meta.config, exp.recipe_config)})")
    return None


def seed_staleness(exp: Experiment, seed: int) -> str | None:
    """Why the stored checkpoint or failure record of ``seed`` was made under another model, data
    or recipe config than ``exp``'s (``checkpoint_staleness``), or ``None`` (same config, none
    recorded, or nothing stored)."""
    store = exp.store
    path = store.checkpoint_path(seed)
    if path.exists():
        return checkpoint_staleness(exp, path)
    try:
        record = json.loads(store.failed_path(seed).read_text(encoding="utf-8"))
    except (OSError, ValueError):  # none, or damaged: seed_problem names it
        return None
    made_with = record.get("config_hash") if isinstance(record, dict) else None
    if made_with is not None and made_with != exp.config_hash:
        return (f"{store.failed_path(seed)}: failure recorded under config_hash {made_with}, the current config's is "
                f"{exp.config_hash}")
    return None


def _flat(values: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            out |= _flat(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def recipe_differences(recorded: dict | None, current: dict) -> str:
    """The config fields in which a checkpoint's recorded ``config`` differs from ``current``
    (``Experiment.recipe_config``), as ``train.epochs: 3 -> 4, ...``; what can be said when the
    checkpoint records none."""
    if not recorded:
        return "its fields are not recorded in the checkpoint: model, data or recipe changed"
    old, new = _flat(recorded), _flat(current)
    missing = "(absent)"
    diffs = [f"{key}: {old.get(key, missing)} -> {new.get(key, missing)}" for key in sorted(set(old) | set(new))
             if old.get(key, missing) != new.get(key, missing)]
    return ", ".join(diffs) or "no field differs: recorded by another version of the config schema"


@dataclass(frozen=True)
class ReferenceRecipe:
    """The recipes the reference checkpoints were trained under: ``config_hashes`` (sorted;
    ``unrecorded`` for checkpoints that record none: imported), and ``other``: seed -> the fields
    that differ, for those trained under another config than the current one."""

    config_hashes: tuple[str, ...]
    other: dict[int, str]

    def describe(self, exp: Experiment) -> str | None:
        """What is of another recipe (how many checkpoints, the fields that differ), or ``None``."""
        if not self.other:
            return None
        fields = sorted(set(self.other.values()))
        shown = "; ".join(fields[:3]) + ("; ..." if len(fields) > 3 else "")
        return (f"{len(self.other)} reference checkpoint(s) of {exp.name} in {exp.store.zoo_dir} were trained under "
                f"another recipe than this run's (config_hash {exp.config_hash}): {shown}")

    def problem(self, exp: Experiment) -> str | None:
        """The one-line refusal of a reference of another recipe (``describe``, the command that
        retrains it, the override that accepts it), or ``None``."""
        described = self.describe(exp)
        if described is None:
            return None
        return (f"{described}; retrain them with python -m benchmark stage=zoo experiment={exp.name} "
                "zoo.range=reference and this run's overrides, or pass evaluate.allow_other_recipe=true to evaluate "
                "against them (recorded in metrics.csv)")

    def note(self) -> str:
        """metrics.csv's ``reference_recipe``: empty when every checkpoint is of the current recipe,
        else what was accepted with ``evaluate.allow_other_recipe``."""
        if not self.other:
            return ""
        return (f"other recipe accepted (evaluate.allow_other_recipe=true): {len(self.other)} checkpoint(s), "
                + "; ".join(sorted(set(self.other.values()))))


def reference_recipe(exp: Experiment) -> ReferenceRecipe:
    """The ``ReferenceRecipe`` of the converged reference checkpoints (their metadata only; a
    checkpoint whose header cannot be read is left to the reference's validation, which names it)."""
    hashes, other = set(), {}
    for seed in reference_seeds(exp):
        try:
            meta = CheckpointMetadata.decode(read_metadata(exp.store.checkpoint_path(seed)))
        except (CheckpointError, OSError):
            continue
        hashes.add(meta.config_hash or "unrecorded")
        if meta.config_hash is not None and meta.config_hash != exp.config_hash:
            other[seed] = recipe_differences(meta.config, exp.recipe_config)
    return ReferenceRecipe(tuple(sorted(hashes)), other)


# ---- the sample units --------------------------------------------------------------------------

def heldout_shortfall(exp: Experiment, bases: int) -> str | None:
    """Why ``seeds.heldout`` cannot supply the sample stage, or ``None``: repetition k's bases
    start at converged held-out seed ``k x Design.stride``, so the design's repetitions need
    ``Design.needed(bases)`` converged seeds (at the largest count of any method, ``Design.most``:
    ``sample.repetitions`` or ``sample.repetitions_per_method``; ``bases``: the most any selected
    method x mode takes, e.g. Deep Ensembles' members). Seeds already trained count as they are;
    the rest at ``seeds.expected_convergence``. The message gives the numbers and the range to use."""
    design, heldout = Design.of(exp), exp.heldout
    if bases < 1:
        return None
    stride, needed = design.stride, design.needed(bases)
    done = len(converged(exp, heldout))
    failed = sum(s in heldout for s in exp.store.failed_seeds())
    untried = max(0, len(heldout) - done - failed)
    rate = exp.config.seeds.expected_convergence
    expected = done + round(untried * rate)
    if expected >= needed:
        return None
    stop = heldout.stop + math.ceil((needed - expected) / rate)
    return (f"seeds.heldout=[{heldout.start}, {heldout.stop}] cannot supply the sample stage: "
            f"{design.most} repetition(s){_largest_count(design)} {stride} converged seeds apart need {needed} "
            f"converged held-out "
            f"seeds ((repetitions - 1) x {stride} + {bases} bases), and the range gives about {expected} "
            f"({done} converged, {failed} failed, {untried} not trained yet at seeds.expected_convergence={rate:g}); "
            f"use 'seeds.heldout=[{heldout.start},{stop}]' (or fewer {_count_keys(design)} / sample.per_method)")


def _largest_count(design: Design) -> str:
    """Where the largest count comes from, when ``sample.repetitions_per_method`` gives it."""
    most = [name for name, count in design.per_method_repetitions if count == design.most]
    return f" (sample.repetitions_per_method: {', '.join(most)})" if most and design.most > design.repetitions else ""


def _count_keys(design: Design) -> str:
    """The key(s) that set the largest count: ``sample.repetitions`` and/or ``sample.repetitions_per_method.<name>``."""
    keys = [f"sample.repetitions_per_method.{name}" for name, count in design.per_method_repetitions
            if count == design.most]
    return " / ".join((["sample.repetitions"] if design.repetitions == design.most else []) + keys)


SAMPLE_CODE = ("methods.base", "methods.modes", "benchmark.core.models", "benchmark.core.data", "benchmark.core.settings",
               "benchmark.core.store.checkpoint", "benchmark.core.store.sampleset")
"""Code every method's samples and predictions go through besides the method's own module: the
protocol, the modes, every model (reached through the config's model name), the data loaders
(reached through the config's data set), the settings, and the store's readers and writers of
checkpoints and sample sets (the bases read, the samples written). Packages count whole."""


def expected_units(exp: Experiment) -> list[Unit]:
    """Every unit a full sample stage of this config writes: each registered method the
    experiment runs x each mode it supports x its repetitions (``Design.repetitions_of``)."""
    design = Design.of(exp)
    return [exp.store.sample_unit(m, mode, r) for m, mode in selected("all", "both")
            if not exp.method_settings(m).unavailable for r in range(design.repetitions_of(m))]


def sample_settings_hash(exp: Experiment, method: str) -> str:
    """Hash of what determines a unit's output besides the repetition and the networks it reads:
    the zoo config, the method's settings, the sample counts, the method's own code (its module
    and what it imports, ``code_fingerprint``) with the code every method goes through
    (``SAMPLE_CODE``), and the library versions. A docstring edit changes nothing; a change to
    ``methods/swag.py`` changes SWAG's hash only. The number of repetitions is not in it: more
    repetitions keep the ones done. Nor is the held-out range: a unit is keyed on the held-out
    seeds it read (``read_seeds``, checked by ``moved_seeds``) and on their content
    (``base_digests``, ``changed_bases``), so a range grown at its end (``seeds.heldout=[a,b]`` to
    ``[a,c]``) keeps every unit drawn, while one whose start or end moves the seeds at a unit's
    block's positions makes that unit stale."""
    return stable_hash({
        "zoo": exp.config_hash,
        "method": exp.method_settings(method),
        "sample": {"per_method": exp.config.sample.per_method, "modes_multi": exp.config.sample.modes_multi},
        "code": code_fingerprint(sample_code(method)),
    })


def sample_code(method: str) -> tuple[str, ...]:
    """The roots of the code a unit of ``method`` is keyed by: the method's own module (the one its
    registered class is defined in) and ``SAMPLE_CODE``; ``code_fingerprint`` adds what they import."""
    return (method_class(method).__module__, *SAMPLE_CODE)


def chain_key(exp: Experiment, method: PosteriorMethod, seeds: Iterable[int]) -> str:
    """The key the saved chains of a unit of ``method`` (``ResumableChains``) must have been run
    under: the unit's settings (``sample_settings_hash``: zoo config, settings, sample counts,
    code), the base ``seeds`` its chains start from (what they read of the held-out range: one
    chain per base, none can fail) with their checkpoints' content digests (``base_digests``: a
    base retrained since is another start), and the method's own fingerprint (its data, prior,
    layout: ``method.fingerprint``). Not the held-out range: a range grown at its end keeps the
    chains; a change that gives the unit other bases, or other networks at them, discards them."""
    return stable_hash({"unit": sample_settings_hash(exp, method.name), "bases": base_digests(exp, seeds),
                        "method": method.fingerprint()})


def read_seeds(candidates: Sequence[int], bases: Sequence[int]) -> list[int]:
    """The held-out seeds a unit read, recorded in its files (``read_seeds``): its candidate
    seeds (``ModePlan.candidates``, its block of the converged held-out seeds, ``Design.candidates``)
    up to the last of the ``bases`` it used. ``run_mode`` takes the candidates in order, as many at
    a time as bases are missing, so a unit whose fits cannot fail reads exactly its bases (its
    whole block), and one whose fits can fail (``fits_can_fail``: its block is the whole stride)
    reads its bases and the candidates that failed before them, never a spare after its last base:
    what it drew is fixed by those seeds alone."""
    order = list(candidates)
    return order[: max(order.index(seed) for seed in bases) + 1] if bases else []


def moved_seeds(exp: Experiment, unit: Unit, metadata: dict[str, str]) -> str | None:
    """Why the held-out seeds a unit of a registered method read (its recorded ``read_seeds``) are
    not those at the same positions of its block now (``Design.block`` of the converged held-out
    seeds, the first ``len(read_seeds)`` positions from its repetition's start), with the old and
    the new; ``None`` when they are (a range grown at its end changes none), or when the unit
    records none (not judged here: one written before units recorded them is stale by its settings
    hash, which held the range's bounds then).
    The positions are read from the trained prefix of ``seeds.heldout`` (``trained_prefix``): the
    seeds a unit read are judged without the rest of the range trained, and when an untrained seed
    comes before them they are not fixed yet (stale, naming the seed)."""
    recorded = SampleSetMetadata.decode(metadata).read_seeds
    method = str(unit.method)
    if recorded is None or method not in method_names():
        return None
    design = Design.of(exp)
    block = design.unit_block(method, str(unit.mode), int(unit.repetition))
    try:
        recorded = [int(s) for s in recorded]
    except (TypeError, ValueError):
        return f"its recorded read_seeds {recorded!r} are not a list of seeds"
    if block is None:
        return None  # a unit the sample stage refuses: its layout names it
    start, size = block
    ready, gap = trained_prefix(exp, exp.heldout)
    now = list(design.block(ready, int(unit.repetition), min(len(recorded), size)))
    where = (f"converged held-out seeds {start}..{start + len(recorded) - 1} of "
             f"seeds.heldout={[exp.heldout.start, exp.heldout.stop]}")
    if now == recorded:
        return None
    if gap is not None and len(now) < len(recorded) and now == recorded[: len(now)]:
        return (f"drawn from held-out seeds {_seeds_text(recorded)}, and the {where} are not fixed yet: seed {gap} "
                f"before them is not trained (train it with python -m benchmark stage=zoo experiment={exp.name} "
                f"zoo.range=heldout)")
    return (f"drawn from held-out seeds {_seeds_text(recorded)}, the {where} are now {_seeds_text(now)}"
            f"{_first_difference(recorded, now)}: other base networks")


def _seeds_text(seeds: Sequence[int]) -> str:
    """A list of seeds for a message: whole up to 8, else its first three and last, with the count."""
    seeds = list(seeds)
    if len(seeds) <= 8:
        return str(seeds)
    return f"[{', '.join(map(str, seeds[:3]))}, ..., {seeds[-1]}] ({len(seeds)} seeds)"


def _first_difference(old: Sequence[int], new: Sequence[int]) -> str:
    """Where two lists of seeds first differ, for a message (empty when one list is short of the other's)."""
    for k, (a, b) in enumerate(zip(old, new)):
        if a != b:
            return f" (position {k} of the block: seed {a} then, {b} now)"
    return f" ({len(old)} seeds then, {len(new)} now)" if len(old) != len(new) else ""


def unit_expectations(exp: Experiment, unit: Unit) -> dict[str, str]:
    """The metadata a done unit of a registered method must hold under the current settings and
    code, and the design (``layout``: its candidate block, ``Design.unit_layout``: a unit whose
    block moved was drawn around other bases). What the unit read is checked beside them by
    ``unit_state``: the held-out seeds at its block's positions (``moved_seeds``) and their
    content (``changed_bases``)."""
    return {"method": str(unit.method), "mode": str(unit.mode), "experiment": exp.name,
            "repetition": str(unit.repetition), "settings_hash": sample_settings_hash(exp, str(unit.method)),
            "layout": Design.of(exp).unit_layout(str(unit.method), str(unit.mode), int(unit.repetition))}


NOT_WRITTEN = "not written yet"


@dataclass
class UnitState:
    """The state of a unit's two files in the store: ``missing`` (one or both not written),
    ``stale`` (metadata differ from the current settings: redrawn in place), ``corrupt``
    (file -> what is wrong: quarantined, then redrawn). ``problem`` is ``None`` when the unit is done."""

    missing: bool = False
    stale: str | None = None
    corrupt: dict[Path, str] = field(default_factory=dict)

    @property
    def problem(self) -> str | None:
        if self.corrupt:
            return "; ".join(self.corrupt.values())
        return NOT_WRITTEN if self.missing else self.stale


def base_digests(exp: Experiment, seeds: Iterable[int]) -> dict[str, str | None]:
    """Base seed -> a digest of the tensors of its stored checkpoint (of their checksums, read from
    its header; its metadata left out: a metadata edit changes no network); ``None`` when it has no
    checksums or cannot be read. What a unit records of the networks it was drawn around."""
    out: dict[str, str | None] = {}
    for seed in seeds:
        path = exp.store.checkpoint_path(seed)
        try:
            checksums = stored_checksums(read_metadata(path), str(path))
        except (CheckpointError, OSError):
            checksums = None
        out[str(int(seed))] = None if checksums is None else stable_hash(checksums)
    return out


def changed_bases(exp: Experiment, recorded: dict | None) -> str | None:
    """Which base networks a unit was drawn around changed since (retrained to other weights,
    replaced), from its recorded ``base_digests``; ``None`` when none did, or nothing was recorded.
    A base unreadable now is not judged here: the zoo's validation names it."""
    if not recorded:
        return None
    now = base_digests(exp, [int(s) for s in recorded])
    changed = sorted(int(s) for s, digest in recorded.items()
                     if digest is not None and now.get(s) is not None and now.get(s) != digest)
    return f"base checkpoint(s) {changed} changed since it was drawn (retrained or replaced)" if changed else None


def unit_state(exp: Experiment, unit: Unit, expected: dict[str, str] | None = None) -> UnitState:
    """The ``UnitState`` of ``unit``: done when both files are written, their metadata hold
    ``expected`` (default: ``unit_expectations``), the held-out seeds it read are still those at its
    block's positions (``moved_seeds``) and hold the same networks (``changed_bases``), and they
    validate whole (``store.check_file``:
    checksums, finite values, the model's keys and shapes with the sample count of the metadata,
    predictions ``[S, N, classes]`` for the ID test set and the OOD set), and the predictions were
    computed from this sample set (``pairing_problem``)."""
    store = exp.store
    expected = unit_expectations(exp, unit) if expected is None else expected
    paths = (store.samples_path(unit), store.preds_path(unit))
    state = UnitState(missing=not all(p.is_file() for p in paths))
    metas: dict[Path, dict[str, str]] = {}
    for path in (p for p in paths if p.is_file()):
        try:
            metas[path] = read_metadata(path)
        except CheckpointError as err:
            state.corrupt[path] = str(err)
            continue
        if metas[path].get("experiment") != exp.name:
            state.corrupt[path] = (f"{path}: holds samples of experiment {metas[path].get('experiment')!r}, "
                                   f"expected {exp.name!r}")
        elif state.stale is None:
            stale = [k for k, v in expected.items() if metas[path].get(k) != v]
            if stale == ["layout"] and metas[path].get("layout") is None and drawn_in_block(exp, unit, metas[path]):
                stale = []  # written before units recorded their layout, around bases of its block
            if stale:
                state.stale = f"{path}: metadata {', '.join(stale)} differ from the current settings"
                if "layout" in stale:  # name the move: which block it was drawn from, which it is now
                    state.stale += (f" (layout: drawn from {metas[path].get('layout') or 'an unrecorded block'}, the "
                                    f"repetition design now gives {expected['layout']}: other base networks)")
            elif path == paths[0] and (moved := moved_seeds(exp, unit, metas[path])
                                        or changed_bases(exp, SampleSetMetadata.decode(metas[path]).base_digests)):
                state.stale = f"{path}: {moved}"
    if state.corrupt:  # the unit is redone: name the damage of its other file too (it is quarantined as well)
        _check_whole(exp, paths, metas, state)
    if state.missing or state.stale or state.corrupt:
        return state
    _check_whole(exp, paths, metas, state)
    if not state.corrupt:  # both valid: do they belong together?
        mixed = pairing_problem(metas[paths[0]], metas[paths[1]], paths[1])
        if mixed is not None:
            state.corrupt[paths[1]] = mixed
    return state


def drawn_in_block(exp: Experiment, unit: Unit, metadata: dict[str, str]) -> bool:
    """Whether a unit written before units recorded their ``layout`` (``metadata`` without it) was
    drawn around bases of the block the repetition design gives it now (``Design.unit_block`` of
    the converged held-out seeds): its recorded ``base_seeds`` all lie in it. Such a unit is as
    current as one that records the layout; one without recorded bases is not."""
    recorded = SampleSetMetadata.decode(metadata).base_seeds
    design = Design.of(exp)
    block = design.unit_block(str(unit.method), str(unit.mode), int(unit.repetition))
    if not recorded or block is None:
        return False
    seeds = design.block(converged(exp, exp.heldout), int(unit.repetition), block[1])
    return {int(s) for s in recorded} <= set(seeds)


def _check_whole(exp: Experiment, paths: tuple[Path, Path], metas: dict[Path, dict[str, str]], state: UnitState) -> None:
    """``store.check_file`` on each of the unit's ``paths`` (sample set, predictions) that exists
    and is not known corrupt yet, recording what is wrong in ``state.corrupt``."""
    known = metas.get(paths[0]) if paths[0] not in state.corrupt else None
    n = SampleSetMetadata.decode(known).n_samples if known is not None else None
    c, rows = exp.info.num_classes, prediction_rows(exp)
    shapes = (exp.shapes(), None if rows is None else {"id": (rows[0], c), "ood": (rows[1], c)})
    for path, shape in zip(paths, shapes):
        if path in state.corrupt or path not in metas:
            continue
        try:
            check_file(path, shape, leading=1, samples=n, expect={"experiment": exp.name})
        except CheckpointError as err:
            state.corrupt[path] = str(err)


def pairing_problem(samples_meta: dict[str, str], preds_meta: dict[str, str], preds_path: Path) -> str | None:
    """Why a unit's predictions (metadata ``preds_meta``, at ``preds_path``) were not computed from
    its sample set (metadata ``samples_meta``): their ``samples_digest`` names another sample set's
    content (a pair mixed from two writers). ``None`` when they belong together, or when the
    predictions carry no ``samples_digest`` (written before the binding existed, or by another
    tool; the metadata checksum keeps damage from removing it from a file that has it)."""
    bound = SampleSetMetadata.decode(preds_meta).samples_digest
    if bound is None:
        return None
    actual = content_digest(samples_meta)
    if bound != actual:
        return (f"{preds_path}: computed from another sample set (samples_digest {bound}, the stored sample set's is "
                f"{actual}): a pair mixed from two writers")
    return None


def prediction_rows(exp: Experiment) -> tuple[int, int] | None:
    """Rows of the ID test set and the OOD set, or ``None`` when the data are not on this machine
    (``stage=verify`` then checks predictions without their row counts)."""
    try:
        return len(exp.test_tensors[1]), len(exp.ood_tensors[1])
    except OSError:
        return None


def available_rows(exp: Experiment) -> list[tuple[str, str]]:
    """``(method, mode)`` rows with at least one unit whose sample set and predictions are both in
    the store: registered methods in registry order, then external ones, sorted."""
    store = exp.store
    found = {u.row() for u in store.sample_units() if all(p.is_file() for p in store.unit_paths(u))}
    registered = list(method_names())
    order = registered + sorted({m for m, _ in found} - set(registered))
    return sorted(found, key=lambda row: (order.index(row[0]), MODES.index(row[1])))


def row_units(exp: Experiment, method: str, mode: str) -> list[Unit]:
    """The units a row averages: repetitions ``0 .. Design.repetitions_of(method) - 1`` of a registered
    method, all checked done and current (``StaleSamplesError`` naming every problem and the
    command that redoes them otherwise); the single unit of an external sample set."""
    if method not in method_names():
        return [exp.store.sample_unit(method, mode, 0)]
    units = [exp.store.sample_unit(method, mode, r) for r in range(Design.of(exp).repetitions_of(method))]
    problems = [f"repetition {u.repetition}: {p}" for u in units if (p := unit_state(exp, u).problem) is not None]
    if problems:
        raise StaleSamplesError(
            f"{method}/{mode}: {'; '.join(problems)}. Redo them with: python -m benchmark stage=sample "
            f"experiment={exp.name} method={method} mode={mode} (or lower {_row_count_key(exp, method)})"
        )
    return units


def _row_count_key(exp: Experiment, method: str) -> str:
    """The key that sets ``method``'s count of repetitions."""
    named = method in dict(Design.of(exp).per_method_repetitions)
    return f"sample.repetitions_per_method.{method}" if named else "sample.repetitions"


def describe_store(exp: Experiment) -> str:
    """One line per store folder, for error messages."""
    store = exp.store
    parts = [f"{len(store.completed_seeds())} zoo checkpoints"]
    for folder in (store.samples_dir, store.preds_dir):
        names = sorted(p.name for p in folder.glob("*.safetensors")) if folder.is_dir() else []
        parts.append(f"{folder}: {', '.join(names) if names else 'nothing'}")
    return "; ".join(parts)


def row_label(exp: Experiment, method: str, mode: str) -> str:
    """A row's name in the tables: the method's ``label``; an external sample set's ``label`` metadata."""
    if method in method_names():
        return method_class(method).label
    return SampleSetMetadata.decode(read_metadata(exp.store.samples_path(exp.store.sample_unit(method, mode, 0)))).label \
        or method


# ---- what a stage or an analysis needs -------------------------------------------------------

INPUTS = ("reference", "heldout", "samples", "metrics")
"""What stages and analyses read (``needs``) and write (``produces``): the reference zoo, the
held-out zoo (bases and ensemble members), the methods' samples, the evaluate stage's metrics.csv."""


def input_problem(exp: Experiment, name: str) -> str | None:
    """Why input ``name`` (of ``INPUTS``) is not in the store, with the command that makes it; ``None`` if it is."""
    if name == "reference":
        found = len(reference_seeds(exp))
        if found < 2:
            return (f"the reference zoo: {found} converged checkpoint(s) in seeds.reference={[exp.reference.start, exp.reference.stop]} "
                    f"under {exp.store.zoo_dir}, at least 2 needed; run python -m benchmark stage=zoo experiment={exp.name} "
                    "zoo.range=reference first")
    elif name == "heldout":
        if not converged(exp, exp.heldout):
            return (f"the held-out zoo: no converged checkpoint in seeds.heldout={[exp.heldout.start, exp.heldout.stop]}; "
                    f"run python -m benchmark stage=zoo experiment={exp.name} zoo.range=heldout first")
    elif name == "samples":
        if not available_rows(exp):
            return (f"the methods' samples: {exp.store.samples_dir} holds none; run python -m benchmark stage=sample "
                    f"experiment={exp.name} first")
    elif name == "metrics":
        path = exp.results_dir / "metrics.csv"
        if not path.is_file():
            return f"the metrics: no {path}; run python -m benchmark stage=evaluate experiment={exp.name} first"
    else:
        raise ValueError(f"unknown input {name!r}; expected one of {INPUTS}")
    return None


def require_inputs(exp: Experiment, needed: Iterable[str], who: str) -> None:
    """Raise ``MissingInputsError`` naming ``who`` and every input of ``needed`` the store lacks."""
    problems = [p for name in sorted(needed) if (p := input_problem(exp, name)) is not None]
    if problems:
        raise MissingInputsError(f"{who} needs {'; and '.join(problems)}")


# ---- quarantine --------------------------------------------------------------------------------


def reap_results_litter(exp: Experiment) -> int:
    """Remove the temp files killed writers left in ``results/<experiment>/`` (``store.results_litter``),
    with one log line; how many. Called first by the stages that write results."""
    removed = 0
    for path in exp.store.results_litter(exp.results_dir):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed += 1
    if removed:
        log.info("%s: removed %d temp file(s) left by killed writers", exp.results_dir, removed)
    return removed


def quarantine_and_redo(problems: dict[Path, str], redo: str) -> dict[Path, Path]:
    """Move each damaged file of ``problems`` (path -> what is wrong) to ``quarantine/`` beside it,
    logging one line each with ``redo`` (what will redo its unit); return path -> new path. Call it
    only while holding the claim of the files' unit. A file already gone is skipped."""
    moved = {}
    for path, problem in problems.items():
        try:
            moved[path] = quarantine(path, problem)
        except FileNotFoundError:
            continue
        log.error("%s; moved to %s, %s", problem, moved[path], redo)
    return moved

