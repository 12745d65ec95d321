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
from metrics.tables import write_tables

log = logging.getLogger(__name__)


def run_report(exp: Experiment) -> list[Path]:
    """Write the tables; raises ``FileNotFoundError`` naming the missing metrics.csv."""
    results = Path(str(exp.cfg.results))
    own = results / exp.name / "metrics.csv"
    if not own.is_file():
        raise FileNotFoundError(f"{own}: no metrics for {exp.name}; run python -m benchmark stage=evaluate experiment={exp.name}")
    written = write_tables(pd.read_csv(own, keep_default_na=True), results / exp.name)
    frames = [pd.read_csv(p) for p in sorted(results.glob("*/metrics.csv")) if p.parent.name != "all"]
    if len(frames) > 1:
        written += write_tables(pd.concat(frames, ignore_index=True), results / "all")
    for path in written:
        log.info("wrote %s", path)
    return written


register_stage("report", run_report)
