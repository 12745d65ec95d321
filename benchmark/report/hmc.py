"""``results/<experiment>/table_hmc.{md,csv}`` (``reference=hmc``): each row's distance to the zoo next
to its distance to full-batch HMC, with error bars, its rank under each reference, its predictive's
agreement and total variation with HMC's (the NeurIPS 2021 competition's scores), one row for the zoo
scored against HMC and one for HMC scored against the zoo; then the convergence of every HMC chain
group. Built from the two metrics frames (``metrics.csv``: against the zoo; ``metrics_hmc.csv``:
against HMC; ``benchmark.results``) and, for the convergence, the HMC units' metadata.

Ranks and Kendall's tau (``agreement``) are over the approximate methods: every row but HMC's own
and the zoo's (the two references), and rows that failed under either reference.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from benchmark.core.store import SampleSetMetadata, atomic_write_text, read_metadata
from benchmark.experiment import Experiment
from benchmark.inventory import row_units
from benchmark.reference import HMC_ROW, REFERENCE_METHODS, ZOO_ROW, HMCReference
from benchmark.report.tables import GROUP_LABELS, INDEX_NAMES, MISSING, display_cells, render_csv, render_markdown
from benchmark.results import check_metrics, check_repetitions, half_width
from methods import method_names
from metrics.kendall import RankAgreement, rank_agreement

REFERENCES = {"zoo": "zoo", "hmc": "HMC"}
"""Rows outside the ranks and Kendall's tau: the references themselves."""
REFERENCE_GROUP = "References"
RANKED_COLUMNS = {"MMD": "mmd_median", "NS MMD": "ns_mmd_median"}
"""The columns rows are ranked by under each reference (the median over kernels, as Table 1)."""
SOURCES = {
    "MMD to zoo": "zoo:mmd_median", "MMD to HMC": "hmc:mmd_median",
    "NS MMD to zoo": "zoo:ns_mmd_median", "NS MMD to HMC": "hmc:ns_mmd_median",
    "Agreement with HMC": "hmc:agreement", "TV to HMC": "hmc:tv",
}
"""table_hmc column -> ``<reference>:<metrics column>``."""
CONVERGENCE_KEYS = {
    "rhat_loglik": "R-hat test log-lik.", "rhat_softmax_median": "R-hat softmax median",
    "rhat_softmax_max": "R-hat softmax max", "softmax_converged": "softmax R-hat < 1.1",
    "ess_loglik_min": "ESS log-lik. (min chain)", "accept_prob": "acceptance", "step_size": "step size",
    "leapfrog_per_draw": "leapfrog steps per draw", "divergences": "divergences", "restarts": "restarts",
}
"""Per chain group: the diagnostics the sample stage recorded (``metrics.mcmc.predictive_convergence``,
``HMCMethod.diagnostics``, averaged over a unit's chains) and what the table calls them."""


def merged(zoo: pd.DataFrame, hmc: pd.DataFrame) -> pd.DataFrame:
    """One frame of the rows of either reference, indexed (Experiment, Group, Method) in table order
    (one-mode, multi-mode, then the references' own rows), with ``<reference>:<column>`` values,
    their half-widths, ``status`` (failed under either) and ``reason``."""
    frames = {"zoo": check_metrics(zoo), "hmc": check_metrics(hmc)}
    keys = ["experiment", "method", "mode"]
    out = None
    for name, frame in frames.items():
        values = frame[keys + ["experiment_label", "method_label", "status", "reason"]].copy()
        for column in (*RANKED_COLUMNS.values(), "agreement", "tv"):
            values[f"{name}:{column}"] = frame[column]
            values[half_width(f"{name}:{column}")] = frame[half_width(column)]
        values = values.rename(columns={c: f"{name}|{c}" for c in ("experiment_label", "method_label", "status", "reason")})
        out = values if out is None else out.merge(values, on=keys, how="outer")
    for column in ("experiment_label", "method_label"):
        out[column] = out[f"hmc|{column}"].fillna(out[f"zoo|{column}"])
    failed = (out["zoo|status"] == "failed") | (out["hmc|status"] == "failed")
    out["status"] = np.where(failed, "failed", "ok")
    out["reason"] = [next((str(r) for r in (a, b) if isinstance(r, str) and r), "")
                     for a, b in zip(out["zoo|reason"], out["hmc|reason"])]
    registered = list(method_names())
    methods = registered + sorted(set(out["method"]) - set(registered))
    group = [REFERENCE_GROUP if (m, mode) in (HMC_ROW, ZOO_ROW) else GROUP_LABELS[mode]
             for m, mode in zip(out["method"], out["mode"])]
    order = [*GROUP_LABELS.values(), REFERENCE_GROUP]
    out = out.assign(Group=group, _g=[order.index(g) for g in group], _m=out["method"].map(methods.index),
                     _r=out["method"].eq("hmc")).sort_values(["_g", "_r", "_m"], kind="stable")
    out.index = pd.MultiIndex.from_arrays([out["experiment_label"].fillna(out["experiment"]), out["Group"],
                                           out["method_label"].fillna(out["method"])], names=INDEX_NAMES)
    return out


