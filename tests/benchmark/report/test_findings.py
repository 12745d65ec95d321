"""findings.md: the paper's and the seeds' claims as comparisons of repetitions (paired only where
both rows start from the base network), decided by exact tests with Holm's control, underpowered
where no data could decide them; what each claim needs; methods against baselines; the note on
how to read the vBNN rows. p-values are checked against scipy and statsmodels."""
import re

import numpy as np
import pandas as pd
import pytest
from scipy import stats
from statsmodels.stats.multitest import multipletests
from statsmodels.stats.power import TTestPower

from benchmark.report.findings import (
    BETTER_LOWER, Claim, Comparison, baseline_comparisons, check_claim, design, paper_claims, pairing, render, render_baselines,
    repetitions_needed, repetitions_to_decide, seed_claims, starts_from_base,
)
from benchmark.results import REPETITION_COLUMNS, half_width, repetition_rows
from methods import method_class
from metrics.uncertainty import interval
from tests.benchmark.report.test_tables import row

R = 10
"""Repetitions of the hand-made rows: enough for every exact test of the paper's claims to decide
(9 pairs for the 20 comparisons of the Laplace claim)."""


def _frames(values, spread=None, bases=None, reps=R):
    """``(metrics frame, repetitions frame)`` of digits rows from ``values``: ``(method, mode)`` ->
    ``{column: mean}``. Repetition k of a column is mean + the repetition's base-network effect
    (shared by every row of that repetition, sd 0.02) + the row's own small noise (sd 0.002), or +
    ``spread[(method, mode)][column]`` (``reps`` offsets) where given; metrics.csv's mean and
    half-width are computed from them, as the evaluate stage does. ``bases``: repetition k's base
    seeds, ``{(method, mode): [seeds of each repetition]}`` (default: ``[100000 + k]``)."""
    rng = np.random.default_rng(0)
    shared = rng.normal(0, 0.02, reps)
    metrics, rows = [], []
    for (method, mode), columns in values.items():
        per_rep = {c: v + shared + (spread or {}).get((method, mode), {}).get(c, rng.normal(0, 0.002, reps))
                   for c, v in columns.items()}
        r = row("digits_optunet", method, mode, n_repetitions=reps) | {"method_label": method_class(method).label}
        for column, v in per_rep.items():
            r[column], r[half_width(column)] = interval(v)
        metrics.append(r)
        seeds = (bases or {}).get((method, mode), [[100000 + k] for k in range(reps)])
        numbers = [{"n_samples": 100, **{c: v[k] for c, v in per_rep.items()}} for k in range(reps)]
        rows += repetition_rows(r, numbers, range(reps), seeds)
    return pd.DataFrame(metrics), pd.DataFrame(rows, columns=REPETITION_COLUMNS)


PAPER_VALUES = {  # (method, mode): (mmd, acc, ece)
    ("dropout", "one"): (0.60, 0.50, 0.10), ("dropout", "multi"): (0.10, 0.90, 0.30),
    ("laplace", "one"): (0.20, 0.60, 0.20), ("laplace", "multi"): (0.05, 0.92, 0.25),
    ("swag", "one"): (0.80, 0.85, 0.05), ("swag", "multi"): (0.12, 0.96, 0.21),
    ("ensemble", "multi"): (0.00, 0.96, 0.35),
}


def _paper_values(overrides=None):
    out = {}
    for key, (mmd, acc, ece) in PAPER_VALUES.items():
        out[key] = dict(mmd_median=mmd, ns_mmd_median=mmd, acc=acc, ece=ece, nll=1.0 - acc, aupr=acc, fpr95=1 - acc)
        out[key] |= (overrides or {}).get(key, {})
    return out


SWAG_MULTI_ACC = {("swag", "multi"): {"acc": 0.3 * np.resize([1.0, -1.0, 0.5, -0.5, 0.2], R)}}
"""SWAG multi's accuracy too spread over repetitions to compare with its one-mode form."""


def _summary(text, claim):
    """The summary line of ``claim``: its cells after the claim's text."""
    line = next(x for x in text.splitlines() if x.startswith(f"| {claim} |"))
    return [c.strip() for c in line[len(claim) + 3:].strip("|").split("|")]


def _cells(text, start):
    """The cells of the first table line whose leading cells are those of ``start`` (``| a | b``)."""
    want = [c.strip() for c in start.strip().strip("|").split("|")]
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[:len(want)] == want:
            return cells
    raise AssertionError(f"no table line starts with {start!r}")


