"""The paper's Table 1 (posterior MMD next to predictive metrics) and Table 2 (median /
mean / max MMD, and the median with bandwidths shared by all rows), and Table 3 (seed 002's function-space agreement and total variation next to
MMD with the permutations removed by sorting, NS, and by weight matching, WM), built from
metrics.csv frames (``benchmark.results``) and written as
Markdown, CSV and LaTeX. Every value carries its 95% half-width: ``value ± half-width`` in
Markdown and LaTeX, a separate ``<column> ±`` column in CSV.

The display tables have a row index (experiment label, group "One Mode" | "Multi Mode",
method label) in the paper's order (experiments as they appear, methods in registry order,
others after, sorted) and cells formatted as text with one decimal, scaled as the paper
prints them (every metric x100, i.e. percentages for Acc, ECE, AUPR, FPR95). Failed rows
read "failed" in every cell; their reasons go in a note below the table. Missing values of
rows that did not fail read "n/a"; so does the half-width of a row with a single repetition
("15.0 ± n/a").
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable

import numpy as np
import pandas as pd

from metrics.columns import column, keys, table1_columns
from benchmark.results import check_metrics, half_width
from benchmark.core.store import atomic_write_text
from benchmark.baselines import BASELINES
from benchmark.results import BASELINE_MODE
from methods import method_class, method_names

GROUP_LABELS = {"one": "One Mode", "multi": "Multi Mode", BASELINE_MODE: "Baselines"}
"""Table groups in order; the baseline rows (never ranked) come last."""

INDEX_NAMES = ["Experiment", "Group", "Method"]

TABLE1_SOURCES = {c.label: c.key for c in table1_columns()}
"""Table 1 column -> metrics.csv column, from ``metrics.columns`` (MMD = the median over kernels, as
the paper reports; then the energy coefficient, which has no bandwidth and does not saturate:
``metrics.mmd.energy``); after the paper's columns, the function-space check (agreement and TV with
the reference's predictive), so that a row close in weight marginals but wrong in function space shows."""

TEST_SOURCES = {column(key).label: key for key in keys("test")}
"""Table 1's test columns (percent of layers rejected; no interval)."""

TABLE2_SOURCES = {
    **{(name, statistic): f"{prefix}_{statistic}"
       for name, prefix in (("MMD", "mmd"), ("NS MMD", "ns_mmd"))
       for statistic in ("median", "mean", "max")},
    ("Shared bandwidths", "MMD median"): "mmd_shared_median",
    ("Shared bandwidths", "NS MMD median"): "ns_mmd_shared_median",
}
"""Table 2 column -> metrics.csv column: the paper's median / mean / max of MMD and NS MMD, then
the medians with one bandwidth grid per layer shared by every row (``SHARED_TEXT``)."""

SHARED_TEXT = (
    "Shared bandwidths: MMD and NS MMD (median over the 20 kernels) with one bandwidth grid per layer for every row "
    "of the experiment instead of each row's own: MMDAgg's rule applied to the distances between two disjoint halves "
    "of the (raw or symmetry-free) zoo (up to 500 x 500 checkpoints), i.e. the grid MMDAgg would choose for a method "
    "that samples the reference exactly. It does not depend on the row, so every row is on one scale; where the two "
    "orders of the rows differ, the ranking depends on the per-row bandwidths."
)

ENERGY_TEXT = (
    "Energy and NS Energy: the energy coefficient E / (2 E|x - y|) per layer (E the energy distance, the MMD of the "
    "distance kernel, which has no bandwidth; 0 for the reference's own distribution, 1 for point masses apart), "
    "then the mean over layers weighted by parameter count; {times}. Unlike the MMD, whose smallest bandwidths follow "
    "the closest pair of the sample and the zoo, it does not sit near a ceiling for a sample without spread "
    "(the Copies rows)."
)
"""How to read Table 1's energy columns, for its caption."""

TABLE3_SOURCES = {
    "Agreement": "agreement",
    "TV": "tv",
    "MMD": "mmd_median",
    "NS MMD": "ns_mmd_median",
    "WM MMD": "wm_mmd_median",
}
"""Table 3 (function space, seed 002) column -> metrics.csv column; then the ranks of the rows'
NS MMD and WM MMD within their experiment (``RANK_SOURCES``)."""

