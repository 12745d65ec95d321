"""Analyze stage: the paper's analyses as figures (``python -m benchmark stage=analyze
analysis=<name>|all``), from the same store as the tables.

Every selected analysis is checked before any work (``check``, also before the first stage of
``stage=all``): one whose inputs are missing from the store, and that no earlier stage of the run
makes, stops the stage naming what to run first; with ``analysis=all`` an analysis that does not
apply to the experiment's model (min-mass with BatchNorm) is skipped with its reason, while a
named one is refused. Each writes ``results/<experiment>/figures/<name>.{png,pdf,csv}`` (and extra
CSVs); ``figures/index.md`` lists the figures with their captions. Run times go to the log only,
so the committed figures folder is a function of the inputs.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

from benchmark import analyses, loader
from benchmark.report import curves
from benchmark.core.store import atomic_write_text
from benchmark.experiment import Experiment
from benchmark.inventory import MissingInputsError
from benchmark.inventory.actions import reap_results_litter

log = logging.getLogger(__name__)
NAME = "analyze"


def selected(exp: Experiment) -> list[str]:
    """The analyses ``analysis=`` names, in the paper's order."""
    choice = exp.config.analysis.value
    return list(loader.load().analyses) if choice == "all" else [choice]


def needs(exp: Experiment) -> frozenset[str]:
    """What the selected analyses read from the store."""
    return frozenset().union(*(loader.load().analyses[name].needs(exp) for name in selected(exp)))


def produces(exp: Experiment) -> frozenset[str]:
    return frozenset({"figures"})


def runnable(exp: Experiment, made: frozenset[str] = frozenset()) -> tuple[list[str], dict[str, str]]:
    """``(analyses to run, {skipped analysis: reason})``: every selected analysis's ``applies`` and
    its ``check`` with ``made`` (what earlier stages of this run write). Raises
    ``NotApplicableError`` for a named analysis that does not apply (with ``analysis=all`` it is
    skipped), and ``MissingInputsError`` listing every selected analysis whose inputs are missing."""
    names, skipped, missing = [], {}, []
    for name in selected(exp):
        module = loader.load().analyses[name]
        try:
            module.applies(exp)
        except analyses.NotApplicableError as err:
            if exp.config.analysis.value != "all":
                raise
            skipped[name] = str(err)
            continue
        try:
            module.check(exp, made)
        except MissingInputsError as err:
            missing.append(str(err))
            continue
        names.append(name)
    if missing:
        raise MissingInputsError(" | ".join(missing))
    return names, skipped


def check(exp: Experiment, made: frozenset[str] = frozenset()) -> None:
    """Refuse before any work a named analysis that does not apply, or missing inputs (``runnable``)."""
    runnable(exp, made)


def run(exp: Experiment) -> list[Path]:
    """Draw the selected analyses; returns the files written."""
    names, skipped = runnable(exp)
    reap_results_litter(exp)
    for name, reason in skipped.items():
        log.info("analysis %s skipped: %s", name, reason)
    written = []
    for name in names:
        start = time.perf_counter()
        written += loader.load().analyses[name].run(exp)
        log.info("analysis %s: %.1f s", name, time.perf_counter() - start)
    index = analyses.figures_dir(exp) / "index.md"
    atomic_write_text(index, render_index(exp, names, skipped))
    for path in written:
        log.info("wrote %s", path)
    return [*written, index]


def render_index(exp: Experiment, drawn: list[str], skipped: dict[str, str]) -> str:
    """``figures/index.md``: every figure in the folder with its title and caption (those of
    ``drawn`` by this run, the others from an earlier run), and the analyses skipped with their
    reasons. It holds no run time, so it changes only when the figures do."""
    folder = analyses.figures_dir(exp)
    lines = [f"# Figures of {exp.display_name}", "",
             "Written by `python -m benchmark stage=analyze`; each figure has a PNG, a PDF and its numbers as CSV.", ""]
    for name, module in loader.load().analyses.items():
        figures = sorted(p.stem for p in folder.glob(f"{name}*.png") if p.stem == name or p.stem.startswith(f"{name}_"))
        if name in skipped:
            lines += [f"## {module.TITLE}", "", f"Not applicable: {skipped[name]}", ""]
        if not figures:
            continue
        origin = "" if name in drawn else " (from an earlier run)"
        lines += [f"## {module.TITLE}{origin}", "", module.CAPTION, ""]
        lines += [f"![{stem}]({stem}.png) [PDF]({stem}.pdf) [CSV]({stem}.csv)" for stem in figures] + [""]
    if (folder / f"{curves.NAME}.png").is_file():  # the report stage's figure, from the zoo's stored histories
        stem = curves.NAME
        lines += [f"## {curves.TITLE} (written by stage=report)", "", curves.CAPTION, "",
                  f"![{stem}]({stem}.png) [PDF]({stem}.pdf) [CSV]({stem}.csv)", ""]
    return "\n".join(lines)