def _of(reps, method, mode, column):
    return reps.query(f"method == '{method}' and mode == '{mode}'").sort_values("repetition")[column].to_numpy()


def _exact(a, b, paired):
    kind = "samples" if paired else "independent"
    return stats.permutation_test((a, b), lambda x, y, axis: np.mean(x, axis=axis) - np.mean(y, axis=axis),
                                  permutation_type=kind, vectorized=True, n_resamples=10 ** 6).pvalue


def test_which_methods_start_from_the_base_network():
    assert [starts_from_base(m) for m in ("swag", "laplace", "ensemble")] == [True] * 3
    assert [starts_from_base(m) for m in ("dropout", "bnn", "bnn_skip", "bnn_ordered", "sghmc_sa")] == [False] * 5
    assert not starts_from_base("prior") and starts_from_base("prior", {"prior": True})
    assert not starts_from_base("laplace", {"laplace": False})


def test_pairing_is_real_only_when_both_rows_start_from_the_same_base():
    metrics, reps = _frames(_paper_values(), reps=3)
    per_row = {key: group.set_index("repetition") for key, group in reps.groupby(["method", "mode"])}
    assert design(per_row["laplace", "one"], per_row["swag", "one"], ("laplace", "swag")) == (True, "paired, shared bases")
    assert design(per_row["laplace", "one"], per_row["dropout", "one"], ("laplace", "dropout")) == (
        False, "unpaired: dropout not from the base")
    other = per_row["swag", "one"].assign(base_seeds=[str(200000 + k) for k in range(3)])
    assert design(per_row["laplace", "one"], other, ("laplace", "swag")) == (False, "unpaired: separate bases")
    assert design(per_row["laplace", "one"], per_row["dropout", "one"], ("laplace", "dropout"), {"dropout": True})[0]


def test_claims_and_verdicts():
    """At 10 repetitions every exact test can decide; the ECE comparison of dropout (unpaired:
    Welch and the permutation test) and of SWAG (paired: the t-test and the sign-flip test) equal
    scipy's, Holm statsmodels'."""
    metrics, reps = _frames(_paper_values(), SWAG_MULTI_ACC)
    text = render(metrics, reps)
    claims = {c.text: c for c in paper_claims({("dropout", "one"), ("dropout", "multi"), ("ensemble", "multi")})}
    assert len(claims["For every method, the multi-mode MMD is below the one-mode MMD."].comparisons) == 1
    assert _summary(text, "Deep Ensembles have the lowest MMD of all rows.")[:6] == ["holds", "6", "0", "0", "0", "holds"]
    assert _summary(text, "For every method, the multi-mode MMD is below the one-mode MMD.")[:5] == ["holds", "3", "0", "0", "0"]
    assert _summary(text, "Multi-mode methods are more accurate than their one-mode form.")[:5] == [
        "not distinguishable", "2", "0", "0", "1"]
    assert _summary(text, "One-mode methods have a lower ECE than their multi-mode form.")[:5] == ["holds", "3", "0", "0", "0"]
    assert _summary(text, "After Deep Ensembles, Laplace has the lowest MMD and NS MMD (within each mode).")[:5] == [
        "holds", "8", "0", "0", "0"]
    p_t, p_exact = [], []
    for method, paired in (("dropout", False), ("swag", True), ("laplace", True)):
        a, b = _of(reps, method, "one", "ece"), _of(reps, method, "multi", "ece")
        p_t.append((stats.ttest_rel(a, b) if paired else stats.ttest_ind(a, b, equal_var=False)).pvalue)
        p_exact.append(_exact(a, b, paired))
    holm_t, holm_exact = (multipletests(p, method="holm")[1] for p in (p_t, p_exact))
    for i, (label, design_text, n) in enumerate((("Dropout", "unpaired: dropout not from the base", f"{R} + {R}"),
                                                ("SWAG", "paired, shared bases", f"{R}"))):
        cells = _cells(text, f"| {label} (one) < {label} (multi) | ece")
        row_metrics = metrics.set_index(["method", "mode"]).loc[(label.lower(), "one")]
        assert cells[2] == f"{100 * row_metrics['ece']:.1f} ± {100 * row_metrics['ece_hw']:.1f}"
        assert cells[5:7] == [design_text, n]
        for cell, p in zip(cells[7:11], (p_t[i], holm_t[i], p_exact[i], holm_exact[i])):
            assert cell == (f"{p:.4f}" if p >= 1e-4 else "<0.0001"), (label, cell, p)
        assert cells[-1] == "holds"
    assert "sign-flip" in text and "permutation" in text and "Welch" in text and "alpha = 0.05" in text
    assert f"{R} repetitions" in text
    laplace = {("laplace", mode): {"mmd_median": 0.9} for mode in ("one", "multi")}
    assert _summary(render(*_frames(_paper_values(laplace), SWAG_MULTI_ACC)),
                    "After Deep Ensembles, Laplace has the lowest MMD and NS MMD (within each mode).")[:5] == [
        "fails", "4", "4", "0", "0"]


