"""The closing table of ``make bench``: every measured ratio next to its goal.

Protocol: a bench script (``bench/bench_*.py``) calls ``record(...)`` for each figure it wants
in the table; with the environment variable ``BENCH_SUMMARY`` set (``make bench`` sets it) the
figure is appended to that file as one JSON line, and ``python bench/summary.py FILE`` prints
the table of all lines. A bench script that records nothing still runs; it just adds no row.

Usage: ``python bench/summary.py bench/_work/summary.jsonl``.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pandas as pd


def record(bench: str, entry: str, measured: float, goal: float | None = None, unit: str = "x",
           higher_is_better: bool = True) -> None:
    """Append one figure to ``$BENCH_SUMMARY`` (if set): ``measured`` in ``unit``, and its ``goal``
    (None: reported without one), met when ``measured >= goal`` (or ``<=`` with ``higher_is_better=False``)."""
    path = os.environ.get("BENCH_SUMMARY")
    if not path:
        return
    line = {"bench": bench, "entry": entry, "measured": float(measured), "goal": goal, "unit": unit,
            "higher_is_better": higher_is_better}
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(line) + "\n")


def _status(row: dict) -> str:
    if row["goal"] is None:
        return "-"
    met = row["measured"] >= row["goal"] if row["higher_is_better"] else row["measured"] <= row["goal"]
    return "met" if met else "NOT met"


def _number(value: float, unit: str) -> str:
    text = f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return f"{text}{unit}" if unit in ("x", "") else f"{text} {unit}"


def table(path: str | os.PathLike) -> str:
    """The figures recorded in ``path`` as a Markdown table (bench, entry, measured, goal, status)."""
    lines = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    if not lines:
        return "no figures recorded"
    rows = [{
        "bench": row["bench"], "entry": row["entry"], "measured": _number(row["measured"], row["unit"]),
        "goal": "-" if row["goal"] is None else ("≥ " if row["higher_is_better"] else "≤ ") + _number(row["goal"], row["unit"]),
        "status": _status(row),
    } for row in lines]
    return pd.DataFrame(rows).to_markdown(index=False)


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(__doc__.strip().splitlines()[-1])
    print(table(sys.argv[1]))


if __name__ == "__main__":
    main()
