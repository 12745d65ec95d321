"""Import stage: write a zoo trained elsewhere into the store instead of training it.

``python -m benchmark stage=import experiment=<name> zoo_import.source=<folder or archive> [zoo_import=<mapping>]``

Every checkpoint file of the source (natural order of the paths) is read, its keys mapped to
the experiment's model (``zoo_import.mapping``; ready mappings in ``conf/zoo_import/``), and checked
(every key, shape, finite values; errors name the file, the key and the expected shape). It
becomes the zoo checkpoint of one seed of ``zoo_import.range`` (``zoo_import.seeds_from``: the i-th file
gets the range's i-th seed, or the number in its file name). With ``zoo_import.evaluate`` its
test accuracy and its accuracy on the validation split are measured, and the recipe's
convergence rule is applied to the latter as for a trained seed (a checkpoint below the
threshold is recorded as failed). The metadata records the
provenance: source file, archive, its SHA-256, and the mapping. The rest of the pipeline reads
imported checkpoints like trained ones.

Resumable like the zoo stage: per-seed claims, atomic writes; a seed already imported from the
same file is skipped, and a seed the store holds from anything else stops the import.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from benchmark.config import ConfigError, ImportRange, SeedsFrom
from benchmark.core.fingerprint import library_versions
from benchmark.core.store import CheckpointMetadata, StoreError, read_metadata, save_checkpoint
from benchmark.experiment import Experiment, SeedRange
from benchmark.core.store.importing import (
    ForeignCheckpoint,
    check_against,
    iter_checkpoints,
    list_checkpoints,
    read_checkpoint,
    seed_from_name,
)
from benchmark.core.training import accuracy

log = logging.getLogger(__name__)
NAME = "import"


@dataclass
class ImportSummary:
    """What an import run did, by seed."""

    imported: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    skipped_done: list[int] = field(default_factory=list)
    skipped_busy: list[int] = field(default_factory=list)


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
    (too many files, a file-name seed outside it, two files with one seed).
    """
    settings = exp.config.zoo_import
    if not settings.source:
        raise ConfigError("zoo_import.source: missing; stage=import needs zoo_import.source=/path/to/folder-or-archive")
    found = list_checkpoints(settings.source)
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


def _already(exp: Experiment, seed: int, file: ForeignCheckpoint) -> bool:
    """True if ``seed`` was imported from this very file; ``StoreError`` if the store holds it otherwise."""
    store = exp.store
    if store.checkpoint_path(seed).exists():
        meta = read_metadata(store.checkpoint_path(seed))
        if meta.get("source_sha256") == file.sha256:
            return True
        origin = f"imported from {meta.get('source_file')}" if meta.get("source") == "import" else "trained by the zoo stage"
        raise StoreError(f"{store.checkpoint_path(seed)}: seed {seed} is already in the store ({origin}); importing "
                         f"{file.where} would replace it. Use another store= or another seeds.{target_range(exp).role} range")
    if store.failed_path(seed).exists():
        record = json.loads(store.failed_path(seed).read_text())
        if record.get("source_sha256") == file.sha256:
            return True
        raise StoreError(f"{store.failed_path(seed)}: seed {seed} is recorded as failed; importing {file.where} would "
                         f"replace it. Use another store= or another seeds.{target_range(exp).role} range")
    return False


def run(exp: Experiment) -> ImportSummary:
    """Import the checkpoints of ``zoo_import.source`` (see the module docstring)."""
    settings = exp.config.zoo_import
    names, seeds = planned(exp)
    store = exp.store
    store.ensure_writable()
    reference = exp.model().state_dict()
    model = exp.model().to(exp.device)
    rule = exp.recipe.fail_rule
    # the validation split the convergence rule is judged on (None without one)
    check = exp.training_data.check if settings.evaluate else None
    summary = ImportSummary()
    log.info("import %d checkpoints from %s into %s seeds %d..%d", len(names), settings.source, exp.name, seeds[0], seeds[-1])
    files = iter_checkpoints(settings.source, names)
    for file, seed in tqdm(zip(files, seeds), total=len(names), desc=f"import {exp.name}", unit="file", dynamic_ncols=True):
        with store.claim(store.seed_unit(seed)) as claim:
            if claim is None:
                summary.skipped_busy.append(seed)
                continue
            if _already(exp, seed, file):
                summary.skipped_done.append(seed)
                continue
            state = check_against(settings.mapping.apply(read_checkpoint(file), file.where), reference, settings.mapping,
                                  file.where)
            metadata = provenance(exp, file, seed)
            if settings.evaluate:
                model.load_state_dict(state)
                metadata["test_accuracy"] = accuracy(model, *exp.test_tensors)
                if check is not None:
                    metadata["validation_accuracy"] = accuracy(model, *check)
                if rule.active and check is not None and metadata["validation_accuracy"] < rule.min_accuracy:
                    reason = (f"validation accuracy {metadata['validation_accuracy']:.3f} < {rule.min_accuracy} "
                              "(imported checkpoint)")
                    store.record_failure(seed, {"reason": reason, "validation_accuracy": metadata["validation_accuracy"],
                                                **{k: metadata[k] for k in ("source", "source_file", "archive", "source_sha256")}})
                    summary.failed.append(seed)
                    continue
            save_checkpoint(store.checkpoint_path(seed), state, metadata)
            summary.imported.append(seed)
    log.info("import: %d checkpoints written, %d failed the convergence rule, %d already imported, %d busy elsewhere",
             len(summary.imported), len(summary.failed), len(summary.skipped_done), len(summary.skipped_busy))
    return summary