RANK_SOURCES = {"NS rank": "ns_mmd_median", "WM rank": "wm_mmd_median"}

FAILED = "failed"
UNCONVERGED_MARK = "†"  # on the label of a Markov-chain row whose chains failed their convergence check
MISSING = "n/a"

STEP_TEXT = {
    "scale": "scaling (each hidden unit's incoming weights normalised to unit L2 norm, the factor pushed into the next layer)",
    "minmass": "scaling (the minimum-mass rescaling)",
    "sort": "permutation (hidden units sorted by their first incoming weight)",
    "softmax": "the softmax additive symmetry (last-layer biases shifted to sum to 0)",
}
"""What each step of ``evaluate.canonical_steps`` removes, for the captions."""

def variant_notes(methods: Iterable[str]) -> list[str]:
    """How to read the rows of ``methods``, for the captions and findings.md: the family notes of the
    registered methods among them (``PosteriorMethod.family_note``, each once), then their own
    notes (``table_note``, ``{label}`` the row's label), in table row order; external rows
    (``method=external``) have none."""
    present = [name for name in method_names() if name in set(methods)]
    families = dict.fromkeys(method_class(name).family_note for name in present)
    own = [method_class(name).table_note.format(label=method_class(name).label) for name in present
           if method_class(name).table_note is not None]
    return [note for note in families if note is not None] + own


def _variant_text(df: pd.DataFrame) -> str:
    notes = variant_notes(df["method"])
    return " " + " ".join(notes) if notes else ""


_MARKDOWN_UNITS = {"times": "x100", "pct": "%"}
_LATEX_UNITS = {"times": r"$\times 100$", "pct": r"\%"}


def reference_text(df: pd.DataFrame) -> str:
    """How many reference checkpoints each experiment's rows were scored against (``n_reference``),
    for the captions: "the reference zoo of 1000 checkpoints" (per experiment when they differ)."""
    parts = {}
    for (experiment, label), rows in df.groupby(["experiment", "experiment_label"], sort=False):
        counts = sorted({int(n) for n in rows["n_reference"].dropna()})
        parts[label or experiment] = "/".join(map(str, counts)) or "an unrecorded number of"
    if len(set(parts.values())) == 1:
        return f"the reference zoo (an SGD ensemble) of {next(iter(parts.values()))} converged checkpoints"
    return ("the reference zoo, an SGD ensemble (" + "; ".join(f"{name}: {n} converged checkpoints" for name, n in parts.items())
            + ")")


def reference_kind_text(df: pd.DataFrame) -> str:
    """What kind of reference the zoo is, per experiment, from metrics.csv's ``reference_potential_*``
    columns: the spread of its checkpoints' training potential and their median training accuracy;
    empty when no row records them."""
    parts = []
    for (experiment, label), rows in df.groupby(["experiment", "experiment_label"], sort=False):
        known = rows.dropna(subset=["reference_potential_median"]) if "reference_potential_median" in rows else rows.iloc[:0]
        if known.empty:
            continue
        row = known.iloc[0]
        parts.append(f"{label or experiment}: {row.reference_potential_p05:.0f} to {row.reference_potential_p95:.0f} "
                     f"nats (median {row.reference_potential_median:.0f}; {int(row.reference_potential_n)} "
                     f"checkpoints), median training accuracy {100 * row.reference_train_acc:.1f}{{pct}}")
    if not parts:
        return ""
    return (" The reference is an SGD ensemble (independently trained checkpoints of one recipe), not draws from the "
            "T = 1 posterior: the training potential U (summed training cross-entropy plus the recipe's L2 prior term) "
            "of its checkpoints spans, 5th to 95th percentile, " + "; ".join(parts)
            + "; under exp(-U) the lowest checkpoint would carry nearly all the mass.")


def baseline_text(df: pd.DataFrame) -> str:
    """How to read the Baselines group (``benchmark.baselines``), for the captions; empty without
    baseline rows."""
    present = [BASELINES[name] for name in BASELINES if name in set(df.loc[df["mode"] == BASELINE_MODE, "method"])]
    if not present:
        return ""
    return (" Baselines (not ranked): rows scored exactly as a method's samples are over the same "
            "repetitions, to read the scale of each column by: " + "; ".join(f"{b.label}: {b.about}" for b in present)
            + ". A method that scores no better than the prior or the untrained networks is no closer to the "
            "reference by that column than they are; the second zoo is what a method sampling the reference exactly "
            "scores.")


