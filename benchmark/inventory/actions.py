"""The inventory's writes, apart from its queries: removing the temp files killed writers left in
the results folder (moving damaged store files to quarantine is the work-unit loop's,
``benchmark.core.store.work.quarantine_and_redo``). Only the stages call them
(``tests/test_architecture.py``)."""
from __future__ import annotations

import contextlib
import logging

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
