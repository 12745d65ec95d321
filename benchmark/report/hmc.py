"""The HMC reference's report hook (``HMCReference.hooks.report``): ``write`` gives
``results/<experiment>/table_hmc.{md,csv}`` (``reference=hmc``): each row's distance to the zoo next
to its distance to full-batch HMC, with error bars, its rank under each reference, its predictive's
agreement and total variation with HMC's (the NeurIPS 2021 competition's scores), one row for the zoo
scored against HMC and one for HMC scored against the zoo; then the convergence of every HMC chain
group. Built from the rows of ``metrics.csv`` against the zoo and those against HMC (its
``reference`` column; ``benchmark.results.rows_against``) and, for the convergence, the HMC units'
metadata.

Ranks and Kendall's tau (``benchmark.report.findings.agreement``) are over the approximate methods: every row but HMC's own
and the zoo's (the two references), the baselines (``benchmark.baselines``: shown, never ranked),
and rows that failed under either reference. ``findings`` gives findings.md's section on the two
references (``hmc_claims``, then Kendall's tau: ``benchmark.report.findings.ReferenceSection``).
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from benchmark.results import BASELINE_MODE
from benchmark.core.store import SampleSetMetadata, atomic_write_text, load_sample_set, read_metadata
from benchmark.experiment import Experiment
from benchmark.inventory import row_units
from benchmark.references import REFERENCE_METHODS, ZOO, ZOO_ROW
from benchmark.references.hmc import HMC_ROW, HMCReference
from benchmark.report.findings import RANKED_COLUMNS, Claim, Comparison, ReferenceSection
from benchmark.report.tables import GROUP_LABELS, INDEX_NAMES, MISSING, display_cells, render_csv, render_markdown
from benchmark.results import check_metrics, half_width, rows_against
from methods import method_names
from methods.hmc import start_seed
from metrics.mcmc import RHAT_CONVERGED, predictive_convergence

COMPARED = (ZOO, HMCReference.name)
"""The two references table_hmc sets side by side (metrics.csv's ``reference`` values)."""
REFERENCE_GROUP = "References"
SOURCES = {
    "MMD to zoo": "zoo:mmd_median", "MMD to HMC": "hmc:mmd_median",
    "NS MMD to zoo": "zoo:ns_mmd_median", "NS MMD to HMC": "hmc:ns_mmd_median",
    "Agreement with HMC": "hmc:agreement", "TV to HMC": "hmc:tv",
}
"""table_hmc column -> ``<reference>:<metrics column>``."""
START_KEYS = {
    "within_rhat_loglik": "R-hat log-lik. within a start (median over starts)",
    "within_rhat_loglik_max": "R-hat log-lik. within a start (largest)",
    "within_unconverged": "starts with that R-hat >= 1.1",
    "within_softmax_converged": "softmax R-hat < 1.1 within a start",
    "ess_chain_min": "bulk ESS log-lik. per chain (min)", "ess_chain_median": "bulk ESS log-lik. per chain (median)",
    "across_rhat_loglik": "R-hat log-lik. across starts (spread between modes)",
    "across_softmax_median": "softmax R-hat median across starts",
}
"""Per chain group, from its stored predictions (``summarised``) and what the table calls them."""
CONVERGENCE_KEYS = {
    "accept_prob": "acceptance", "step_size": "step size", "leapfrog_per_draw": "leapfrog steps per draw",
    "truncated_fraction": "trajectories cut by the leapfrog cap", "divergences": "divergences", "restarts": "restarts",
}
"""Per chain group: the diagnostics the sample stage recorded (``HMCMethod.diagnostics``, averaged
over a unit's chains) and what the table calls them."""
PERCENT_KEYS = ("within_softmax_converged", "within_unconverged", "truncated_fraction")


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
                     _r=out["method"].eq(HMC_ROW[0])).sort_values(["_g", "_r", "_m"], kind="stable")
    out.index = pd.MultiIndex.from_arrays([out["experiment_label"].fillna(out["experiment"]), out["Group"],
                                           out["method_label"].fillna(out["method"])], names=INDEX_NAMES)
    return out


def ranked(frame: pd.DataFrame) -> pd.Series:
    """Which rows of a ``merged`` frame are ranked: not a reference's own row, not a baseline, not failed."""
    return ~frame["method"].isin(REFERENCE_METHODS) & frame["mode"].ne(BASELINE_MODE) & frame["status"].eq("ok")


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
        ranks = {name: rows[f"{name}:{column}"].where(keep).rank(method="min") for name in COMPARED}
        out[f"{label} rank zoo / HMC"] = [f"{int(a)} / {int(b)}" if k and not (np.isnan(a) or np.isnan(b)) else ""
                                          for a, b, k in zip(ranks["zoo"], ranks["hmc"], keep)]
    return out


