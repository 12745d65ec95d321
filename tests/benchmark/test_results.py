"""results/<experiment>/metrics.csv and repetitions.csv: the schemas, their round trip through files,
and the errors that name the file and the column."""
import math
import re

import numpy as np
import pandas as pd
import pytest

from benchmark.results import (
    COLUMNS,
    MMD_COLUMNS,
    REPETITION_COLUMNS,
    parse_base_seeds,
    read_metrics,
    read_repetitions,
    reference_sd,
    repetition_rows,
    write_metrics,
    write_repetitions,
)

KEY = {"experiment": "digits_optunet", "method": "laplace", "mode": "one", "reference": "zoo", "status": "ok"}


def _numbers(r):
    """One repetition's numbers as the evaluate stage computes them (the first with the reference's
    standard errors and the test), plus a key repetitions.csv does not hold."""
    numbers = {"n_samples": 100, "acc": 0.7 - 0.1 * r, "mmd_median": 0.2 + r / 100, "mmd_shared_median": 0.3,
               "per_layer_debug": "ignored"}
    if r == 0:
        numbers |= {"mmd_median_ref_sd": 0.004, "mmd_shared_median_ref_sd": 0.005, "mmd_reject": 1.0}
    return numbers


def test_repetition_rows_round_trip_through_repetitions_csv(tmp_path):
    rows = repetition_rows(KEY, [_numbers(0), _numbers(1), {"failed": "NaN in predictions"}], [0, 1, 2],
                           [(100000,), (100001,), None])
    path = tmp_path / "repetitions.csv"
    written = write_repetitions(rows, path)
    frame = read_repetitions(path)
    assert list(frame.columns) == REPETITION_COLUMNS
    pd.testing.assert_frame_equal(frame, written)
    assert frame["repetition"].tolist() == [0, 1, 2] and frame["repetition"].dtype == np.int64
    assert frame["status"].tolist() == ["ok", "ok", "failed"] and frame.loc[2, "reason"] == "NaN in predictions"
    assert frame["base_seeds"].tolist() == ["100000", "100001", ""]
    assert [parse_base_seeds(s) for s in frame["base_seeds"]] == [{100000}, {100001}, frozenset()]
    assert frame["acc"].tolist()[:2] == pytest.approx([0.7, 0.6]) and math.isnan(frame.loc[2, "acc"])
    assert frame.loc[0, reference_sd("mmd_shared_median")] == 0.005 and math.isnan(frame.loc[1, "mmd_median_ref_sd"])
    assert frame.loc[0, "mmd_reject"] == 1.0 and math.isnan(frame.loc[0, "ns_mmd_median"])
    assert all(reference_sd(c) in REPETITION_COLUMNS for c in MMD_COLUMNS)
    members = repetition_rows(KEY | {"method": "ensemble", "mode": "multi"}, [_numbers(0)], [0], [range(5, 9)])
    assert members[0]["base_seeds"] == "5 6 7 8"


@pytest.mark.parametrize(("change", "match"), [
    (lambda f: f.drop(columns=["mmd_median_ref_sd"]), r"missing columns \['mmd_median_ref_sd'\]"),
    (lambda f: f.assign(repetition=[0, -1]), r"'repetition' expects integers >= 0, got \['-1'\]"),
    (lambda f: f.assign(repetition=[0, 0]), r"duplicate \(experiment, method, mode, reference, repetition\) rows"),
    (lambda f: f.assign(base_seeds=["1 2", "1,2"]), r"'base_seeds' expects space-separated integers, got \['1,2'\]"),
    (lambda f: f.assign(mode="single"), r"'mode' expects values in \['one', 'multi', 'baseline'\]"),
    (lambda f: f.assign(acc="high"), r"'acc' expects numbers"),
])
def test_bad_repetitions_are_refused_naming_the_file_and_column(tmp_path, change, match):
    good = pd.DataFrame(repetition_rows(KEY, [_numbers(0), _numbers(1)], [0, 1], [(1,), (2,)]), columns=REPETITION_COLUMNS)
    path = tmp_path / "repetitions.csv"
    change(good).to_csv(path, index=False)
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}: .*{match}"):
        read_repetitions(path)


def test_unknown_columns_are_refused_and_nothing_is_written(tmp_path):
    with pytest.raises(ValueError, match=r"repetitions rows have columns \['per_layer_debug'\].*REPETITION_COLUMNS"):
        write_repetitions([{**KEY, "repetition": 0, "per_layer_debug": 1}], tmp_path / "repetitions.csv")
    with pytest.raises(ValueError, match=r"metrics rows have columns \['repetition'\].*benchmark.results.COLUMNS"):
        write_metrics([{**KEY, "repetition": 0}], tmp_path / "metrics.csv")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match=r"repetition_rows: 1 numbers, 2 repetitions"):
        repetition_rows(KEY, [_numbers(0)], [0, 1], [None, None])


def test_metrics_csv_holds_the_shared_bandwidth_columns_with_their_half_widths(tmp_path):
    frame = write_metrics([{**KEY, "mmd_shared_median": 0.3, "mmd_shared_median_hw": 0.01}], tmp_path / "metrics.csv")
    assert {"mmd_shared_median", "ns_mmd_shared_median", "mmd_shared_median_hw", "ns_mmd_shared_median_hw"} <= set(COLUMNS)
    back = read_metrics(tmp_path / "metrics.csv")
    assert back.loc[0, "mmd_shared_median"] == 0.3 and math.isnan(back.loc[0, "ns_mmd_shared_median"])
    pd.testing.assert_frame_equal(back, frame)


def test_metrics_csv_requires_the_reference_column_and_keys_rows_by_it(tmp_path):
    """A row is keyed by (experiment, method, mode, reference): one method against two references
    is two rows; a file without the column (an older run's) or with an empty one is refused, naming it."""
    path = tmp_path / "metrics.csv"
    frame = write_metrics([KEY, {**KEY, "reference": "hmc"}], path)
    assert frame["reference"].tolist() == ["zoo", "hmc"]
    frame.drop(columns=["reference"]).to_csv(path, index=False)
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}: missing columns \['reference'\]"):
        read_metrics(path)
    frame.assign(reference=["zoo", ""]).to_csv(path, index=False)
    with pytest.raises(ValueError, match=r"column 'reference' expects the name of what each row was scored against"):
        read_metrics(path)
    with pytest.raises(ValueError, match=r"duplicate \(experiment, method, mode, reference\) rows"):
        write_metrics([KEY, KEY], path)
