"""Tables 1, 2 and 3: scales, rounding, row order and grouping, failed rows, several experiments, files."""
import re

import numpy as np
import pandas as pd
import pytest

from benchmark.report import table1, table2, table3, write_tables
from benchmark.report.tables import LATEX_CAPTION_CHARS, captions, table3_caption
from benchmark.results import MEASURED, VALUE_COLUMNS, half_width

# The paper's MNIST - OptuNet Dropout and DE rows (Table 1), as metrics.csv stores them.
DROPOUT_ONE = dict(
    mmd_median=0.150, ns_mmd_median=0.143, acc=0.833, ece=0.334, brier=0.261,
    aupr=0.964, fpr95=0.986, id_mi=0.261, ood_mi=0.222, energy=0.4213, ns_energy=0.0387,
    mmd_mean=0.146, mmd_max=0.229, ns_mmd_mean=0.1434, ns_mmd_max=0.22549,
)
DROPOUT_ONE_TABLE1 = ["15.0", "14.3", "42.1", "3.9", "83.3", "33.4", "26.1", "96.4", "98.6", "26.1", "22.2"]
DROPOUT_ONE_TABLE2 = ["15.0", "14.6", "22.9", "14.3", "14.3", "22.5"]
SINGLE = " ± n/a"
"""What a value of a one-repetition row carries: no half-width (``row``'s default)."""


def values(cells):
    """The values of text cells, their one-repetition suffix ``SINGLE`` removed."""
    return [str(cell).removesuffix(SINGLE) for cell in cells]


EXPERIMENT_LABELS = {"mnist_optunet": "MNIST - OptuNet", "cifar100_resnet18": "CIFAR100 - ResNet18",
                     "digits_optunet": "Digits - OptuNet", "tinyimagenet_resnet18": "TinyImageNet - ResNet18"}
METHOD_LABELS = {"dropout": "Dropout", "bnn": "BNN", "sghmc": "SGHMC", "swag": "SWAG", "laplace": "Laplace",
                 "ensemble": "Deep Ensembles"}


def row(experiment, method, mode, status="ok", reason="", wm_anchor="seed 0", reference="zoo", **values):
    """A metrics.csv row scored against ``reference``; labels as the evaluate stage writes them (raw names when unknown)."""
    filled = {c: 0.01 for c in VALUE_COLUMNS} | {half_width(c): np.nan for c in MEASURED}
    filled |= {"n_samples": 100, "n_repetitions": 1, "nll": 0.5, "agreement": 0.9, "tv": 0.1, "ess": np.nan,
               "stationary": np.nan} | values
    return dict(experiment=experiment, experiment_label=EXPERIMENT_LABELS.get(experiment, experiment), method=method,
                method_label=METHOD_LABELS.get(method, method), mode=mode, reference=reference, status=status, reason=reason,
                ns_steps="scale+sort", wm_anchor=wm_anchor, **filled)


def paper_rows(experiment="mnist_optunet"):
    """All rows of one experiment in a scrambled order."""
    return [
        row(experiment, "ensemble", "multi", mmd_median=0.0, ns_mmd_median=-4e-5, acc=0.953),
        row(experiment, "laplace", "one", acc=0.879),
        row(experiment, "sghmc", "one", acc=0.951, brier=1.23456),
        row(experiment, "dropout", "multi", acc=0.921),
        row(experiment, "swag", "multi", acc=0.950),
        row(experiment, "dropout", "one", **DROPOUT_ONE),
        row(experiment, "bnn", "multi", status="failed", reason="ELBO diverged: loss NaN at epoch 3"),
        row(experiment, "bnn", "one", acc=0.12345, ece=0.12351, id_mi=np.nan),
        row(experiment, "swag", "one", acc=0.883),
        row(experiment, "laplace", "multi", acc=0.948),
    ]


PAPER_ORDER = [
    ("One Mode", "Dropout"), ("One Mode", "BNN"), ("One Mode", "SGHMC"), ("One Mode", "SWAG"),
    ("One Mode", "Laplace"), ("Multi Mode", "Dropout"), ("Multi Mode", "BNN"), ("Multi Mode", "SWAG"),
    ("Multi Mode", "Laplace"), ("Multi Mode", "Deep Ensembles"),
]


