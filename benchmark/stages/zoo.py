"""Zoo stage: train the checkpoints of ``seeds.reference`` and ``seeds.heldout`` (``zoo.range``
selects one) that the store lacks.

Seeds are trained K at a time by the vectorised trainer where the architecture and data allow
it (``zoo.vectorize``, decided once per run: ``Experiment.zoo_trainer``), else one at a time. On
a CPU a process trains as many stacks at once as it has torch threads (``stacks_at_once``), each on
a thread of its own: one process outside a sweep uses every core.
Resumable and shareable: a batch of seeds is claimed seed by seed (``store.claim``, which holds
across cluster nodes), each re-checked after its claim is taken, and every seed's checkpoint or
failure record is written atomically as soon as that seed finishes, so killed runs and
overlapping ranges on one store neither corrupt nor duplicate work. Seeds that do not converge
are recorded as failed; a seed that diverges (NaN/Inf) is counted, and recorded as failed with
reason ``diverged`` in the ``zoo.max_attempts``-th run that sees it diverge. Publication is fenced
(``store/atomic.py``): a worker paused past its claim never replaces what another published.

Never done while others hold its seeds: a seed claimed by a live process elsewhere is skipped on the
first pass (``run_zoo``: ``skipped_busy``); the stage (``run``) then waits for those seeds
(``claims.wait_s``, ``work.finish_busy``): each is published by its holder, or its claim is
released or goes stale and this job takes it over and trains it. After ``claims.wait_s`` it fails
(``HeldElsewhereError``) naming the seeds and their holders, so a job never ends successfully with
seeds of its shard untrained.

Self-healing: every checkpoint of the range already in the store is validated first (checksum,
keys and shapes, finite values, experiment and seed in its metadata; failure records must parse).
One that fails is moved to ``zoo/quarantine/`` with the reason, logged in one line, and its seed
is trained again.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Iterator

import torch
from tqdm.auto import tqdm

from benchmark.config import ZooRange
from benchmark.core.fingerprint import library_versions
from benchmark.core.store.importing import imported_archives
from benchmark.core.store import CheckpointMetadata, Claim, read_metadata, save_checkpoint, CheckpointError
from benchmark.core.store.claims import HeldElsewhereError  # noqa: F401 (the stage's error)
from benchmark.core.store.work import Recheck, WorkSummary, claim_unit, finish_busy as finish_busy_units, publish
from benchmark.core.training import NonFiniteError, TrainResult, accuracy, seeded, train_network
from benchmark.core.training.vectorised import train_networks
from benchmark.experiment import Experiment, SeedRange, ZooTrainer
from benchmark.inventory import (
    RangeState, heldout_shortfall, range_state, seed_problem, seed_staleness,
)

log = logging.getLogger(__name__)
NAME = "zoo"


class TrainingDivergedError(RuntimeError):
    """One or more seeds produced NaN/Inf during training; nothing was stored for them."""


@dataclass
class ZooSummary(WorkSummary[int]):
    """What a zoo run did, by seed (the work-unit loop's ``WorkSummary``; ``trained``, ``failed``: a
    failure record written, ``diverged``: NaN/Inf, nothing stored), and the state of its seed range
    in the store after it."""

    trained: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    diverged: dict[int, str] = field(default_factory=dict)
    state: RangeState | None = None

    def describe(self) -> str:
        """The range's state, then what this run did."""
        head = self.state.describe() if self.state else ""
        return (f"{head}; this run trained {len(self.trained)}, recorded {len(self.failed)} failures, quarantined "
                f"{len(self.quarantined)}, skipped {len(self.skipped_done)} done and {len(self.skipped_busy)} "
                "in progress elsewhere" + (f", waited for {len(self.done_elsewhere)} done elsewhere"
                                           if self.done_elsewhere else ""))


def ranges(exp: Experiment) -> tuple[SeedRange, ...]:
    """The seed ranges ``zoo.range`` selects."""
    return {ZooRange.both: (exp.reference, exp.heldout), ZooRange.reference: (exp.reference,),
            ZooRange.heldout: (exp.heldout,)}[exp.config.zoo.range]


def needs(exp: Experiment) -> frozenset[str]:
    return frozenset()