def test_five_paired_repetitions_are_underpowered_and_say_what_they_need():
    """At 5 repetitions the sign-flip test cannot give p < 0.0625: SWAG's and Laplace's paired
    comparisons are underpowered (the t-tests alone would hold them); dropout's unpaired one
    (smallest p 2/252, times 3 for Holm: 0.024) still decides. Power and the repetitions for 80%
    are the t-test's at Holm's first threshold 0.05 / 3, at least the 7 pairs at which the
    sign-flip test can reach it."""
    metrics, reps = _frames(_paper_values(), reps=5)
    text = render(metrics, reps)
    claim = "One-mode methods have a lower ECE than their multi-mode form."
    assert _summary(text, claim)[:6] == ["underpowered", "1", "0", "2", "0", "holds"]
    assert _cells(text, "| Dropout (one) < Dropout (multi) | ece")[-1] == "holds"
    swag = _cells(text, "| SWAG (one) < SWAG (multi) | ece")
    assert swag[-1] == "underpowered" and swag[9] == "0.0625"
    a, b = _of(reps, "swag", "one", "ece"), _of(reps, "swag", "multi", "ece")
    d = a - b
    power = TTestPower().power(effect_size=abs(d.mean()) / d.std(ddof=1), nobs=5, alpha=0.05 / 3)
    assert float(swag[11]) == pytest.approx(power, abs=0.005)
    assert swag[12].startswith("7 (")  # power ~1: the sign-flip test's floor, 2 / 2^7 <= 0.05 / 3
    needs = repetitions_needed(metrics, reps).set_index("claim")
    assert needs.loc[claim, ["comparisons", "paired", "unpaired", "repetitions", "to_decide"]].tolist() == [3, 2, 1, 5, 7]
    assert needs.loc[claim, "verdict"] == "underpowered" and needs.loc[claim, "t_verdict"] == "holds"


def test_repetitions_to_decide_a_family():
    assert repetitions_to_decide([True]) == 6 and repetitions_to_decide([False]) == 4
    assert repetitions_to_decide([True] * 12) == 9 and repetitions_to_decide([False] * 12) == 6
    # 6 + 6 unpaired gives 2/924, rejected first (x 2 <= 0.05), then the paired one's 2/64 faces 0.05 alone
    assert repetitions_to_decide([True, False]) == 6 and repetitions_to_decide([True, True]) == 7
    with pytest.raises(ValueError, match="no comparison"):
        repetitions_to_decide([])


def test_holm_keeps_a_claim_from_holding_on_comparisons_that_each_look_significant():
    """Three paired comparisons of 8 pairs, each with an exact p-value of 10/256 (one of eight
    differences of the other sign): one alone holds, as a family of three (Holm's first threshold
    0.05 / 3) none does, although the family could decide (2/256 x 3 < 0.05)."""
    d = np.array([0.01, 0.012, 0.011, 0.013, 0.009, 0.014, 0.010, -0.0105])
    per_row = {("swag", "one"): pd.DataFrame({"nll": np.full(8, 0.5), "base_seeds": [str(k) for k in range(8)]})}
    for m in ("laplace", "ensemble", "swag"):
        per_row[(m, "multi")] = pd.DataFrame({"nll": 0.5 - d, "base_seeds": [str(k) for k in range(8)]})
    p = _exact(per_row[("laplace", "multi")]["nll"].to_numpy(), per_row[("swag", "one")]["nll"].to_numpy(), True)
    assert 0.05 / 3 < p <= 0.05
    family = Claim("three", tuple(Comparison((m, "multi"), ("swag", "one"), "nll") for m in ("laplace", "ensemble", "swag")))
    outcomes = check_claim(family, per_row)
    assert [o.test.exact_p for o in outcomes] == pytest.approx([p] * 3, rel=1e-12)
    assert [o.outcome for o in outcomes] == ["not distinguishable"] * 3
    assert [o.adjusted for o in outcomes] == pytest.approx(list(multipletests([p] * 3, method="holm")[1]))
    alone = Claim("one comparison", family.comparisons[:1])
    assert [o.outcome for o in check_claim(alone, per_row)] == ["holds"]