def test_table1_values_scaled_and_rounded_like_the_paper():
    t = table1(pd.DataFrame(paper_rows()))
    assert list(t.columns) == ["MMD", "NS MMD", "Energy", "NS Energy", "Acc", "ECE", "Brier", "AUPR", "FPR95", "ID MI", "OOD MI", "Agree", "TV",
                               "MMD rej.", "NS rej."]
    assert list(t.loc[("MNIST - OptuNet", "One Mode", "Dropout")])[:11] == [v + SINGLE for v in DROPOUT_ONE_TABLE1]
    bnn = t.loc[("MNIST - OptuNet", "One Mode", "BNN")]
    assert values([bnn["Acc"], bnn["ECE"], bnn["ID MI"], bnn["MMD"]]) == ["12.3", "12.4", "n/a", "1.0"]
    assert bnn["ID MI"] == "n/a"  # a missing value has no half-width either
    assert t.loc[("MNIST - OptuNet", "One Mode", "SGHMC"), "Brier"] == "123.5" + SINGLE  # Brier (sum) can exceed 1
    assert t.loc[("MNIST - OptuNet", "Multi Mode", "Deep Ensembles"), "MMD"] == "0.0" + SINGLE
    # an unbiased MMD estimate a hair below 0 prints as 0.0, not "-0.0"
    assert t.loc[("MNIST - OptuNet", "Multi Mode", "Deep Ensembles"), "NS MMD"] == "0.0" + SINGLE


def test_row_order_and_groups_follow_the_paper():
    t = table1(pd.DataFrame(paper_rows()))
    assert list(t.index.names) == ["Experiment", "Group", "Method"]
    assert [i[1:] for i in t.index] == PAPER_ORDER
    assert table2(pd.DataFrame(paper_rows())).index.equals(t.index)


def test_failed_rows_show_failed_everywhere():
    df = pd.DataFrame(paper_rows())
    failed = ("MNIST - OptuNet", "Multi Mode", "BNN")
    assert set(table1(df).loc[failed]) == {"failed"}
    assert set(table2(df).loc[failed]) == {"failed"}


def test_table2_has_median_mean_max_of_both_mmds_and_the_shared_bandwidth_medians():
    rows = paper_rows()
    rows[5] |= {"mmd_shared_median": 0.0912, "ns_mmd_shared_median": 0.0801, "mmd_shared_median_hw": 0.0049}
    t = table2(pd.DataFrame(rows))
    assert list(t.columns) == [(m, s) for m in ("MMD", "NS MMD") for s in ("median", "mean", "max")] + [
        ("Shared bandwidths", "MMD median"), ("Shared bandwidths", "NS MMD median")]
    dropout = list(t.loc[("MNIST - OptuNet", "One Mode", "Dropout")])
    assert values(dropout) == DROPOUT_ONE_TABLE2 + ["9.1 ± 0.5", "8.0"]


def test_several_experiments_stack_as_blocks_in_order_of_appearance():
    rows = paper_rows("cifar100_resnet18") + [row("my_new_exp", "swag", "one")] + paper_rows("mnist_optunet")
    rows.append(row("digits_optunet", "zeta_method", "one"))
    rows.append(row("digits_optunet", "dropout", "one", acc=0.5))
    t = table1(pd.DataFrame(rows))
    experiments = list(dict.fromkeys(t.index.get_level_values(0)))
    assert experiments == ["CIFAR100 - ResNet18", "my_new_exp", "MNIST - OptuNet", "Digits - OptuNet"]
    assert [i[1:] for i in t.index if i[0] == "CIFAR100 - ResNet18"] == PAPER_ORDER
    assert [i[1:] for i in t.index if i[0] == "Digits - OptuNet"] == [("One Mode", "Dropout"), ("One Mode", "zeta_method")]
    assert t.loc[("Digits - OptuNet", "One Mode", "Dropout"), "Acc"] == "50.0" + SINGLE


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda df: df.drop(columns=["acc", "ns_mmd_median"]), r"missing columns \['ns_mmd_median', 'acc'\]"),
        (lambda df: df.assign(mode=["single"] + list(df["mode"][1:])), r"'mode'.*\['one', 'multi', 'baseline'\].*single"),
        (lambda df: df.assign(status="done"), r"'status'.*done"),
        (lambda df: pd.concat([df, df.iloc[:1]]), r"duplicate.*ensemble"),
        (lambda df: df.assign(acc="high"), r"'acc' expects numbers"),
    ],
)
def test_bad_frames_raise(change, match):
    df = change(pd.DataFrame(paper_rows()))
    with pytest.raises(ValueError, match=match):
        table1(df)


