"""``results/<experiment>/findings.md``: each qualitative claim of the paper's section 4.3 and
appendix B.4 (and of seeds 000 and 001 on the symmetry-breaking vBNNs), checked against this
run's repetitions.

A claim is a list of comparisons "row A's column < row B's" (or >). Each comparison is Student's
paired t-test on the per-repetition differences of the two rows (repetition k of A against
repetition k of B, from ``repetitions.csv``; ``metrics.uncertainty.paired_test``); for MMD the
reference zoo's standard error is left out, being common to both rows. The comparisons of one
claim form a family: Holm's step-down procedure controls its family-wise error rate at
``ALPHA`` (``metrics.uncertainty.holm_decisions``). A comparison holds when Holm rejects "no
difference" and the mean difference is on the claimed side, fails when it is on the other,
and is not distinguishable otherwise (also when a row has a single repetition). The claim's
verdict: "holds" when every comparison holds, "fails" when any fails, else "not
distinguishable".
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from benchmark.reference import REFERENCE_METHODS, ZOO_ROW
from benchmark.report.hmc import RANKED_COLUMNS, agreement
from benchmark.report.tables import variant_notes
from benchmark.results import check_metrics, check_repetitions, half_width, parse_base_seeds
from metrics.kendall import BOOTSTRAP_DRAWS
from metrics.uncertainty import ALPHA, HIGHER, LOWER, PairedTest, holm, holm_decisions, paired_test

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
    """The paper's claims, as comparisons between the rows present (``(method, mode)``; HMC's rows,
    a reference rather than one of the paper's methods, are left out)."""
    rows = {r for r in rows if r[0] not in REFERENCE_METHODS}
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


def hmc_claims(rows: set[tuple[str, str]]) -> list[Claim]:
    """Against HMC (the rows of metrics_hmc.csv): the zoo's row has a lower MMD and NS MMD than every
    one-mode row of the paper's methods."""
    one = sorted(r for r in rows if r[1] == "one" and r[0] not in REFERENCE_METHODS)
    return [claim for claim in [
        Claim("Against HMC, the zoo is closer to HMC than every one-mode method: lower MMD and NS MMD.",
              tuple(Comparison(ZOO_ROW, r, column) for r in one for column in ("mmd_median", "ns_mmd_median"))
              if ZOO_ROW in rows else ()),
    ] if claim.comparisons]


def tau_verdict(low: float, high: float) -> str:
    """The rank-agreement claim's verdict from tau's interval: holds above 0, fails below, else not distinguishable."""
    return "holds" if low > 0 else "fails" if high < 0 else "not distinguishable"


def verdict(outcomes: list[str]) -> str:
    """A claim's verdict from its comparisons' outcomes (see the module doc)."""
    if outcomes and all(o == "holds" for o in outcomes):
        return "holds"
    if any(o == "fails" for o in outcomes):
        return "fails"
    return "not distinguishable"


SHARED, SEPARATE, SOME_SHARED, REUSED, UNKNOWN = (
    "shared bases", "separate bases", "some bases shared", "bases reused across pairs", "bases unknown")


def pairing(a: dict[int, frozenset[int]], b: dict[int, frozenset[int]]) -> str:
    """How the repetitions common to two rows pair up, from their base seeds (``{repetition: seeds}``):
    ``"bases reused across pairs"`` when a base network of one pair is also in another pair (the
    pairs are then not independent, which the paired test assumes: its p-value is approximate),
    else ``"shared bases"`` when every pair's two repetitions share a base (the design that makes
    pairing pay), ``"separate bases"`` when none does (still a valid test, without the gain),
    ``"some bases shared"`` in between, ``"bases unknown"`` when a repetition has no seeds recorded."""
    common = sorted(set(a) & set(b))
    if any(not a[k] or not b[k] for k in common):
        return UNKNOWN
    pairs = [a[k] | b[k] for k in common]
    if any(pairs[i] & pairs[j] for i in range(len(pairs)) for j in range(i + 1, len(pairs))):
        return REUSED
    shared = [bool(a[k] & b[k]) for k in common]
    return SHARED if all(shared) else SEPARATE if not any(shared) else SOME_SHARED


@dataclass(frozen=True)
class Outcome:
    """One comparison checked: its paired test, Holm-adjusted p-value, pairing and outcome."""

    comparison: Comparison
    test: PairedTest
    adjusted: float
    pairs: str
    outcome: str


def check_claim(claim: Claim, repetitions: dict[tuple[str, str], pd.DataFrame], alpha: float = ALPHA) -> list[Outcome]:
    """The outcomes of ``claim``'s comparisons: paired t-tests on the repetitions the two rows have
    in common, Holm over the claim. ``repetitions``: ``(method, mode)`` -> that row's repetitions
    (repetitions.csv rows indexed by ``repetition``)."""
    tests, pairs = [], []
    for c in claim.comparisons:
        a, b = repetitions[c.a], repetitions[c.b]
        common = sorted(set(a.index) & set(b.index))
        tests.append(paired_test(a.loc[common, c.column].to_numpy(), b.loc[common, c.column].to_numpy()))
        seeds = [{k: parse_base_seeds(r.loc[k, "base_seeds"]) for k in common} for r in (a, b)]
        pairs.append(pairing(*seeds))
    adjusted = holm([t.p_value for t in tests])
    out = []
    for c, test, q, pair, side in zip(claim.comparisons, tests, adjusted, pairs, holm_decisions(tests, alpha)):
        wanted = LOWER if c.lower else HIGHER
        outcome = "holds" if side == wanted else "fails" if side in (LOWER, HIGHER) else "not distinguishable"
        out.append(Outcome(c, test, float(q), pair, outcome))
    return out