def ranked(frame: pd.DataFrame) -> pd.Series:
    """Which rows of a ``merged`` frame are ranked: not a reference's own row, not failed."""
    return ~frame["method"].isin(REFERENCE_METHODS) & frame["status"].eq("ok")


def table(zoo: pd.DataFrame, hmc: pd.DataFrame, separate: bool = False) -> pd.DataFrame:
    """table_hmc: ``SOURCES`` (value x100 ± half-width, as Table 1) and, per ``RANKED_COLUMNS``, the
    row's rank under the zoo / under HMC among the ranked rows (1 = closest); a reference's own
    distance to itself reads "ref."."""
    rows = merged(zoo, hmc)
    out = display_cells(rows, SOURCES, separate)
    is_zoo = rows["method"].eq(ZOO_ROW[0]).to_numpy()
    for label, source in SOURCES.items():
        if source.startswith("zoo:"):
            out[label] = np.where(is_zoo, "ref.", out[label])
            if separate:
                out[f"{label} ±"] = np.where(is_zoo, "", out[f"{label} ±"])
    keep = ranked(rows)
    for label, column in RANKED_COLUMNS.items():
        ranks = {name: rows[f"{name}:{column}"].where(keep).rank(method="min") for name in REFERENCES}
        out[f"{label} rank zoo / HMC"] = [f"{int(a)} / {int(b)}" if k and not (np.isnan(a) or np.isnan(b)) else ""
                                          for a, b, k in zip(ranks["zoo"], ranks["hmc"], keep)]
    return out


def agreement(zoo_repetitions: pd.DataFrame, hmc_repetitions: pd.DataFrame, ranked_rows: list[tuple[str, str]],
              column: str) -> RankAgreement:
    """Kendall's tau between the rankings of ``ranked_rows`` (method, mode) by ``column`` under the zoo
    and under HMC, with its bootstrap interval over the repetitions (``metrics.kendall.rank_agreement``;
    repetition k of a row is the same sample set under both references)."""
    reps = {name: check_repetitions(frame) for name, frame in (("zoo", zoo_repetitions), ("hmc", hmc_repetitions))}
    values: dict[str, list[np.ndarray]] = {"zoo": [], "hmc": []}
    for method, mode in ranked_rows:
        mine = {name: frame[(frame["method"] == method) & (frame["mode"] == mode) & (frame["status"] == "ok")]
                .set_index("repetition")[column] for name, frame in reps.items()}
        common = sorted(set(mine["zoo"].index) & set(mine["hmc"].index))
        for name in values:
            values[name].append(mine[name].loc[common].to_numpy())
    return rank_agreement(values["zoo"], values["hmc"])


