"""Report stage: Tables 1, 2 and 3 (Markdown, CSV, LaTeX) from every ``results/*/metrics.csv``,
the zoo summary, the diagnostics of every method and mode (``diagnostics.{md,csv}``) and the
paper's claims checked by exact tests over the repetitions (``findings.md``, from the evaluate
stage's ``repetitions.csv``), and, for an experiment the paper ran, its published Tables 1 and 2
beside ours (``paper.md``, ``benchmark.report.paper``).

The current experiment's files go to ``results/<experiment>/``; when several experiments have
results, the side-by-side tables go to ``results/all/``.

Tables 1-3, the findings and the diagnostics are of the rows scored against the zoo (metrics.csv's
``reference`` column: ``zoo``). ``reference=<name>`` adds what that reference's report hook writes
(``Reference.hooks.report``, a module with ``write`` and ``findings``: its extra tables and its
section of ``findings.md``, from the rows with ``reference`` = ``<name>``); a reference without a
report hook adds its rows to metrics.csv only.
"""
from __future__ import annotations

import importlib
import logging
from collections import Counter
from pathlib import Path
from typing import Sequence

import pandas as pd

from benchmark.core.store import CheckpointMetadata, atomic_write_text, read_metadata
from benchmark.experiment import Experiment
from benchmark.inventory import MissingInputsError, range_state, require_inputs
from benchmark.inventory.actions import reap_results_litter
from benchmark.results import BASELINE_MODE
from benchmark.references import REFERENCES, ZOO, evaluated
from benchmark.report import curves, diagnostics, findings, paper, write_tables
from metrics.mmd import group_layers
from benchmark.results import metrics_path, read_metrics, read_repetitions, repetitions_path, rows_against

log = logging.getLogger(__name__)
NAME = "report"


def needs(exp: Experiment) -> frozenset[str]:
    """The evaluate stage's metrics.csv (and, for the diagnostics, the samples it was computed from)."""
    return frozenset({"metrics"})


def produces(exp: Experiment) -> frozenset[str]:
    return frozenset({"tables"})


def check(exp: Experiment, made: frozenset[str] = frozenset()) -> None:
    """The metrics.csv, unless an earlier stage of this run writes it; with ``reference=<name>``
    its rows against that reference (``missing_reference``)."""
    require_inputs(exp, needs(exp) - made, f"stage={NAME}")
    path = metrics_path(exp.results_dir)
    if "metrics" not in made and path.is_file():
        problem = missing_reference(exp, read_metrics(path))
        if problem is not None:
            raise MissingInputsError(problem)


def missing_reference(exp: Experiment, metrics: pd.DataFrame) -> str | None:
    """Why ``metrics`` (metrics.csv's frame) cannot give the report of ``reference=<name>`` (none
    of its rows: evaluated without it), with the command that scores them; ``None`` when it can."""
    for name in evaluated(exp)[1:]:
        if rows_against(metrics, name).empty:
            return (f"stage={NAME} reference={name} needs the rows of {metrics_path(exp.results_dir)} with "
                    f"reference={name} (every row scored against it); run python -m benchmark stage=evaluate "
                    f"experiment={exp.name} reference={name} first")
    return None


def run(exp: Experiment) -> list[Path]:
    """Write the tables; raises ``MissingInputsError`` naming a missing metrics.csv or repetitions.csv."""
    check(exp)
    reap_results_litter(exp)
    every_metric = read_metrics(metrics_path(exp.results_dir))
    path = repetitions_path(exp.results_dir)
    if not path.is_file():  # written by the evaluate stage beside metrics.csv
        raise MissingInputsError(f"stage={NAME} needs {path} (the per-repetition numbers of the findings' "
                                 f"tests), written by the evaluate stage; rerun python -m benchmark stage=evaluate "
                                 f"experiment={exp.name}")
    every_repetition = read_repetitions(path)
    metrics, repetitions = rows_against(every_metric, ZOO), rows_against(every_repetition, ZOO)
    written = write_tables(metrics, exp.results_dir)
    written += paper.write(metrics, exp.name, exp.results_dir, layers=len(group_layers(exp.model().state_dict())))
    trained = curves.curve_numbers(curves.histories(exp))
    written += curves.write(exp, trained)
    written.append(write_zoo_summary(exp, exp.results_dir / "zoo.md", curves.summary_lines(trained)))
    written += diagnostics.write(exp, exp.results_dir)
    sections = []
    for name in evaluated(exp)[1:]:
        hook = REFERENCES[name].hooks.report
        if hook is None:
            continue
        module = importlib.import_module(hook)
        written += module.write(exp, every_metric, every_repetition, exp.results_dir)
        sections.append(module.findings(*(_methods_only(rows_against(frame, name)) for frame in (every_metric, every_repetition))))
    text = findings.render(_methods_only(metrics), _methods_only(repetitions), others=sections)
    atomic_write_text(exp.results_dir / "findings.md", text + against_baselines(metrics, repetitions))
    written.append(exp.results_dir / "findings.md")
    results = exp.results_dir.parent
    others = [p for p in sorted(results.glob("*/metrics.csv")) if p.parent.name != "all"]
    if len(others) > 1:
        written += write_tables(pd.concat([rows_against(read_metrics(p), ZOO) for p in others], ignore_index=True),
                                results / "all")
    for path in written:
        log.info("wrote %s", path)
    return written


