"""Analyze stage: the paper's analyses as figures (``python -m benchmark stage=analyze
analysis=<name>|all``), from the same store as the tables.

Every selected analysis is checked before any work (and by the CLI's preflight before the
first stage of ``stage=all``): one whose inputs are missing from the store stops the stage
naming what to run first; with ``analysis=all`` an analysis that does not apply to the
experiment's model (min-mass with BatchNorm) is skipped with its reason, while a named one is
refused. Each writes ``results/<experiment>/figures/<name>.{png,pdf,csv}``
(and extra CSVs); ``figures/index.md`` lists the figures with their captions and timings.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Sequence

from benchmark import analyses  # the package, not its names: it imports the evaluate stage (a cycle)
from benchmark.experiment import Experiment
from benchmark.core.store import atomic_write_text

log = logging.getLogger(__name__)


def selected(exp: Experiment) -> list[str]:
    """The analyses ``analysis=`` names, in the paper's order."""
    choice = exp.config.analysis.value
    return list(analyses.ANALYSES) if choice == "all" else [choice]


def produced_by(exp: Experiment, stages: Sequence[str]) -> frozenset[str]:
    """The analysis inputs (``INPUTS`` of the analysis modules) that ``stages``, run in this
    process before the analyze stage, write to the store: ``"reference"`` (the zoo stage, when
    ``zoo.range`` includes the reference seeds; an import into the reference range) and
    ``"samples"`` (the sample stage)."""
    made = set()
    if "zoo" in stages and exp.config.zoo.range.value in ("both", "reference"):
        made.add("reference")
    if "import" in stages and exp.config.import_.range.value == "reference":
        made.add("reference")
    if "sample" in stages:
        made.add("samples")
    return frozenset(made)


def runnable(exp: Experiment, produced: frozenset[str] = frozenset()) -> tuple[list[str], dict[str, str]]:
    """``(analyses to run, {skipped analysis: reason})``: every selected analysis's ``applies``
    and, unless ``produced`` (what earlier stages of this run will write, ``produced_by``) covers
    its ``INPUTS``, its store check. Raises ``NotApplicableError`` for a named analysis that does
    not apply (with ``analysis=all`` it is skipped), and ``MissingInputsError`` listing every
    selected analysis whose inputs are missing."""
    names, skipped, missing = [], {}, []
    for name in selected(exp):
        module = analyses.ANALYSES[name]
        try:
            module.applies(exp)
        except analyses.NotApplicableError as err:
            if exp.config.analysis.value != "all":
                raise
            skipped[name] = str(err)
            continue
        if not set(module.INPUTS) <= produced:
            try:
                module.check(exp)
            except analyses.MissingInputsError as err:
                missing.append(str(err))
                continue
        names.append(name)
    if missing:
        raise analyses.MissingInputsError(" | ".join(missing))
    return names, skipped


def run(exp: Experiment) -> list[Path]:
    """Draw the selected analyses; returns the files written."""
    names, skipped = runnable(exp)
    for name, reason in skipped.items():
        log.info("analysis %s skipped: %s", name, reason)
    written, timings = [], {}
    for name in names:
        start = time.perf_counter()
        written += analyses.ANALYSES[name].run(exp)
        timings[name] = time.perf_counter() - start
        log.info("analysis %s: %.1f s", name, timings[name])
    index = analyses.figures_dir(exp) / "index.md"
    atomic_write_text(index, render_index(exp, timings, skipped))
    for path in written:
        log.info("wrote %s", path)
    return [*written, index]


def render_index(exp: Experiment, timings: dict[str, float], skipped: dict[str, str]) -> str:
    """``figures/index.md``: every figure of this run with its title, caption and run time, and
    the analyses skipped with their reasons. Figures of earlier runs in the folder are listed too."""
    folder = analyses.figures_dir(exp)
    lines = [f"# Figures of {exp.display_name}", "",
             "Written by `python -m benchmark stage=analyze`; each figure has a PNG, a PDF and its numbers as CSV.", ""]
    for name, module in analyses.ANALYSES.items():
        figures = sorted(p.stem for p in folder.glob(f"{name}*.png") if p.stem == name or p.stem.startswith(f"{name}_"))
        if name in skipped:
            lines += [f"## {module.TITLE}", "", f"Not applicable: {skipped[name]}", ""]
        if not figures:
            continue
        timing = f" (this run: {timings[name]:.1f} s)" if name in timings else " (from an earlier run)"
        lines += [f"## {module.TITLE}{timing}", "", module.CAPTION, ""]
        lines += [f"![{stem}]({stem}.png) [PDF]({stem}.pdf) [CSV]({stem}.csv)" for stem in figures] + [""]
    return "\n".join(lines)
