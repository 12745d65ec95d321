"""The zoo in the store: which seeds of a range converged, which are not trained yet, what is wrong
with one seed's files, which were trained under another recipe config, and the one error for
damaged checkpoints. Read-only: quarantining damaged files is ``inventory.actions``'s."""
from __future__ import annotations

import json
import logging
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from benchmark.core.store import (
    CheckpointError, CheckpointMetadata, ExperimentStore, StoreError, broken_link, check_file, quarantined, read_metadata,
)
from benchmark.experiment import Experiment, SeedRange

log = logging.getLogger(__name__)


class CorruptZooError(StoreError):
    """Checkpoints a stage needs fail validation; the message names them and the command that heals them."""



def corrupt_zoo_error(exp: Experiment, problems: dict[Path, str], what: str = "zoo checkpoint(s)") -> CorruptZooError:
    """The one error for damaged checkpoints: each file and what is wrong, then how to heal the store."""
    details = "; ".join(problems.values())
    return CorruptZooError(
        f"{len(problems)} {what} of {exp.name} fail validation: {details}. Heal the store with "
        f"python -m benchmark stage=zoo experiment={exp.name} (quarantines and retrains them) or "
        f"python -m benchmark stage=verify experiment={exp.name} verify.repair=true (quarantines them)"
    )



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
    """Converged seeds of the reference range (``seeds.reference``, ``exp.reference``): the reference zoo."""
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