def against_baselines(metrics: pd.DataFrame, repetitions: pd.DataFrame) -> str:
    """findings.md's section of every method row against every baseline row (``findings.baseline_comparisons``,
    the rows that did not fail); empty without both."""
    ok = metrics[metrics["status"] == "ok"]
    is_baseline = ok["mode"] == BASELINE_MODE
    baselines = list(zip(ok.loc[is_baseline, "method"], ok.loc[is_baseline, "mode"]))
    methods = list(zip(ok.loc[~is_baseline, "method"], ok.loc[~is_baseline, "mode"]))
    if not baselines or not methods:
        return ""
    labels = dict(zip(ok["method"], ok["method_label"]))
    table = findings.baseline_comparisons(repetitions[repetitions["status"] == "ok"], baselines, methods)
    return "\n" + findings.render_baselines(table, labels)


def _methods_only(frame: pd.DataFrame) -> pd.DataFrame:
    """The rows of a metrics or repetitions frame that are not baselines (the paper's claims compare methods)."""
    return frame[frame["mode"] != BASELINE_MODE]


def write_zoo_summary(exp: Experiment, path: Path, extra: Sequence[str] = ()) -> Path:
    """The reference zoo and held-out seeds: checkpoints, failures (with the rate), accuracies, the
    trainers that made them, and the seeds trained by both trainers (``zoo.crosscheck``): on how many
    the convergence verdicts differ; then the paragraphs of ``extra`` (the training curves)."""
    lines = [f"# Zoo of {exp.name}", ""]
    for seeds, role in ((exp.reference, "the reference posterior"), (exp.heldout, "base networks, Deep Ensembles")):
        lines += [f"- {range_state(exp, seeds).describe()} ({role})"]
    failed = exp.store.failed_seeds()
    reasons = sorted({r.get("reason", "").split(" (")[-1].rstrip(")") for r in failed.values()})
    if failed:
        lines += ["", f"Failed seeds are excluded from the reference and the bases; reasons: {', '.join(reasons)}."]
    lines += ["", *trainer_lines(exp, failed)]
    for paragraph in extra:
        lines += ["", paragraph]
    atomic_write_text(path, "\n".join(lines) + "\n")
    return path


def trainer_lines(exp: Experiment, failed: dict[int, dict]) -> list[str]:
    """Which trainer made the checkpoints and failure records of both ranges (their metadata's
    ``trainer``), and the verdicts of the seeds also trained by the other trainer (``crosscheck``)."""
    def ours(seed: int) -> bool:
        return seed in exp.reference or seed in exp.heldout

    records: dict[int, tuple[str, str, dict | None]] = {}  # seed -> (trainer, verdict, crosscheck)
    for seed in filter(ours, exp.store.completed_seeds()):
        meta = CheckpointMetadata.decode(read_metadata(exp.store.checkpoint_path(seed)))
        trainer = meta.trainer or ("imported" if meta.source_file or meta.source else "not recorded")
        records[seed] = (trainer, "converged", meta.crosscheck)
    for seed in filter(ours, failed):
        record = failed[seed]
        verdict = "diverged" if record.get("reason") == "diverged" else "failed"
        records[seed] = (record.get("trainer", "not recorded"), verdict, record.get("crosscheck"))
    counts = Counter(trainer for trainer, _, _ in records.values())
    lines = ["Trainers: " + ", ".join(f"{trainer} {count}" for trainer, count in sorted(counts.items())) +
             " (checkpoints and failure records of both ranges)."] if counts else []
    checked = {seed: (verdict, check) for seed, (_, verdict, check) in records.items() if check}
    if checked:
        differ = sorted(seed for seed, (verdict, check) in checked.items() if check["verdict"] != verdict)
        gaps = [check["max_weight_difference"] for _, check in checked.values() if "max_weight_difference" in check]
        trainers = sorted({check["trainer"] for _, check in checked.values()})
        lines.append(f"Trainers cross-checked (zoo.crosscheck={exp.config.zoo.crosscheck}: the first seeds of each range, also "
                     f"trained {' / '.join(trainers)}): the convergence verdicts differ on {len(differ)} of {len(checked)} "
                     f"seeds{' (' + ', '.join(map(str, differ)) + ')' if differ else ''}"
                     + (f"; largest weight difference where both kept the network: {max(gaps):.2g}" if gaps else "")
                     + ". make bench compares them on 64 digits seeds (bench/bench_zoo.py).")
    return lines
