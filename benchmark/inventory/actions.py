"""The inventory's writes, apart from its queries: removing the temp files killed writers left in
the results folder, and moving damaged store files to quarantine before their unit is redone.
Only the stages call them (``tests/test_architecture.py``)."""
from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from benchmark.core.store import quarantine
from benchmark.experiment import Experiment

log = logging.getLogger(__name__)


def reap_results_litter(exp: Experiment) -> int:
    """Remove the temp files killed writers left in ``results/<experiment>/`` (``store.results_litter``),
    with one log line; how many. Called first by the stages that write results."""
    removed = 0
    for path in exp.store.results_litter(exp.results_dir):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed += 1
    if removed:
        log.info("%s: removed %d temp file(s) left by killed writers", exp.results_dir, removed)
    return removed


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
