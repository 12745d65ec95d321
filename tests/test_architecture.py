"""The layers of ARCHITECTURE.md, checked on the import statements of every module.

runners (benchmark.cli, config, experiment, stages, report, results)
    -> methods, metrics
        -> plumbing (benchmark.core.data, models, store, training, settings)

Imports point one way only: plumbing imports nothing of the layers above it, metrics imports
no project package but itself, methods import plumbing and themselves and never Hydra or
OmegaConf, and only the runners read the config.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import REPO

PLUMBING = ("benchmark.core",)
RUNNERS = ("benchmark.cli", "benchmark.config", "benchmark.experiment", "benchmark.stages", "benchmark.report",
           "benchmark.analyses",
           "benchmark.results", "benchmark.__main__")
CONFIG_LIBRARIES = ("hydra", "omegaconf")


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Absolute module names imported anywhere in ``path`` (function-level imports included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


MODULES = {
    _module_name(path): _imports(path)
    for package in ("benchmark", "methods", "metrics")
    for path in sorted((REPO / package).rglob("*.py"))
}


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def layer(name: str) -> str:
    """The layer of a project module."""
    if _within(name, PLUMBING):
        return "plumbing"
    if _within(name, RUNNERS) or name == "benchmark":
        return "runners"
    if _within(name, ("methods",)):
        return "methods"
    if _within(name, ("metrics",)):
        return "metrics"
    raise AssertionError(f"module {name} is in no layer; add it to ARCHITECTURE.md and this test")


ALLOWED = {
    "plumbing": {"plumbing"},
    "metrics": {"metrics"},
    "methods": {"methods", "plumbing"},
    "runners": {"runners", "methods", "metrics", "plumbing"},
}


def test_every_module_belongs_to_a_layer():
    assert {layer(name) for name in MODULES} == set(ALLOWED)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down_the_layers_only(module):
    mine = layer(module)
    project = [n for n in MODULES[module] if n.split(".")[0] in ("benchmark", "methods", "metrics")]
    wrong = sorted(n for n in project if layer(n) not in ALLOWED[mine])
    assert not wrong, f"{module} ({mine}) imports {wrong} from a layer above or beside it"
    if mine != "runners":
        config = sorted(n for n in MODULES[module] if n.split(".")[0] in CONFIG_LIBRARIES)
        assert not config, f"{module} ({mine}) imports {config}: only the runners read the config"


def test_stages_do_not_import_the_cli():
    offenders = [m for m, imports in MODULES.items() if m.startswith("benchmark.stages") and "benchmark.cli" in imports]
    assert not offenders, f"{offenders} import benchmark.cli: the CLI dispatches on the static stage table"


def test_this_test_sees_the_arrows():
    """A guard against a scanner that finds nothing: known arrows of each layer are seen."""
    assert "benchmark.core.store" in MODULES["methods.base"]
    assert "metrics.mmd" in MODULES["benchmark.stages.evaluate"]
    assert "metrics.mmd.layers" in MODULES["metrics.mmd.table"]
