"""Zoo stage: train the checkpoints of ``seeds.reference`` and ``seeds.heldout`` (``zoo.range``
selects one) that the store lacks.

Seeds are trained K at a time by the vectorised trainer where the architecture and data allow
it (``zoo.vectorize``; ``stack_size``), else one at a time. Resumable and shareable: a batch
of seeds is claimed under per-seed locks (each re-checked after its lock is taken), and every
seed's checkpoint or failure record is written atomically as soon as that seed finishes, so
killed runs and overlapping ranges on one store neither corrupt nor duplicate work. Seeds that
do not converge are recorded as failed.
"""
from __future__ import annotations

import contextlib
import logging
import statistics
from dataclasses import dataclass, field
from typing import Iterator

from tqdm.auto import tqdm

from benchmark.config import ConfigError, ZooRange
from benchmark.experiment import Experiment, SeedRange, library_versions
from benchmark.store import metadata_float, read_metadata, save_checkpoint, seed_name, try_lock
from benchmark.training import NonFiniteError, TrainResult, seeded, train_network
from benchmark.training.stacked import NotStackableError, stacked_networks
from benchmark.training.vectorised import AUTO_NETWORKS, check_stackable, networks_that_fit, train_networks

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
        where=f"{exp.name} {role} seed {seed}", train_eval=data.train_tensors, acceleration=exp.acceleration,
    )


