"""The paper's Tables 1 and 2 beside ours: the transcription, the cells, the bold marks, the files."""
import numpy as np
import pandas as pd

from benchmark.report import paper
from benchmark.results import half_width
from tests.benchmark.report.test_tables import row


def test_the_paper_prints_each_median_twice_and_the_copies_agree_but_where_listed():
    # Table 1's MMD and NS MMD are Table 2's medians: a transcription error in either table shows here
    disagreeing = set()
    for experiment, rows in paper.TABLE1.items():
        assert len(rows) == len(paper.TABLE2[experiment]) == len(paper.ROWS)
        for (mode, label), first, second in zip(paper.ROWS, rows, paper.TABLE2[experiment]):
            assert len(first) == len(paper.TABLE1_COLUMNS) and len(second) == len(paper.TABLE2_COLUMNS)
            if first[0] is None:
                assert set(first) == set(second) == {None}  # a row the paper did not run is empty in both
                continue
            if abs(first[0] - second[0]) > 0.1 + 1e-9 or abs(first[1] - second[3]) > 0.1 + 1e-9:
                disagreeing.add((experiment, mode, label))
    assert disagreeing == {("cifar100_resnet18", "one", "BNN"), ("tinyimagenet_resnet18", "one", "SWAG"),
                           ("tinyimagenet_resnet18", "multi", "SWAG")}
    assert {experiment for experiment, _, _ in disagreeing} == set(paper.DISAGREEMENTS)


def test_each_paper_row_stands_beside_the_methods_that_name_it_the_paper_recipe_first():
    # the attributes of the methods (PosteriorMethod.paper_label, paper_recipe) give the paper's rows their methods
    assert [paper.beside(label) for label in ("Dropout", "BNN", "SGHMC", "SWAG", "Laplace", "DE")] == [
        ("dropout",), ("bnn",), ("sghmc_sa", "sghmc"), ("swag",), ("laplace",), ("ensemble",)]


def metrics():
    """Our MNIST rows: dropout one-mode near the paper, SWAG multi-mode failed, Laplace one-mode a
    single repetition, the vBNN's multi-mode row absent."""
    widths = {half_width(c): 0.02 for c in ("mmd_median", "ns_mmd_median", "acc", "ece", "brier", "aupr", "fpr95",
                                              "id_mi", "ood_mi", "mmd_mean", "mmd_max", "ns_mmd_mean", "ns_mmd_max")}
    rows = [
        row("mnist_optunet", "dropout", "one", mmd_median=0.16, acc=0.90, **widths),  # 15.0 inside 16 ± 2; 83.3 outside 90 ± 2
        row("mnist_optunet", "swag", "multi", status="failed", reason="no"),
        row("mnist_optunet", "laplace", "one", mmd_median=0.11),  # one repetition: no half-width
        row("mnist_optunet", "sghmc", "one", acc=0.951, **widths),
        row("mnist_optunet", "sghmc_sa", "one", acc=0.5, **widths),
        row("mnist_optunet", "ensemble", "multi", mmd_median=0.0, **widths),
    ]
    return pd.DataFrame(rows)


def cell(cells, mode, method, column, table=1):
    found = cells[(cells["table"] == table) & (cells["mode"] == mode) & (cells["method"] == method)
                  & (cells["column"] == column)]
    assert len(found) == 1
    return found.iloc[0]


