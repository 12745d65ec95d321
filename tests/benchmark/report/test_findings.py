"""findings.md: the paper's and the seeds' claims as paired comparisons of repetitions with Holm's
control, their verdicts, and the note on how to read the vBNN rows."""
import re

import numpy as np
import pandas as pd
import pytest
from scipy import stats
from statsmodels.stats.multitest import multipletests

from benchmark.report.findings import Claim, Comparison, check_claim, paper_claims, pairing, render, seed_claims
from benchmark.results import REPETITION_COLUMNS, half_width, repetition_rows
from methods import method_class
from metrics.uncertainty import interval
from tests.benchmark.report.test_tables import row

BASE = np.array([-0.03, 0.01, 0.02])
"""Each repetition's base-network effect, shared by every row of that repetition (as rows drawn
around the same held-out bases are)."""


def _frames(values, spread=None, bases=None):
    """``(metrics frame, repetitions frame)`` of digits rows from ``values``: ``(method, mode)`` ->
    ``{column: mean}``. Repetition k of a column is mean + ``BASE[k]`` + the row's own small noise
    (sd 0.002), or + ``spread[(method, mode)][column]`` (3 offsets) where given; metrics.csv's
    mean and half-width are computed from them, as the evaluate stage does. ``bases``: repetition
    k's base seeds, ``{(method, mode): [seeds of repetition 0, 1, 2]}`` (default: ``[100000 + k]``)."""
    rng = np.random.default_rng(0)
    metrics, reps = [], []
    for (method, mode), columns in values.items():
        per_rep = {c: v + BASE + (spread or {}).get((method, mode), {}).get(c, rng.normal(0, 0.002, 3))
                   for c, v in columns.items()}
        r = row("digits_optunet", method, mode, n_repetitions=3) | {"method_label": method_class(method).label}
        for column, v in per_rep.items():
            r[column], r[half_width(column)] = interval(v)
        metrics.append(r)
        seeds = (bases or {}).get((method, mode), [[100000 + k] for k in range(3)])
        numbers = [{"n_samples": 100, **{c: v[k] for c, v in per_rep.items()}} for k in range(3)]
        reps += repetition_rows(r, numbers, range(3), seeds)
    return pd.DataFrame(metrics), pd.DataFrame(reps, columns=REPETITION_COLUMNS)


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


SWAG_MULTI_ACC = {("swag", "multi"): {"acc": np.array([0.05, -0.22, 0.09])}}
"""SWAG multi's accuracy too spread over repetitions to compare with its one-mode form."""