def _mmd_text(df: pd.DataFrame, statistic: str) -> str:
    steps = [step for value in sorted(set(df["ns_steps"].dropna().astype(str)) - {""}) for step in value.split("+")]
    removed = "; then ".join(STEP_TEXT.get(step, step) for step in dict.fromkeys(steps)) or "nothing"
    return (
        f"MMD between the method's weight samples and {reference_text(df)}, and NS MMD after removing, from both, "
        f"{removed}: per layer, {statistic} over 20 Gaussian and Laplace kernels, then the mean over layers "
        "weighted by parameter count; {times}."
    )


def _uncertainty_text(df: pd.DataFrame) -> str:
    counts = sorted({int(n) for n in df["n_repetitions"].dropna()})
    repetitions = "/".join(map(str, counts)) or "?"
    single = " \"± n/a\": a single repetition, whose spread cannot be estimated." if 1 in counts else ""
    return (
        f"Values are means over {repetitions} independent repetitions of the sample stage (each on its own "
        "base networks, hence its own method seeds) ± the half-width of the 95{pct} t-interval of the row's mean "
        "(t quantile with repetitions - 1 degrees of freedom, times the standard deviation over repetitions over "
        "the square root of their number); for the MMD columns the half-width also includes, in quadrature, the "
        "reference zoo's standard error (the spread of the MMD over random halves of the zoo, first repetition)."
        f"{single} These intervals describe one row each; comparisons between rows are in findings.md (exact tests "
        "over the repetitions, with Holm's control per claim)."
    )


def captions(df: pd.DataFrame) -> tuple[str, str]:
    """The captions of Tables 1 and 2 for the rows of ``df`` (with ``{times}``/``{pct}`` unit slots);
    with vBNN rows, how to read them (``variant_notes``)."""
    table1_caption = (
        "Table 1: Posterior estimation and predictive performance. " + _mmd_text(df, "the median")
        + " " + ENERGY_TEXT
        + " Acc, ECE (top-label, 15 bins), AUPR and FPR95 (OOD as positive class, FPR at 95{pct} TPR) in {pct}; "
        "Brier (sum over classes) {times}; ID MI and OOD MI (mutual information, nats) {times}. "
        + _uncertainty_text(df)
        + " MMD rej. and NS rej.: {pct} of layers where MMDAgg's aggregated test (the 20 kernels, level 0.05) "
        "rejects \"same distribution\" (first repetition" + _chain_text(df) + ")."
        + " Agree and TV: the function-space check, agreement and total variation of the row's predictive with "
        "the reference's (as in Table 3), {pct}."
        + " The accuracies of each row's base networks are in diagnostics.md."
        + reference_kind_text(df) + baseline_text(df)
        + _variant_text(df)
    )
    table2_caption = ("Table 2: Full MMD table. " + _mmd_text(df, "the median, mean or max") + " " + SHARED_TEXT + " "
                      + _uncertainty_text(df) + baseline_text(df) + _variant_text(df))
    return table1_caption, table2_caption


def _chain_text(df: pd.DataFrame) -> str:
    """For the rows whose samples are Markov-chain states (an ``ess`` in metrics.csv): how many of
    their kept states the effective sample size says are independent, for Table 1's caption."""
    chains = df[df["ess"].notna()] if "ess" in df.columns else df.iloc[:0]
    if chains.empty:
        return ""
    sizes = "; ".join(f"{row.method_label} {row.ess:.0f} of {row.n_samples:.0f}" for row in chains.itertuples())
    text = (f"; the samples of {', '.join(dict.fromkeys(chains['method_label']))} are states of Markov chains, "
            f"exchangeable only as far as their effective sample size (chains as chains, whatever the storage "
            f"order) says: {sizes}, mean over repetitions")
    checked = chains[chains["stationary"].notna()] if "stationary" in chains.columns else chains.iloc[:0]
    unsettled = checked[checked["stationary"] < 1]
    if len(unsettled):
        parts = ", ".join(f"{row.method_label} in {round((1 - row.stationary) * row.n_repetitions)} of "
                          f"{row.n_repetitions:.0f} repetitions" for row in unsettled.itertuples())
        text += (f"; NOT STATIONARY: the chains did not pass their stationarity check (split R-hat of the training "
                 f"log-likelihood between each chain's halves below 1.05) within the sampler's budget ({parts}), so "
                 "these rows describe the sampler within that budget, not its stationary distribution")
    return text


