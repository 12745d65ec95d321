"""Zoo stage: train the checkpoints of ``seeds.reference`` and ``seeds.heldout`` (``zoo.range``
selects one) that the store lacks.

Resumable and shareable: each seed is trained under a per-seed claim (``store/claims.py``, which
holds across cluster nodes), re-checked after the claim is taken, and written atomically, so
killed runs and overlapping ranges on one store neither corrupt nor duplicate work. Seeds that
do not converge are recorded as failed.

Self-healing: every checkpoint of the range already in the store is validated first (checksum,
keys and shapes, finite values, experiment and seed in its metadata; failure records must parse).
One that fails is moved to ``zoo/quarantine/`` with the reason, logged in one line, and its seed
is trained again.
"""
from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from benchmark.config import ZooRange
from benchmark.experiment import Experiment, SeedRange, library_versions
from benchmark.store import (
    CheckpointError, ExperimentStore, StoreError, check_file, metadata_float, quarantine, quarantined, read_metadata,
    remove_temp_files_of, save_checkpoint, seed_name, seed_of_file,
)
from benchmark.training import NonFiniteError, TrainResult, accuracy, seeded, train_network

log = logging.getLogger(__name__)


class TrainingDivergedError(RuntimeError):
    """One or more seeds produced NaN/Inf during training; nothing was stored for them."""


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


@dataclass
class ZooSummary:
    """What a zoo run did, and the state of its seed range in the store."""

    trained: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    skipped_done: list[int] = field(default_factory=list)
    skipped_busy: list[int] = field(default_factory=list)
    diverged: dict[int, str] = field(default_factory=dict)
    quarantined: dict[int, str] = field(default_factory=dict)  # this run: seed -> what was wrong
    accuracies: dict[int, float] = field(default_factory=dict)
    failed_in_range: int = 0
    quarantined_in_range: int = 0  # files in zoo/quarantine (and zoo/failed/quarantine) of the range

    def describe(self, seeds: SeedRange, this_run: bool = True) -> str:
        """Human-readable state of the range (and, with ``this_run``, what this run did)."""
        n = len(seeds)
        accs = list(self.accuracies.values())
        head = (
            f"{seeds.role} seeds {seeds}: {len(self.accuracies)} checkpoints, {self.failed_in_range} failed "
            f"({self.failed_in_range / max(1, n):.1%} failure rate), {self.quarantined_in_range} quarantined"
        )
        if this_run:
            head += (
                f"; this run trained {len(self.trained)}, recorded {len(self.failed)} failures, quarantined "
                f"{len(self.quarantined)}, skipped {len(self.skipped_done)} done and {len(self.skipped_busy)} "
                "in progress elsewhere"
            )
        lines = [head]
        if accs:
            lines.append(
                f"test accuracy of the checkpoints: mean {statistics.fmean(accs):.3f}, "
                f"min {min(accs):.3f}, max {max(accs):.3f}"
            )
        return "\n".join(lines)


def train_seed(exp: Experiment, seed: int, role: str = "zoo") -> TrainResult:
    """Train the experiment's plain model from ``seed`` (deterministic on CPU)."""
    with seeded(seed):
        model = exp.model().to(exp.device)
    data = exp.training_data
    return train_network(
        model, data.train, data.check, exp.recipe, seed,
        where=f"{exp.name} {role} seed {seed}", train_eval=data.train_tensors,
    )


def checkpoint_metadata(exp: Experiment, seed: int, result: TrainResult, role: str) -> dict[str, object]:
    """Metadata stored with every trained checkpoint (accuracies as fractions: train, validation
    (the convergence rule's held-out data, NaN without one) and test)."""
    with seeded(seed):  # building a model draws from the global RNG; leave it as it was
        model = exp.model().to(exp.device)
    model.load_state_dict(result.state_dict)
    return {
        "seed": seed,
        "experiment": exp.name,
        "role": role,
        "config_hash": exp.config_hash,
        "train_accuracy": result.train_accuracy,
        "validation_accuracy": result.check_accuracy,
        "test_accuracy": accuracy(model, *exp.test_tensors),
        "epochs": result.epochs_run,
        "versions": library_versions(),
    }


