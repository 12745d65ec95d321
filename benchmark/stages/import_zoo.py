"""Import stage: write a zoo trained elsewhere into the store instead of training it.

``python -m benchmark stage=import experiment=<name> zoo_import.source=<folder or archive> [zoo_import=<mapping>]``

The checkpoint files of the source are listed in natural order of their paths, which gives
each its seed of ``zoo_import.range`` (``zoo_import.seeds_from``: the i-th file gets the range's i-th
seed, or the number in its file name); members left out (links, hidden and other files) are
logged in one line, and an archive naming one member twice is refused. The files are then read
in the archive's own order, in one pass, each mapped to the experiment's model
(``zoo_import.mapping``; ready mappings in ``conf/zoo_import/``) and checked (every key, shape, finite
values; errors name the file, the key and the expected shape).

With ``zoo_import.evaluate`` each network's test accuracy and its accuracy on the validation split
are measured, and the recipe's convergence rule is applied to the latter as for a trained seed
(a checkpoint below the threshold is recorded as failed). Before anything is written, the first
``zoo_import.chance_probe`` networks of the run are judged together: when their median test accuracy is
within ``zoo_import.near_chance_margin`` of chance (null: no check), the zoo does not read this data set as it was trained
on it (class order, normalisation, another data set) and the import is refused (``NearChanceError``).

A file that cannot be used (unreadable, wrong keys or shapes, non-finite values) is recorded as
a failed seed with its reason, like a seed that did not converge, and the import goes on; the
run then ends with ``ImportFailuresError`` (non-zero exit) giving their count. The next import
tries such files again (the mapping or the file may have been fixed).

The metadata records the provenance: source file, archive, its SHA-256, and the mapping. The
rest of the pipeline reads imported checkpoints like trained ones. Resumable like the zoo stage:
per-seed claims, fenced writes (a late writer never replaces a published checkpoint), and the seeds
claimed by other processes waited for until each is published or its claim goes stale and this job
imports it (the work-unit loop of ``benchmark.core.store.work``, as the zoo and sample stages); a
seed already imported from the same file is skipped, and a seed the store holds from anything else
(or a damaged failure record) stops the import.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from benchmark.config import ConfigError, ImportRange, SeedsFrom
from benchmark.loader import ready_mappings
from benchmark.core.fingerprint import library_versions
from benchmark.core.store import CheckpointError, Claim, StoreError, read_metadata, save_checkpoint
from benchmark.core.store.work import Recheck, WorkSummary, claim_unit, finish_busy, publish
from benchmark.experiment import Experiment, SeedRange
from benchmark.core.store.importing import (
    ForeignCheckpoint,
    check_against,
    iter_checkpoints,
    read_checkpoint,
    scan_source,
    seed_from_name,
)
from benchmark.core.training import accuracy

log = logging.getLogger(__name__)
NAME = "import"
UNUSABLE = "unusable file"  # the ``kind`` of a failure record written for a file that could not be used


class NearChanceError(ValueError):
    """The imported networks score near chance on this experiment's test split."""


class ImportFailuresError(CheckpointError):
    """Some files of the source could not be imported (each recorded as a failed seed)."""


@dataclass
class ImportSummary(WorkSummary[int]):
    """What an import run did, by seed (sorted): the work-unit loop's ``WorkSummary``, and
    ``imported``, ``failed`` (a failure record written: the convergence rule), ``unusable`` (seed ->
    why its file was not imported) and ``test_accuracies``."""

    imported: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    unusable: dict[int, str] = field(default_factory=dict)
    test_accuracies: dict[int, float] = field(default_factory=dict)


def needs(exp: Experiment) -> frozenset[str]:
    return frozenset()


def produces(exp: Experiment) -> frozenset[str]:
    """The range the checkpoints fill (``reference`` or ``heldout``)."""
    return frozenset({target_range(exp).role})


def check(exp: Experiment, made: frozenset[str] = frozenset()) -> None:
    """``zoo_import.source`` readable and its seeds fitting the range; the data on disk when the
    imported networks are evaluated."""
    if exp.config.zoo_import.evaluate:
        exp.check_data()
    planned(exp)


def target_range(exp: Experiment) -> SeedRange:
    """The seed range ``zoo_import.range`` names."""
    return exp.reference if exp.config.zoo_import.range == ImportRange.reference else exp.heldout


