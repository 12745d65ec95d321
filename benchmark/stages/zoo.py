"""Zoo stage: train the checkpoints of ``seeds.reference`` and ``seeds.heldout`` (``zoo.range``
selects one) that the store lacks.

Seeds are trained K at a time by the vectorised trainer where the architecture and data allow
it (``zoo.vectorize``; ``stack_size``), else one at a time. Resumable and shareable: a batch of
seeds is claimed seed by seed (``store/claims.py``, which holds across cluster nodes), each
re-checked after its claim is taken, and every seed's checkpoint or failure record is written
atomically as soon as that seed finishes, so killed runs and overlapping ranges on one store
neither corrupt nor duplicate work. Seeds that do not converge are recorded as failed.

Self-healing: every checkpoint of the range already in the store is validated first (checksum,
keys and shapes, finite values, experiment and seed in its metadata; failure records must parse).
One that fails is moved to ``zoo/quarantine/`` with the reason, logged in one line, and its seed
is trained again.
"""
from __future__ import annotations

import contextlib
import logging
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from tqdm.auto import tqdm

from benchmark.config import ConfigError, ZooRange
from benchmark.experiment import Experiment, SeedRange, library_versions
from benchmark.core.store import (
    CheckpointError, ExperimentStore, StoreError, check_file, metadata_float, quarantine, quarantined, read_metadata,
    remove_temp_files_of, save_checkpoint, seed_name, seed_of_file,
)
from benchmark.core.store.claims import Claim
from benchmark.core.training import NonFiniteError, TrainResult, accuracy, seeded, train_network
from benchmark.core.training.stacked import NotStackableError, stacked_networks
from benchmark.core.training.vectorised import AUTO_NETWORKS, check_stackable, networks_that_fit, train_networks

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
        where=f"{exp.name} {role} seed {seed}", train_eval=data.train_tensors, acceleration=exp.acceleration,
    )


def checkpoint_metadata(exp: Experiment, seed: int, result: TrainResult, role: str, trainer: str) -> dict[str, object]:
    """Metadata stored with every trained checkpoint (accuracies as fractions: train, validation
    (the convergence rule's held-out data, NaN without one) and test; ``trainer``: how it was trained)."""
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
        "trainer": trainer,
        "versions": library_versions(),
    }


def one_at_a_time(exp: Experiment) -> str:
    """The ``trainer`` metadata of a seed trained by ``train_seed`` (with its precision and format)."""
    acc = exp.acceleration
    extras = ([f"autocast {str(acc.autocast).replace('torch.', '')}"] if acc.autocast else []) + \
        (["channels_last"] if acc.channels_last else [])
    return "one at a time" + (f" ({', '.join(extras)})" if extras else "")


def not_stackable(exp: Experiment) -> str | None:
    """Why the experiment's model or training data cannot be trained stacked (None: they can)."""
    try:
        check_stackable(exp.train_set)
        stacked_networks(exp.model().to(exp.device), exp.device)
    except NotStackableError as err:
        return str(err)
    return None


def stack_size(exp: Experiment, pending: int) -> int:
    """K, the number of seeds trained at once (``zoo.vectorize``), for ``pending`` seeds to train.

    ``auto``: as many as fit in memory, up to ``AUTO_NETWORKS``, or 1 (one at a time) when the
    architecture or the training data cannot be stacked. An explicit K that cannot be stacked
    or does not fit raises ``ConfigError`` naming the value to use.
    """
    setting = str(exp.config.zoo.vectorize)
    if setting == "1":
        return 1
    reason = not_stackable(exp)
    if reason is not None:
        if setting != "auto":
            raise ConfigError(f"zoo.vectorize={setting}: {exp.name} cannot be trained stacked ({reason}); "
                              "use zoo.vectorize=1 or zoo.vectorize=auto")
        log.info("zoo: one network at a time (%s)", reason)
        return 1
    shape = (exp.info.in_channels, exp.info.image_size, exp.info.image_size)
    fit, per_network, available = networks_that_fit(exp.model().to(exp.device), shape, exp.recipe.batch_size, exp.device)
    if setting == "auto":
        return max(1, min(AUTO_NETWORKS, fit, max(1, pending)))
    wanted = int(setting)
    if wanted > fit:
        raise ConfigError(
            f"zoo.vectorize={wanted}: {wanted} networks need about {wanted * per_network / 2**30:.2f} GiB on "
            f"{exp.device}, more than half of the {available / 2**30:.2f} GiB available; use zoo.vectorize={max(1, fit)} "
            "(or zoo.vectorize=auto)")
    return max(1, min(wanted, pending))


