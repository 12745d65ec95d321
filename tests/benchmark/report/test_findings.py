"""findings.md: the paper's and the seeds' claims as comparisons with error bars, their verdicts, and
the note on how to read the symmetry-breaking vBNN rows."""
import re

import pandas as pd

from benchmark.report.findings import Comparison, paper_claims, render, seed_claims
from methods import method_class
from metrics.uncertainty import compare, interval
from tests.benchmark.report.test_tables import row


def test_compare_uses_the_interval_of_the_difference():
    assert compare(1.0, 0.1, 2.0, 0.1) == "lower"
    assert compare(2.0, 0.1, 1.0, 0.1) == "higher"
    assert compare(1.0, 0.8, 2.0, 0.8) == "not distinguishable"  # sqrt(0.64 + 0.64) = 1.13 > 1
    assert compare(1.0, float("nan"), 2.0, 0.1) == "not distinguishable"


def test_interval_is_a_t_interval_widened_by_an_independent_standard_error():
    mean, hw = interval([1.0, 2.0, 3.0])
    assert mean == 2.0 and abs(hw - 4.302653 * 1.0 / 3**0.5) < 1e-6
    _, wider = interval([1.0, 2.0, 3.0], extra_sd=1.0)
    assert abs(wider - (hw**2 + 1.959964**2) ** 0.5) < 1e-6
    assert interval([5.0])[1] != interval([5.0])[1]  # NaN: one repetition, no extra error
    assert abs(interval([5.0], extra_sd=0.5)[1] - 0.979982) < 1e-5


def _rows():
    values = {  # (method, mode): (mmd, acc, ece); small half-widths except where a verdict must be unclear
        ("dropout", "one"): (0.60, 0.50, 0.10), ("dropout", "multi"): (0.10, 0.90, 0.30),
        ("laplace", "one"): (0.20, 0.60, 0.20), ("laplace", "multi"): (0.05, 0.92, 0.25),
        ("swag", "one"): (0.80, 0.85, 0.05), ("swag", "multi"): (0.12, 0.96, 0.21),
        ("ensemble", "multi"): (0.00, 0.96, 0.35),
    }
    out = []
    for (method, mode), (mmd, acc, ece) in values.items():
        r = row("digits_optunet", method, mode, mmd_median=mmd, ns_mmd_median=mmd, acc=acc, ece=ece,
                nll=1.0 - acc, aupr=acc, fpr95=1 - acc)
        r |= {f"{c}_hw": 0.01 for c in ("mmd_median", "ns_mmd_median", "acc", "ece", "nll", "aupr", "fpr95")}
        out.append(r)
    out[-2]["acc_hw"] = 0.5  # SWAG multi: accuracy too uncertain to compare
    return pd.DataFrame(out)


def test_claims_and_verdicts():
    text = render(_rows())
    claims = {c.text: c for c in paper_claims({("dropout", "one"), ("dropout", "multi"), ("ensemble", "multi")})}
    assert len(claims["For every method, the multi-mode MMD is below the one-mode MMD."].comparisons) == 1
    assert "| Deep Ensembles have the lowest MMD of all rows. | holds | 6/6 |" in text
    assert "| For every method, the multi-mode MMD is below the one-mode MMD. | holds | 3/3 |" in text
    assert "| Multi-mode methods are more accurate than their one-mode form. | not distinguishable | 2/3 |" in text
    assert "| One-mode methods have a lower ECE than their multi-mode form. | holds | 3/3 |" in text
    assert "| After Deep Ensembles, Laplace has the lowest MMD and NS MMD (within each mode). | holds | 8/8 |" in text
    assert "| Dropout (one) < Dropout (multi) | ece      | 10.0 ± 1.0 | 30.0 ± 1.0 | holds" in text
    frame = _rows()
    frame.loc[frame["method"] == "laplace", "mmd_median"] = 0.9
    assert "| After Deep Ensembles, Laplace has the lowest MMD and NS MMD (within each mode). | fails |" in render(frame)


def test_claims_need_their_rows():
    frame = _rows()
    without_de = frame[frame["method"] != "ensemble"]
    text = render(without_de)
    assert "Deep Ensembles have the lowest" not in text and "Laplace has the lowest" in text
    assert "No claim can be checked" in render(frame[frame["mode"] == "one"].iloc[:1])


def test_failed_rows_are_named_and_left_out():
    frame = _rows()
    frame.loc[frame["method"] == "swag", "status"] = "failed"
    text = render(frame)
    assert "Rows that failed are left out: SWAG (one), SWAG (multi)." in text and "SWAG (multi) <" not in text


def _vbnn_rows(**variants):
    """The plain vBNN (one mode) and the variants given as ``name={column: value}``; every
    half-width 0.01 unless a variant sets ``<column>_hw``."""
    base = dict(acc=0.80, nll=0.60, mmd_median=0.30, ns_mmd_median=0.20)
    out = []
    for method, values in {"bnn": {}, **variants}.items():
        r = row("digits_optunet", method, "one", **(base | {k: v for k, v in values.items() if not k.endswith("_hw")}))
        r |= {f"{c}_hw": 0.01 for c in base} | {k: v for k, v in values.items() if k.endswith("_hw")}
        out.append(r | {"method_label": method_class(method).label})
    return pd.DataFrame(out)


def test_seed_claims_need_the_plain_vbnn_and_a_variant():
    assert all(not claim.comparisons for claim in seed_claims({("bnn", "one")}))
    assert all(not claim.comparisons for claim in seed_claims({("bnn_skip", "one"), ("bnn_ordered", "one")}))
    assert all(not claim.comparisons for claim in seed_claims({("bnn", "multi"), ("bnn_skip", "one")}))
    claims = {claim.text: claim.comparisons for claim in seed_claims({("bnn", "one"), ("bnn_ordered", "one")})}
    assert [len(c) for c in claims.values()] == [0, 0, 1, 1], "the accuracy and NLL claims are seed 001's (skips)"
    text = render(_vbnn_rows())
    assert "Seed 001" not in text and "Seeds 000, 001" not in text and "symmetry-breaking vBNN rows" not in text


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
    frame = _vbnn_rows(
        bnn_skip=dict(acc=0.85, nll=0.70, ns_mmd_median=0.15, mmd_median=0.29, mmd_median_hw=0.05),
        bnn_ordered=dict(ns_mmd_median=0.10, mmd_median=0.45),  # bias-sorted: raw MMD worse by construction
    )
    text = render(frame)
    assert "| Seed 001: fixed orthogonal skips reduce the vBNN's underfitting: higher accuracy ... | holds | 1/1 |" in text
    assert "| ... and lower NLL than the plain vBNN. | fails | 0/1 |" in text
    assert ("| Seeds 000, 001: breaking the symmetry during training brings the vBNN's posterior closer to the "
            "reference: lower NS MMD than the plain vBNN. | holds | 2/2 |") in text
    assert "| ... and lower MMD. | fails | 0/2 |" in text
    assert re.search(r"\| BNN \(orthogonal skips\) \(one\) < BNN \(one\) +\| mmd_median +\| 29.0 ± 5.0 \| 30.0 ± 1.0 "
                     r"\| not distinguishable", text)
    assert re.search(r"\| BNN \(ordered biases\) \(one\) +< BNN \(one\) +\| mmd_median +\| 45.0 ± 1.0 \| 30.0 ± 1.0 "
                     r"\| fails", text)
    note = text[text.index("## Reading the symmetry-breaking vBNN rows"):]
    assert "BNN (orthogonal skips): the vBNN of another model" in note and "worse by construction" in note
    assert "fc1's 3 units" in note
