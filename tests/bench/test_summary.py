"""The closing table of make bench: figures recorded by the bench scripts, with their goals."""
from __future__ import annotations

import pytest

import subprocess
import sys

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
import summary  # noqa: E402  (bench/summary.py)

pytestmark = pytest.mark.slow  # runs bench/summary.py in a subprocess


def test_recorded_figures_make_one_table(tmp_path, monkeypatch):
    path = tmp_path / "summary.jsonl"
    monkeypatch.setenv("BENCH_SUMMARY", str(path))
    summary.record("zoo", "training: vectorised / one at a time", 5.12, 10.0)
    summary.record("mmd", "peak RSS", 1.5, 4.0, unit="GiB", higher_is_better=False)
    summary.record("store", "no goal", 3.0, unit="s/checkpoint", higher_is_better=False)
    lines = summary.table(path).splitlines()
    assert [cell.strip() for cell in lines[0].split("|")[1:6]] == ["bench", "entry", "measured", "goal", "status"]
    assert "| 5.12x" in lines[2] and "≥ 10x" in lines[2] and "NOT met" in lines[2]
    assert "1.5 GiB" in lines[3] and "≤ 4 GiB" in lines[3] and "| met " in lines[3]
    assert lines[4].rstrip().endswith("| -        |") and "3 s/checkpoint" in lines[4]
    done = subprocess.run([sys.executable, str(REPO / "bench" / "summary.py"), str(path)], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == summary.table(path)


def test_without_the_variable_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.delenv("BENCH_SUMMARY", raising=False)
    monkeypatch.chdir(tmp_path)
    summary.record("zoo", "x", 1.0, 2.0)
    assert list(tmp_path.iterdir()) == []
