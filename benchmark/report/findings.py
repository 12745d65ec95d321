"""``results/<experiment>/findings.md``: each qualitative claim of the paper's section 4.3 and
appendix B.4 (and of seeds 000 and 001 on the symmetry-breaking vBNNs), checked against this
run's numbers with their 95% half-widths.

A claim is a list of comparisons "row A's column < row B's" (or >). A comparison holds when the
difference's interval (half-width ``sqrt(hw_A^2 + hw_B^2)``) lies wholly on the claimed side, fails
when it lies wholly on the other, and is not distinguishable otherwise. The claim's verdict:
"holds" when every comparison holds, "fails" when any fails, else "not distinguishable".
"""
from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from benchmark.report.tables import variant_notes
from benchmark.results import check_metrics, half_width
from metrics.uncertainty import compare

PAIRED = ("dropout", "bnn", "swag", "laplace")  # methods with both modes (SGHMC is one-mode only)


@dataclass(frozen=True)
class Comparison:
    """``a`` and ``b`` are (method, mode) rows; ``lower``: the claim is a's value < b's."""

    a: tuple[str, str]
    b: tuple[str, str]
    column: str
    lower: bool = True


@dataclass(frozen=True)
class Claim:
    text: str
    comparisons: tuple[Comparison, ...]


def paper_claims(rows: set[tuple[str, str]]) -> list[Claim]:
    """The paper's claims, as comparisons between the rows present (``(method, mode)``)."""
    paired = [m for m in PAIRED if (m, "one") in rows and (m, "multi") in rows]
    de = ("ensemble", "multi")
    others = sorted(r for r in rows if r != de)
    claims = [
        Claim("Deep Ensembles have the lowest MMD of all rows.",
              tuple(Comparison(de, r, "mmd_median") for r in others) if de in rows else ()),
        Claim("For every method, the multi-mode MMD is below the one-mode MMD.",
              tuple(Comparison((m, "multi"), (m, "one"), "mmd_median") for m in paired)),
        Claim("For every method, the multi-mode NS MMD is below the one-mode NS MMD.",
              tuple(Comparison((m, "multi"), (m, "one"), "ns_mmd_median") for m in paired)),
    ]
    laplace = []
    for mode in ("one", "multi"):
        if ("laplace", mode) in rows:
            laplace += [Comparison(("laplace", mode), r, column) for r in others
                        if r[1] == mode and r[0] not in ("laplace", "ensemble")
                        for column in ("mmd_median", "ns_mmd_median")]
    claims += [
        Claim("After Deep Ensembles, Laplace has the lowest MMD and NS MMD (within each mode).", tuple(laplace)),
        Claim("Multi-mode methods are more accurate than their one-mode form.",
              tuple(Comparison((m, "multi"), (m, "one"), "acc", lower=False) for m in paired)),
        Claim("Multi-mode methods have a lower NLL than their one-mode form.",
              tuple(Comparison((m, "multi"), (m, "one"), "nll") for m in paired)),
        Claim("One-mode methods have a lower ECE than their multi-mode form.",
              tuple(Comparison((m, "one"), (m, "multi"), "ece") for m in paired)),
        Claim("Multi-mode methods are ahead on OOD detection: higher AUPR ...",
              tuple(Comparison((m, "multi"), (m, "one"), "aupr", lower=False) for m in paired)),
        Claim("... and lower FPR95.", tuple(Comparison((m, "multi"), (m, "one"), "fpr95") for m in paired)),
    ]
    return [claim for claim in claims + seed_claims(rows) if claim.comparisons]