def render(df: pd.DataFrame, repetitions: pd.DataFrame, alpha: float = ALPHA,
           hmc: tuple[pd.DataFrame, pd.DataFrame] | None = None) -> str:
    """findings.md for the rows of one experiment's metrics frame (``df``, metrics.csv) and their
    repetitions (``repetitions``, repetitions.csv: every repetition of every row that did not
    fail); with vBNN rows, a closing note on how to read them
    (``tables.variant_notes``); with ``hmc`` (metrics_hmc.csv and repetitions_hmc.csv:
    ``reference=hmc``), the claims about the two references (``hmc_claims``, Kendall's tau).
    Raises ``ValueError`` when a row's repetitions are missing."""
    frame, per_row, failed = _ok_rows(df, repetitions)
    experiment = frame["experiment_label"].iloc[0] if len(frame) else ""
    counts = sorted({int(n) for n in frame["n_repetitions"].dropna()})
    lines = [f"# The paper's claims on {experiment}", "", _method_text(counts, alpha), ""]
    summary = []
    for claim in paper_claims(set(frame.index)):
        lines += _claim_section(claim, frame, per_row, alpha, summary)
    if hmc is not None:
        lines += _hmc_sections(frame, repetitions, *hmc, alpha, summary)
    head = ["| Claim | Verdict | Hold | Fail | Not distinguishable |", "|:--|:--|--:|--:|--:|"]
    head += [f"| {text} | {result} | {k} | {f} | {u} |" for text, result, k, f, u in summary]
    if not summary:
        head = ["No claim can be checked: they compare rows this run does not have."]
    if len(failed):
        names = ", ".join(f"{label} ({mode})" for label, mode in zip(failed["method_label"], failed["mode"]))
        head += ["", f"Rows that failed are left out: {names}."]
    notes = variant_notes(frame.index.get_level_values("method"))
    if notes:
        lines += ["## Reading the vBNN rows", "", *[f"- {note}" for note in notes], ""]
    return "\n".join(lines[:4] + head + [""] + lines[4:])


def _ok_rows(df: pd.DataFrame, repetitions: pd.DataFrame) -> tuple[pd.DataFrame, dict, pd.DataFrame]:
    """The rows that did not fail (indexed by (method, mode)), their repetitions, and the failed rows."""
    frame = check_metrics(df)
    failed = frame[frame["status"] != "ok"]
    frame = frame[frame["status"] == "ok"].set_index(["method", "mode"])
    return frame, _repetitions_of(frame, check_repetitions(repetitions)), failed


def _claim_section(claim: Claim, frame: pd.DataFrame, per_row: dict, alpha: float, summary: list) -> list[str]:
    """The lines of one claim's section (its comparisons checked), appending its summary entry."""
    labels = {key: f"{frame.loc[key, 'method_label']} ({key[1]})" for key in frame.index}
    outcomes, rows = check_claim(claim, per_row, alpha), []
    for o in outcomes:
        c, a, b = o.comparison, frame.loc[o.comparison.a], frame.loc[o.comparison.b]
        rows.append({"Comparison": f"{labels[c.a]} {'<' if c.lower else '>'} {labels[c.b]}", "Column": c.column,
                     "A": _cell(a[c.column], a[half_width(c.column)]), "B": _cell(b[c.column], b[half_width(c.column)]),
                     "A - B (paired)": _cell(o.test.mean, o.test.half_width), "Pairs": f"{o.test.n}, {o.pairs}",
                     "p": _p(o.test.p_value), "Holm p": _p(o.adjusted), "Verdict": o.outcome})
    result = verdict([o.outcome for o in outcomes])
    summary.append((claim.text, result, *(sum(o.outcome == v for o in outcomes)
                                          for v in ("holds", "fails", "not distinguishable"))))
    return [f"## {claim.text} **{result}**", "", pd.DataFrame(rows).to_markdown(index=False, disable_numparse=True), ""]