def run(exp: Experiment) -> list[ZooSummary]:
    """The zoo stage: the ranges ``zoo.range`` selects, this job's shard of each."""
    zoo = exp.config.zoo
    ranges = {ZooRange.both: (exp.reference, exp.heldout), ZooRange.reference: (exp.reference,),
              ZooRange.heldout: (exp.heldout,)}[zoo.range]
    return [run_zoo(exp, seeds, zoo.shard, zoo.num_shards) for seeds in ranges]


def seed_problem(exp: Experiment, seed: int, shapes: dict[str, tuple[int, ...]] | None = None) -> str | None:
    """What is wrong with the stored checkpoint (or failure record) of ``seed``; ``None`` if it is
    valid or absent. Reads the checkpoint whole (``store.check_file``)."""
    store = exp.store
    path = store.checkpoint_path(seed)
    if path.exists():
        try:
            check_file(path, shapes or exp.shapes(), expect={"experiment": exp.name, "seed": str(seed)})
        except CheckpointError as err:
            return str(err)
        except OSError as err:
            return f"{path}: unreadable ({err.strerror or err})"
        return None
    return store.unreadable_failure_records().get(seed) if store.failed_path(seed).exists() else None


def quarantine_seed(exp: Experiment, seed: int, problem: str) -> Path | None:
    """Move the damaged checkpoint or failure record of ``seed`` to quarantine; log one line."""
    store = exp.store
    path = store.checkpoint_path(seed) if store.checkpoint_path(seed).exists() else store.failed_path(seed)
    try:
        dest = quarantine(path, problem)
    except FileNotFoundError:
        return None
    log.error("%s; moved to %s, seed %d will be trained again", problem, dest, seed)
    return dest


def run_zoo(exp: Experiment, seeds: SeedRange, shard: int = 0, num_shards: int = 1) -> ZooSummary:
    """Train the missing seeds of ``seeds`` (this shard's share: seed % num_shards == shard), after
    quarantining those whose stored checkpoint or failure record fails validation.

    Raises ``TrainingDivergedError`` at the end if any seed produced NaN/Inf.
    """
    start, stop = seeds.start, seeds.stop
    store = exp.store
    store.ensure_writable()
    store.reap_stale_claims()  # claims of runs killed after they stored their seed
    summary = ZooSummary()
    mine = [s for s in range(start, stop) if s % num_shards == shard]
    shapes = exp.shapes()
    stored = sorted(set(mine) & (set(store.completed_seeds()) | set(store.unreadable_failure_records())))
    problems = {}
    for seed in tqdm(stored, desc=f"validate zoo {exp.name} {seeds.role}", unit="file", dynamic_ncols=True,
                     disable=len(stored) < 50):
        problem = seed_problem(exp, seed, shapes)
        if problem:
            problems[seed] = problem
    done, failed = set(store.completed_seeds()), set(store.failed_seeds())
    todo = [s for s in mine if s in problems or (s not in done and s not in failed)]
    summary.skipped_done = [s for s in mine if s not in todo]
    _warn_stale(exp, [s for s in summary.skipped_done if s in done])
    log.info("zoo %s %s seeds %s: %d of %d to train, %d of them to redo after failing validation (shard %d/%d)",
             exp.name, seeds.role, seeds, len(todo), len(mine), len(problems), shard, num_shards)
    for seed in tqdm(todo, desc=f"zoo {exp.name} {seeds.role}", unit="seed", dynamic_ncols=True):
        with store.claim(f"zoo-{seed_name(seed)}") as claim:
            if claim is None:
                summary.skipped_busy.append(seed)
                continue
            remove_temp_files_of(store.checkpoint_path(seed))  # left by a writer killed mid-write
            problem = seed_problem(exp, seed, shapes)  # again, under the claim
            if problem is None and (store.checkpoint_path(seed).exists() or store.failed_path(seed).exists()):
                summary.skipped_done.append(seed)
                continue
            if problem is not None and quarantine_seed(exp, seed, problem) is not None:
                summary.quarantined[seed] = problem
            try:
                result = train_seed(exp, seed, seeds.role)
            except NonFiniteError as err:
                log.error("seed %d stopped: %s (nothing stored)", seed, err)
                summary.diverged[seed] = str(err)
                continue
            if claim.lost:
                log.warning("seed %d: the claim was taken over while training; result not stored", seed)
                summary.skipped_busy.append(seed)
                continue
            if result.failure:
                store.record_failure(seed, {"reason": result.failure, "validation_accuracy": result.check_accuracy,
                                            "epoch": result.epochs_run, "config_hash": exp.config_hash})
                summary.failed.append(seed)
            else:
                save_checkpoint(store.checkpoint_path(seed), result.state_dict,
                                checkpoint_metadata(exp, seed, result, seeds.role))
                summary.trained.append(seed)
    _fill_range_state(exp, summary, start, stop)
    log.info("%s", summary.describe(seeds))
    if summary.diverged:
        details = "; ".join(f"seed {s}: {m}" for s, m in sorted(summary.diverged.items()))
        raise TrainingDivergedError(f"{len(summary.diverged)} seed(s) produced NaN/Inf and were not stored: {details}")
    return summary