def test_pairing_from_base_seeds():
    seeds = lambda *blocks: {k: frozenset(b) for k, b in enumerate(blocks)}  # noqa: E731
    assert pairing(seeds({1}, {2}, {3}), seeds({1}, {2}, {3})) == "shared bases"
    assert pairing(seeds({1}, {2}), seeds({11}, {12})) == "separate bases"
    assert pairing(seeds({1}, {2}), seeds({1}, {12})) == "some bases shared"
    # one-mode rows with pools of 1 and 3 seeds: repetition 1 of one is repetition 3's base of the other
    assert pairing(seeds({0}, {1}, {2}, {3}), seeds({0}, {3}, {6}, {9})) == "bases reused across pairs"
    assert pairing(seeds({0}, {1}), seeds(set(range(100)), set(range(100, 200)))) == "bases reused across pairs"
    assert pairing(seeds({0}, set()), seeds({0}, {1})) == "bases unknown"
    assert pairing(seeds({0}, {1}, {2}), seeds({0})) == "shared bases"  # only common repetitions pair
    members = {("ensemble", "multi"): [list(range(100000 + 100 * k, 100100 + 100 * k)) for k in range(R)]}
    text = render(*_frames(_paper_values(), bases=members))
    assert _cells(text, "| Deep Ensembles (multi) < Laplace (one)")[5] == (
        "unpaired: bases reused across pairs: approximate")
    assert _cells(text, "| Deep Ensembles (multi) < Dropout (one)")[5] == (
        "unpaired: dropout not from the base; bases reused across pairs: approximate")
    assert _cells(text, "| Laplace (multi) < Laplace (one)")[5] == "paired, shared bases"


def test_a_row_with_one_repetition_is_underpowered_and_shows_n_a():
    metrics, reps = _frames(_paper_values())
    keep = ~((reps["method"] == "laplace") & (reps["mode"] == "one") & (reps["repetition"] > 0))
    metrics.loc[(metrics["method"] == "laplace") & (metrics["mode"] == "one"), "n_repetitions"] = 1
    cells = _cells(render(metrics, reps[keep]), "| Laplace (one) < Swag (one) | mmd_median".replace("Swag", "SWAG"))
    assert cells[4].endswith("± n/a") and cells[5] == "unpaired: fewer than 2 common repetitions"
    assert cells[7:13] == ["n/a"] * 6 and cells[-1] == "underpowered"
    assert f"1/{R} repetitions" in render(metrics, reps[keep])


def test_missing_repetitions_are_named():
    metrics, reps = _frames(_paper_values(), reps=3)
    with pytest.raises(ValueError, match=r"repetitions.csv does not hold.*swag/one: 0 of 3.*stage=evaluate"):
        render(metrics, reps[reps["method"] != "swag"].query("method != 'swag'"))


def _rows():
    return _frames(_paper_values(), SWAG_MULTI_ACC)


def test_claims_need_their_rows():
    metrics, reps = _rows()
    text = render(metrics[metrics["method"] != "ensemble"], reps)
    assert "Deep Ensembles have the lowest" not in text and "Laplace has the lowest" in text
    assert "No claim can be checked" in render(metrics[metrics["mode"] == "one"].iloc[:1], reps)


def test_failed_rows_are_named_and_left_out():
    metrics, reps = _rows()
    metrics.loc[metrics["method"] == "swag", "status"] = "failed"
    text = render(metrics, reps[reps["method"] != "swag"])
    assert "Rows that failed are left out: SWAG (one), SWAG (multi)." in text and "SWAG (multi) <" not in text