def trains_stacked(exp: Experiment) -> bool:
    """Whether the zoo stage trains with the vectorised trainer (whatever K: its per-network
    results do not depend on K, so a seed retrained alone, e.g. after quarantine, gets the same
    bits as in a batch); ``zoo.vectorize=1`` or an unstackable model/data: one at a time."""
    return str(exp.config.zoo.vectorize) != "1" and not_stackable(exp) is None


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


def _claim(exp: Experiment, pending: Iterator[int], count: int, held: contextlib.ExitStack, shapes: dict,
           summary: ZooSummary) -> dict[int, Claim]:
    """Up to ``count`` seeds of ``pending`` claimed for this process (the claims live as long as
    ``held``), each re-checked under its claim: done seeds are skipped, damaged ones quarantined."""
    store = exp.store
    claimed: dict[int, Claim] = {}
    for seed in pending:
        claim = held.enter_context(store.claim(f"zoo-{seed_name(seed)}"))
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
        claimed[seed] = claim
        if len(claimed) == count:
            break
    return claimed


def _store_outcome(exp: Experiment, seed: int, outcome: TrainResult | NonFiniteError, role: str, trainer: str,
                   claim: Claim, summary: ZooSummary) -> None:
    """Write a finished seed's checkpoint or failure record (NaN/Inf: logged, nothing written;
    a claim taken over meanwhile: nothing written)."""
    store = exp.store
    if isinstance(outcome, NonFiniteError):
        log.error("seed %d stopped: %s (nothing stored)", seed, outcome)
        summary.diverged[seed] = str(outcome)
    elif claim.lost:
        log.warning("seed %d: the claim was taken over while training; result not stored", seed)
        summary.skipped_busy.append(seed)
    elif outcome.failure:
        store.record_failure(seed, {"reason": outcome.failure, "validation_accuracy": outcome.check_accuracy,
                                    "epoch": outcome.epochs_run, "config_hash": exp.config_hash})
        summary.failed.append(seed)
    else:
        save_checkpoint(store.checkpoint_path(seed), outcome.state_dict,
                        checkpoint_metadata(exp, seed, outcome, role, trainer))
        summary.trained.append(seed)


def _train_claimed(exp: Experiment, claimed: dict[int, Claim], role: str, stacked: bool, summary: ZooSummary,
                   bar) -> None:
    """Train the ``claimed`` seeds, storing each as soon as it finishes."""
    seeds = list(claimed)
    if not stacked:
        for seed in seeds:
            try:
                outcome: TrainResult | NonFiniteError = train_seed(exp, seed, role)
            except NonFiniteError as err:
                outcome = err
            _store_outcome(exp, seed, outcome, role, one_at_a_time(exp), claimed[seed], summary)
            bar.update()
        return
    models = []
    for seed in seeds:
        with seeded(seed):
            models.append(exp.model().to(exp.device))
    trainer = "vectorised"  # not K: a network's result does not depend on how many train beside it

    def done(index: int, outcome: TrainResult | NonFiniteError) -> None:
        _store_outcome(exp, seeds[index], outcome, role, trainer, claimed[seeds[index]], summary)
        bar.update()

    data = exp.training_data
    train_networks(models, data, exp.recipe, seeds, [f"{exp.name} {role} seed {s}" for s in seeds], on_done=done,
                   train_eval=data.train_tensors)


def run_zoo(exp: Experiment, seeds: SeedRange, shard: int = 0, num_shards: int = 1) -> ZooSummary:
    """Train the missing seeds of ``seeds`` (this shard's share: seed % num_shards == shard),
    K at a time (``stack_size``), after quarantining those whose stored checkpoint or failure
    record fails validation.

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
    count = stack_size(exp, len(todo)) if todo else 1
    stacked = bool(todo) and trains_stacked(exp)
    log.info("zoo %s %s seeds %s: %d of %d to train, %d of them to redo after failing validation (shard %d/%d), %s",
             exp.name, seeds.role, seeds, len(todo), len(mine), len(problems), shard, num_shards,
             f"{count} at a time" if stacked else "one at a time")
    pending = iter(todo)
    with tqdm(total=len(todo), desc=f"zoo {exp.name} {seeds.role}", unit="seed", dynamic_ncols=True) as bar:
        while True:
            with contextlib.ExitStack() as held:
                skipped = len(summary.skipped_busy) + len(summary.skipped_done)
                claimed = _claim(exp, pending, count, held, shapes, summary)
                bar.update(len(summary.skipped_busy) + len(summary.skipped_done) - skipped)
                if not claimed:
                    break
                _train_claimed(exp, claimed, seeds.role, stacked, summary, bar)
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