def _anchor_text(df: pd.DataFrame) -> str:
    """Which network each experiment's WM MMD aligned to (``wm_anchor``), for the caption."""
    parts = []
    for (experiment, label), rows in df.groupby(["experiment", "experiment_label"], sort=False):
        anchors = sorted(set(rows["wm_anchor"].astype(str)) - {""})
        name = label or experiment
        parts.append(f"{name}: the reference checkpoint of {', '.join(anchors)}" if anchors
                     else f"{name}: not computed (evaluate.weight_matching=false)")
    return "; ".join(parts)


def table3_caption(df: pd.DataFrame) -> str:
    """The caption of Table 3 (with ``{times}``/``{pct}`` unit slots)."""
    return (
        "Table 3: Function space and the removal of permutations (seed 002). Agreement: fraction of ID test inputs "
        "where the argmax of the method's predictive equals that of the reference ensemble (the mean predictive of "
        f"{reference_text(df)}); TV: mean over the ID test inputs of the total variation distance to it (half the L1 "
        "distance between the two predictives); both in {pct}. MMD and NS MMD as in Table 1. WM MMD: as NS MMD, but "
        "with the permutations "
        "removed by weight matching (git re-basin: maximise the sum of inner products of all parameters with an "
        "anchor network, one layer's linear assignment at a time) every network, zoo checkpoints and samples, to "
        "one fixed anchor instead of sorting; the anchor is the converged reference checkpoint with the lowest seed "
        f"(seed 002's code aligns to the first network of its list); {_anchor_text(df)}. MMD columns {{times}}. "
        "NS rank / WM rank: the row's rank by NS MMD / WM MMD among the experiment's methods (1 = closest to the zoo; "
        "baselines are not ranked). "
        + _uncertainty_text(df)
        + baseline_text(df)
        + _variant_text(df)
    )


def table3(df: pd.DataFrame, separate: bool = False) -> pd.DataFrame:
    """Table 3: the rows of :func:`table1`, columns ``TABLE3_SOURCES`` then the NS and WM MMD ranks
    among the experiment's rows that did not fail (text; "n/a" where the MMD is missing)."""
    rows = _ordered(df, TABLE3_SOURCES.values())
    table = display_cells(rows, TABLE3_SOURCES, separate)
    experiment = rows.index.get_level_values(0)
    for label, key in RANK_SOURCES.items():
        values = rows[key].where((rows["status"] != "failed") & (rows["mode"] != BASELINE_MODE))
        ranks = values.groupby(experiment).rank(method="min")
        table[label] = [MISSING if np.isnan(r) else f"{int(r)}" for r in ranks]
    return table


def table1(df: pd.DataFrame, separate: bool = False) -> pd.DataFrame:
    """Table 1 of the paper from a metrics.csv frame (``benchmark.results.COLUMNS``).

    Index (Experiment, Group, Method) in the paper's order; columns ``TABLE1_SOURCES`` then
    ``TEST_SOURCES``; cells are text: value x100 with one decimal ``± half-width`` (separate
    ``<column> ±`` columns with ``separate``), "failed" or "n/a".
    """
    rows = _ordered(df, [*TABLE1_SOURCES.values(), *TEST_SOURCES.values()])
    table = display_cells(rows, TABLE1_SOURCES, separate)
    tests = display_cells(rows, TEST_SOURCES, separate, with_half_widths=False)
    return pd.concat([table, tests], axis=1)