def test_rows_whose_chains_did_not_converge_are_named_and_left_out_of_the_comparisons():
    metrics, reps = _rows()
    swag_one = (metrics["method"] == "swag") & (metrics["mode"] == "one")
    metrics.loc[swag_one, "stationary"] = 0.3  # as if SWAG one-mode were a chain that failed in 7 of 10 repetitions
    text = render(metrics, reps)
    assert "are left out of every comparison" in text and "SWAG (one: stationary in 3 of 10 repetitions)" in text
    compared = [line for line in text.splitlines() if line.startswith("| ") and "SWAG (one)" in line]
    assert not compared, compared  # in no comparison row
    kept = render(metrics.assign(stationary=1.0), reps)
    assert "left out of every comparison" not in kept and kept != text


def _vbnn_rows(spread=None, **variants):
    """The plain vBNN (one mode) and the variants given as ``name={column: mean}``, as
    ``_frames``; ``spread``: ``{name: {column: R offsets}}`` for a row whose repetitions scatter."""
    base = dict(acc=0.80, nll=0.60, mmd_median=0.30, ns_mmd_median=0.20)
    values = {(method, "one"): base | columns for method, columns in {"bnn": {}, **variants}.items()}
    return _frames(values, {(name, "one"): columns for name, columns in (spread or {}).items()})


def test_seed_claims_need_the_plain_vbnn_and_a_variant():
    assert all(not claim.comparisons for claim in seed_claims({("bnn", "one")}))
    assert all(not claim.comparisons for claim in seed_claims({("bnn_skip", "one"), ("bnn_ordered", "one")}))
    assert all(not claim.comparisons for claim in seed_claims({("bnn", "multi"), ("bnn_skip", "one")}))
    claims = {claim.text: claim.comparisons for claim in seed_claims({("bnn", "one"), ("bnn_ordered", "one")})}
    assert [len(c) for c in claims.values()] == [0, 0, 1, 1], "the accuracy and NLL claims are seed 001's (skips)"
    text = render(*_vbnn_rows())
    assert "Seed 001" not in text and "Seeds 000, 001" not in text and "(seed 00" not in text
    assert "log(pdf + 1e-6)" in text, "the note every vBNN row needs"


def test_seed_claim_directions_and_verdicts_on_hand_made_rows():
    rows = {("bnn", "one"), ("bnn_skip", "one"), ("bnn_ordered", "one")}
    skip, ordered, bnn = ("bnn_skip", "one"), ("bnn_ordered", "one"), ("bnn", "one")
    claims = {claim.text: claim.comparisons for claim in seed_claims(rows)}
    assert list(claims.values()) == [
        (Comparison(skip, bnn, "acc"),),
        (Comparison(skip, bnn, "nll"),),
        (Comparison(ordered, bnn, "ns_mmd_median"), Comparison(skip, bnn, "ns_mmd_median")),  # table row order
        (Comparison(ordered, bnn, "mmd_median"), Comparison(skip, bnn, "mmd_median")),
    ]
    metrics, reps = _vbnn_rows(
        spread={"bnn_skip": {"mmd_median": 0.05 * np.resize([0.8, -1.0, 0.2], R)}},  # scattered: not distinguishable
        bnn_skip=dict(acc=0.85, nll=0.70, ns_mmd_median=0.15, mmd_median=0.29),
        bnn_ordered=dict(ns_mmd_median=0.10, mmd_median=0.45),  # bias-sorted: raw MMD worse by construction
    )
    text = render(metrics, reps)
    assert _summary(text, "Seed 001: fixed orthogonal skips reduce the vBNN's underfitting: higher accuracy ...")[:5] == [
        "holds", "1", "0", "0", "0"]
    assert _summary(text, "... and lower NLL than the plain vBNN.")[:5] == ["fails", "0", "1", "0", "0"]
    assert _summary(text, "Seeds 000, 001: breaking the symmetry during training brings the vBNN's posterior closer to "
                          "the reference: lower NS MMD than the plain vBNN.")[:5] == ["holds", "2", "0", "0", "0"]
    assert _summary(text, "... and lower MMD.")[:5] == ["fails", "0", "1", "0", "1"]
    skip = _cells(text, "| BNN (orthogonal skips) (one) < BNN (one) | mmd_median")
    assert skip[5] == "unpaired: bnn and bnn_skip not from the base" and skip[-1] == "not distinguishable"
    assert re.fullmatch(r"-[01]\.[0-9] ± [0-9.]+", skip[4]) and skip[3].startswith("30.")
    ordered = _cells(text, "| BNN (ordered biases) (one) < BNN (one) | mmd_median")
    assert re.fullmatch(r"1[45]\.[0-9] ± [0-9.]+", ordered[4]) and ordered[-1] == "fails"
    note = text[text.index("## Reading the vBNN rows"):]
    assert "BNN (orthogonal skips): the vBNN of another model" in note and "worse by construction" in note
    assert "fc1's 3 units" in note