def zoo_summary(exp: Experiment, seeds: SeedRange) -> ZooSummary:
    """State of ``seeds`` in the store: checkpoints, accuracies, failures, quarantined files.

    Raises ``CorruptZooError`` (naming the files and the healing command) if a checkpoint's
    header cannot be read."""
    summary = ZooSummary()
    _fill_range_state(exp, summary, seeds.start, seeds.stop, strict=True)
    return summary


def _warn_stale(exp: Experiment, seeds: list[int]) -> None:
    """One line when checkpoints of the range were trained with another model/data/recipe config."""
    stale = []
    for seed in seeds:
        try:
            trained_with = read_metadata(exp.store.checkpoint_path(seed)).get("config_hash")
        except CheckpointError:
            continue
        if trained_with is not None and trained_with != exp.config_hash:
            stale.append(seed)
    if stale:
        log.warning("%d checkpoint(s) of %s (seeds %s) were trained with another config (config_hash differs from "
                    "%s); kept. python -m benchmark stage=verify lists them", len(stale), exp.store.zoo_dir,
                    stale[:5] + (["..."] if len(stale) > 5 else []), exp.config_hash)


def quarantined_seeds(store: ExperimentStore) -> list[int]:
    """Seeds of the zoo's quarantined checkpoints and failure records (one entry per file)."""
    entries = quarantined(store.zoo_dir) + quarantined(store.failed_dir, suffix=".json")
    seeds = (seed_of_file(str(entry.record.get("file") or entry.path.name)) for entry in entries)
    return [s for s in seeds if s is not None]


def _fill_range_state(exp: Experiment, summary: ZooSummary, start: int, stop: int, strict: bool = False) -> None:
    """Accuracies, failures and quarantined files of ``[start, stop)``. A checkpoint whose header
    cannot be read raises ``CorruptZooError`` with ``strict``; otherwise (another shard's seed,
    left to its job) it is logged and left out."""
    store = exp.store
    problems = {}
    for seed in store.converged_seeds(start, stop):
        path = store.checkpoint_path(seed)
        try:
            summary.accuracies[seed] = metadata_float(read_metadata(path), "test_accuracy")
        except CheckpointError as err:
            problems[path] = str(err)
    if problems and strict:
        raise corrupt_zoo_error(exp, problems)
    for problem in problems.values():
        log.warning("%s; left for the zoo run of its shard (not counted here)", problem)
    summary.failed_in_range = sum(start <= s < stop for s in store.failed_seeds())
    summary.quarantined_in_range = sum(start <= s < stop for s in quarantined_seeds(store))