def test_claims_and_verdicts():
    metrics, reps = _frames(_paper_values(), SWAG_MULTI_ACC)
    text = render(metrics, reps)
    claims = {c.text: c for c in paper_claims({("dropout", "one"), ("dropout", "multi"), ("ensemble", "multi")})}
    assert len(claims["For every method, the multi-mode MMD is below the one-mode MMD."].comparisons) == 1
    assert "| Deep Ensembles have the lowest MMD of all rows. | holds | 6 | 0 | 0 |" in text
    assert "| For every method, the multi-mode MMD is below the one-mode MMD. | holds | 3 | 0 | 0 |" in text
    assert "| Multi-mode methods are more accurate than their one-mode form. | not distinguishable | 2 | 0 | 1 |" in text
    assert "| One-mode methods have a lower ECE than their multi-mode form. | holds | 3 | 0 | 0 |" in text
    assert "| After Deep Ensembles, Laplace has the lowest MMD and NS MMD (within each mode). | holds | 8 | 0 | 0 |" in text
    line = next(x for x in text.splitlines() if x.startswith("| Dropout (one) < Dropout (multi) | ece"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    test = stats.ttest_rel(reps.query("method == 'dropout' and mode == 'one'")["ece"],
                           reps.query("method == 'dropout' and mode == 'multi'")["ece"])
    _, holm_p, _, _ = multipletests([test.pvalue] + [_p_value(reps, m, "ece") for m in ("swag", "laplace")], method="holm")
    assert cells[2:4] == [f"{100 * metrics.loc[0, 'ece']:.1f} ± {100 * metrics.loc[0, 'ece_hw']:.1f}",
                          f"{100 * metrics.loc[1, 'ece']:.1f} ± {100 * metrics.loc[1, 'ece_hw']:.1f}"]
    assert cells[5] == "3, shared bases" and cells[8] == "holds"
    for cell, p in zip(cells[6:8], (test.pvalue, holm_p[0])):
        assert cell == (f"{p:.4f}" if p >= 1e-4 else "<0.0001"), (cell, p)
    assert "paired t-test" in text and "Holm" in text and "alpha = 0.05" in text and "3 repetitions" in text
    laplace = {("laplace", mode): {"mmd_median": 0.9} for mode in ("one", "multi")}
    assert ("| After Deep Ensembles, Laplace has the lowest MMD and NS MMD (within each mode). | fails | 4 | 4 | 0 |"
            in render(*_frames(_paper_values(laplace), SWAG_MULTI_ACC)))


def _p_value(reps, method, column):
    """The paired p-value of method's one-mode < multi-mode comparison of ``column``."""
    a, b = (reps.query(f"method == '{method}' and mode == '{mode}'")[column] for mode in ("one", "multi"))
    return stats.ttest_rel(a, b).pvalue


def test_holm_keeps_a_claim_from_holding_on_comparisons_that_each_look_significant():
    """Three comparisons each at p = 0.029 hold one by one, not as a family of three (Holm's first
    threshold is 0.05 / 3): the NLL claim is not distinguishable, where the same numbers in a
    claim of one comparison hold."""
    methods = ("dropout", "laplace", "swag")
    values = _paper_values({(m, mode): {"nll": 0.50 if mode == "one" else 0.49} for m in methods for mode in ("one", "multi")})
    spread = {(m, mode): {"nll": np.array([0.003, -0.003, 0.0]) if mode == "multi" else np.zeros(3)}
              for m in methods for mode in ("one", "multi")}
    metrics, reps = _frames(values, spread)
    p = [_p_value(reps, m, "nll") for m in methods]
    assert p == pytest.approx([0.0287] * 3, abs=5e-4)
    text = render(metrics, reps)
    assert "| Multi-mode methods have a lower NLL than their one-mode form. | not distinguishable | 0 | 0 | 3 |" in text
    adjusted = multipletests(p, method="holm")[1]
    assert adjusted == pytest.approx([0.0862] * 3, abs=1e-3)
    for method, q in zip(("Dropout", "Laplace", "SWAG"), adjusted):
        assert re.search(rf"\| {method} \(multi\) < {method} \(one\) +\| nll .*\| {p[0]:.4f} +\| {q:.4f} +\| "
                         r"not distinguishable", text), method
    per_row = {key: group.set_index("repetition") for key, group in reps.groupby(["method", "mode"])}
    alone = Claim("one comparison", (Comparison(("dropout", "multi"), ("dropout", "one"), "nll"),))
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
    members = {("ensemble", "multi"): [list(range(100000 + 100 * k, 100100 + 100 * k)) for k in range(3)]}
    text = render(*_frames(_paper_values(), bases=members))
    assert re.search(r"\| Deep Ensembles \(multi\) < Dropout \(one\) .*\| 3, bases reused across pairs +\|", text)
    assert re.search(r"\| Dropout \(multi\) < Dropout \(one\) .*\| 3, shared bases +\|", text)


def test_a_row_with_one_repetition_is_never_distinguishable_and_shows_n_a():
    metrics, reps = _frames(_paper_values())
    keep = ~((reps["method"] == "laplace") & (reps["mode"] == "one") & (reps["repetition"] > 0))
    metrics.loc[(metrics["method"] == "laplace") & (metrics["mode"] == "one"), "n_repetitions"] = 1
    text = render(metrics, reps[keep])
    assert re.search(r"\| Laplace \(one\) < Dropout \(one\) +\| mmd_median +\|[^|]+\|[^|]+\| [-0-9.]+ ± n/a +\| "
                     r"1, shared bases +\| n/a +\| n/a +\| not distinguishable", text)
    assert "1/3 repetitions" in text


def test_missing_repetitions_are_named():
    metrics, reps = _frames(_paper_values())
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


def _vbnn_rows(spread=None, **variants):
    """The plain vBNN (one mode) and the variants given as ``name={column: mean}``, as
    ``_frames``; ``spread``: ``{name: {column: 3 offsets}}`` for a row whose repetitions scatter."""
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
        (Comparison(skip, bnn, "acc", lower=False),),
        (Comparison(skip, bnn, "nll"),),
        (Comparison(skip, bnn, "ns_mmd_median"), Comparison(ordered, bnn, "ns_mmd_median")),
        (Comparison(skip, bnn, "mmd_median"), Comparison(ordered, bnn, "mmd_median")),
    ]
    metrics, reps = _vbnn_rows(
        spread={"bnn_skip": {"mmd_median": np.array([0.04, -0.05, 0.01])}},  # scattered: not distinguishable
        bnn_skip=dict(acc=0.85, nll=0.70, ns_mmd_median=0.15, mmd_median=0.29),
        bnn_ordered=dict(ns_mmd_median=0.10, mmd_median=0.45),  # bias-sorted: raw MMD worse by construction
    )
    text = render(metrics, reps)
    assert "| Seed 001: fixed orthogonal skips reduce the vBNN's underfitting: higher accuracy ... | holds | 1 | 0 | 0 |" in text
    assert "| ... and lower NLL than the plain vBNN. | fails | 0 | 1 | 0 |" in text
    assert ("| Seeds 000, 001: breaking the symmetry during training brings the vBNN's posterior closer to the "
            "reference: lower NS MMD than the plain vBNN. | holds | 2 | 0 | 0 |") in text
    assert "| ... and lower MMD. | fails | 0 | 1 | 1 |" in text
    assert re.search(r"\| BNN \(orthogonal skips\) \(one\) < BNN \(one\) +\| mmd_median +\| 29.0 ± [0-9.]+ +\| "
                     r"30.[01] ± [0-9.]+ +\| -1.[01] ± [0-9.]+ +\| 3, shared bases .*\| not distinguishable", text)
    assert re.search(r"\| BNN \(ordered biases\) \(one\) +< BNN \(one\) +\| mmd_median +\| 4[45].[0-9] ± [0-9.]+ +\| "
                     r"30.[01] ± [0-9.]+ +\| 1[45].[0-9] ± [0-9.]+ +\| 3, shared bases .*\| fails", text)
    note = text[text.index("## Reading the vBNN rows"):]
    assert "BNN (orthogonal skips): the vBNN of another model" in note and "worse by construction" in note
    assert "fc1's 3 units" in note