def planned(exp: Experiment) -> tuple[list[str], list[int]]:
    """The files to import (natural order, after ``zoo_import.skip``, at most ``zoo_import.limit``) and their seeds.

    Raises ``ConfigError`` when the source is not set, or the seeds do not fit the range
    (too many files, a file-name seed outside it, two files with one seed); ``CheckpointError``
    when the source cannot be listed or names a member twice.
    """
    settings = exp.config.zoo_import
    if not settings.source:
        raise ConfigError("zoo_import.source: missing; stage=import needs zoo_import.source=/path/to/folder-or-archive")
    found = list(scan_source(settings.source).names)
    names = found[settings.skip :]
    if settings.limit is not None:
        names = names[: settings.limit]
    if not names:
        raise ConfigError(f"zoo_import.skip={settings.skip}: {settings.source} holds only {len(found)} checkpoints")
    seeds_range = target_range(exp)
    if settings.seeds_from == SeedsFrom.order:
        if len(names) > len(seeds_range):
            raise ConfigError(
                f"zoo_import.source={settings.source}: {len(names)} checkpoints but seeds.{seeds_range.role}={[seeds_range.start, seeds_range.stop]} "
                f"holds {len(seeds_range)} seeds; pass 'seeds.{seeds_range.role}=[{seeds_range.start},{seeds_range.start + len(names)}]' "
                f"or zoo_import.limit={len(seeds_range)}")
        return names, [seeds_range.start + i for i in range(len(names))]
    seeds, owner = [], {}
    for name in names:
        seed = seed_from_name(name)
        if seed not in seeds_range:
            raise ConfigError(f"{name}: seed {seed} (from its file name) is outside seeds.{seeds_range.role}={[seeds_range.start, seeds_range.stop]}")
        if seed in owner:
            raise ConfigError(f"{name}: seed {seed} (from its file name) is also the seed of {owner[seed]}")
        owner[seed] = name
        seeds.append(seed)
    return names, seeds


def provenance(exp: Experiment, file: ForeignCheckpoint, seed: int) -> dict[str, object]:
    """Metadata of an imported checkpoint (no ``config_hash``: it was not trained with this recipe)."""
    settings = exp.config.zoo_import
    return {
        "seed": seed,
        "experiment": exp.name,
        "role": target_range(exp).role,
        "source": "import",
        "source_file": file.name,
        "archive": file.archive or str(Path(settings.source).expanduser().resolve()),
        "source_sha256": file.sha256,
        "mapping": settings.mapping.describe(),
        "versions": library_versions(),
    }


def chance_level(labels: torch.Tensor, num_classes: int) -> float:
    """Accuracy of the best constant guess on ``labels`` ``[N]``: the share of the most frequent
    class, and at least ``1 / num_classes`` (equal on a balanced test split)."""
    if labels.numel() == 0:
        return 1.0 / num_classes
    return max(1.0 / num_classes, float(torch.bincount(labels).max()) / labels.numel())


def near_chance_margin(chance: float, test_size: int, margin: float) -> float:
    """How far above ``chance`` a median accuracy still counts as chance: ``margin``
    (``zoo_import.near_chance_margin``), or 3 standard errors of an accuracy at chance on
    ``test_size`` images if that is more."""
    return max(margin, 3.0 * math.sqrt(chance * (1.0 - chance) / max(1, test_size)))


def judge_against_chance(exp: Experiment, accuracies: list[float]) -> None:
    """``NearChanceError`` (one line, with the numbers and the likely causes) when the median
    of ``accuracies`` (test accuracies of imported networks) is within the margin of chance."""
    images, labels = exp.test_tensors
    chance = chance_level(labels, exp.info.num_classes)
    margin = near_chance_margin(chance, len(labels), float(exp.config.zoo_import.near_chance_margin))
    median = statistics.median(accuracies)
    if median > chance + margin:
        return
    info = exp.info
    order = f" ({info.name}: {info.labels})" if info.labels else ""
    raise NearChanceError(
        f"zoo_import.source={exp.config.zoo_import.source}: refused: the {len(accuracies)} imported network(s) checked first "
        f"score a median test accuracy of {median:.3f} (from {min(accuracies):.3f} to {max(accuracies):.3f}) on "
        f"{info.name}'s test split ({len(labels)} images), within {margin:.3f} of chance ({chance:.3f}): they do not "
        f"read this data set as they were trained on it. Likely causes: the class order{order}, the input normalisation (here mean {_numbers(info.mean)}, std {_numbers(info.std)}), or another data set than "
        f"experiment={exp.name}'s. No checkpoint was written")