def test_write_tables_round_trips_through_files(tmp_path):
    df = pd.DataFrame(paper_rows("mnist_optunet") + paper_rows("tinyimagenet_resnet18"))
    out = tmp_path / "results" / "mnist"
    paths = write_tables(df, out)
    assert sorted(p.name for p in paths) == sorted(f"table{i}.{s}" for i in (1, 2, 3) for s in ("md", "csv", "tex"))
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in paths)  # no temp files left

    expected = table1(df)
    csv = pd.read_csv(out / "table1.csv", dtype=str, keep_default_na=False)
    assert list(csv.columns) == ["Experiment", "Group", "Method", *table1(df, separate=True).columns, "Note"]
    assert csv[list(expected.columns)].values.tolist() == [values(r) for r in expected.values.tolist()]
    ok = csv["Note"] == ""
    assert set(csv.loc[ok, "MMD ±"]) == {"n/a"} and set(csv.loc[~ok, "MMD ±"]) == {""}  # one repetition: no half-width
    assert csv["Note"].tolist().count("failed: ELBO diverged: loss NaN at epoch 3") == 2
    csv2 = pd.read_csv(out / "table2.csv", dtype=str, keep_default_na=False)
    assert "MMD median" in csv2.columns and csv2["NS MMD max"].tolist() == values(table2(df)[("NS MMD", "max")])

    md = (out / "table1.md").read_text()
    caption, rows = md.splitlines()[0], _markdown_rows(md)
    assert "x100" in caption and "in %" in caption and "nats" in caption
    assert [r[3:] for r in rows] == expected.values.tolist()
    labels = pd.DataFrame([r[:3] for r in rows]).replace("", np.nan).ffill().values.tolist()
    assert [tuple(x) for x in labels] == list(expected.index)
    assert md.count("- MNIST - OptuNet / Multi Mode / BNN: ELBO diverged") == 1
    assert "TinyImageNet - ResNet18 / Multi Mode / BNN" in md

    tex = (out / "table1.tex").read_text()
    caption = re.search(r"\\caption\{(.*?)\}\n", tex).group(1)
    assert caption.startswith("Table 1: ") and r"$\times 100$" in caption and len(caption) <= LATEX_CAPTION_CHARS
    assert r"{\footnotesize Mean over the repetitions $\pm$" in tex and "the caption of table1.md" in tex
    for name in ("table2", "table3"):  # every .tex caption fits a paper
        other = (out / f"{name}.tex").read_text()
        assert len(re.search(r"\\caption\{(.*?)\}\n", other).group(1)) <= LATEX_CAPTION_CHARS
    body = tex.split("\n", 1)[1].replace("{%\n", "{\n")  # but the first line and the resizebox's line end: comments
    assert not re.search(r"(?<!\\)%", body)  # an unescaped % would comment out the rest of a line
    assert r"\multirow" in tex and r"\label{tab:table1}" in tex
    assert " & ".join(v + r" $\pm$ n/a" for v in [*DROPOUT_ONE_TABLE1, "90.0", "10.0"]) + " & 1.0 & 1.0" in tex
    assert tex.count("failed") >= 2 * 9 and "Failed runs:" in tex
    assert r"\multicolumn{3}{c}{NS MMD}" in (out / "table2.tex").read_text()