def table2(df: pd.DataFrame, separate: bool = False) -> pd.DataFrame:
    """Table 2 of the paper: the rows of :func:`table1`, columns (MMD | NS MMD) x (median, mean, max),
    then (Shared bandwidths) x (MMD median, NS MMD median) (``TABLE2_SOURCES``)."""
    table = display_cells(_ordered(df, TABLE2_SOURCES.values()), TABLE2_SOURCES, separate)
    table.columns = pd.MultiIndex.from_tuples(table.columns)
    return table


def failure_reasons(df: pd.DataFrame) -> dict[tuple[str, str, str], str]:
    """Failed rows in table order: row label (experiment, group, method) -> reason."""
    rows = _ordered(df, [])
    failed = rows[rows["status"] == "failed"]
    return {label: _reason(reason) for label, reason in zip(failed.index, failed["reason"])}


def not_converged(df: pd.DataFrame) -> pd.Series:
    """Per row of ``df`` (metrics.csv), True where the row did not fail but its Markov chains failed
    their sampler's own convergence check in at least one repetition (``stationary`` below 1: the
    fraction of repetitions that passed). Such a row is marked with ``UNCONVERGED_MARK`` in the
    tables and left out of findings.md's comparisons; rows without the check (NaN) are not."""
    stationary = df["stationary"] if "stationary" in df.columns else pd.Series(np.nan, index=df.index)
    return (df["status"] != "failed") & stationary.notna() & (stationary < 1)


def convergence_notes(df: pd.DataFrame) -> dict[tuple[str, str, str], str]:
    """Rows marked ``UNCONVERGED_MARK`` in table order: row label (experiment, group, method with
    its mark) -> how many repetitions' chains failed the check."""
    rows = _ordered(df, ["stationary", "n_repetitions"])
    rows = rows[rows["unconverged"]]
    return {label: (f"its chains failed their convergence check in {round((1 - row.stationary) * row.n_repetitions)} "
                    f"of {row.n_repetitions:.0f} repetitions (split R-hat of the training log-likelihood between "
                    "each chain's halves 1.05 or above); shown, but left out of the comparisons of findings.md")
            for label, row in zip(rows.index, rows.itertuples())}


def render_markdown(table: pd.DataFrame, caption: str, reasons: dict[tuple, str],
                    unsettled: dict[tuple, str] | None = None) -> str:
    """Markdown text: the caption line, the table (repeated row labels blanked), then the notes on
    failed rows (``reasons``) and on rows whose chains did not converge (``unsettled``)."""
    flat = _flat(table)
    # Blank a label that repeats the row above within the same enclosing block (as the paper).
    repeats = {
        name: flat[INDEX_NAMES[: level + 1]].ne(flat[INDEX_NAMES[: level + 1]].shift()).sum(axis=1).eq(0)
        for level, name in enumerate(INDEX_NAMES[:-1])
    }
    for name, repeated in repeats.items():
        flat.loc[repeated, name] = ""
    body = flat.to_markdown(
        index=False,
        disable_numparse=True,
        colalign=["left"] * len(INDEX_NAMES) + ["right"] * (flat.shape[1] - len(INDEX_NAMES)),
    )
    text = f"{caption.format(**_MARKDOWN_UNITS)}\n\n{body}\n"
    if reasons:
        text += "\nFailed runs:\n\n" + "".join(f"- {note}\n" for note in _notes(reasons))
    if unsettled:
        text += (f"\n{UNCONVERGED_MARK} Not converged:\n\n"
                 + "".join(f"- {note}\n" for note in _notes(unsettled)))
    return text


LATEX_CAPTION_CHARS = 300
"""The longest caption a ``.tex`` table carries (a paper's caption, not the Markdown's notes)."""

LATEX_CAPTIONS = {
    "table1": ("Posterior estimation and predictive performance. MMD, NS MMD (symmetries removed) and the energy "
               "coefficients between each method's weight samples and the reference zoo, {times}, lower is closer; "
               "predictive metrics on the ID test set and for OOD detection."),
    "table2": ("Full MMD table: the median, mean and max over the 20 kernels of the layer-wise MMD and NS MMD, {times}, "
               "and the medians with one bandwidth grid per layer shared by every row."),
    "table3": ("Function space and the removal of permutations: agreement and total variation with the reference "
               "ensemble's predictive ({pct}), beside MMD, NS MMD (sorting) and WM MMD (weight matching), {times}."),
}
"""Each ``.tex`` table's caption (at most ``LATEX_CAPTION_CHARS`` once the units are filled in); the
long explanation is in the ``.md`` caption, and the ``.tex`` note below the table says so."""