BASELINES = [("prior", "baseline"), ("init", "baseline")]


def _with_baselines(reps, n=R):
    """``reps`` plus two baseline rows (names the registry does not know): a prior far worse than every
    method on accuracy, an untrained init no better than SWAG one-mode's accuracy."""
    rng = np.random.default_rng(3)
    extra = []
    for name, acc in (("prior", 0.1), ("init", 0.85)):
        values = acc + rng.normal(0, 0.01, n)
        extra += [{**{c: np.nan for c in REPETITION_COLUMNS}, "experiment": "digits_optunet", "method": name,
                   "mode": "baseline", "reference": "zoo", "repetition": k, "status": "ok", "reason": "", "base_seeds": str(300000 + k),
                   "n_samples": 100, "acc": values[k], "nll": 2.3 - values[k]} for k in range(n)]
    return pd.concat([reps, pd.DataFrame(extra, columns=REPETITION_COLUMNS)], ignore_index=True)


def test_methods_against_baselines_are_unpaired_tests_with_holm_per_column():
    _, reps = _frames(_paper_values(), reps=8)
    reps = _with_baselines(reps, n=8)
    methods = [("laplace", "one"), ("swag", "one"), ("ensemble", "multi")]
    table = baseline_comparisons(reps, BASELINES, methods, columns=["acc", "nll"])
    assert len(table) == 12 and set(table["column"]) == {"acc", "nll"}
    acc = table[table["column"] == "acc"].set_index(["method", "baseline"])
    assert (acc.xs("prior", level="baseline")["outcome"] == "beats").all()
    assert acc.loc[("laplace", "init"), "outcome"] == "worse" and acc.loc[("ensemble", "init"), "outcome"] == "beats"
    assert not acc["paired"].any() and acc.loc[("swag", "init"), "design"] == "unpaired: init not from the base"
    exact, welch = [], []
    for m, b in acc.index:
        x, y = _of(reps, m, "one" if m != "ensemble" else "multi", "acc"), _of(reps, b, "baseline", "acc")
        exact.append(_exact(x, y, False))
        welch.append(stats.ttest_ind(x, y, equal_var=False).pvalue)
    assert acc["exact_p"].tolist() == pytest.approx(exact, rel=1e-9)
    assert acc["t_p"].tolist() == pytest.approx(welch, rel=1e-9)
    assert acc["holm_exact_p"].tolist() == pytest.approx(list(multipletests(exact, method="holm")[1]), rel=1e-9)
    paired = baseline_comparisons(reps, BASELINES, methods, columns=["acc"], overrides={"init": True, "prior": True})
    # declared to start from the base, yet drawn on other bases (300000 + k): still independent samples
    assert paired.set_index(["method", "baseline"]).loc[("laplace", "init"), "design"] == "unpaired: separate bases"
    same = reps.assign(base_seeds=reps["base_seeds"].where(reps["mode"] != "baseline", reps["repetition"].map(
        lambda k: str(100000 + k))))
    paired = baseline_comparisons(same, BASELINES, methods, columns=["acc"], overrides={"init": True, "prior": True})
    laplace_init = paired.set_index(["method", "baseline"]).loc[("laplace", "init")]
    assert laplace_init["design"] == "paired, shared bases" and laplace_init["n_method"] == 8
    assert laplace_init["t_p"] == pytest.approx(stats.ttest_rel(_of(reps, "laplace", "one", "acc"),
                                                                _of(reps, "init", "baseline", "acc")).pvalue, rel=1e-9)
    text = render_baselines(table, labels={"laplace": "Laplace"})
    assert "### acc (higher is better)" in text and "### nll (lower is better)" in text
    grid = _cells(text, "| Laplace (one) ")
    assert grid[1:] == ["beats", "worse"]
    detail = _cells(text, "| acc | Laplace (one) | init (baseline)")
    assert detail[4:6] == ["unpaired: init not from the base", "8 + 8"] and detail[-2:] == ["worse", "worse"]
    assert detail[8] == f"{acc.loc[('laplace', 'init'), 'exact_p']:.4f}"


