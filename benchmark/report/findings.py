"""``results/<experiment>/findings.md``: each qualitative claim of the paper's section 4.3 and
appendix B.4 (and of seeds 000 and 001 on the symmetry-breaking vBNNs), checked against this
run's repetitions.

A claim is a list of comparisons "row A's column < row B's" (or >), on the rows' repetitions
(``repetitions.csv``). A comparison is **paired** only where the pairing is real: both rows'
methods start from the repetition's base network (``starts_from_base`` on the method's class,
``methods.base.PosteriorMethod``) and repetition k of both records the same base
(``pairing``); then the tests are on the differences a_k - b_k: Student's paired t-test and the
exact sign-flip test. Otherwise the rows are two independent samples: Welch's t-test and the
exact permutation test (``metrics.uncertainty.compare_rows``). For MMD the reference zoo's
standard error is left out, being common to both rows.

The comparisons of one claim form a family: Holm's step-down procedure controls its family-wise
error rate at ``ALPHA``. The verdict rests on the **exact** tests, valid without normality: a
comparison holds when Holm rejects "no difference" on the exact p-values and the mean
difference is on the claimed side, fails when it is on the other side, is **underpowered** when
no data could make Holm reject it at these repetitions (``metrics.uncertainty.reachable``:
5 pairs cannot give p < 0.0625), and is not distinguishable otherwise. The t-tests' Holm
decisions are shown beside it (what normality would add). An underpowered comparison reports
the t-test's power at the observed difference and Holm's first threshold (alpha / m), and the
repetitions at which the power reaches 80% and the exact test can reach that threshold
(``metrics.uncertainty.repetitions_for_power``), with the range of that number over the
difference's 95% interval. The claim's verdict: "holds" when every comparison holds, "fails"
when any fails, "underpowered" when any is (and none fails), else "not distinguishable".

``baseline_comparisons`` and ``render_baselines`` compare methods with baseline rows the same
way (one Holm family per metric); ``repetitions_needed`` tabulates what each claim needs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np
import pandas as pd

from benchmark.references import REFERENCE_METHODS
from benchmark.report.tables import UNCONVERGED_MARK, not_converged, variant_notes
from benchmark.results import check_metrics, check_repetitions, half_width, parse_base_seeds
from metrics.columns import baseline_directions, column as measured
from metrics.kendall import BOOTSTRAP_DRAWS, RankAgreement, rank_agreement
from methods import METHODS
from metrics.uncertainty import (
    ALPHA, MAX_REPETITIONS, POWER_TARGET, RowTest, compare_rows, holm, min_exact_p, reachable,
    repetitions_for_power,
)


@dataclass(frozen=True)
class Comparison:
    """``a`` and ``b`` are (method, mode) rows; the claim is that a is better than b in ``column``,
    the direction its definition gives (``metrics.columns``): ``lower``, a's value < b's."""

    a: tuple[str, str]
    b: tuple[str, str]
    column: str

    @property
    def lower(self) -> bool:
        return measured(self.column).lower


@dataclass(frozen=True)
class Claim:
    text: str
    comparisons: tuple[Comparison, ...]


RANKED_COLUMNS = {"MMD": "mmd_median", "NS MMD": "ns_mmd_median"}
"""The columns rows are ranked by under each reference (the median over kernels, as Table 1)."""


@dataclass(frozen=True)
class ReferenceSection:
    """What a second reference adds to findings.md (a reference's report hook gives it): ``title``
    (the section's heading), ``intro`` (its first paragraph), ``label`` (the reference's name in
    the text), ``claims`` (its claims on the rows scored against it, given those rows) and
    ``metrics``, ``repetitions`` (metrics.csv's and repetitions.csv's rows against it). Its
    section holds its claims, then Kendall's tau between the rankings under the zoo and under it."""

    title: str
    intro: str
    label: str
    claims: Callable[[set[tuple[str, str]]], list[Claim]]
    metrics: pd.DataFrame
    repetitions: pd.DataFrame


def agreement(zoo_repetitions: pd.DataFrame, other_repetitions: pd.DataFrame, ranked_rows: list[tuple[str, str]],
              column: str) -> RankAgreement:
    """Kendall's tau between the rankings of ``ranked_rows`` (method, mode) by ``column`` under the zoo
    and under another reference (repetitions.csv's rows against each), with its bootstrap interval
    over the repetitions (``metrics.kendall.rank_agreement``; repetition k of a row is the same
    sample set under both references)."""
    reps = {name: check_repetitions(frame) for name, frame in (("zoo", zoo_repetitions), ("other", other_repetitions))}
    values: dict[str, list[np.ndarray]] = {"zoo": [], "other": []}
    for method, mode in ranked_rows:
        mine = {name: frame[(frame["method"] == method) & (frame["mode"] == mode) & (frame["status"] == "ok")]
                .set_index("repetition")[column] for name, frame in reps.items()}
        common = sorted(set(mine["zoo"].index) & set(mine["other"].index))
        for name in values:
            values[name].append(mine[name].loc[common].to_numpy())
    return rank_agreement(values["zoo"], values["other"])


DEEP_ENSEMBLES, LAPLACE = "DE", "Laplace"
"""The paper's rows its claims name (``PosteriorMethod.paper_label``: the methods set beside them)."""


def paper_label(method: str) -> str | None:
    """The paper's row that row ``method`` is set beside (``PosteriorMethod.paper_label``); None for a
    method not in the paper's tables and for a row the registry does not know (a baseline, an external set)."""
    return METHODS[method].paper_label if method in METHODS else None


def paper_claims(rows: set[tuple[str, str]]) -> list[Claim]:
    """The paper's claims, as comparisons between the rows present (``(method, mode)``; a reference's
    own rows, ``REFERENCE_METHODS``, are not the paper's methods and are left out). The rows a claim
    names are those of the methods labelled with the paper's row (``paper_label``)."""
    rows = {r for r in rows if r[0] not in REFERENCE_METHODS}
    paired = [m for m in METHODS if (m, "one") in rows and (m, "multi") in rows]  # registry order; both modes
    ensembles = sorted(r for r in rows if r[1] == "multi" and paper_label(r[0]) == DEEP_ENSEMBLES)
    others = sorted(r for r in rows if r not in ensembles)
    claims = [
        Claim("Deep Ensembles have the lowest MMD of all rows.",
              tuple(Comparison(de, r, "mmd_median") for de in ensembles for r in others)),
        Claim("For every method, the multi-mode MMD is below the one-mode MMD.",
              tuple(Comparison((m, "multi"), (m, "one"), "mmd_median") for m in paired)),
        Claim("For every method, the multi-mode NS MMD is below the one-mode NS MMD.",
              tuple(Comparison((m, "multi"), (m, "one"), "ns_mmd_median") for m in paired)),
    ]
    laplace = []
    for mode in ("one", "multi"):
        for best in sorted(r for r in rows if r[1] == mode and paper_label(r[0]) == LAPLACE):
            laplace += [Comparison(best, r, column) for r in others
                        if r[1] == mode and paper_label(r[0]) not in (LAPLACE, DEEP_ENSEMBLES)
                        for column in ("mmd_median", "ns_mmd_median")]
    claims += [
        Claim("After Deep Ensembles, Laplace has the lowest MMD and NS MMD (within each mode).", tuple(laplace)),
        Claim("Multi-mode methods are more accurate than their one-mode form.",
              tuple(Comparison((m, "multi"), (m, "one"), "acc") for m in paired)),
        Claim("Multi-mode methods have a lower NLL than their one-mode form.",
              tuple(Comparison((m, "multi"), (m, "one"), "nll") for m in paired)),
        Claim("One-mode methods have a lower ECE than their multi-mode form.",
              tuple(Comparison((m, "one"), (m, "multi"), "ece") for m in paired)),
        Claim("Multi-mode methods are ahead on OOD detection: higher AUPR ...",
              tuple(Comparison((m, "multi"), (m, "one"), "aupr") for m in paired)),
        Claim("... and lower FPR95.", tuple(Comparison((m, "multi"), (m, "one"), "fpr95") for m in paired)),
    ]
    return [claim for claim in claims + seed_claims(rows) if claim.comparisons]


def variant_pairs(rows: set[tuple[str, str]], claim: str) -> list[tuple[tuple[str, str], tuple[str, str]]]:
    """``(variant's row, followed method's row)``, one mode, in table row order, of every variant
    whose ``PosteriorMethod.variant_claims`` hold ``claim`` when both rows are present."""
    pairs = [((name, "one"), (cls.follows, "one")) for name, cls in METHODS.items() if claim in cls.variant_claims]
    return [(v, b) for v, b in pairs if v in rows and b in rows]


def seed_claims(rows: set[tuple[str, str]]) -> list[Claim]:
    """The symmetry-breaking vBNNs against the plain vBNN they follow (one mode), as seeds 000 and 001
    claim (``PosteriorMethod.variant_claims``): better fits (``underfitting``, seed 001: fixed
    orthogonal skips), and, the question the seeds raise, a posterior closer to the reference once the
    symmetries are broken during training (``closer``)."""
    fits, closer = variant_pairs(rows, "underfitting"), variant_pairs(rows, "closer")
    return [
        Claim("Seed 001: fixed orthogonal skips reduce the vBNN's underfitting: higher accuracy ...",
              tuple(Comparison(v, b, "acc") for v, b in fits)),
        Claim("... and lower NLL than the plain vBNN.", tuple(Comparison(v, b, "nll") for v, b in fits)),
        Claim("Seeds 000, 001: breaking the symmetry during training brings the vBNN's posterior closer to the "
              "reference: lower NS MMD than the plain vBNN.", tuple(Comparison(v, b, "ns_mmd_median") for v, b in closer)),
        Claim("... and lower MMD.", tuple(Comparison(v, b, "mmd_median") for v, b in closer)),
    ]


def tau_verdict(low: float, high: float) -> str:
    """The rank-agreement claim's verdict from tau's interval: holds above 0, fails below, else not distinguishable."""
    return "holds" if low > 0 else "fails" if high < 0 else "not distinguishable"


HOLDS, FAILS, UNDERPOWERED, UNDECIDED = "holds", "fails", "underpowered", "not distinguishable"
OUTCOMES = (HOLDS, FAILS, UNDERPOWERED, UNDECIDED)


def verdict(outcomes: list[str]) -> str:
    """A claim's verdict from its comparisons' outcomes (see the module doc)."""
    if outcomes and all(o == HOLDS for o in outcomes):
        return HOLDS
    if any(o == FAILS for o in outcomes):
        return FAILS
    if any(o == UNDERPOWERED for o in outcomes):
        return UNDERPOWERED
    return UNDECIDED


def starts_from_base(method: str, overrides: Mapping[str, bool] | None = None) -> bool:
    """Whether row ``method``'s fit starts from the repetition's base network: ``overrides[method]``
    when given, else the registered class's ``PosteriorMethod.starts_from_base``, else False (a row
    the registry does not know, e.g. a baseline, is an independent sample)."""
    if overrides is not None and method in overrides:
        return bool(overrides[method])
    return METHODS[method].starts_from_base if method in METHODS else False


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
    """One comparison checked: its tests (``RowTest``: paired or not), the Holm-adjusted exact and
    t-test p-values, the design (``pairs``: how the repetitions pair up, or why they do not), the
    outcome (holds, fails, underpowered, not distinguishable: on the exact test) and what the
    t-test alone would give; ``level``: Holm's first threshold in this family (alpha / m);
    ``power``: the t-test's power at the observed difference and ``level``; ``needed``: the
    repetitions for 80% power at ``level`` and an exact test that can reach it, with ``needed_range``
    (fewest, most) over the difference's 95% interval (``math.inf``: the interval reaches 0)."""

    comparison: Comparison
    test: RowTest
    adjusted: float
    adjusted_t: float
    pairs: str
    outcome: str
    t_outcome: str
    level: float
    power: float
    needed: float
    needed_range: tuple[float, float]


def design(a: pd.DataFrame, b: pd.DataFrame, methods: tuple[str, str],
           overrides: Mapping[str, bool] | None = None) -> tuple[bool, str]:
    """``(paired, description)`` for rows of ``methods`` (A's, B's) with repetitions ``a``, ``b``
    (repetitions.csv rows indexed by ``repetition``): paired when both methods start from the base
    network (``starts_from_base``) and every repetition the two have in common shares a base
    (``pairing``); otherwise independent samples, saying why."""
    common = sorted(set(a.index) & set(b.index))
    seeds = [{k: parse_base_seeds(r.loc[k, "base_seeds"]) for k in common} for r in (a, b)]
    shared = pairing(*seeds)
    own = sorted({m for m in methods if not starts_from_base(m, overrides)})
    if not own and shared == SHARED and len(common) >= 2:
        return True, f"paired, {SHARED}"
    if own:
        why = f"{' and '.join(own)} not from the base"
    elif len(common) < 2:
        why = "fewer than 2 common repetitions"
    else:
        why = shared
    if shared == REUSED:
        why = f"{why}: approximate" if why == REUSED else f"{why}; {REUSED}: approximate"
    return False, f"unpaired: {why}"


def _needed(test: RowTest, level: float) -> tuple[float, tuple[float, float]]:
    """Repetitions for 80% power at ``level`` at the observed difference, and over its 95% interval."""
    if not math.isfinite(test.half_width):
        return math.nan, (math.nan, math.nan)
    size = abs(test.mean)
    ends = (size + test.half_width, max(0.0, size - test.half_width))
    return (repetitions_for_power(test, level),
            tuple(repetitions_for_power(test, level, mean=m) for m in ends))  # type: ignore[return-value]


def check_claim(claim: Claim, repetitions: dict[tuple[str, str], pd.DataFrame], alpha: float = ALPHA,
                overrides: Mapping[str, bool] | None = None) -> list[Outcome]:
    """The outcomes of ``claim``'s comparisons (see the module doc): each pair of rows paired or
    not (``design``), the exact and the t-tests, Holm over the claim on each.
    ``repetitions``: ``(method, mode)`` -> that row's repetitions (repetitions.csv rows indexed by
    ``repetition``); ``overrides``: method -> starts from the base (``starts_from_base``)."""
    tests, pairs = [], []
    for c in claim.comparisons:
        a, b = repetitions[c.a], repetitions[c.b]
        paired, text = design(a, b, (c.a[0], c.b[0]), overrides)
        if paired:
            common = sorted(set(a.index) & set(b.index))
            a, b = a.loc[common], b.loc[common]
        tests.append(compare_rows(a[c.column].to_numpy(), b[c.column].to_numpy(), paired))
        pairs.append(text)
    adjusted, adjusted_t = holm([t.exact_p for t in tests]), holm([t.t_p for t in tests])
    possible = reachable([t.min_p for t in tests], alpha)
    level = alpha / max(1, sum(t.testable for t in tests))
    out = []
    for c, test, q, q_t, pair, can in zip(claim.comparisons, tests, adjusted, adjusted_t, pairs, possible):
        outcome, t_outcome = (_side(c, test, x, alpha) for x in (q, q_t))
        if outcome == UNDECIDED and not can:
            outcome = UNDERPOWERED
        needed, needed_range = _needed(test, level)
        out.append(Outcome(c, test, float(q), float(q_t), pair, outcome, t_outcome, level, test.power(level),
                           needed, needed_range))
    return out


def _side(c: Comparison, test: RowTest, adjusted: float, alpha: float) -> str:
    """holds / fails by the sign of the difference when the Holm-adjusted p-value is <= alpha."""
    if not adjusted <= alpha:
        return UNDECIDED
    return HOLDS if (test.mean < 0) == c.lower else FAILS


def render(df: pd.DataFrame, repetitions: pd.DataFrame, alpha: float = ALPHA,
           others: Sequence[ReferenceSection] = ()) -> str:
    """findings.md for the rows of one experiment's metrics frame (``df``, metrics.csv) and their
    repetitions (``repetitions``, repetitions.csv: every repetition of every row that did not
    fail); with vBNN rows, a closing note on how to read them
    (``tables.variant_notes``); for each of ``others`` (a second reference's ``ReferenceSection``),
    its claims on the rows scored against it and Kendall's tau between the two rankings.
    Raises ``ValueError`` when a row's repetitions are missing."""
    frame, per_row, failed = _ok_rows(df, repetitions)
    experiment = frame["experiment_label"].iloc[0] if len(frame) else ""
    counts = sorted({int(n) for n in frame["n_repetitions"].dropna()})
    lines = [f"# The paper's claims on {experiment}", "", _method_text(counts, alpha), ""]
    summary = []
    for claim in paper_claims(set(frame.index)):
        lines += _claim_section(claim, frame, per_row, alpha, summary)
    for other in others:
        lines += _reference_sections(frame, repetitions, other, alpha, summary)
    head = ["| Claim | Verdict | Hold | Fail | Underpowered | Not distinguishable | t-tests alone | "
            f"Repetitions for {POWER_TARGET:.0%} power |", "|:--|:--|--:|--:|--:|--:|:--|:--|"]
    head += [f"| {e['text']} | {e['verdict']} | {' | '.join(map(str, e['counts']))} | {e['t_verdict']} | {e['needed']} |"
             for e in summary]
    if not summary:
        head = ["No claim can be checked: they compare rows this run does not have."]
    unsettled = failed[failed["status"] == "ok"]
    failed = failed[failed["status"] != "ok"]
    if len(failed):
        names = ", ".join(f"{label} ({mode})" for label, mode in zip(failed["method_label"], failed["mode"]))
        head += ["", f"Rows that failed are left out: {names}."]
    if len(unsettled):
        names = ", ".join(f"{row.method_label} ({row.mode}: stationary in {round(row.stationary * row.n_repetitions)} of "
                          f"{row.n_repetitions:.0f} repetitions)" for row in unsettled.itertuples())
        head += ["", f"Markov-chain rows whose chains failed their own convergence check (split R-hat of the training "
                     f"log-likelihood between each chain's halves 1.05 or above in some repetition) are left out of "
                     f"every comparison, because their samples do not yet describe the distribution the method names: "
                     f"{names}. Table 1 marks them {UNCONVERGED_MARK}."]
    notes = variant_notes(frame.index.get_level_values("method"))
    if notes:
        lines += ["## Reading the vBNN rows", "", *[f"- {note}" for note in notes], ""]
    return "\n".join(lines[:4] + head + [""] + lines[4:])


def _ok_rows(df: pd.DataFrame, repetitions: pd.DataFrame) -> tuple[pd.DataFrame, dict, pd.DataFrame]:
    """The rows that neither failed nor failed their chains' convergence check (``tables.not_converged``),
    indexed by (method, mode); their repetitions; and the rows left out (``status`` failed, or ok and
    not converged)."""
    frame = check_metrics(df)
    kept = (frame["status"] == "ok") & ~not_converged(frame)
    left_out = frame[~kept]
    frame = frame[kept].set_index(["method", "mode"])
    return frame, _repetitions_of(frame, check_repetitions(repetitions)), left_out


def _claim_section(claim: Claim, frame: pd.DataFrame, per_row: dict, alpha: float, summary: list) -> list[str]:
    """The lines of one claim's section (its comparisons checked), appending its summary entry."""
    labels = {key: f"{frame.loc[key, 'method_label']} ({key[1]})" for key in frame.index}
    outcomes = check_claim(claim, per_row, alpha)
    rows = []
    for o in outcomes:
        c = o.comparison
        rows.append({"Comparison": f"{labels[c.a]} {'<' if c.lower else '>'} {labels[c.b]}", "Column": c.column,
                     "A": _cell(frame.loc[c.a, c.column], frame.loc[c.a, half_width(c.column)]),
                     "B": _cell(frame.loc[c.b, c.column], frame.loc[c.b, half_width(c.column)]), **outcome_cells(o)})
    result = verdict([o.outcome for o in outcomes])
    summary.append(_summary_entry(claim.text, outcomes))
    return [f"## {claim.text} **{result}**", "", pd.DataFrame(rows).to_markdown(index=False, disable_numparse=True), ""]


def outcome_cells(o: Outcome) -> dict[str, str]:
    """The columns every comparison table shows for one checked comparison (values x100)."""
    t = o.test
    return {"A - B": _cell(t.mean, t.half_width), "Design": o.pairs,
            "n": f"{t.n_a}" if t.paired else f"{t.n_a} + {t.n_b}",
            "p (t)": _p(t.t_p), "Holm p (t)": _p(o.adjusted_t), "p (exact)": _p(t.exact_p),
            "Holm p (exact)": _p(o.adjusted), "Power": _power(o.power),
            f"Reps for {POWER_TARGET:.0%}": _reps(o.needed, o.needed_range), "Verdict": o.outcome}


def _summary_entry(text: str, outcomes: list[Outcome]) -> dict:
    """One claim's line of the summary: its verdict, outcome counts, the t-tests' verdict, and the
    repetitions at which every comparison has 80% power (the largest over them)."""
    worst = _largest([o.needed for o in outcomes])
    ranges = [_largest([o.needed_range[i] for o in outcomes]) for i in (0, 1)]
    return {"text": text, "verdict": verdict([o.outcome for o in outcomes]),
            "counts": tuple(sum(o.outcome == v for o in outcomes) for v in OUTCOMES),
            "t_verdict": verdict([o.t_outcome for o in outcomes]), "needed": _reps(worst, tuple(ranges)),
            "needed_value": worst, "needed_range": tuple(ranges)}


def _largest(values: list[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return max(finite) if finite else math.nan


def _reference_sections(zoo: pd.DataFrame, zoo_repetitions: pd.DataFrame, other: ReferenceSection, alpha: float,
                        summary: list) -> list[str]:
    """The claims about a second reference (``other``): its claims on the rows scored against it,
    then Kendall's tau between the rankings under the zoo and under it."""
    frame, per_row, _ = _ok_rows(other.metrics, other.repetitions)
    lines = [f"## {other.title}", "", other.intro, ""]
    for claim in other.claims(set(frame.index)):
        lines += _claim_section(claim, frame, per_row, alpha, summary)
    both = [r for r in frame.index if r in zoo.index and r[0] not in REFERENCE_METHODS]
    if len(both) < 2:
        return lines
    text = ("The two references rank the methods alike: Kendall's tau between the rankings under the zoo and under "
            f"{other.label} is above 0.")
    rows, verdicts = [], []
    for label, column in RANKED_COLUMNS.items():
        result = agreement(zoo_repetitions, other.repetitions, both, column)
        verdicts.append(tau_verdict(result.low, result.high))
        rows.append({"Ranked by": label, "Rows": str(result.rows), "Kendall's tau": f"{result.tau:.2f}",
                     f"{result.level:.0%} interval": f"[{result.low:.2f}, {result.high:.2f}]",
                     "p (tau = 0)": _p(result.p_value), "Discordant pairs": f"{result.discordant} of {result.pairs}",
                     "Verdict": verdicts[-1]})
    result = verdict(verdicts)
    summary.append({"text": text, "verdict": result, "counts": tuple(sum(v == w for v in verdicts) for w in OUTCOMES),
                    "t_verdict": "n/a", "needed": "n/a", "needed_value": math.nan, "needed_range": (math.nan, math.nan)})
    lines += [f"## {text} **{result}**", "",
              f"Tau-b between the rows' means under the two references, over the approximate methods ({other.label}'s rows and "
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
        f"checked on this run's {repetitions} repetitions of the sample stage. {TEST_TEXT} Multiplicity: within each "
        f"claim, Holm's step-down procedure over its comparisons, family-wise error rate alpha = {alpha:g}, on the exact "
        f"p-values (the verdict) and on the t-tests' (shown beside it). A comparison holds when its Holm-adjusted exact "
        f"p-value is <= {alpha:g} and the difference is on the claimed side, fails when it is on the other side, is "
        f"underpowered when no data could bring its Holm-adjusted exact p-value to {alpha:g} at these repetitions (every "
        f"comparison of the claim at the smallest p-value its exact test allows: 2/2^R for R pairs, 0.0625 at 5, "
        f"2/C(2R, R) for R + R independent repetitions, 0.0079 at 5 + 5), and is not distinguishable otherwise. A claim "
        f"holds when all its comparisons hold, fails when any fails, and is underpowered when any is (and none fails). "
        f"Values x100. A and B: each row's mean ± the half-width of its 95% interval, as in the tables (for reading; "
        f"the verdicts do not use them). A - B: the mean difference (paired) or the difference of the means "
        f"(unpaired) ± the half-width of its 95% t-interval (paired or Welch; not adjusted for multiplicity). n: pairs, "
        f"or each row's repetitions. {POWER_TEXT} 't-tests alone': the verdict Holm over the t-tests would give, "
        f"which rests on normal repetitions (doubtful where a row's repetitions form two clusters)."
    )


TEST_TEXT = (
    "Design: two rows are compared **paired** only where the pairing is real, i.e. both rows' methods start from the "
    "repetition's base network (SWAG, Laplace, Deep Ensembles, SGHMC; `starts_from_base` on the method's class) and "
    "repetition k of both records the same base: then the tests are on the differences A - B of repetition k, "
    "Student's paired t-test and the exact sign-flip test (all 2^R sign patterns). Otherwise (dropout and the vBNNs "
    "train their own networks, at most under the base's seed) the rows are two independent samples: Welch's t-test and "
    "the exact permutation test (every split of the pooled repetitions). For MMD the reference zoo's standard error is "
    "left out, being common to both rows (the tests are conditional on this zoo). All tests two-sided. Design column: "
    "paired (shared bases), or unpaired and why; 'bases reused across pairs' means a base network of one repetition "
    "is also in another, so the repetitions are not independent and the p-values approximate."
)
POWER_TEXT = (
    f"Power: the t-test's power at the observed difference and sds, at Holm's first threshold alpha / m (m: the "
    f"claim's comparisons; the threshold every comparison is sure to face), an estimate as uncertain as the difference "
    f"itself. Reps for {POWER_TARGET:.0%}: the repetitions (pairs, or of each row) at which that power reaches "
    f"{POWER_TARGET:.0%} and the exact test can reach alpha / m at all, at the observed difference (and, in brackets, "
    f"at the ends of its 95% interval; >{MAX_REPETITIONS}: the interval reaches 0)."
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


def _power(power: float) -> str:
    return "n/a" if math.isnan(power) else f"{power:.2f}"


def _reps(n: float, span: tuple[float, float]) -> str:
    """``8 (5 to 40)``: repetitions at the observed difference (and over its 95% interval)."""
    def one(x: float) -> str:
        return "n/a" if math.isnan(x) else f">{MAX_REPETITIONS}" if math.isinf(x) else f"{x:.0f}"
    if math.isnan(n):
        return "n/a"
    return f"{one(n)} ({one(span[0])} to {one(span[1])})"


def _cell(value: float, width: float) -> str:
    if pd.isna(value):
        return "n/a"
    return f"{value * 100:.1f} ± {'n/a' if pd.isna(width) else f'{width * 100:.1f}'}"


def _p(p: float) -> str:
    return "n/a" if not np.isfinite(p) else "<0.0001" if p < 1e-4 else f"{p:.4f}"


# --- What each claim needs; methods against baselines ------------------------------------------

def repetitions_to_decide(paired: Sequence[bool], alpha: float = ALPHA) -> int:
    """The fewest repetitions (pairs, or of each row unpaired), the same for every comparison of a
    Holm family with these designs, at which every comparison's exact test could be rejected at
    all (``reachable``): e.g. 6 for one paired comparison at 0.05, 9 for 12 paired ones, 6 for 12
    unpaired ones. ``ValueError`` for an empty family."""
    if not paired:
        raise ValueError("repetitions_to_decide: the family has no comparison")
    n = 2
    while not reachable([min_exact_p(n) if p else min_exact_p(n, n) for p in paired], alpha).all():
        n += 1
    return n


def repetitions_needed(df: pd.DataFrame, repetitions: pd.DataFrame, alpha: float = ALPHA,
                       others: Sequence[ReferenceSection] = ()) -> pd.DataFrame:
    """For each claim of ``render`` (metrics.csv ``df``, repetitions.csv ``repetitions``; ``others`` as
    in ``render``): its comparisons (``paired``, ``unpaired``), the repetitions it has now
    (``repetitions``: the fewest any of its comparisons uses), its ``verdict`` and the t-tests'
    (``t_verdict``), ``to_decide``: the repetitions at which its exact tests could decide every
    comparison at all (``repetitions_to_decide``), and ``needed``: the repetitions at which every
    comparison has 80% power and can be decided (the largest of the comparisons'
    ``Outcome.needed``), with ``needed_low``/``needed_high`` over the differences' 95% intervals
    (``inf``: an interval reaches 0)."""
    frame, per_row, _ = _ok_rows(df, repetitions)
    families = [(claim, per_row) for claim in paper_claims(set(frame.index))]
    for other in others:
        other_frame, other_rows, _ = _ok_rows(other.metrics, other.repetitions)
        families += [(claim, other_rows) for claim in other.claims(set(other_frame.index))]
    records = []
    for claim, rows in families:
        outcomes = check_claim(claim, rows, alpha)
        entry = _summary_entry(claim.text, outcomes)
        designs = [o.test.paired for o in outcomes]
        records.append({"claim": claim.text, "comparisons": len(outcomes), "paired": sum(designs),
                        "unpaired": len(designs) - sum(designs),
                        "repetitions": min(min(o.test.n_a, o.test.n_b) for o in outcomes),
                        "verdict": entry["verdict"], "t_verdict": entry["t_verdict"],
                        "to_decide": repetitions_to_decide(designs, alpha), "needed": entry["needed_value"],
                        "needed_low": entry["needed_range"][0], "needed_high": entry["needed_range"][1]})
    return pd.DataFrame(records)


BETTER_LOWER: dict[str, bool] = baseline_directions()
"""The columns ``baseline_comparisons`` compares by default, each with whether lower is better (``metrics.columns``)."""
BEATS, WORSE = "beats", "worse"


def rows_of(repetitions: pd.DataFrame, experiment: str | None = None) -> dict[tuple[str, str], pd.DataFrame]:
    """``(method, mode)`` -> that row's repetitions that did not fail, indexed by ``repetition``, from a
    repetitions.csv frame of one experiment (``experiment`` picks one; ``ValueError`` naming them
    when the frame holds several and none is picked, or naming the one picked when absent)."""
    ok = repetitions[repetitions["status"] == "ok"]
    present = sorted(ok["experiment"].unique())
    if experiment is not None:
        if experiment not in present:
            raise ValueError(f"experiment={experiment!r}: not in the repetitions (they hold {present})")
        ok = ok[ok["experiment"] == experiment]
    elif len(present) > 1:
        raise ValueError(f"the repetitions hold several experiments ({', '.join(present)}); pass experiment=")
    return {key: group.set_index("repetition").sort_index() for key, group in ok.groupby(["method", "mode"])}


def baseline_comparisons(repetitions: pd.DataFrame, baselines: Sequence[tuple[str, str]],
                         methods: Sequence[tuple[str, str]], columns: Sequence[str] | None = None,
                         alpha: float = ALPHA, overrides: Mapping[str, bool] | None = None,
                         experiment: str | None = None) -> pd.DataFrame:
    """Which method rows beat which baseline rows, per column, from a repetitions.csv frame.

    ``baselines``, ``methods``: ``(method, mode)`` rows (baselines e.g. ``("prior", "baseline")``);
    ``columns``: the columns compared (default ``BETTER_LOWER``'s), each in the direction its
    definition gives (``metrics.columns``); ``overrides``: method ->
    starts from the base network (``starts_from_base``: a name the registry does not know is an
    independent sample). For each column, every method against every baseline is one comparison
    (``check_claim``: paired only where both start from the base, exact test and t-test) and the
    column's comparisons form one Holm family at ``alpha``. Returns one row per (column, method,
    baseline): ``column``, ``method``, ``mode``, ``baseline``, ``baseline_mode``, ``better``
    (lower/higher), ``paired``, ``design``, ``n_method``, ``n_baseline``, ``difference`` (method -
    baseline) and ``half_width`` (of its 95% t-interval), ``t_p``, ``holm_t_p``, ``exact_p``,
    ``holm_exact_p``, ``power``, ``needed`` (repetitions for 80% power), ``outcome`` (beats, worse,
    underpowered, not distinguishable: on the exact tests) and ``t_outcome`` (Holm on the t-tests).
    ``ValueError`` naming a row or a column the repetitions lack."""
    columns = list(BETTER_LOWER if columns is None else columns)
    per_row = rows_of(repetitions, experiment)
    missing = [f"{m}/{mode}" for m, mode in (*baselines, *methods) if (m, mode) not in per_row]
    if missing:
        raise ValueError(f"baseline_comparisons: no repetitions of {', '.join(missing)} (rows present: "
                         f"{', '.join(f'{m}/{mode}' for m, mode in sorted(per_row))})")
    absent = [c for c in columns if c not in repetitions.columns]
    if absent:
        raise ValueError(f"baseline_comparisons: columns={absent} are not repetitions.csv columns")
    if not baselines or not methods:
        raise ValueError("baseline_comparisons: baselines= and methods= each need at least one (method, mode) row")
    named = {HOLDS: BEATS, FAILS: WORSE, UNDERPOWERED: UNDERPOWERED, UNDECIDED: UNDECIDED}
    records = []
    for column in columns:
        lower = measured(column).lower
        family = Claim(column, tuple(Comparison(m, b, column) for m in methods for b in baselines))
        for o in check_claim(family, per_row, alpha, overrides):
            t = o.test
            records.append({
                "column": column, "method": o.comparison.a[0], "mode": o.comparison.a[1], "baseline": o.comparison.b[0],
                "baseline_mode": o.comparison.b[1], "better": "lower" if lower else "higher", "paired": t.paired,
                "design": o.pairs, "n_method": t.n_a, "n_baseline": t.n_b, "difference": t.mean,
                "half_width": t.half_width, "t_p": t.t_p, "holm_t_p": o.adjusted_t, "exact_p": t.exact_p,
                "holm_exact_p": o.adjusted, "power": o.power, "needed": o.needed, "outcome": named[o.outcome],
                "t_outcome": named[o.t_outcome]})
    return pd.DataFrame(records)


def render_baselines(table: pd.DataFrame, labels: Mapping[str, str] | None = None, alpha: float = ALPHA) -> str:
    """The findings.md section of ``baseline_comparisons``' ``table``: per column, a grid of method
    rows x baselines with each outcome (``beats``, ``worse``, ``underpowered (n)`` with the
    repetitions for 80% power, ``n.d.``: not distinguishable), then every comparison's numbers.
    ``labels``: method name -> table label (default: the name)."""
    labels = dict(labels or {})
    name = lambda m, mode: f"{labels.get(m, m)} ({mode})"  # noqa: E731
    lines = ["## Methods against baselines", "",
             f"Each method row against each baseline row, per column: {TEST_TEXT} Multiplicity: the comparisons of one "
             f"column form one family, Holm at family-wise error rate alpha = {alpha:g}, on the exact p-values. A method "
             f"beats a baseline when its Holm-adjusted exact p-value is <= {alpha:g} and the difference is on the better "
             f"side, is worse when on the other, underpowered when no data could bring it to {alpha:g} at these "
             f"repetitions (with, in brackets, the repetitions for {POWER_TARGET:.0%} power at the observed difference), "
             f"n.d. (not distinguishable) otherwise. {POWER_TEXT}", ""]
    if table.empty:
        return "\n".join(lines + ["No comparison: no method or baseline rows.", ""])
    for column, group in table.groupby("column", sort=False):
        better = group["better"].iloc[0]
        cells = {}
        for r in group.itertuples():
            cell = {BEATS: "beats", WORSE: "worse", UNDECIDED: "n.d."}.get(r.outcome)
            if cell is None:
                needed = "n/a" if math.isnan(r.needed) else f">{MAX_REPETITIONS}" if math.isinf(r.needed) else f"{r.needed:.0f}"
                cell = f"underpowered ({needed})"
            cells.setdefault(name(r.method, r.mode), {})[name(r.baseline, r.baseline_mode)] = cell
        grid = pd.DataFrame.from_dict(cells, orient="index")
        grid.index.name = "Method"
        lines += [f"### {column} ({better} is better)", "", grid.reset_index().to_markdown(index=False), ""]
    detail = [{"Column": r.column, "Method": name(r.method, r.mode), "Baseline": name(r.baseline, r.baseline_mode),
               "Method - baseline": _cell(r.difference, r.half_width), "Design": r.design,
               "n": f"{r.n_method}" if r.paired else f"{r.n_method} + {r.n_baseline}", "p (t)": _p(r.t_p),
               "Holm p (t)": _p(r.holm_t_p), "p (exact)": _p(r.exact_p), "Holm p (exact)": _p(r.holm_exact_p),
               "Power": _power(r.power), f"Reps for {POWER_TARGET:.0%}": _reps(r.needed, (r.needed, r.needed)).split(" (")[0],
               "Outcome": r.outcome, "t-tests alone": r.t_outcome} for r in table.itertuples()]
    lines += ["### Every comparison (values x100)", "", pd.DataFrame(detail).to_markdown(index=False, disable_numparse=True), ""]
    return "\n".join(lines)
