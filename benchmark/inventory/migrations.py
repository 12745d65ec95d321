"""The one migration from what older versions wrote to this version's formats, found and applied
by ``stage=verify`` (reported always; applied with ``verify.repair=true`` or ``stale``, a unit's
files under the unit's claim). The readers read the current formats only: without the migration,
an old sample unit reads as stale (the sample stage draws it again, its files moved to
``quarantine/``), and an old reference's file in ``results/`` is never read.

The formats older versions wrote, each with what the migration does:

- ``results/<experiment>/metrics_hmc.csv`` and ``repetitions_hmc.csv`` (``LEGACY_FILES``): one
  reference's rows, apart from ``metrics.csv`` and ``repetitions.csv``, which now hold them as rows
  with ``reference`` = its name: removed (no other file of ``results/`` is touched: it may be the user's);
- a sample unit without ``layout`` in its metadata (written before units recorded their block of
  the held-out seeds), drawn around bases of the block the repetition design gives it now (its
  recorded ``base_seeds`` all lie in it, ``drawn_in_block``): ``layout`` is added to both files
  (the predictions bound again to the rewritten sample set, ``samples_digest``). One drawn
  elsewhere, or without recorded bases, is stale and is left to be drawn again.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from benchmark.core.store import (
    CheckpointError, SampleSetMetadata, Unit, load_sample_set, read_metadata, save_sample_set,
)
from benchmark.core.store.checksum import FORMAT_KEY, METADATA_KEY
from benchmark.experiment import Experiment
from benchmark.inventory.keys import unit_expectations
from benchmark.inventory.zoo import converged


LEGACY_FILES = {"metrics_hmc.csv": "hmc", "repetitions_hmc.csv": "hmc"}
"""The files older versions wrote one reference's rows to (file name -> the reference), apart from
metrics.csv and repetitions.csv. No other name is removed: a file of another name is the user's."""


@dataclass
class Migration:
    """One file (or unit) of an older format: ``path``, ``what`` (the old format and what the
    migration does, in words), ``unit`` (whose claim guards it; ``None`` for a file of
    ``results/``) and ``apply`` (the rewrite)."""

    path: Path
    what: str
    unit: Unit | None
    apply: Callable[[], None]


def results_migrations(results_dir: Path) -> list[Migration]:
    """The files of ``results_dir`` (one experiment's) in an older format (see the module doc)."""
    out = []
    for name, reference in LEGACY_FILES.items():
        path = results_dir / name
        if path.is_file() or path.is_symlink():
            out.append(Migration(path, f"{path}: one reference's rows as an older version wrote them (its rows are those "
                                       f"of metrics.csv and repetitions.csv with reference={reference}): removed",
                                 None, path.unlink))
    return out


def drawn_in_block(exp: Experiment, unit: Unit, metadata: dict[str, str]) -> bool:
    """Whether a unit written before units recorded their ``layout`` (``metadata`` without it) was
    drawn around bases of the block the repetition design gives it now (``Design.unit_block`` of
    the converged held-out seeds): its recorded ``base_seeds`` all lie in it. One without recorded
    bases was not."""
    recorded = SampleSetMetadata.decode(metadata).base_seeds
    design = exp.design
    block = design.unit_block(str(unit.method), str(unit.mode), int(unit.repetition))
    if not recorded or block is None:
        return False
    seeds = design.block(converged(exp, exp.heldout), int(unit.repetition), block[1])
    return {int(s) for s in recorded} <= set(seeds)


def unit_migrations(exp: Experiment, unit: Unit) -> list[Migration]:
    """The sample unit ``unit`` of a registered method when it is of an older format (see the module
    doc); [] when it is current, missing, unreadable (verify's checks name it) or stale."""
    samples, preds = exp.store.samples_path(unit), exp.store.preds_path(unit)
    if not (samples.is_file() and preds.is_file()):
        return []
    try:
        metas = {path: read_metadata(path) for path in (samples, preds)}
    except CheckpointError:
        return []
    if any("layout" in meta for meta in metas.values()) or not drawn_in_block(exp, unit, metas[samples]):
        return []
    layout = unit_expectations(exp, unit)["layout"]
    return [Migration(samples, f"{unit.label}: written before units recorded their layout, drawn around bases of its "
                               f"block: layout {layout} added to its sample set and predictions", unit,
                      lambda: _add_layout(samples, preds, layout))]


def _add_layout(samples: Path, preds: Path, layout: str) -> None:
    """Rewrite both files of a unit with ``layout`` in their metadata (atomically, each replacing the
    old file), the predictions bound to the rewritten sample set."""
    def metadata(path: Path) -> dict[str, str]:
        return {k: v for k, v in read_metadata(path).items() if k not in (METADATA_KEY, FORMAT_KEY)}

    digest = save_sample_set(samples, load_sample_set(samples), {**metadata(samples), "layout": layout})
    save_sample_set(preds, load_sample_set(preds), {**metadata(preds), "layout": layout, "samples_digest": digest})