LATEX_NOTE = ("Mean over the repetitions $\pm$ the half-width of its 95\% t-interval (for the MMD and energy "
              "columns widened by the reference zoo's standard error). Baselines are not ranked: they give each column's "
              "scale (the copies of the base, no spread: the ceiling; the second zoo: the floor). How every number is "
              "made: the caption of {name}.md.")
"""The footnote-size note under each ``.tex`` table (``{name}``: the table's file stem)."""


LATEX_PREAMBLE = "% \\input{} into a document with \\usepackage{booktabs,multirow,graphicx}\n"
"""The first line of every ``.tex`` table: the packages it needs."""


def render_latex(table: pd.DataFrame, caption: str, reasons: dict[tuple, str], label: str,
                 unsettled: dict[tuple, str] | None = None, note: str | None = None) -> str:
    """A LaTeX ``table`` (booktabs rules, multirow row labels) with caption, label and the notes
    (``note`` in footnote size; failed rows, ``reasons``; rows whose chains did not converge, ``unsettled``)."""
    text = table.to_latex(
        caption=caption.replace('"same distribution"', "``same distribution''").format(**_LATEX_UNITS),
        label=label,
        escape=True,
        multirow=True,
        multicolumn=True,
        multicolumn_format="c",
        column_format="l" * len(INDEX_NAMES) + "r" * table.shape[1],
    )
    # pandas closes the last block with \cline rules that would double the \bottomrule.
    text = re.sub(r"(\\cline\{[^}]*\}\s*)+\\bottomrule", r"\\bottomrule", text)
    # Wider than a page's text: scaled to it (graphicx), as papers print wide tables.
    text = text.replace("\\begin{tabular}", "\\resizebox{\\linewidth}{!}{%\n\\begin{tabular}", 1)
    text = text.replace("\\end{tabular}\n", "\\end{tabular}}\n", 1)
    text = LATEX_PREAMBLE + text
    text = text.replace(" ± ", r" $\pm$ ")
    if note:
        text = text.replace(r"\end{table}", f"\\par\\smallskip{{\\footnotesize {note}}}\n\\end{{table}}")
    if reasons:
        lines = r" \\ ".join(_escape_latex(note) for note in _notes(reasons))
        text = text.replace(r"\end{table}", f"\\par\\smallskip{{\\footnotesize Failed runs: {lines}}}\n\\end{{table}}")
    if unsettled:
        lines = r" \\ ".join(_escape_latex(note) for note in _notes(unsettled))
        text = text.replace(r"\end{table}",
                            f"\\par\\smallskip{{\\footnotesize {UNCONVERGED_MARK} Not converged: {lines}}}\n\\end{{table}}")
    return text


def render_csv(table: pd.DataFrame, reasons: dict[tuple, str], unsettled: dict[tuple, str] | None = None) -> str:
    """CSV text: the row labels as columns, flattened column names, and a Note column (failure
    reasons; ``not converged: ...`` for the rows of ``unsettled``)."""
    flat = _flat(table)
    unsettled = unsettled or {}
    flat["Note"] = [f"{FAILED}: {reasons[row]}" if row in reasons else
                    f"not converged: {unsettled[row]}" if row in unsettled else ""
                    for row in map(tuple, flat[INDEX_NAMES].values)]
    return flat.to_csv(index=False)


def write_tables(df: pd.DataFrame, out_dir: Path) -> list[Path]:
    """Write table1, table2 and table3 as .md, .csv and .tex into ``out_dir``; return their paths.

    Both tables are built (and the frame validated) before anything is written; each file
    is written atomically.
    """
    caption1, caption2 = captions(check_metrics(df))
    tables = {"table1": (table1, caption1), "table2": (table2, caption2), "table3": (table3, table3_caption(df))}
    reasons, unsettled = failure_reasons(df), convergence_notes(df)
    out_dir = Path(out_dir)
    written = []
    rendered = {name: (build(df), build(df, separate=True), caption) for name, (build, caption) in tables.items()}
    for name, (table, numbers, caption) in rendered.items():
        texts = {
            "md": render_markdown(table, caption, reasons, unsettled),
            "csv": render_csv(numbers, reasons, unsettled),
            "tex": render_latex(table, f"Table {name[-1]}: {LATEX_CAPTIONS[name]}", reasons, label=f"tab:{name}",
                                unsettled=unsettled, note=LATEX_NOTE.format(name=name)),
        }
        for suffix, text in texts.items():
            path = out_dir / f"{name}.{suffix}"
            atomic_write_text(path, text)
            written.append(path)
    return written