def produces(exp: Experiment) -> frozenset[str]:
    """The ranges it trains (``reference``, ``heldout``)."""
    return frozenset(seeds.role for seeds in ranges(exp))


def check(exp: Experiment, made: frozenset[str] = frozenset()) -> None:
    """The data on disk, ``zoo.vectorize`` (a K that cannot be stacked or does not fit), the
    precision and memory format the device can run, and every selected method x mode, so that a
    zoo is never paid for that the sample stage would then refuse; a held-out range too small
    for the sample stage's repetitions is a warning here (the sample stage refuses it)."""
    exp.check_data()
    _ = exp.zoo_trainer
    _ = exp.acceleration
    if exp.config.method.value != "external":
        planned, _ = exp.planned_methods()
        problem = heldout_shortfall(exp, max((plan.bases for _, plan in planned), default=0))
        if problem and exp.config.zoo.range.value != "reference":
            log.warning("%s (the sample stage will refuse it)", problem)


def train_seed(exp: Experiment, seed: int, role: str = "zoo") -> TrainResult:
    """Train the experiment's plain model from ``seed`` one at a time (deterministic on CPU)."""
    with seeded(seed):
        model = exp.model().to(exp.device)
    data = exp.training_data
    return train_network(
        model, data.train, data.check, exp.recipe, seed,
        where=f"{exp.name} {role} seed {seed}", train_eval=data.train_tensors, acceleration=exp.acceleration,
        curves=True,
    )


def _one_at_a_time_outcome(exp: Experiment, seed: int, role: str) -> TrainResult | NonFiniteError:
    """``train_seed``'s result, or the ``NonFiniteError`` it raised (a failure record, not a crash)."""
    try:
        return train_seed(exp, seed, role)
    except NonFiniteError as err:
        return err


GLOBAL_RNG = threading.Lock()
"""Held while a stack on a thread draws from torch's global RNG (``checkpoint_metadata``)."""


def checkpoint_metadata(exp: Experiment, seed: int, result: TrainResult, role: str, trainer: str,
                        crosscheck: dict | None = None) -> CheckpointMetadata:
    """Metadata stored with every trained checkpoint (accuracies as fractions: train, validation
    (the convergence rule's held-out data, NaN without one) and test; ``trainer``: how it was trained;
    ``crosscheck``: the other trainer's outcome, see ``crosscheck_record``)."""
    with GLOBAL_RNG, seeded(seed):  # building a model draws from the global RNG; leave it as it was
        model = exp.model().to(exp.device)
    model.load_state_dict(result.state_dict)
    return CheckpointMetadata(
        experiment=exp.name, seed=seed, role=role, config_hash=exp.config_hash, config=exp.recipe_config,
        train_accuracy=result.train_accuracy, validation_accuracy=result.check_accuracy,
        test_accuracy=accuracy(model, *exp.test_tensors), epochs=result.epochs_run, plateaued=result.plateaued,
        trainer=trainer, history=result.history,
        crosscheck=crosscheck, versions=library_versions(),
    )


def one_at_a_time(exp: Experiment) -> str:
    """The ``trainer`` metadata of a seed trained by ``train_seed`` (with its precision and format)."""
    acc = exp.acceleration
    extras = ([f"autocast {str(acc.autocast).replace('torch.', '')}"] if acc.autocast else []) + \
        (["channels_last"] if acc.channels_last else [])
    return "one at a time" + (f" ({', '.join(extras)})" if extras else "")


def verdict(outcome: TrainResult | NonFiniteError) -> str:
    """``converged``, ``failed`` (the recipe's rule) or ``diverged`` (NaN/Inf)."""
    if isinstance(outcome, NonFiniteError):
        return "diverged"
    return "failed" if outcome.failure else "converged"


def crosscheck_record(ours: TrainResult | NonFiniteError, theirs: TrainResult | NonFiniteError, trainer: str) -> dict:
    """What a seed's checkpoint or failure record keeps of its training by the other ``trainer``: that
    trainer, its ``verdict``, its validation accuracy and the largest weight difference between the two
    results (where both have weights)."""
    record: dict = {"trainer": trainer, "verdict": verdict(theirs)}
    if isinstance(theirs, TrainResult):
        record["validation_accuracy"] = theirs.check_accuracy
        if isinstance(ours, TrainResult):
            record["max_weight_difference"] = max(float((ours.state_dict[k] - v).abs().max()) for k, v in theirs.state_dict.items())
    return record