def start_groups(seeds: list[int], chains_per_start: int) -> list[list[int]]:
    """The chains (indices into ``seeds``, the chains' base seeds in order) grouped by the start they
    share (``methods.hmc.start_seed``; ``chains_per_start`` 1: one group per chain), in order of first
    appearance."""
    groups: dict[int, list[int]] = {}
    for i, seed in enumerate(seeds):
        groups.setdefault(start_seed(seed, chains_per_start), []).append(i)
    return list(groups.values())


def summarised(probs, labels, groups: list[list[int]], within: list[dict]) -> dict[str, float]:
    """Convergence of chains ``probs [chains, draws, N, classes]`` (softmax outputs on the test split,
    ``labels [N]``) grouped by start (``groups``: chain indices per start), all ArviZ's, from
    ``within``: each start's ``metrics.mcmc.predictive_convergence`` (whose ``ess_loglik`` is each of
    its chains' own ESS), already computed:

    - within a start: the R-hat of the test log-likelihood among the start's chains (a start with
      one chain: that chain's two halves, which detects drift only), its median and largest over the
      starts (``within_rhat_loglik``, ``within_rhat_loglik_max``), the share of starts where it is
      not below 1.1 (``within_unconverged``, a fraction), and the share of softmax outputs whose R-hat within their start is
      below 1.1, averaged over the starts (``within_softmax_converged``, a fraction);
    - per chain: the bulk ESS of its test log-likelihood, smallest and median (``ess_chain_min``,
      ``ess_chain_median``);
    - across starts: the R-hat of the test log-likelihood among the first chains of the starts
      (``across_rhat_loglik``) and the median softmax R-hat (``across_softmax_median``): how far
      apart the modes the starts sit in are, not a failure of the sampler (NaN with one start);
    - ``starts`` and ``chains_per_start`` (the largest group)."""
    ess = np.concatenate([np.asarray(w["ess_loglik"], dtype=np.float64) for w in within])
    rhats = [w["rhat_loglik"] for w in within]
    out = {"within_rhat_loglik": float(np.median(rhats)), "within_rhat_loglik_max": float(np.max(rhats)),
           "within_unconverged": float(np.mean([not r < RHAT_CONVERGED for r in rhats])),
           "within_softmax_converged": float(np.mean([w["softmax_converged"] for w in within])),
           "ess_chain_min": float(ess.min()), "ess_chain_median": float(np.median(ess)),
           "across_rhat_loglik": math.nan, "across_softmax_median": math.nan,
           "starts": float(len(groups)), "chains_per_start": float(max(len(g) for g in groups))}
    if len(groups) > 1:
        across = predictive_convergence(probs[[g[0] for g in groups]], labels)
        out |= {"across_rhat_loglik": across["rhat_loglik"], "across_softmax_median": across["rhat_softmax_median"]}
    return out