def checkpoint_metadata(exp: Experiment, seed: int, result: TrainResult, role: str, trainer: str) -> dict[str, object]:
    """Metadata stored with every trained checkpoint (``trainer``: how it was trained)."""
    return {
        "seed": seed,
        "experiment": exp.name,
        "role": role,
        "config_hash": exp.config_hash,
        "train_accuracy": result.train_accuracy,
        "test_accuracy": result.test_accuracy,
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


def stack_size(exp: Experiment, pending: int) -> int:
    """K, the number of seeds trained at once (``zoo.vectorize``), for ``pending`` seeds to train.

    ``auto``: as many as fit in memory, up to ``AUTO_NETWORKS``, or 1 (one at a time) when the
    architecture or the training data cannot be stacked. An explicit K that cannot be stacked
    or does not fit raises ``ConfigError`` naming the value to use.
    """
    setting = str(exp.config.zoo.vectorize)
    if setting == "1":
        return 1
    template = exp.model().to(exp.device)
    try:
        check_stackable(exp.train_set)
        stacked_networks(template, exp.device)
    except NotStackableError as err:
        if setting != "auto":
            raise ConfigError(f"zoo.vectorize={setting}: {exp.name} cannot be trained stacked ({err}); "
                              "use zoo.vectorize=1 or zoo.vectorize=auto") from None
        log.info("zoo: one network at a time (%s)", err)
        return 1
    shape = (exp.info.in_channels, exp.info.image_size, exp.info.image_size)
    fit, per_network, available = networks_that_fit(template, shape, exp.recipe.batch_size, exp.device)
    if setting == "auto":
        return max(1, min(AUTO_NETWORKS, fit, max(1, pending)))
    wanted = int(setting)
    if wanted > fit:
        raise ConfigError(
            f"zoo.vectorize={wanted}: {wanted} networks need about {wanted * per_network / 2**30:.2f} GiB on "
            f"{exp.device}, more than half of the {available / 2**30:.2f} GiB available; use zoo.vectorize={max(1, fit)} "
            "(or zoo.vectorize=auto)")
    return max(1, min(wanted, pending))


def run(exp: Experiment) -> list[ZooSummary]:
    """The zoo stage: the ranges ``zoo.range`` selects, this job's shard of each."""
    zoo = exp.config.zoo
    ranges = {ZooRange.both: (exp.reference, exp.heldout), ZooRange.reference: (exp.reference,),
              ZooRange.heldout: (exp.heldout,)}[zoo.range]
    return [run_zoo(exp, seeds, zoo.shard, zoo.num_shards) for seeds in ranges]


def _claim(exp: Experiment, pending: Iterator[int], count: int, held: contextlib.ExitStack,
           summary: ZooSummary) -> list[int]:
    """Up to ``count`` seeds of ``pending`` locked for this process (the locks live as long as ``held``)."""
    store = exp.store
    claimed: list[int] = []
    for seed in pending:
        if not held.enter_context(try_lock(store.lock_path(f"zoo-{seed_name(seed)}"))):
            summary.skipped_busy.append(seed)
        elif store.checkpoint_path(seed).exists() or store.failed_path(seed).exists():
            summary.skipped_done.append(seed)
        else:
            claimed.append(seed)
            if len(claimed) == count:
                break
    return claimed


def _store_outcome(exp: Experiment, seed: int, outcome: TrainResult | NonFiniteError, role: str, trainer: str,
                   summary: ZooSummary) -> None:
    """Write a finished seed's checkpoint or failure record (NaN/Inf: logged, nothing written)."""
    store = exp.store
    if isinstance(outcome, NonFiniteError):
        log.error("seed %d stopped: %s (nothing stored)", seed, outcome)
        summary.diverged[seed] = str(outcome)
    elif outcome.failure:
        store.record_failure(seed, {"reason": outcome.failure, "check_accuracy": outcome.test_accuracy,
                                    "epoch": outcome.epochs_run, "config_hash": exp.config_hash})
        summary.failed.append(seed)
    else:
        save_checkpoint(store.checkpoint_path(seed), outcome.state_dict,
                        checkpoint_metadata(exp, seed, outcome, role, trainer))
        summary.trained.append(seed)


def _train_claimed(exp: Experiment, seeds: list[int], role: str, stacked: bool, summary: ZooSummary, bar) -> None:
    """Train ``seeds`` (locked by this process), storing each as soon as it finishes."""
    if not stacked:
        for seed in seeds:
            try:
                outcome: TrainResult | NonFiniteError = train_seed(exp, seed, role)
            except NonFiniteError as err:
                outcome = err
            _store_outcome(exp, seed, outcome, role, one_at_a_time(exp), summary)
            bar.update()
        return
    models = []
    for seed in seeds:
        with seeded(seed):
            models.append(exp.model().to(exp.device))
    trainer = f"vectorised, {len(seeds)} networks"

    def done(index: int, outcome: TrainResult | NonFiniteError) -> None:
        _store_outcome(exp, seeds[index], outcome, role, trainer, summary)
        bar.update()

    data = exp.training_data
    train_networks(models, data, exp.recipe, seeds, [f"{exp.name} {role} seed {s}" for s in seeds], on_done=done,
                   train_eval=data.train_tensors)


def run_zoo(exp: Experiment, seeds: SeedRange, shard: int = 0, num_shards: int = 1) -> ZooSummary:
    """Train the missing seeds of ``seeds`` (this shard's share: seed % num_shards == shard),
    K at a time (``stack_size``).

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
    count = stack_size(exp, len(todo)) if todo else 1
    log.info("zoo %s %s seeds %s: %d of %d to train (shard %d/%d), %s", exp.name, seeds.role, seeds, len(todo), len(mine),
             shard, num_shards, f"{count} at a time" if count > 1 else "one at a time")
    pending = iter(todo)
    with tqdm(total=len(todo), desc=f"zoo {exp.name} {seeds.role}", unit="seed", dynamic_ncols=True) as bar:
        while True:
            with contextlib.ExitStack() as held:
                skipped = len(summary.skipped_busy) + len(summary.skipped_done)
                claimed = _claim(exp, pending, count, held, summary)
                bar.update(len(summary.skipped_busy) + len(summary.skipped_done) - skipped)
                if not claimed:
                    break
                _train_claimed(exp, claimed, seeds.role, count > 1, summary, bar)
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