def _ordered(df: pd.DataFrame, value_columns) -> pd.DataFrame:
    """Validated rows of ``df`` (the value columns and their half-widths) indexed by display
    labels and sorted in the paper's order."""
    rows = check_metrics(df)
    experiments = list(dict.fromkeys(rows["experiment"]))
    registered = [*method_names(), *BASELINES]
    methods = registered + sorted(set(rows["method"]) - set(registered))
    rows = rows.assign(
        _e=rows["experiment"].map(experiments.index),
        _g=rows["mode"].map(list(GROUP_LABELS).index),
        _m=rows["method"].map(methods.index),
    ).sort_values(["_e", "_g", "_m"], kind="stable")
    rows["unconverged"] = not_converged(rows)
    rows.index = pd.MultiIndex.from_arrays(
        [
            [label or name for label, name in zip(rows["experiment_label"], rows["experiment"])],
            rows["mode"].map(GROUP_LABELS),
            [f"{label or name} {UNCONVERGED_MARK}" if mark else label or name
             for label, name, mark in zip(rows["method_label"], rows["method"], rows["unconverged"])],
        ],
        names=INDEX_NAMES,
    )
    value_columns = list(value_columns)
    widths = [half_width(c) for c in value_columns if half_width(c) in rows.columns]
    return rows[["status", "reason", "mode", "unconverged", *value_columns, *widths]]


def display_cells(rows: pd.DataFrame, sources: dict, separate: bool = False, with_half_widths: bool = True) -> pd.DataFrame:
    """Text cells: value x its column's scale (``metrics.columns``; a source ``<reference>:<key>`` is
    key's) to one decimal with `` ± half-width`` ("± n/a" when unknown: a single repetition; in a
    separate ``(label, "±")`` column with ``separate``), "failed" for failed rows, "n/a" for missing values."""
    failed = rows["status"].eq("failed")
    table = pd.DataFrame(index=rows.index)

    def text(v: float, is_failed: bool, scale: float) -> str:
        if is_failed or np.isnan(v):
            return FAILED if is_failed else MISSING
        shown = f"{v * scale:.1f}"
        return "0.0" if shown == "-0.0" else shown  # an unbiased MMD estimate a hair below 0

    for label, source in sources.items():
        scale = column(source.rpartition(":")[2]).scale
        values = [text(v, f, scale) for v, f in zip(rows[source], failed)]
        widths = rows[half_width(source)] if with_half_widths and half_width(source) in rows else None
        if widths is None:
            table[label] = values
        elif separate:
            table[label] = values
            table[(*label[:-1], f"{label[-1]} ±") if isinstance(label, tuple) else f"{label} ±"] = [
                "" if f else text(w, False, scale) for w, f in zip(widths, failed)]
        else:
            table[label] = [v if f or v == MISSING else f"{v} ± {text(w, False, scale)}" for v, w, f in zip(values, widths, failed)]
    return table


def _flat(table: pd.DataFrame) -> pd.DataFrame:
    """The table with its row labels as columns and multi-level column names joined by a space."""
    flat = table.copy()
    flat.columns = [" ".join(c) if isinstance(c, tuple) else c for c in flat.columns]
    return flat.reset_index()


def _notes(reasons: dict[tuple, str]) -> list[str]:
    return [f"{' / '.join(label)}: {reason}" for label, reason in reasons.items()]


def _reason(reason) -> str:
    return "no reason recorded" if pd.isna(reason) or not str(reason).strip() else str(reason).strip()


_LATEX_SPECIALS = {
    "\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
    "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}",
}


def _escape_latex(text: str) -> str:
    return "".join(_LATEX_SPECIALS.get(char, char) for char in text)
