"""The work-unit loop the zoo, sample and import stages share (each with its own callbacks):

1. **claim** a unit (``claim_unit``): a unit another live process holds is skipped on this pass
   (``WorkSummary.skipped_busy``);
2. **check it again** under the claim: temp files of a writer killed mid-write are removed, a unit
   published meanwhile is skipped (``skipped_done``), damaged files are moved to ``quarantine/``
   (``quarantine_and_redo``, ``quarantined``) before it is produced again;
3. **produce and publish** it (``publish``): fenced, so that nothing is written once the claim was
   taken over (``Claim.lost``, ``ClaimLostError``) and a copy another worker published first is never
   replaced (``AlreadyPublishedError``); a unit that could not be published is busy elsewhere;
4. **take over from a dead holder** (``finish_busy``): the units skipped as busy are waited for until
   each is published by its holder, or its claim is released or goes stale and this process produces it;
5. **summarise**: ``WorkSummary`` holds what every stage's pass reports; each stage's summary adds its own.
"""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Generic, Sequence, TypeVar

from benchmark.core.store.atomic import AlreadyPublishedError, remove_temp_files_of
from benchmark.core.store.claims import Claim, held_elsewhere, wait_for_claims
from benchmark.core.store.layout import ExperimentStore
from benchmark.core.store.quarantine import quarantine
from benchmark.core.store.units import Unit

log = logging.getLogger(__name__)
K = TypeVar("K")


class ClaimLostError(RuntimeError):
    """This worker's claim on a unit was taken over: it stops the unit and writes nothing more."""


@dataclass
class WorkSummary(Generic[K]):
    """What a stage's pass did with its units (keys ``K``: a seed, a unit label), the part every stage
    shares: ``skipped_done`` (published before this pass came to them), ``skipped_busy`` (claimed
    elsewhere: waited for by ``finish_busy``), ``done_elsewhere`` (busy at first, published by their
    holders while waited for) and ``quarantined`` (key -> what was wrong with its files, moved to
    ``quarantine/`` before it was produced again)."""

    skipped_done: list[K] = field(default_factory=list)
    skipped_busy: list[K] = field(default_factory=list)
    done_elsewhere: list[K] = field(default_factory=list)
    quarantined: dict[K, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Recheck:
    """A unit's state read under its claim: ``done`` (published and valid: nothing to produce) and
    ``damaged`` (path -> what is wrong: files to quarantine before producing it again)."""

    done: bool
    damaged: dict[Path, str] = field(default_factory=dict)


def quarantine_and_redo(problems: dict[Path, str], redo: str) -> dict[Path, Path]:
    """Move each damaged file of ``problems`` (path -> what is wrong) to ``quarantine/`` beside it,
    logging one line each with ``redo`` (what will redo its unit); return path -> new path. Call it
    only while holding the claim of the files' unit. A file already gone is skipped."""
    moved = {}
    for path, problem in problems.items():
        try:
            moved[path] = quarantine(path, problem)
        except FileNotFoundError:
            continue
        log.error("%s; moved to %s, %s", problem, moved[path], redo)
    return moved


def claim_unit(store: ExperimentStore, unit: Unit, held: contextlib.ExitStack, summary: WorkSummary[K], key: K,
               recheck: Callable[[], Recheck], redo: str) -> Claim | None:
    """Steps 1 and 2 of the loop for ``unit`` (``key`` in ``summary``): its claim, held as long as
    ``held``, once the unit is checked again under it; ``None`` when it is busy elsewhere
    (``skipped_busy``) or done (``skipped_done``). Temp files of its killed writers are removed and its
    damaged files quarantined (``quarantined[key]``; ``redo``: what will produce it again)."""
    claim = held.enter_context(store.claim(unit))
    if claim is None:
        summary.skipped_busy.append(key)
        return None
    for path in store.unit_paths(unit):
        remove_temp_files_of(path)  # left by a writer killed mid-write
    state = recheck()
    if state.done:
        summary.skipped_done.append(key)
        return None
    if quarantine_and_redo(state.damaged, redo):
        summary.quarantined[key] = "; ".join(state.damaged.values())
    return claim


def publish(claim: Claim, name: str, doing: str, write: Callable[[], object]) -> bool:
    """Step 3's fence: ``write()`` (the stage's exclusive writes) unless the claim was taken over
    while ``doing`` (e.g. "training"); False, with one warning naming ``name``, when nothing could be
    published: the claim was lost (before or during ``write``: ``ClaimLostError``) or another worker
    published the unit first (``AlreadyPublishedError``). The caller then counts the unit busy elsewhere."""
    if claim.lost:
        log.warning("%s: the claim was taken over while %s; this worker stops it, nothing stored", name, doing)
        return False
    try:
        write()
    except AlreadyPublishedError:
        log.warning("%s: another worker published it first; this run's copy dropped", name)
        return False
    except ClaimLostError as err:
        log.warning("%s: the claim was taken over while %s; nothing more written (%s)", name, doing, err)
        return False
    return True


def finish_busy(busy: Sequence[K], claim_path: Callable[[K], Path], published: Callable[[K], bool],
                take_over: Callable[[list[K]], Sequence[K]], timeout_s: float, wait_s: float, poll_s: float, what: str,
                name: Callable[[K], str] = str) -> list[K]:
    """Step 4: wait for the units of ``busy`` (claimed by other processes when this one came to them)
    until each is ``published`` by its holder or taken over here. ``take_over(free)`` runs the units
    whose claims were released or went stale (claiming each, as the stage's own pass does) and returns
    the units it found held elsewhere again (a third process claimed them meanwhile; a stage's whole
    pass may return others of ``busy`` too). ``claim_path(unit)``: its claim's shared name (read when
    needed: a pass may rename units). Returns the units published elsewhere while waiting. Raises
    ``HeldElsewhereError`` once ``wait_s`` seconds have passed with units still held (``wait_for_claims``)."""
    deadline = time.monotonic() + wait_s
    pending, elsewhere = list(dict.fromkeys(busy)), []
    while pending:
        free = wait_for_claims({unit: claim_path(unit) for unit in pending}, published, timeout_s, deadline, poll_s,
                               what, name)
        done = [unit for unit in pending if unit not in free and published(unit)]
        elsewhere += done
        if not free:  # every one published by its holder
            break
        still = list(take_over(free))
        pending = list(dict.fromkeys([*still, *(u for u in pending if u not in done and u not in free)]))
        if set(still) >= set(free) and pending:  # none taken: held again elsewhere (chains running, a third process)
            if time.monotonic() >= deadline:
                raise held_elsewhere(what, {unit: claim_path(unit) for unit in pending}, timeout_s, name)
            time.sleep(poll_s)
    return elsewhere