def run(exp: Experiment) -> list[ZooSummary]:
    """The zoo stage: the ranges ``zoo.range`` selects, this job's shard of each; then the seeds
    other processes held, waited for (``finish_busy``)."""
    zoo = exp.config.zoo
    summaries = [run_zoo(exp, seeds, zoo.shard, zoo.num_shards) for seeds in ranges(exp)]
    finish_busy(exp, summaries)
    return summaries


def _published(exp: Experiment, seed: int) -> bool:
    store = exp.store
    return store.checkpoint_path(seed).exists() or store.failed_path(seed).exists()


def finish_busy(exp: Experiment, summaries: list[ZooSummary]) -> None:
    """Wait for the seeds of ``summaries`` (one per range of ``ranges(exp)``) that were skipped as
    claimed elsewhere, until each is published by its holder or this job took it over and trained
    it (the store's work-unit loop, ``work.finish_busy``); raises ``HeldElsewhereError`` after
    ``claims.wait_s``."""
    store, claims, zoo = exp.store, exp.config.claims, exp.config.zoo
    pairs = list(zip(ranges(exp), summaries))
    busy = [seed for _, summary in pairs for seed in summary.skipped_busy]
    if not busy:
        return

    def take_over(free: list[int]) -> list[int]:
        still = []
        for seeds, summary in pairs:
            retry = [seed for seed in free if seed in seeds]
            if not retry:
                continue
            log.info("zoo %s %s: taking over seeds %s (their claims were released or went stale)", exp.name,
                     seeds.role, retry)
            again = run_zoo(exp, seeds, zoo.shard, zoo.num_shards, only=retry)
            summary.trained += again.trained
            summary.failed += again.failed
            summary.quarantined.update(again.quarantined)
            summary.done_elsewhere += again.skipped_done
            still += again.skipped_busy
        return still

    elsewhere = finish_busy_units(busy, lambda seed: store.claim_path(store.seed_unit(seed)),
                                  lambda seed: _published(exp, seed), take_over, claims.timeout_s, claims.wait_s,
                                  claims.poll_s, f"zoo {exp.name}", lambda seed: f"seed {seed}")
    for seeds, summary in pairs:
        summary.done_elsewhere += [seed for seed in elsewhere if seed in seeds]
        summary.skipped_busy = []
    for seeds, summary in pairs:
        summary.state = range_state(exp, seeds, strict=False)
        log.info("%s", summary.describe())


def _claim(exp: Experiment, pending: Iterator[int], count: int, held: contextlib.ExitStack, shapes: dict,
           summary: ZooSummary) -> dict[int, Claim]:
    """Up to ``count`` seeds of ``pending`` claimed for this process (the claims live as long as
    ``held``), each re-checked under its claim: done seeds are skipped, damaged ones quarantined."""
    store = exp.store
    claimed: dict[int, Claim] = {}

    def recheck(seed: int) -> Recheck:
        problem = seed_problem(exp, seed, shapes) or _other_recipe(exp, seed)
        if problem is None:
            return Recheck(done=_published(exp, seed))
        damaged = store.checkpoint_path(seed) if os.path.lexists(store.checkpoint_path(seed)) else store.failed_path(seed)
        return Recheck(done=False, damaged={damaged: problem})

    for seed in pending:
        claim = claim_unit(store, store.seed_unit(seed), held, summary, seed, lambda: recheck(seed),
                           f"seed {seed} will be trained again")
        if claim is None:
            continue
        claimed[seed] = claim
        if len(claimed) == count:
            break
    return claimed


