"""Zoo stage: train the checkpoints of ``seeds.reference`` and ``seeds.heldout`` (``zoo.range``
selects one) that the store lacks.

Resumable and shareable: each seed is trained under a per-seed lock, re-checked after the
lock is taken, and written atomically, so killed runs and overlapping ranges on one store
neither corrupt nor duplicate work. Seeds that do not converge are recorded as failed.
"""
from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass, field

from tqdm.auto import tqdm

from benchmark.config import ZooRange
from benchmark.experiment import Experiment, SeedRange, library_versions
from benchmark.store import metadata_float, read_metadata, save_checkpoint, seed_name, try_lock
from benchmark.training import NonFiniteError, TrainResult, accuracy, seeded, train_network

log = logging.getLogger(__name__)


class TrainingDivergedError(RuntimeError):
    """One or more seeds produced NaN/Inf during training; nothing was stored for them."""


@dataclass
class ZooSummary:
    """What a zoo run did, and the state of its seed range in the store."""

    trained: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    skipped_done: list[int] = field(default_factory=list)
    skipped_busy: list[int] = field(default_factory=list)
    diverged: dict[int, str] = field(default_factory=dict)
    accuracies: dict[int, float] = field(default_factory=dict)
    failed_in_range: int = 0

    def describe(self, seeds: SeedRange, this_run: bool = True) -> str:
        """Human-readable state of the range (and, with ``this_run``, what this run did)."""
        n = len(seeds)
        accs = list(self.accuracies.values())
        head = (
            f"{seeds.role} seeds {seeds}: {len(self.accuracies)} checkpoints, {self.failed_in_range} failed "
            f"({self.failed_in_range / max(1, n):.1%} failure rate)"
        )
        if this_run:
            head += (
                f"; this run trained {len(self.trained)}, recorded {len(self.failed)} failures, skipped "
                f"{len(self.skipped_done)} done and {len(self.skipped_busy)} in progress elsewhere"
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


def run_zoo(exp: Experiment, seeds: SeedRange, shard: int = 0, num_shards: int = 1) -> ZooSummary:
    """Train the missing seeds of ``seeds`` (this shard's share: seed % num_shards == shard).

    Raises ``TrainingDivergedError`` at the end if any seed produced NaN/Inf.
    """
    start, stop = seeds.start, seeds.stop
    store = exp.store
    store.ensure_writable()
    summary = ZooSummary()
    mine = [s for s in range(start, stop) if s % num_shards == shard]
    done, failed = set(store.completed_seeds()), set(store.failed_seeds())
    todo = [s for s in mine if s not in done and s not in failed]
    summary.skipped_done = [s for s in mine if s in done or s in failed]
    log.info("zoo %s %s seeds %s: %d of %d to train (shard %d/%d)", exp.name, seeds.role, seeds, len(todo), len(mine),
             shard, num_shards)
    for seed in tqdm(todo, desc=f"zoo {exp.name} {seeds.role}", unit="seed", dynamic_ncols=True):
        with try_lock(store.lock_path(f"zoo-{seed_name(seed)}")) as locked:
            if not locked:
                summary.skipped_busy.append(seed)
                continue
            if store.checkpoint_path(seed).exists() or store.failed_path(seed).exists():
                summary.skipped_done.append(seed)
                continue
            try:
                result = train_seed(exp, seed, seeds.role)
            except NonFiniteError as err:
                log.error("seed %d stopped: %s (nothing stored)", seed, err)
                summary.diverged[seed] = str(err)
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
    """State of ``seeds`` in the store: checkpoints, accuracies, failures."""
    summary = ZooSummary()
    _fill_range_state(exp, summary, seeds.start, seeds.stop)
    return summary


def _fill_range_state(exp: Experiment, summary: ZooSummary, start: int, stop: int) -> None:
    store = exp.store
    for seed in store.converged_seeds(start, stop):
        summary.accuracies[seed] = metadata_float(read_metadata(store.checkpoint_path(seed)), "test_accuracy")
    summary.failed_in_range = sum(start <= s < stop for s in store.failed_seeds())
