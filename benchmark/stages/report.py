"""Report stage: Tables 1 and 2 (Markdown, CSV, LaTeX) from every ``results/*/metrics.csv``.

The current experiment's tables go to ``results/<experiment>/``; when several experiments
have results, the side-by-side tables go to ``results/all/``.
"""
from __future__ import annotations

import logging
from pathlib import Path

import pandas as pd

from benchmark.cli import register_stage
from benchmark.experiment import Experiment
from benchmark.stages.zoo import zoo_summary
from benchmark.store import atomic_write_text
from metrics.tables import write_tables

log = logging.getLogger(__name__)


def run_report(exp: Experiment) -> list[Path]:
    """Write the tables; raises ``FileNotFoundError`` naming the missing metrics.csv."""
    results = Path(str(exp.cfg.results))
    own = results / exp.name / "metrics.csv"
    if not own.is_file():
        raise FileNotFoundError(f"{own}: no metrics for {exp.name}; run python -m benchmark stage=evaluate experiment={exp.name}")
    written = write_tables(pd.read_csv(own, keep_default_na=True), results / exp.name)
    written.append(write_zoo_summary(exp, results / exp.name / "zoo.md"))
    frames = [pd.read_csv(p) for p in sorted(results.glob("*/metrics.csv")) if p.parent.name != "all"]
    if len(frames) > 1:
        written += write_tables(pd.concat(frames, ignore_index=True), results / "all")
    for path in written:
        log.info("wrote %s", path)
    return written


def write_zoo_summary(exp: Experiment, path: Path) -> Path:
    """The reference zoo and held-out seeds: checkpoints, failures (with the rate), accuracies."""
    lines = [f"# Zoo of {exp.name}", ""]
    for label, start, stop in (
        ("reference", int(exp.cfg.zoo.start), int(exp.cfg.reference.stop)),
        ("held-out (bases, Deep Ensembles)", int(exp.cfg.heldout.start), int(exp.cfg.heldout.stop)),
    ):
        lines += [f"- {label}: {zoo_summary(exp, start, stop).describe(start, stop, this_run=False).replace(chr(10), '; ')}"]
    failed = exp.store.failed_seeds()
    reasons = sorted({r.get("reason", "").split(" (")[-1].rstrip(")") for r in failed.values()})
    if failed:
        lines += ["", f"Failed seeds are excluded from the reference and the bases; reasons: {', '.join(reasons)}."]
    atomic_write_text(path, "\n".join(lines) + "\n")
    return path


register_stage("report", run_report)