def test_few_baseline_repetitions_are_underpowered_and_bad_names_are_refused():
    _, reps = _frames(_paper_values(), reps=3)
    reps = _with_baselines(reps, n=3)
    table = baseline_comparisons(reps, BASELINES, [("swag", "one")], columns=["acc"])
    assert (table["outcome"] == "underpowered").all()  # 3 + 3: smallest p 2/20 = 0.1
    assert "underpowered (" in render_baselines(table)
    with pytest.raises(ValueError, match=r"no repetitions of second_zoo/baseline .*rows present: .*prior/baseline"):
        baseline_comparisons(reps, [("second_zoo", "baseline")], [("swag", "one")])
    with pytest.raises(ValueError, match=r"columns=\['accuracy'\]"):
        baseline_comparisons(reps, BASELINES, [("swag", "one")], columns=["accuracy"])
    two = pd.concat([reps, reps.assign(experiment="mnist_optunet")])
    with pytest.raises(ValueError, match="several experiments.*experiment="):
        baseline_comparisons(two, BASELINES, [("swag", "one")])
    assert len(baseline_comparisons(two, BASELINES, [("swag", "one")], experiment="mnist_optunet")) == 2 * len(BETTER_LOWER)


def test_rows_with_more_repetitions_are_paired_on_the_common_ones_and_decide_at_eight():
    """Per-method counts (``sample.repetitions_per_method``: digits runs 8 for the rows that start
    from the base, 5 for the others): two rows at 8 are paired on their 8 repetitions, and an exact
    sign-flip test there reaches p = 2/256 < 0.05 (at 5 it could not go below 0.0625); a row at 8
    against one at 5 that also starts from the base is paired on the 5 repetitions both have
    (repetition k of both starts from the same base), against one that does not, unpaired on all
    8 + 5; n says how many each test used."""
    from benchmark.report.findings import outcome_cells
    rng = np.random.default_rng(3)

    def frame(values):
        return pd.DataFrame({"ece": values, "base_seeds": [str(100000 + 100 * k) for k in range(len(values))]})

    shared = rng.normal(0, 0.02, 8)  # repetition k's base-network effect, common to every row
    per_row = {("swag", "one"): frame(0.10 + shared + rng.normal(0, 0.002, 8)),
               ("swag", "multi"): frame(0.20 + shared + rng.normal(0, 0.002, 8)),
               ("laplace", "multi"): frame(0.25 + shared[:5] + rng.normal(0, 0.002, 5)),
               ("dropout", "multi"): frame(0.30 + shared[:5] + rng.normal(0, 0.002, 5))}
    check = lambda a, b: check_claim(Claim("one", (Comparison(a, b, "ece"),)), per_row)[0]  # noqa: E731
    eight = check(("swag", "one"), ("swag", "multi"))
    assert eight.test.paired and (eight.test.n_a, eight.test.n_b) == (8, 8)
    assert eight.test.exact_p == pytest.approx(2 / 256) and eight.outcome == "holds"
    assert outcome_cells(eight)["n"] == "8" and outcome_cells(eight)["Design"] == "paired, shared bases"
    common = check(("swag", "multi"), ("laplace", "multi"))
    assert common.test.paired and (common.test.n_a, common.test.n_b) == (5, 5)
    a, b = per_row[("swag", "multi")]["ece"].to_numpy()[:5], per_row[("laplace", "multi")]["ece"].to_numpy()
    assert common.test.mean == pytest.approx(float(np.mean(a - b)))
    assert common.test.exact_p == pytest.approx(2 / 32) and common.outcome == "underpowered"
    assert outcome_cells(common)["n"] == "5"
    unpaired = check(("swag", "one"), ("dropout", "multi"))
    assert not unpaired.test.paired and (unpaired.test.n_a, unpaired.test.n_b) == (8, 5)
    assert outcome_cells(unpaired)["n"] == "8 + 5" and outcome_cells(unpaired)["Design"].startswith("unpaired")
    x, y = per_row[("swag", "one")]["ece"].to_numpy(), per_row[("dropout", "multi")]["ece"].to_numpy()
    assert unpaired.test.exact_p == pytest.approx(_exact(x, y, False), abs=2e-3)
    assert unpaired.test.exact_p == pytest.approx(2 / 1287) and unpaired.outcome == "holds"  # C(13, 5) splits