def _store_outcome(exp: Experiment, seed: int, outcome: TrainResult | NonFiniteError, role: str, trainer: str,
                   claim: Claim, summary: ZooSummary, crosscheck: dict | None = None) -> None:
    """Write a finished seed's checkpoint or failure record, each naming its ``trainer`` (and the
    other trainer's outcome, ``crosscheck``) (NaN/Inf: logged, nothing written until the last
    attempt; a claim taken over meanwhile: nothing written)."""
    extra = {"trainer": trainer, **({"crosscheck": crosscheck} if crosscheck else {})}
    store, name = exp.store, f"seed {seed}"
    if isinstance(outcome, NonFiniteError) and not claim.lost:
        attempts, limit = store.record_divergence(seed, exp.config_hash), exp.config.zoo.max_attempts
        if attempts < limit:
            log.error("seed %d stopped: %s (nothing stored; diverged in %d of zoo.max_attempts=%d runs)",
                      seed, outcome, attempts, limit)
            summary.diverged[seed] = str(outcome)
            return

        def write() -> None:
            store.record_failure(seed, {"reason": "diverged", "detail": str(outcome), "attempts": attempts,
                                        "config_hash": exp.config_hash, **extra}, exclusive=True)
            log.error("seed %d recorded as failed (diverged in %d runs, zoo.max_attempts=%d): %s", seed, attempts,
                      limit, outcome)
            summary.failed.append(seed)

        if not publish(claim, name, "training", write):
            summary.skipped_busy.append(seed)
        store.clear_divergences(seed)
        return

    def write() -> None:  # fenced: a late writer never replaces what another worker published (atomic.py)
        if outcome.failure:
            store.record_failure(seed, {"reason": outcome.failure, "validation_accuracy": outcome.check_accuracy,
                                        "epoch": outcome.epochs_run, "config_hash": exp.config_hash,
                                        "history": outcome.history, **extra},
                                 exclusive=True)
            summary.failed.append(seed)
        else:
            save_checkpoint(store.checkpoint_path(seed), outcome.state_dict,
                            checkpoint_metadata(exp, seed, outcome, role, trainer, crosscheck).encode(), exclusive=True)
            summary.trained.append(seed)
        store.clear_divergences(seed)

    if not publish(claim, name, "training", write):
        summary.skipped_busy.append(seed)


def _train_claimed(exp: Experiment, claimed: dict[int, Claim], seed_range: SeedRange, summary: ZooSummary, bar,
                   stacks: int = 1) -> None:
    """Train the ``claimed`` seeds, storing each as soon as it finishes; stacked, in up to
    ``stacks`` stacks at once (``_train_on_threads``), and the first ``zoo.crosscheck`` seeds of the
    range are also trained one at a time (before the stack)."""
    if not exp.zoo_trainer.stacked:
        for seed in claimed:
            _store_outcome(exp, seed, _one_at_a_time_outcome(exp, seed, seed_range.role), seed_range.role,
                           one_at_a_time(exp), claimed[seed], summary)
            bar.update()
        return
    groups = [{seed: claimed[seed] for seed in group} for group in split_evenly(list(claimed), stacks)]
    prepared = [_prepare_stack(exp, group, seed_range) for group in groups]
    if len(prepared) == 1:
        _train_stack(exp, prepared[0], summary, bar)
    else:
        _train_on_threads(exp, prepared, summary, bar)


@dataclass
class _Stack:
    """A stack ready to train: its claimed seeds, their freshly built models and the one-at-a-time
    outcomes of the seeds ``zoo.crosscheck`` compares."""

    claimed: dict[int, Claim]
    seed_range: SeedRange
    models: list
    crosschecked: dict[int, TrainResult | NonFiniteError]


def _prepare_stack(exp: Experiment, claimed: dict[int, Claim], seed_range: SeedRange) -> _Stack:
    """What draws from torch's global RNG before a stack trains (its models, each built under its
    seed; the crosscheck's one-at-a-time training), done by the caller's thread: stacks trained on
    threads then never share that RNG (``_train_on_threads``)."""
    models = []
    for seed in claimed:
        with seeded(seed):
            models.append(exp.model().to(exp.device))
    crosschecked = {seed: _one_at_a_time_outcome(exp, seed, seed_range.role) for seed in claimed
                    if seed - seed_range.start < exp.config.zoo.crosscheck}
    return _Stack(claimed, seed_range, models, crosschecked)


