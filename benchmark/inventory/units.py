"""The state of the sample units: which (method, mode, repetition) units a config asks for (the
repetitions from the repetition design, ``benchmark.design``), whether the held-out range can
supply their bases, and the state of a unit's two files (missing, stale, corrupt): stale when its
metadata differ from ``keys.unit_expectations``, when the held-out seeds at its block's positions
moved (``moved_seeds``) or its base networks changed (``changed_bases``); corrupt when a file fails
validation or the predictions were computed from another sample set (``pairing_problem``)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from benchmark.core.store import CheckpointError, SampleSetMetadata, Unit, check_file, content_digest, read_metadata
from benchmark.design import Design
from benchmark.experiment import Experiment
from benchmark.inventory.keys import base_digests, unit_expectations
from benchmark.inventory.zoo import converged, trained_prefix
from methods import method_names, selected


def heldout_shortfall(exp: Experiment, bases: int) -> str | None:
    """Why ``seeds.heldout`` cannot supply the sample stage, or ``None``: repetition k's bases
    start at converged held-out seed ``k x Design.stride``, so the design's repetitions need
    ``Design.needed(bases)`` converged seeds (at the largest count of any method, ``Design.most``:
    ``sample.repetitions`` or ``sample.repetitions_per_method``; ``bases``: the most any selected
    method x mode takes, e.g. Deep Ensembles' members). Seeds already trained count as they are;
    the rest at ``seeds.expected_convergence``. The message gives the numbers and the range to use."""
    design, heldout = exp.design, exp.heldout
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


def expected_units(exp: Experiment) -> list[Unit]:
    """Every unit a full sample stage of this config writes: each registered method the
    experiment runs x each mode it supports x its repetitions (``Design.repetitions_of``)."""
    design = exp.design
    return [exp.store.sample_unit(m, mode, r) for m, mode in selected("all", "both")
            if not exp.method_settings(m).unavailable for r in range(design.repetitions_of(m))]


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
    design = exp.design
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
            if stale:
                state.stale = f"{path}: metadata {', '.join(stale)} differ from the current settings"
                if "layout" in stale and metas[path].get("layout") is None:  # an older version's unit
                    state.stale += (f" (layout: unrecorded, written by an older version; the repetition design gives "
                                    f"{expected['layout']}: stage=verify verify.repair=true records it when the unit "
                                    "was drawn around bases of that block)")
                elif "layout" in stale:  # name the move: which block it was drawn from, which it is now
                    state.stale += (f" (layout: drawn from {metas[path].get('layout')}, the "
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