def test_write_tables_writes_nothing_for_a_bad_frame(tmp_path):
    with pytest.raises(ValueError, match="missing columns"):
        write_tables(pd.DataFrame(paper_rows()).drop(columns=["mmd_max"]), tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_latex_escapes_raw_experiment_names_and_reasons(tmp_path):
    df = pd.DataFrame([row("my_exp", "dropout", "one", status="failed", reason="50% of runs_x & more")])
    write_tables(df, tmp_path)
    tex = (tmp_path / "table1.tex").read_text()
    assert r"my\_exp" in tex and r"50\% of runs\_x \& more" in tex


def test_half_widths_are_printed_with_their_values_and_in_their_own_csv_columns(tmp_path):
    rows = paper_rows()
    rows[5] |= {"mmd_median_hw": 0.021, "acc_hw": 0.0049, "n_repetitions": 3}  # dropout one-mode
    df = pd.DataFrame(rows)
    label = ("MNIST - OptuNet", "One Mode", "Dropout")
    t = table1(df)
    assert (t.loc[label, "MMD"], t.loc[label, "Acc"], t.loc[label, "ECE"]) == ("15.0 ± 2.1", "83.3 ± 0.5", "33.4 ± n/a")
    numbers = table1(df, separate=True)
    assert (numbers.loc[label, "MMD"], numbers.loc[label, "MMD ±"], numbers.loc[label, "ECE ±"]) == ("15.0", "2.1", "n/a")
    assert table2(df, separate=True).loc[label, ("MMD", "median ±")] == "2.1"
    write_tables(df, tmp_path)
    assert r"15.0 $\pm$ 2.1" in (tmp_path / "table1.tex").read_text()
    caption = (tmp_path / "table1.md").read_text().splitlines()[0]
    assert "means over 1/3 independent repetitions" in caption and "95% t-interval" in caption
    assert "scaling (each hidden unit's incoming weights normalised" in caption and "then permutation" in caption
    assert "softmax" not in caption
    assert '"± n/a": a single repetition' in caption and "exact tests over the repetitions" in caption
    three = pd.DataFrame([r | {"n_repetitions": 3} for r in rows])
    for text in captions(three):
        assert "means over 3 independent repetitions" in text and "± n/a" not in text
    table2_caption = (tmp_path / "table2.md").read_text().splitlines()[0]
    assert "Shared bandwidths: MMD and NS MMD (median over the 20 kernels) with one bandwidth grid per layer" in table2_caption


def _markdown_rows(md):
    lines = [line for line in md.splitlines() if line.startswith("|")][2:]  # skip header and rule
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]



def test_table3_has_agreement_tv_and_the_three_mmds_with_their_ranks():
    rows = paper_rows()
    for r, (ns, wm) in zip(rows, [(0.0, 0.0), (0.3, 0.1), (0.2, 0.4), (0.1, 0.2), (0.5, 0.3), (0.143, 0.05), (0.9, 0.9),
                                  (0.4, np.nan), (0.6, 0.6), (0.7, 0.7)]):
        r.update(ns_mmd_median=ns, wm_mmd_median=wm, agreement=0.875, tv=0.1234)
    t = table3(pd.DataFrame(rows))
    assert list(t.columns) == ["Agreement", "TV", "MMD", "NS MMD", "WM MMD", "NS rank", "WM rank"]
    assert [tuple(i[1:]) for i in t.index] == PAPER_ORDER
    dropout = t.loc[("MNIST - OptuNet", "One Mode", "Dropout")]
    assert values(dropout[["Agreement", "TV", "MMD", "NS MMD", "WM MMD"]]) == ["87.5", "12.3", "15.0", "14.3", "5.0"]
    # ranks among the rows that did not fail (BNN multi failed); a missing WM MMD has no rank
    ns = dict(zip((i[1:] for i in t.index), t["NS rank"]))
    wm = dict(zip((i[1:] for i in t.index), t["WM rank"]))
    assert ns[("Multi Mode", "Deep Ensembles")] == "1" and t.loc[("MNIST - OptuNet", "Multi Mode", "BNN"), "TV"] == "failed"
    assert t.loc[("MNIST - OptuNet", "Multi Mode", "BNN"), "NS rank"] == "n/a"
    assert t.loc[("MNIST - OptuNet", "One Mode", "BNN"), "WM rank"] == "n/a"
    assert sorted(int(v) for v in ns.values() if v != "n/a") == list(range(1, 10))
    assert wm[("One Mode", "Dropout")] == "2" and wm[("Multi Mode", "Deep Ensembles")] == "1"