def seed_claims(rows: set[tuple[str, str]]) -> list[Claim]:
    """The symmetry-breaking vBNNs against the plain vBNN (one mode), as seeds 000 and 001 claim:
    better fits (001: less underfitting; 000: better predictions), and, the question of issue 12,
    a posterior closer to the reference once the symmetries are broken during training."""
    bnn = ("bnn", "one")
    variants = [v for v in (("bnn_skip", "one"), ("bnn_ordered", "one")) if v in rows and bnn in rows]
    skip = [v for v in variants if v[0] == "bnn_skip"]
    return [
        Claim("Seed 001: fixed orthogonal skips reduce the vBNN's underfitting: higher accuracy ...",
              tuple(Comparison(v, bnn, "acc", lower=False) for v in skip)),
        Claim("... and lower NLL than the plain vBNN.", tuple(Comparison(v, bnn, "nll") for v in skip)),
        Claim("Seeds 000, 001: breaking the symmetry during training brings the vBNN's posterior closer to the "
              "reference: lower NS MMD than the plain vBNN.", tuple(Comparison(v, bnn, "ns_mmd_median") for v in variants)),
        Claim("... and lower MMD.", tuple(Comparison(v, bnn, "mmd_median") for v in variants)),
    ]


def verdict(outcomes: list[str]) -> str:
    if outcomes and all(o == "holds" for o in outcomes):
        return "holds"
    if any(o == "fails" for o in outcomes):
        return "fails"
    return "not distinguishable"


def render(df: pd.DataFrame) -> str:
    """findings.md for the rows of one experiment's metrics frame; with symmetry-breaking vBNN rows,
    a closing note on how to read them (``tables.variant_notes``)."""
    frame = check_metrics(df)
    failed = frame[frame["status"] != "ok"]
    frame = frame[frame["status"] == "ok"].set_index(["method", "mode"])
    labels = {key: f"{frame.loc[key, 'method_label']} ({key[1]})" for key in frame.index}
    experiment = frame["experiment_label"].iloc[0] if len(frame) else ""
    lines = [f"# The paper's claims on {experiment}", "",
             "Each claim of the paper (section 4.3, appendix B.4), and of seeds 000 and 001 on the symmetry-breaking vBNNs, "
             "checked on this run: values x100 with their 95% "
             "half-widths (see the table captions); a comparison holds when the difference's interval is wholly on "
             "the claimed side, fails when wholly on the other, and is not distinguishable otherwise.", ""]
    summary = []
    for claim in paper_claims(set(frame.index)):
        rows, outcomes = [], []
        for c in claim.comparisons:
            a, b = frame.loc[c.a], frame.loc[c.b]
            side = compare(a[c.column], a[half_width(c.column)], b[c.column], b[half_width(c.column)])
            wanted = "lower" if c.lower else "higher"
            outcome = "holds" if side == wanted else "not distinguishable" if side == "not distinguishable" else "fails"
            outcomes.append(outcome)
            rows.append({"Comparison": f"{labels[c.a]} {'<' if c.lower else '>'} {labels[c.b]}", "Column": c.column,
                         "A": _cell(a, c.column), "B": _cell(b, c.column), "Verdict": outcome})
        result = verdict(outcomes)
        summary.append((claim.text, result, sum(o == "holds" for o in outcomes), len(outcomes)))
        lines += [f"## {claim.text} **{result}**", "", pd.DataFrame(rows).to_markdown(index=False), ""]
    head = ["| Claim | Verdict | Comparisons that hold |", "|:--|:--|--:|"]
    head += [f"| {text} | {result} | {k}/{n} |" for text, result, k, n in summary]
    if not summary:
        head = ["No claim can be checked: they compare rows this run does not have."]
    if len(failed):
        names = ", ".join(f"{label} ({mode})" for label, mode in zip(failed["method_label"], failed["mode"]))
        head += ["", f"Rows that failed are left out: {names}."]
    notes = variant_notes(frame.index.get_level_values("method"))
    if notes:
        lines += ["## Reading the symmetry-breaking vBNN rows", "", *[f"- {note}" for note in notes], ""]
    return "\n".join(lines[:4] + head + [""] + lines[4:])


def _cell(row: pd.Series, column: str) -> str:
    value, width = row[column] * 100, row[half_width(column)] * 100
    return f"{value:.1f}" if pd.isna(width) else f"{value:.1f} ± {width:.1f}"