def _numbers(values: tuple[float, ...]) -> str:
    return "(" + ", ".join(f"{v:.3f}" for v in values) + ")"


def _failure_record(exp: Experiment, seed: int) -> dict[str, Any]:
    """The failure record of ``seed``; ``StoreError`` (one line) when it is damaged."""
    path = exp.store.failed_path(seed)
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        record, why = None, f"{type(err).__name__}: {err}"
    else:
        why = "not a JSON object with a 'reason'"
    if isinstance(record, dict) and "reason" in record:
        return record
    raise StoreError(f"{path}: the failure record of seed {seed} is damaged ({why}); the import cannot tell what it "
                     "may replace. Run stage=verify verify.repair=true (it quarantines the record) or move it away, "
                     "then import again")


def _already(exp: Experiment, seed: int, file: ForeignCheckpoint) -> bool:
    """True if ``seed`` was imported from this very file; ``StoreError`` if the store holds it
    otherwise. A failure record of an unusable file is not final: the file is tried again."""
    store = exp.store
    if store.checkpoint_path(seed).exists():
        meta = read_metadata(store.checkpoint_path(seed))
        if meta.get("source_sha256") == file.sha256:
            return True
        origin = f"imported from {meta.get('source_file')}" if meta.get("source") == "import" else "trained by the zoo stage"
        raise StoreError(f"{store.checkpoint_path(seed)}: seed {seed} is already in the store ({origin}); importing "
                         f"{file.where} would replace it. Use another store= or another seeds.{target_range(exp).role} range")
    if store.failed_path(seed).exists():
        record = _failure_record(exp, seed)
        if record.get("kind") == UNUSABLE:
            return False
        if record.get("source_sha256") == file.sha256:
            return True
        raise StoreError(f"{store.failed_path(seed)}: seed {seed} is recorded as failed; importing {file.where} would "
                         f"replace it. Use another store= or another seeds.{target_range(exp).role} range")
    return False


def _source_fields(metadata: dict[str, Any]) -> dict[str, Any]:
    return {k: metadata[k] for k in ("source", "source_file", "archive", "source_sha256")}


@dataclass
class _Ready:
    """A checked (and evaluated) network waiting to be written, with the claim on its seed."""

    seed: int
    state: dict[str, torch.Tensor]
    metadata: dict[str, Any]
    claim: contextlib.ExitStack
    held: Claim


def _write(exp: Experiment, ready: _Ready, summary: ImportSummary) -> None:
    """Store ``ready``: its checkpoint, or a failure record when it fails the convergence rule.
    Fenced like the zoo stage's writes: nothing is written when the claim was taken over, and a
    checkpoint published by another worker meanwhile is never replaced (this copy is dropped)."""
    store, metadata, seed = exp.store, ready.metadata, ready.seed
    rule = exp.recipe.fail_rule
    validation = metadata.get("validation_accuracy")

    def write() -> None:
        summary.test_accuracies[seed] = metadata.get("test_accuracy", math.nan)
        if rule.active and validation is not None and validation < rule.final_threshold:
            reason = f"validation accuracy {validation:.3f} < {rule.final_threshold} (imported checkpoint)"
            # replaces only this seed's record of an unusable file (``_already``), under the claim
            store.record_failure(seed, {"reason": reason, "validation_accuracy": validation, **_source_fields(metadata)},
                                 exclusive=not store.failed_path(seed).exists())
            summary.failed.append(seed)
            return
        save_checkpoint(store.checkpoint_path(seed), ready.state, metadata, exclusive=True)
        store.failed_path(seed).unlink(missing_ok=True)  # the record of an earlier try with an unusable file
        summary.imported.append(seed)

    if not publish(ready.held, f"seed {seed}", "importing", write):
        summary.skipped_busy.append(seed)


def _refuse_damaged_records(exp: Experiment, seeds: list[int]) -> None:
    """``StoreError`` before any work when a planned seed has a damaged failure record."""
    damaged = sorted(set(exp.store.unreadable_failure_records()) & set(seeds))
    if damaged:
        _failure_record(exp, damaged[0])


def _judged_before(exp: Experiment, seeds: list[int]) -> bool:
    """True when a planned seed holds a checkpoint imported with evaluation: an earlier run of
    this import passed the chance check (a resumed import is not judged on its last few files)."""
    for seed in seeds:
        path = exp.store.checkpoint_path(seed)
        if path.exists():
            meta = read_metadata(path)
            if meta.get("source") == "import" and "test_accuracy" in meta:
                return True
    return False


