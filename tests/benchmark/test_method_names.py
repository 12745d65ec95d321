"""No file outside ``methods/`` names a method: what the report, the stages, the inventory, the
analyses, the baselines and the references need to know about one is an attribute of its class
(``methods.base.PosteriorMethod``: its notes, its paper row, its claims, its chain layout). The scan
reads every string constant of the packages above ``methods/``; a reference's own name (``hmc``: the
HMC reference and the method whose chains it pools share it) is the reference's, not the method's.
``benchmark/core`` is left out: the plumbing names layers (OptuNet's ``dropout``), never a method."""
from __future__ import annotations

import ast
from pathlib import Path

from benchmark.references import REFERENCES
from methods import method_names
from tests.conftest import REPO

SCANNED = ("benchmark",)
PLUMBING = ("benchmark/core",)


def method_literals(root: Path, methods: set[str], allowed: set[str]) -> list[str]:
    """``path:line: 'name'`` of every string constant in the scanned packages under ``root`` that is
    one of ``methods`` and not in ``allowed``."""
    out = []
    for package in SCANNED:
        for path in sorted((root / package).rglob("*.py")):
            relative = path.relative_to(root).as_posix()
            if any(relative.startswith(p + "/") for p in PLUMBING):
                continue
            for node in ast.walk(ast.parse(path.read_text(), relative)):
                if isinstance(node, ast.Constant) and node.value in methods and node.value not in allowed:
                    out.append(f"{relative}:{node.lineno}: {node.value!r}")
    return out


def test_no_file_above_the_methods_names_a_method():
    assert method_literals(REPO, set(method_names()), set(REFERENCES)) == []


def test_the_scan_sees_a_method_named_in_the_report(tmp_path):
    (tmp_path / "benchmark" / "report").mkdir(parents=True)
    (tmp_path / "benchmark" / "core").mkdir()
    (tmp_path / "benchmark" / "report" / "claims.py").write_text('BEST = ("laplace", "one")\nLABEL = "Laplace"\n')
    (tmp_path / "benchmark" / "core" / "model.py").write_text('LAYER = "dropout"\n')
    assert method_literals(tmp_path, {"laplace", "dropout", "hmc"}, {"hmc"}) == ["benchmark/report/claims.py:1: 'laplace'"]