def _hmc_sections(zoo: pd.DataFrame, zoo_repetitions: pd.DataFrame, hmc_metrics: pd.DataFrame,
                  hmc_repetitions: pd.DataFrame, alpha: float, summary: list) -> list[str]:
    """The claims about the two references (``reference=hmc``): ``hmc_claims`` on the rows scored
    against HMC, then Kendall's tau between the rankings under the zoo and under HMC."""
    frame, per_row, _ = _ok_rows(hmc_metrics, hmc_repetitions)
    lines = ["## Against full-batch HMC (reference=hmc)", "",
             "Every row was also scored against full-batch HMC's draws (metrics_hmc.csv, table_hmc.md); the zoo's "
             "row there is blocks of reference checkpoints of a method's sample size. The tests are those above, on "
             "the rows scored against HMC.", ""]
    for claim in hmc_claims(set(frame.index)):
        lines += _claim_section(claim, frame, per_row, alpha, summary)
    both = [r for r in frame.index if r in zoo.index and r[0] not in REFERENCE_METHODS]
    if len(both) < 2:
        return lines
    text = ("The two references rank the methods alike: Kendall's tau between the rankings under the zoo and under "
            "HMC is above 0.")
    rows, verdicts = [], []
    for label, column in RANKED_COLUMNS.items():
        result = agreement(zoo_repetitions, hmc_repetitions, both, column)
        verdicts.append(tau_verdict(result.low, result.high))
        rows.append({"Ranked by": label, "Rows": str(result.rows), "Kendall's tau": f"{result.tau:.2f}",
                     f"{result.level:.0%} interval": f"[{result.low:.2f}, {result.high:.2f}]",
                     "p (tau = 0)": _p(result.p_value), "Discordant pairs": f"{result.discordant} of {result.pairs}",
                     "Verdict": verdicts[-1]})
    result = verdict(verdicts)
    summary.append((text, result, *(sum(v == w for v in verdicts) for w in ("holds", "fails", "not distinguishable"))))
    lines += [f"## {text} **{result}**", "",
              "Tau-b between the rows' means under the two references, over the approximate methods (HMC's rows and "
              "the zoo's are the references, failed rows are left out); interval: percentile bootstrap over each "
              f"row's repetitions (the same resampled repetitions under both references, {BOOTSTRAP_DRAWS} draws; coarse with few "
              "repetitions); p: scipy's test of tau = 0 taking the rows as the sample. The claim holds when the "
              "interval lies above 0, fails when below.", "",
              pd.DataFrame(rows).to_markdown(index=False, disable_numparse=True), ""]
    return lines


def _method_text(counts: list[int], alpha: float) -> str:
    repetitions = "/".join(map(str, counts)) or "no"
    return (
        f"Each claim of the paper (section 4.3, appendix B.4), and of seeds 000 and 001 on the symmetry-breaking vBNNs, "
        f"checked on this run's {repetitions} repetitions of the sample stage. Test: for each comparison, Student's "
        f"paired t-test (two-sided) on the per-repetition differences A - B, repetition k of one row against "
        f"repetition k of the other; for MMD the reference zoo's standard error is left out, being common to both rows "
        f"(the test is conditional on this zoo). Multiplicity: within each claim, Holm's step-down procedure over its "
        f"comparisons, family-wise error rate alpha = {alpha:g}. A comparison holds when its Holm-adjusted p-value is "
        f"<= {alpha:g} and the mean difference is on the claimed side, fails when it is on the other side, and is not "
        f"distinguishable otherwise (also when a row has a single repetition: no test). A claim holds when all its "
        f"comparisons hold and fails when any fails. Values x100. A and B: each row's mean ± the half-width of its "
        f"95% interval, as in the tables (for reading; the verdicts do not use them). A - B (paired): the mean "
        f"difference ± the half-width of its 95% paired t-interval (not adjusted for multiplicity). Pairs: the number "
        f"of repetitions compared, and whether each pair's two repetitions started from the same base networks "
        f"(shared bases: what makes pairing pay), from different ones (separate bases: still a valid test), or "
        f"whether a base network of one pair is also used in another pair (bases reused across pairs: the pairs are "
        f"not independent, as the test assumes, and its p-value is approximate)."
    )


def _repetitions_of(frame: pd.DataFrame, repetitions: pd.DataFrame) -> dict[tuple[str, str], pd.DataFrame]:
    """Each row's repetitions that did not fail, indexed by repetition; ``ValueError`` naming the
    rows whose repetitions.csv entries do not match metrics.csv's ``n_repetitions``."""
    ok = repetitions[repetitions["status"] == "ok"]
    out, problems = {}, []
    for key in frame.index:
        row = frame.loc[key]
        mine = ok[(ok["experiment"] == row["experiment"]) & (ok["method"] == key[0]) & (ok["mode"] == key[1])]
        if len(mine) != row["n_repetitions"]:
            problems.append(f"{key[0]}/{key[1]}: {len(mine)} of {row['n_repetitions']:g}")
        out[key] = mine.set_index("repetition").sort_index()
    if problems:
        raise ValueError(
            f"repetitions.csv does not hold the repetitions metrics.csv averages ({'; '.join(problems)}); rerun "
            f"python -m benchmark stage=evaluate for this experiment, which writes both"
        )
    return out


def _cell(value: float, width: float) -> str:
    if pd.isna(value):
        return "n/a"
    return f"{value * 100:.1f} ± {'n/a' if pd.isna(width) else f'{width * 100:.1f}'}"


def _p(p: float) -> str:
    return "n/a" if not np.isfinite(p) else "<0.0001" if p < 1e-4 else f"{p:.4f}"