class _Importer:
    """What importing one file needs: the experiment's fresh state dict (keys, shapes), a model to
    evaluate with, and the splits."""

    def __init__(self, exp: Experiment) -> None:
        self.exp = exp
        self.settings = exp.config.zoo_import
        self.reference = exp.model().state_dict()
        self.model = exp.model().to(exp.device) if self.settings.evaluate else None
        self.check = exp.validation_tensors if self.settings.evaluate else None  # the convergence rule's split
        self._hint: str | None = None  # ready_mapping_hint's answer, once found

    def ready_mapping_hint(self, raw: Any, where: str) -> str:
        """``; zoo_import=<name> ...`` when a ready-made mapping of ``conf/zoo_import/`` (other than
        the one in use) maps the file ``raw`` (its loaded object) to the model; else "". Tried
        on the first file the mapping in use refuses, then remembered (a zoo's files share a format)."""
        if raw is None:
            return ""
        if self._hint is None:
            self._hint = ""
            in_use = self.settings.mapping.describe()
            for name, mapping in ready_mappings().items():
                if mapping.describe() == in_use:
                    continue
                try:
                    check_against(mapping.apply(raw, where), self.reference, mapping, where)
                except CheckpointError:
                    continue
                self._hint = (f"; the ready-made mapping zoo_import={name} (conf/zoo_import/{name}.yaml) reads this "
                              f"file: add zoo_import={name} to the command line")
                break
        return self._hint

    def prepare(self, file: ForeignCheckpoint, seed: int, summary: ImportSummary) -> tuple[dict, dict] | None:
        """``(state, metadata)`` of ``file`` mapped, checked and evaluated; None (and a failure
        record with the reason) when the file cannot be used."""
        exp, settings = self.exp, self.settings
        metadata = provenance(exp, file, seed)
        raw = None
        try:
            raw = read_checkpoint(file)
            loaded = settings.mapping.apply(raw, file.where)
            state = check_against(loaded, self.reference, settings.mapping, file.where)
        except CheckpointError as err:
            reason = " ".join(str(err).split()) + self.ready_mapping_hint(raw, file.where)
            log.error("seed %d not imported: %s (recorded as failed)", seed, reason)
            exp.store.record_failure(seed, {"reason": f"{UNUSABLE}: {reason}", "kind": UNUSABLE, **_source_fields(metadata)})
            summary.unusable[seed] = reason
            return None
        if self.model is not None:
            self.model.load_state_dict(state)
            metadata["test_accuracy"] = accuracy(self.model, *exp.test_tensors)
            if self.check is not None:
                metadata["validation_accuracy"] = accuracy(self.model, *self.check)
        return state, metadata


def run(exp: Experiment) -> ImportSummary:
    """Import the checkpoints of ``zoo_import.source`` (see the module docstring).

    Raises ``NearChanceError`` (no checkpoint written) when the first networks score near chance,
    ``ImportFailuresError`` at the end when some files could not be used, ``StoreError`` when
    a seed is taken by something else or has a damaged failure record.
    """
    settings = exp.config.zoo_import
    names, seeds = planned(exp)
    listing = scan_source(settings.source)
    if listing.skipped:
        log.warning("import: %d entries of %s left out: %s", len(listing.skipped), settings.source, listing.describe_skipped())
    seed_of = dict(zip(names, seeds))
    store = exp.store
    store.ensure_writable()
    _refuse_damaged_records(exp, seeds)
    importer = _Importer(exp)
    summary = ImportSummary()
    log.info("import %d checkpoints from %s into %s seeds %d..%d (archive order, one pass)", len(names), settings.source,
             exp.name, min(seeds), max(seeds))
    _import_files(exp, importer, names, seed_of, summary)
    _finish_busy(exp, importer, names, seed_of, summary)
    _finish(exp, summary, len(names))
    return summary