def _train_stack(exp: Experiment, stack: _Stack, summary: ZooSummary, bar) -> None:
    """Train a prepared stack (``train_networks``), storing each seed as soon as it finishes."""
    seeds, role, trainer = list(stack.claimed), stack.seed_range.role, exp.zoo_trainer

    def done(index: int, outcome: TrainResult | NonFiniteError) -> None:
        seed = seeds[index]
        other = stack.crosschecked.get(seed)
        check = crosscheck_record(outcome, other, one_at_a_time(exp)) if other is not None else None
        _store_outcome(exp, seed, outcome, role, trainer.name, stack.claimed[seed], summary, check)
        bar.update()

    data = exp.training_data
    # The seeds' bar moves only as networks finish (most at the last epoch): the epochs' bar gives the stack's ETA.
    train_networks(stack.models, data, exp.recipe, seeds, [f"{exp.name} {role} seed {s}" for s in seeds], on_done=done,
                   train_eval=data.train_tensors, progress=f"{len(seeds)} seeds stacked", curves=True)


def stacks_at_once(trainer: ZooTrainer | None) -> int:
    """How many stacks the zoo stage trains at once in this process: ``trainer.stacks`` (on a CPU
    one per torch thread, ``threads``: ``auto`` gives a process that is not one of several sweep
    jobs every core); one for one-at-a-time training, which has no stacks."""
    return trainer.stacks if trainer is not None and trainer.stacked else 1


def split_evenly(seeds: list[int], parts: int) -> list[list[int]]:
    """``seeds`` in order, cut into at most ``parts`` runs whose sizes differ by at most one (none empty)."""
    if not seeds:
        return []
    parts = max(1, min(parts, len(seeds)))
    size, extra = divmod(len(seeds), parts)
    cuts = [i * size + min(i, extra) for i in range(parts + 1)]
    return [seeds[a:b] for a, b in zip(cuts, cuts[1:])]


def _train_on_threads(exp: Experiment, stacks: list[_Stack], summary: ZooSummary, bar) -> None:
    """Train the prepared ``stacks`` at once on threads of this process with one torch thread each:
    the packed kernels release the GIL, so each stack runs on its own core. Whatever draws from
    torch's global RNG (the models' initialisation, the crosscheck) was done by the caller's thread
    (``_prepare_stack``); in the threads only ``checkpoint_metadata`` touches that RNG, under
    ``GLOBAL_RNG``. A network's checkpoint does not depend on which networks share its stack,
    so the zoo is the same to the bit as one stack after the other. The threads are
    daemons and the main thread waits in short joins, so a signal (SIGTERM in a SLURM job) still
    stops the stage at once, releasing the claims; a stack's error is raised once all have ended."""
    errors: list[BaseException] = []
    _ = exp.training_data, exp.test_tensors  # loaded here once, not by two threads at once

    def train(stack: _Stack) -> None:
        torch.set_num_threads(1)  # torch's intra-op setting is per thread: a new thread starts at the default
        try:
            _train_stack(exp, stack, summary, bar)
        except BaseException as err:  # noqa: BLE001 - re-raised in the main thread below
            errors.append(err)

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        workers = [threading.Thread(target=train, args=(stack,), name=f"zoo stack {i}", daemon=True)
                   for i, stack in enumerate(stacks)]
        for worker in workers:
            worker.start()
        for worker in workers:
            while worker.is_alive():
                worker.join(0.5)
    finally:
        torch.set_num_threads(before)
    if errors:
        raise errors[0]


def _warn_imported(exp: Experiment, seeds: SeedRange, stored: list[int], training: int) -> None:
    """One warning when this run trains seeds of a range whose stored checkpoints were imported:
    the pool then mixes networks trained elsewhere with networks trained here."""
    imported = imported_archives(exp.store.checkpoint_paths(stored))
    if imported:
        sources = ", ".join(f"{archive} ({n})" for archive, n in imported.items())
        log.warning("zoo %s: training %d seed(s) of seeds.%s=%s here, whose other checkpoints were imported from %s: "
                    "the %s pool will mix locally trained networks with imported ones (to keep it imported, import "
                    "the missing seeds with stage=import zoo_import.range=%s instead)", exp.name, training, seeds.role,
                    [seeds.start, seeds.stop], sources, seeds.role, seeds.role)