def test_each_paper_cell_stands_beside_ours_with_whether_it_lies_in_our_interval():
    cells = paper.comparison(metrics(), "mnist_optunet")
    # 11 rows (the paper's SGHMC beside both of ours) x 9 columns of Table 1, x 6 of Table 2
    assert len(cells) == 11 * 9 + 11 * 6
    mmd = cell(cells, "one", "dropout", "MMD")
    assert (mmd["paper"], mmd["ours"], mmd["half_width"]) == (15.0, 16.0, 2.0) and mmd["inside"]
    assert np.isclose(mmd["difference"], 1.0)
    acc = cell(cells, "one", "dropout", "Acc")
    assert acc["paper"] == 83.3 and np.isclose(acc["ours"], 90.0) and not acc["inside"]
    assert cell(cells, "one", "dropout", "NS MMD median", table=2)["paper"] == 14.3
    assert cell(cells, "multi", "swag", "MMD")["status"] == "failed" and np.isnan(cell(cells, "multi", "swag", "MMD")["ours"])
    assert cell(cells, "multi", "bnn", "Acc")["status"] == "absent"
    single = cell(cells, "one", "laplace", "MMD")
    assert np.isclose(single["ours"], 11.0) and single["inside"] is None  # no interval to judge by
    assert cell(cells, "one", "sghmc", "Acc")["paper_method"] == cell(cells, "one", "sghmc_sa", "Acc")["paper_method"] == "SGHMC"
    assert cell(cells, "one", "sghmc", "Acc")["inside"] and not cell(cells, "one", "sghmc_sa", "Acc")["inside"]
    assert cell(cells, "multi", "ensemble", "MMD")["paper_method"] == "DE"


def test_paper_md_bolds_exactly_the_cells_outside_our_interval_and_counts_them():
    frame = metrics()
    cells = paper.comparison(frame, "mnist_optunet")
    text = paper.render(cells, "mnist_optunet")
    dropout = next(line for line in text.splitlines() if line.startswith("| One Mode | Dropout | Dropout |"))
    assert "| 15.0 / 16.0 ± 2.0 |" in dropout and "| **83.3 / 90.0 ± 2.0** |" in dropout
    assert "| 10.6 / 11.0 ± n/a |" in text and "| 1.8 / failed |" in text and "| 95.3 / absent |" not in text
    assert "| 86.5 / absent |" in text and "| Multi Mode | BNN | BNN |" in text  # a row of ours absent: the registry's label
    assert "| One Mode | SGHMC | SGHMC (scale-adapted) |" in text and "| Multi Mode | DE | Deep Ensembles |" in text
    table1 = cells[cells["table"] == 1]
    judged = table1["inside"].dropna()
    outside = int((~judged.astype(bool)).sum())
    assert outside == sum(line.count("**") // 2 for line in text.split("## Table 2")[0].splitlines() if line.startswith("|"))
    assert f"{outside} of {len(judged)} cells with both values and our interval lie outside it" in text


def test_the_files_are_written_only_for_the_experiments_of_the_paper(tmp_path):
    frame = metrics()
    assert paper.write(frame.assign(experiment="digits_optunet"), "digits_optunet", tmp_path) == []
    assert not list(tmp_path.iterdir())
    written = paper.write(frame, "mnist_optunet", tmp_path)
    assert written == [tmp_path / "paper.md", tmp_path / "paper.csv"]
    back = pd.read_csv(tmp_path / "paper.csv")
    assert len(back) == 11 * 15 and set(back["column"]) >= {"MMD", "OOD MI", "NS MMD max"}
    assert "Laurent et al." in (tmp_path / "paper.md").read_text()


def test_each_mmd_cell_carries_ours_divided_by_the_models_parameter_layers():
    cells = paper.comparison(metrics(), "mnist_optunet", layers=4)
    dropout = cells[(cells["method"] == "dropout") & (cells["mode"] == "one")].set_index(["table", "column"])
    assert dropout.loc[(1, "MMD"), "per_layer"] == 16.0 / 4
    assert dropout.loc[(2, "MMD max"), "per_layer"] == dropout.loc[(2, "MMD max"), "ours"] / 4
    assert np.isnan(dropout.loc[(1, "Acc"), "per_layer"])  # only the MMD cells
    text = paper.render(cells, "mnist_optunet", layers=4)
    assert "L = 4, the model's number of parameter layers" in text
    assert "15.0 / 16.0 ± 2.0 (÷L: 4.0)" in text and "83.3 / 90.0 ± 2.0**" in text and "(÷L: 22.5)" not in text
    assert "÷L" not in paper.render(paper.comparison(metrics(), "mnist_optunet"), "mnist_optunet")