def _finish_busy(exp: Experiment, importer: "_Importer", names: list[str], seed_of: dict[str, int],
                 summary: ImportSummary) -> None:
    """Wait for the seeds of ``summary.skipped_busy`` until each is published by its holder, or its
    claim is released or stale and this job imports its file (the work-unit loop, ``work.finish_busy``);
    raises ``HeldElsewhereError`` after ``claims.wait_s``."""
    store, claims = exp.store, exp.config.claims
    if not summary.skipped_busy:
        return

    def take_over(free: list[int]) -> list[int]:
        log.info("import %s: taking over seeds %s (their claims were released or went stale)", exp.name, free)
        again = ImportSummary()
        _import_files(exp, importer, [name for name in names if seed_of[name] in free], seed_of, again)
        summary.imported += again.imported
        summary.failed += again.failed
        summary.unusable.update(again.unusable)
        summary.test_accuracies.update(again.test_accuracies)
        summary.quarantined.update(again.quarantined)
        summary.done_elsewhere += again.skipped_done
        return again.skipped_busy

    summary.done_elsewhere += finish_busy(
        summary.skipped_busy, lambda seed: store.claim_path(store.seed_unit(seed)),
        lambda seed: store.checkpoint_path(seed).exists() or store.failed_path(seed).exists(), take_over,
        claims.timeout_s, claims.wait_s, claims.poll_s, f"import {exp.name}", lambda seed: f"seed {seed}")
    summary.skipped_busy = []


def _import_files(exp: Experiment, importer: "_Importer", names: list[str], seed_of: dict[str, int],
                  summary: ImportSummary) -> None:
    """One pass over the files ``names`` of ``zoo_import.source`` (in order), each into its seed under
    the seed's claim (``claim_unit``; a seed held elsewhere is left in ``skipped_busy``); the first
    networks are judged against chance before any is written."""
    settings, store = exp.config.zoo_import, exp.store
    seeds = [seed_of[name] for name in names]
    probing = settings.evaluate and settings.near_chance_margin is not None and not _judged_before(exp, seeds)
    waiting: list[_Ready] = []  # held, with their claims, until the chance check has passed
    try:
        for file in tqdm(iter_checkpoints(settings.source, names), total=len(names), desc=f"import {exp.name}",
                         unit="file", dynamic_ncols=True):
            seed = seed_of[file.name]
            with contextlib.ExitStack() as unit:
                held = claim_unit(store, store.seed_unit(seed), unit, summary, seed,
                                  lambda: Recheck(done=_already(exp, seed, file)), f"seed {seed} will be imported again")
                if held is None:
                    continue
                prepared = importer.prepare(file, seed, summary)
                if prepared is None:
                    continue
                ready = _Ready(seed, *prepared, claim=unit.pop_all(), held=held)
            if not probing:
                with ready.claim:
                    _write(exp, ready, summary)
                continue
            waiting.append(ready)
            if len(waiting) >= settings.chance_probe:
                probing = _judge_and_flush(exp, waiting, summary)
        if waiting:
            _judge_and_flush(exp, waiting, summary)
    finally:
        for ready in waiting:
            ready.claim.close()


def _finish(exp: Experiment, summary: ImportSummary, planned_files: int) -> None:
    """Sort the summary, log it, and raise ``ImportFailuresError`` when some files could not be used."""
    for seeds_list in (summary.imported, summary.failed, summary.skipped_done, summary.skipped_busy, summary.done_elsewhere):
        seeds_list.sort()
    written = [summary.test_accuracies[s] for s in summary.imported if not math.isnan(summary.test_accuracies[s])]
    log.info("import: %d checkpoints written (median test accuracy %s), %d failed the convergence rule, %d files "
             "unusable, %d already imported, %d imported elsewhere while waited for", len(summary.imported),
             f"{statistics.median(written):.3f}" if written else "not measured",
             len(summary.failed), len(summary.unusable), len(summary.skipped_done), len(summary.done_elsewhere))
    if summary.unusable:
        first = sorted(summary.unusable.items())[:3]
        raise ImportFailuresError(
            f"zoo_import.source={exp.config.zoo_import.source}: {len(summary.unusable)} of {planned_files} files could not be "
            "imported (recorded as failed seeds; the next import tries them again): "
            + "; ".join(f"seed {seed}: {reason}" for seed, reason in first)
            + (" ..." if len(summary.unusable) > len(first) else ""))


def _judge_and_flush(exp: Experiment, waiting: list[_Ready], summary: ImportSummary) -> bool:
    """Judge the ``waiting`` networks against chance (``NearChanceError``), then write them and
    release their claims; False (probing is over)."""
    judge_against_chance(exp, [ready.metadata["test_accuracy"] for ready in waiting])
    while waiting:
        ready = waiting.pop(0)
        with ready.claim:
            _write(exp, ready, summary)
    return False