def test_table3_caption_names_the_anchor_or_says_it_was_off():
    df = pd.DataFrame(paper_rows("mnist_optunet") + [row("cifar100_resnet18", "ensemble", "multi", wm_anchor="")])
    caption = table3_caption(df)
    assert "MNIST - OptuNet: the reference checkpoint of seed 0" in caption
    assert "CIFAR100 - ResNet18: not computed (evaluate.weight_matching=false)" in caption
    assert "lowest seed" in caption and "Agreement" in caption


def test_captions_say_how_to_read_the_symmetry_breaking_rows_when_they_are_there(tmp_path):
    plain = pd.DataFrame(paper_rows("digits_optunet"))
    with_skip = pd.DataFrame(paper_rows("digits_optunet") + [row("digits_optunet", "bnn_skip", "one")])
    both = pd.DataFrame(paper_rows("digits_optunet") + [row("digits_optunet", "bnn_skip", "one"),
                                                         row("digits_optunet", "bnn_ordered", "one")])
    for caption in (*captions(plain), table3_caption(plain)):
        assert "skip connections" not in caption and "bias-sorted" not in caption
    for caption in (*captions(with_skip), table3_caption(with_skip)):
        assert "BNN (orthogonal skips): the vBNN of another model" in caption and "shared state-dict keys" in caption
        assert "bias-sorted" not in caption
    for caption in (*captions(both), table3_caption(both)):
        assert "BNN (ordered biases): " in caption and "worse by construction" in caption
        assert "NS MMD, which sorts both the same way, is the fair comparison" in caption and "fc1's 3 units" in caption
    written = write_tables(both, tmp_path)
    for name in ("table1", "table2", "table3"):
        assert "worse by construction" in (tmp_path / f"{name}.md").read_text()
        assert "fc1's 3 units" not in (tmp_path / f"{name}.tex").read_text()  # a paper's caption: the notes are in the .md
        assert f"the caption of {name}.md" in (tmp_path / f"{name}.tex").read_text()
    assert len(written) == 9


def test_table1_caption_gives_the_effective_sample_size_of_the_markov_chain_rows():
    plain = pd.DataFrame(paper_rows("digits_optunet"))
    assert "Markov chains" not in captions(plain)[0]
    rows = paper_rows("digits_optunet") + [row("digits_optunet", "sghmc_sa", "one", ess=2.3)]
    rows[2]["ess"] = 97.6  # the SGHMC row
    caption = captions(pd.DataFrame(rows))[0]
    assert "the samples of SGHMC, sghmc_sa are states of Markov chains" in caption
    assert "SGHMC 98 of 100; sghmc_sa 2 of 100, mean over repetitions" in caption


def test_a_chain_row_that_failed_its_convergence_check_is_marked_and_explained(tmp_path):
    rows = paper_rows("digits_optunet")
    rows[2] |= {"ess": 11.0, "stationary": 0.25, "n_repetitions": 8}  # SGHMC: 2 of 8 repetitions stationary
    rows[0] |= {"stationary": 1.0}  # a row whose chains all passed: not marked
    table = table1(pd.DataFrame(rows))
    assert ("Digits - OptuNet", "One Mode", "SGHMC †") in table.index
    assert ("Digits - OptuNet", "Multi Mode", "Deep Ensembles") in table.index
    assert sum("†" in label for label in table.index.get_level_values("Method")) == 1
    write_tables(pd.DataFrame(rows), tmp_path)
    md = (tmp_path / "table1.md").read_text()
    assert "† Not converged:" in md and "SGHMC †: its chains failed their convergence check in 6 of 8 repetitions" in md
    csv = pd.read_csv(tmp_path / "table1.csv")
    note = csv.loc[csv["Method"] == "SGHMC †", "Note"].item()
    assert note.startswith("not converged: its chains failed") and csv["Note"].notna().sum() == 2  # + the failed BNN
    assert "Not converged: " in (tmp_path / "table1.tex").read_text()


def test_rows_without_a_convergence_check_are_not_marked():
    rows = paper_rows("digits_optunet")
    rows[2] |= {"ess": 11.0, "stationary": np.nan}
    assert not any("†" in label for label in table1(pd.DataFrame(rows)).index.get_level_values("Method"))