def _unit_chains(exp: Experiment, unit) -> tuple[torch.Tensor, list[int], SampleSetMetadata]:
    """A chain unit's test-split predictions ``[chains, draws, N, C]``, its chains' base seeds, its metadata."""
    path = exp.store.preds_path(unit)
    meta = SampleSetMetadata.decode(read_metadata(exp.store.samples_path(unit)))
    seeds = [int(s) for s in (meta.base_seeds or ())] or [0]
    probs = load_sample_set(path, ["id"])["id"]
    return probs.reshape(len(seeds), len(probs) // len(seeds), *probs.shape[1:]), seeds, meta


def convergence(exp: Experiment) -> pd.DataFrame:
    """One row per HMC chain group: each repetition of each HMC mode in the store (one-mode: one
    chain, judged by its two halves; multi-mode: its chains, grouped by the start they share,
    ``methods.hmc.chains_per_start``), then the pooled chains of the HMC reference (within-start
    numbers over every start of every repetition; across starts: ``HMCReference.convergence``).
    Columns: group, starts, chains per start, draws per chain, ``START_KEYS``, ``CONVERGENCE_KEYS``."""
    rows, per_start = [], exp.config.methods.hmc.chains_per_start
    labels = exp.test_tensors[1]
    pooled_within: dict[str, list[float]] = {"rhat": [], "softmax": [], "ess": []}
    for mode in ("one", "multi"):
        path = exp.store.samples_path(exp.store.sample_unit(HMC_ROW[0], mode, 0))
        if not path.is_file():
            continue
        for unit in row_units(exp, HMC_ROW[0], mode):
            probs, seeds, meta = _unit_chains(exp, unit)
            groups = start_groups(seeds, per_start)
            within = [predictive_convergence(probs[group], labels) for group in groups]
            found = summarised(probs, labels, groups, within)
            if mode == "multi":
                pooled_within["rhat"] += [w["rhat_loglik"] for w in within]
                pooled_within["softmax"] += [w["softmax_converged"] for w in within]
                pooled_within["ess"] += [float(e) for w in within for e in w["ess_loglik"]]
            row = {"group": f"HMC {mode}-mode, repetition {unit.repetition}", "draws_per_chain": probs.shape[1]}
            rows.append(row | found | {k: float((meta.diagnostics or {}).get(k, math.nan)) for k in CONVERGENCE_KEYS})
    pooled = HMCReference(exp).convergence()
    row = {"group": f"HMC reference: the {'/'.join(HMC_ROW)} chains of every repetition, pooled",
           "draws_per_chain": int(pooled["draws_per_chain"]), "starts": math.nan, "chains_per_start": float(per_start),
           "across_rhat_loglik": pooled["rhat_loglik"], "across_softmax_median": pooled["rhat_softmax_median"]}
    if pooled_within["rhat"]:
        row |= {"starts": float(len(pooled_within["rhat"])),
                "within_rhat_loglik": float(np.median(pooled_within["rhat"])),
                "within_rhat_loglik_max": float(np.max(pooled_within["rhat"])),
                "within_unconverged": float(np.mean([not r < RHAT_CONVERGED for r in pooled_within["rhat"]])),
                "within_softmax_converged": float(np.mean(pooled_within["softmax"])),
                "ess_chain_min": float(np.min(pooled_within["ess"])),
                "ess_chain_median": float(np.median(pooled_within["ess"]))}
    rows.append(row)
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
        "Table HMC: " + reading(settings.get("within_rhat", math.nan), settings.get("within_rhat_max", math.nan),
                                settings.get("within_unconverged", math.nan), settings.get("starts", math.nan))
        + " Each row's distance to the two references. MMD and NS MMD as in Table 1 (median over the 20 "
        f"kernels, mean over layers weighted by parameter count; {{times}}), against the zoo ({'/'.join(map(str, zoo_n))} "
        f"converged checkpoints) and against full-batch HMC: the pooled draws ({pool}) of every chain of the HMC "
        f"multi-mode units, {settings['repetitions']} repetitions x {settings['chains']} chains ({settings['chains_per_start']} "
        f"chain(s) per start, the starts independent; start={settings['start']}), each chain {settings['draws']} draws after {settings['warmup']} warm-up "
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


def reading(median: float, largest: float = math.nan, unconverged: float = math.nan, starts: float = math.nan) -> str:
    """The HMC reference's convergence within its starts, in one sentence (table_hmc's first), from
    the R-hat of the test log-likelihood among each start's chains: its ``median`` and ``largest``
    over the starts, the share of starts where it is not below 1.1 (``unconverged``, a fraction)
    and the number of ``starts``. Converged means below 1.1 in every start."""
    if not np.isfinite(median):
        return ("The HMC reference's convergence within its starts was not measured (no R-hat of the test "
                "log-likelihood within a start).")
    largest = median if not np.isfinite(largest) else largest
    count = "" if not np.isfinite(starts) else f" of its {int(starts)} starts"
    if largest < RHAT_CONVERGED:
        return (f"The HMC reference converged within its starts: the R-hat of the test log-likelihood among the chains "
                f"of a start is below 1.1 in every one{count} (largest {largest:.2f}, median {median:.2f}); the spread "
                "between starts is between modes.")
    share = "" if not np.isfinite(unconverged) else f" in {unconverged:.0%}{count}"
    return (f"The HMC reference did NOT converge within its starts: the R-hat of the test log-likelihood among the "
            f"chains of a start is 1.1 or above{share} (largest {largest:.2f}, median {median:.2f}), so it is a local, "
            "unconverged reference: many short explorations from independent starts, not a converged posterior.")


def render_convergence(frame: pd.DataFrame) -> str:
    """Markdown of ``convergence``: one line per chain group."""
    shape = [MISSING if not np.isfinite(s) else f"{int(s)} x {int(c)} x {int(d)}"
             for s, c, d in zip(frame["starts"], frame["chains_per_start"], frame["draws_per_chain"])]
    text = pd.DataFrame({"Chain group": frame["group"], "Starts x chains per start x draws": shape})
    for key, label in (START_KEYS | CONVERGENCE_KEYS).items():
        values = frame[key] * (100 if key in PERCENT_KEYS else 1) if key in frame else pd.Series([math.nan] * len(frame))
        text[label + (" (%)" if key in PERCENT_KEYS else "")] = [MISSING if not np.isfinite(v) else f"{v:.3g}" for v in values]
    return (
        "Convergence of the HMC chains (Izmailov et al. 2021's predictive R-hat, ArviZ's rank-normalised split R-hat: "
        "below 1.1 counts as converged). Within a start: the R-hat of the test log-likelihood (mean over the test "
        "images of log p(y | x, w)) among the chains that share a start (methods.hmc.chains_per_start; a start with "
        "one chain is judged by its two halves, which detects drift only), median over the starts, and the share of "
        "softmax outputs whose R-hat within their start is below 1.1 (mean over the starts): whether the sampler has "
        "converged in the region it explores. Bulk ESS of each chain's test log-likelihood (smallest, median). Across "
        "starts: the R-hat among the starts (their first chains; pooled: every chain of the reference): the spread "
        "between the modes the starts sit in, expected far above 1.1 for independent starts on a multi-modal "
        "posterior, not a failure of the sampler. Acceptance, step size, leapfrog steps per kept draw (warm-up "
        "included), the share of sampling iterations whose trajectory the leapfrog cap cut short, divergences "
        "after warm-up and restarts: means over a group's chains (HMCMethod.diagnostics; — where the run did not "
        "record it).\n\n"
        + text.to_markdown(index=False) + "\n"
    )


def hmc_claims(rows: set[tuple[str, str]]) -> list[Claim]:
    """Against HMC (metrics.csv's rows with ``reference`` = ``hmc``): the zoo's row has a lower MMD and NS MMD than every
    one-mode row of the paper's methods."""
    one = sorted(r for r in rows if r[1] == "one" and r[0] not in REFERENCE_METHODS)
    return [claim for claim in [
        Claim("Against HMC, the zoo is closer to HMC than every one-mode method: lower MMD and NS MMD.",
              tuple(Comparison(ZOO_ROW, r, column) for r in one for column in ("mmd_median", "ns_mmd_median"))
              if ZOO_ROW in rows else ()),
    ] if claim.comparisons]


def findings(metrics: pd.DataFrame, repetitions: pd.DataFrame) -> ReferenceSection:
    """findings.md's section on the two references from metrics.csv's and repetitions.csv's rows
    against HMC (the paper's methods only: no baseline row)."""
    return ReferenceSection(
        title="Against full-batch HMC (reference=hmc)",
        intro=("Every row was also scored against full-batch HMC's draws (metrics.csv's rows with reference=hmc, "
               "table_hmc.md); the zoo's row there is blocks of reference checkpoints of a method's sample size. The "
               "tests are those above, on the rows scored against HMC."),
        label="HMC", claims=hmc_claims, metrics=metrics, repetitions=repetitions)


def write(exp: Experiment, metrics: pd.DataFrame, repetitions: pd.DataFrame, out_dir: Path,
          reference: str = HMCReference.name) -> list[Path]:
    """Write ``table_hmc.md`` (table, caption, failure notes, convergence) and ``table_hmc.csv``
    (numbers with separate ± columns) into ``out_dir`` from ``metrics`` (metrics.csv's frame: the
    rows against the zoo and those against ``reference``, HMC's draws; ``repetitions`` is not
    read); return their paths. ``ValueError`` naming the reference when ``metrics`` holds none of
    its rows."""
    zoo, hmc = rows_against(metrics, ZOO), rows_against(metrics, reference)
    if hmc.empty:
        raise ValueError(f"table_hmc: metrics.csv holds no row with reference={reference}; run python -m benchmark "
                         f"stage=evaluate experiment={exp.name} reference={reference}")
    settings = exp.config.methods.hmc
    design = exp.design
    chains = design.modes_multi
    chain_groups = convergence(exp)
    pooled = chain_groups.iloc[-1]  # the reference: every start of every repetition
    within = {key: float(pooled.get(column, math.nan)) for key, column in (
        ("within_rhat", "within_rhat_loglik"), ("within_rhat_max", "within_rhat_loglik_max"),
        ("within_unconverged", "within_unconverged"), ("starts", "starts"))}
    text = caption(zoo, hmc, {"repetitions": design.repetitions, "chains": chains, "draws": design.per_method // chains,
                              "chains_per_start": settings.chains_per_start, **within,
                              "start": settings.start, "warmup": settings.warmup, "thinning": settings.thinning,
                              "trajectory_length": settings.trajectory_length,
                              "max_leapfrog_steps": settings.max_leapfrog_steps, "temperature": settings.temperature,
                              "initial_mass": settings.initial_mass, "adapt_mass": settings.adapt_mass})
    rows = merged(zoo, hmc)
    failed = rows[rows["status"] == "failed"]
    reasons = {label: reason or "no reason recorded" for label, reason in zip(failed.index, failed["reason"])}
    markdown = render_markdown(table(zoo, hmc), text, reasons) + "\n" + render_convergence(chain_groups)
    paths = {"md": out_dir / "table_hmc.md", "csv": out_dir / "table_hmc.csv"}
    atomic_write_text(paths["md"], markdown)
    atomic_write_text(paths["csv"], render_csv(table(zoo, hmc, separate=True), reasons))
    return list(paths.values())