def convergence(exp: Experiment) -> pd.DataFrame:
    """One row per HMC chain group: each repetition of each HMC mode in the store (one-mode: one
    chain, judged by its two halves; multi-mode: its chains), then the pooled chains of the HMC
    reference. Columns: group, chains, draws per chain, then ``CONVERGENCE_KEYS``."""
    rows = []
    for mode in ("one", "multi"):
        path = exp.store.samples_path(exp.store.sample_unit("hmc", mode, 0))
        if not path.is_file():
            continue
        for unit in row_units(exp, "hmc", mode):
            meta = SampleSetMetadata.decode(read_metadata(exp.store.samples_path(unit)))
            chains = len(meta.base_seeds or ()) or 1
            row = {"group": f"HMC {mode}-mode, repetition {unit.repetition}", "chains": chains,
                   "draws_per_chain": meta.n_samples // chains}
            rows.append(row | {k: float((meta.diagnostics or {}).get(k, math.nan)) for k in CONVERGENCE_KEYS})
    pool = HMCReference(exp)
    pooled = pool.convergence()
    rows.append({"group": f"HMC reference: the {'/'.join(HMC_ROW)} chains of every repetition, pooled",
                 "chains": int(pooled["chains"]), "draws_per_chain": int(pooled["draws_per_chain"])}
                | {k: pooled.get(k, math.nan) for k in CONVERGENCE_KEYS})
    return pd.DataFrame(rows)


def mass_text(settings: dict) -> str:
    """How the chains' diagonal mass matrix was set, from the method's settings."""
    start = ("the inverse of the Fisher diagonal plus the prior precision at the chain's start"
             if settings["initial_mass"] == "fisher" else "the identity at the start")
    return start + (", then adapted in Stan's warm-up windows" if settings["adapt_mass"] else ", kept throughout")


def caption(zoo: pd.DataFrame, hmc: pd.DataFrame, settings: dict) -> str:
    """table_hmc's caption (with ``{times}``/``{pct}`` unit slots)."""
    frame = check_metrics(hmc)
    own = frame[frame["method"] == HMC_ROW[0]]
    pool = int(frame.loc[frame["method"] != HMC_ROW[0], "n_reference"].max())
    loo = sorted({int(n) for n in own["n_reference"].dropna()})
    zoo_n = sorted({int(n) for n in check_metrics(zoo)["n_reference"].dropna()})
    blocks = frame.loc[frame["method"] == ZOO_ROW[0], "n_samples"]
    return (
        "Table HMC: each row's distance to the two references. MMD and NS MMD as in Table 1 (median over the 20 "
        f"kernels, mean over layers weighted by parameter count; {{times}}), against the zoo ({'/'.join(map(str, zoo_n))} "
        f"converged checkpoints) and against full-batch HMC: the pooled draws ({pool}) of every chain of the HMC "
        f"multi-mode units, {settings['repetitions']} repetitions x {settings['chains']} chains from independent "
        f"starts (start={settings['start']}), each chain {settings['draws']} draws after {settings['warmup']} warm-up "
        f"iterations (thinning {settings['thinning']}, trajectory length {settings['trajectory_length']} in the "
        f"units of the mass matrix ({mass_text(settings)}), at most "
        f"{settings['max_leapfrog_steps']} leapfrog steps per iteration), temperature {settings['temperature']}: "
        "the training split's cross-entropy summed over its images and a Gaussian prior of precision N x the "
        "recipe's weight decay. HMC's own multi-mode row is scored against the other repetitions' chains only "
        f"({'/'.join(map(str, loo))} draws), never against its own draws. Zoo (reference): repetition k is the k-th "
        f"block of {'/'.join(str(int(n)) for n in sorted(set(blocks)))} converged reference checkpoints in seed "
        "order, scored against HMC as a method's samples are. Agreement: fraction of ID test inputs where the argmax "
        "of the row's predictive equals that of HMC's (the mean predictive of the pooled draws); TV: mean over the ID "
        "test inputs of the total variation distance to it; both in {pct}. Ranks: by MMD / NS MMD among the "
        "approximate methods (the references' own rows and failed rows are not ranked), under the zoo / under HMC; "
        "Kendall's tau between the two rankings, with its interval, is in findings.md. Values are means over the "
        "repetitions ± the half-width of the 95{pct} t-interval (for MMD including the reference's standard error "
        "from its halves), as in Table 1. Convergence of every chain group below the table."
    )


def render_convergence(frame: pd.DataFrame) -> str:
    """Markdown of ``convergence``: one line per chain group."""
    text = pd.DataFrame({"Chain group": frame["group"], "Chains x draws": [f"{int(c)} x {int(d)}" for c, d in
                                                                        zip(frame["chains"], frame["draws_per_chain"])]})
    for key, label in CONVERGENCE_KEYS.items():
        values = frame[key] * (100 if key == "softmax_converged" else 1)
        text[label + (" (%)" if key == "softmax_converged" else "")] = [
            MISSING if not np.isfinite(v) else f"{v:.3g}" for v in values]
    return (
        "Convergence of the HMC chains (Izmailov et al. 2021's predictive R-hat, ArviZ's rank-normalised split R-hat: "
        "below 1.1 counts as converged): R-hat of the test log-likelihood (mean over the test images of log p(y | x, "
        "w)) across a group's chains, and of every softmax output (median, maximum, share below 1.1); a one-mode "
        "group is one chain, judged by its two halves (it detects drift only). ESS: the smallest per-chain bulk ESS "
        "of the test log-likelihood. Acceptance, step size, leapfrog steps per kept draw (warm-up included), "
        "divergences after warm-up and restarts: means over a group's chains (HMCMethod.diagnostics).\n\n"
        + text.to_markdown(index=False) + "\n"
    )


def write(exp: Experiment, zoo: pd.DataFrame, hmc: pd.DataFrame, out_dir: Path) -> list[Path]:
    """Write ``table_hmc.md`` (table, caption, failure notes, convergence) and ``table_hmc.csv``
    (numbers with separate ± columns) into ``out_dir``; return their paths."""
    settings = exp.config.methods.hmc
    sample = exp.config.sample
    chains = sample.modes_multi
    text = caption(zoo, hmc, {"repetitions": sample.repetitions, "chains": chains, "draws": sample.per_method // chains,
                              "start": settings.start, "warmup": settings.warmup, "thinning": settings.thinning,
                              "trajectory_length": settings.trajectory_length,
                              "max_leapfrog_steps": settings.max_leapfrog_steps, "temperature": settings.temperature,
                              "initial_mass": settings.initial_mass, "adapt_mass": settings.adapt_mass})
    rows = merged(zoo, hmc)
    failed = rows[rows["status"] == "failed"]
    reasons = {label: reason or "no reason recorded" for label, reason in zip(failed.index, failed["reason"])}
    markdown = render_markdown(table(zoo, hmc), text, reasons) + "\n" + render_convergence(convergence(exp))
    paths = {"md": out_dir / "table_hmc.md", "csv": out_dir / "table_hmc.csv"}
    atomic_write_text(paths["md"], markdown)
    atomic_write_text(paths["csv"], render_csv(table(zoo, hmc, separate=True), reasons))
    return list(paths.values())