def run_zoo(exp: Experiment, seeds: SeedRange, shard: int = 0, num_shards: int = 1,
            only: list[int] | None = None) -> ZooSummary:
    """Train the missing seeds of ``seeds`` (this shard's share: seed % num_shards == shard; of
    those, ``only`` the ones listed when given), K at a time (``Experiment.zoo_trainer``), after
    quarantining those whose stored checkpoint or failure record fails validation. One pass:
    seeds claimed by live processes elsewhere are left in ``skipped_busy`` (``run`` waits for them).

    Raises ``TrainingDivergedError`` at the end if any seed produced NaN/Inf.
    """
    store = exp.store
    store.ensure_writable()
    store.reap_stale_claims()  # claims of runs killed after they stored their seed
    summary = ZooSummary()
    mine = [s for s in seeds if s % num_shards == shard and (only is None or s in only)]
    shapes = exp.shapes()
    recorded = set(store.failed_seeds())  # valid failure records: checked for their recipe only
    stored = sorted(set(mine) & (set(store.completed_seeds()) | set(store.unreadable_failure_records()) | recorded))
    problems = {}
    for seed in tqdm(stored, desc=f"validate zoo {exp.name} {seeds.role}", unit="file", dynamic_ncols=True,
                     disable=len(stored) < 50):
        valid = seed in recorded and not store.checkpoint_path(seed).exists()
        problem = (None if valid else seed_problem(exp, seed, shapes)) or _other_recipe(exp, seed)
        if problem:
            problems[seed] = problem
    done, failed = set(store.completed_seeds()), set(store.failed_seeds())
    todo = [s for s in mine if s in problems or (s not in done and s not in failed)]
    summary.skipped_done = [s for s in mine if s not in todo]
    _warn_stale(exp, [s for s in summary.skipped_done if s in done])
    if todo:
        _warn_imported(exp, seeds, [s for s in summary.skipped_done if s in done], len(todo))
    trainer = exp.zoo_trainer if todo else None
    count = max(1, min(trainer.networks, len(todo))) if trainer else 1
    stacks = stacks_at_once(trainer)
    log.info("zoo %s %s seeds %s: %d of %d to train, %d of them to redo after failing validation (shard %d/%d), %s",
             exp.name, seeds.role, seeds, len(todo), len(mine), len(problems), shard, num_shards,
             (f"{count} at a time" + (f", up to {stacks} stacks at once (one per torch thread)" if stacks > 1 else ""))
             if trainer and trainer.stacked else "one at a time")
    pending = iter(todo)
    with tqdm(total=len(todo), desc=f"zoo {exp.name} {seeds.role}", unit="seed", dynamic_ncols=True) as bar:
        while True:
            with contextlib.ExitStack() as held:
                skipped = len(summary.skipped_busy) + len(summary.skipped_done)
                claimed = _claim(exp, pending, count * stacks, held, shapes, summary)
                bar.update(len(summary.skipped_busy) + len(summary.skipped_done) - skipped)
                if not claimed:
                    break
                _train_claimed(exp, claimed, seeds, summary, bar, stacks)
    summary.state = range_state(exp, seeds, strict=False)
    log.info("%s", summary.describe())
    if summary.diverged:
        details = "; ".join(f"seed {s}: {m}" for s, m in sorted(summary.diverged.items()))
        raise TrainingDivergedError(f"{len(summary.diverged)} seed(s) produced NaN/Inf and were not stored: {details}")
    return summary


def _other_recipe(exp: Experiment, seed: int) -> str | None:
    """Why the stored checkpoint or failure record of ``seed`` is to be trained again: made under
    another config (``inventory.seed_staleness``), unless ``zoo.keep_other_recipe``."""
    return None if exp.config.zoo.keep_other_recipe else seed_staleness(exp, seed)


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
                    "%s); kept (zoo.keep_other_recipe=true). python -m benchmark stage=verify lists them", len(stale), exp.store.zoo_dir,
                    stale[:5] + (["..."] if len(stale) > 5 else []), exp.config_hash)
