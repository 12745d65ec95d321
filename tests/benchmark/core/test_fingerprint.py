"""Code fingerprints narrowed to the modules that compute a result: a docstring edit changes
nothing, a code change changes the fingerprints of what depends on it and of nothing else."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import benchmark.core.fingerprint as fingerprint
from benchmark.core.fingerprint import SOURCE_PACKAGES, closure, code_fingerprint, source_fingerprint, source_modules, stable_hash
from benchmark.inventory import sample_code
from benchmark.references import REFERENCES
from methods import METHODS
from tests.conftest import REPO

pytestmark = pytest.mark.slow  # runs stages end to end or trains networks: make test, not make test-fast


@pytest.fixture
def source_copy(tmp_path, monkeypatch) -> Path:
    """An editable copy of the computational packages, read by ``code_fingerprint`` in this test."""
    for package in ("methods", "metrics", "benchmark/core"):
        shutil.copytree(REPO / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "benchmark" / "__init__.py").write_text("")
    monkeypatch.setattr(fingerprint, "SOURCE_ROOT", tmp_path)
    return tmp_path


def _sample_fingerprints() -> dict[str, str]:
    """What every registered method's samples are keyed by (``inventory.sample_settings_hash``)."""
    return {name: code_fingerprint(sample_code(name)) for name in METHODS}


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{path} no longer holds {old!r}: update this test"
    path.write_text(text.replace(old, new, 1))
    assert len(new) != len(old)  # the parse caches are keyed by mtime and size: a new size is a new version


def test_a_docstring_edit_in_one_method_makes_no_sample_stale(source_copy):
    before = _sample_fingerprints()
    _edit(source_copy / "methods" / "swag.py", '"""', '"""A docstring edit. ')
    _edit(source_copy / "methods" / "swag.py", "\n", "\n# a comment\n")
    assert _sample_fingerprints() == before


def test_a_code_change_in_one_method_makes_only_its_samples_stale(source_copy):
    before = _sample_fingerprints()
    _edit(source_copy / "methods" / "swag.py", "import math\n", "import math\nCHANGED = 1\n")
    after = _sample_fingerprints()
    assert [name for name in METHODS if after[name] != before[name]] == ["swag"]


def test_a_change_to_shared_training_code_reaches_every_method_that_trains(source_copy):
    before = _sample_fingerprints()
    _edit(source_copy / "benchmark" / "core" / "training" / "loop.py", "import torch\n", "import torch\nCHANGED = 1\n")
    after = _sample_fingerprints()
    changed = {name for name in METHODS if after[name] != before[name]}
    assert {"dropout", "bnn", "swag", "bnn_ordered", "bnn_skip"} <= changed


def test_the_closure_follows_reexports_to_the_defining_module_and_counts_the_packages_above():
    modules = closure(["methods.dropout"])
    assert "benchmark.core.training.loop" in modules and "benchmark.core.models.predict" in modules
    assert "benchmark.core.store.sampleset" in modules  # stack_state_dicts shapes the samples
    assert {"methods", "benchmark.core", "benchmark.core.store"} <= set(modules)  # the __init__s run on import
    assert "methods.swag" not in modules and "methods.registry" not in modules
    assert set(closure(["benchmark.core.data"])) >= {"benchmark.core.data.loading", "benchmark.core.data.on_disk"}
    with pytest.raises(ValueError, match="not a module"):
        closure(["methods.no_such_method"])


def test_no_key_holds_a_path(source_copy, monkeypatch):
    before = code_fingerprint(("methods.swag",))
    moved = source_copy.parent / "moved"
    source_copy.rename(moved)
    monkeypatch.setattr(fingerprint, "SOURCE_ROOT", moved)
    try:
        assert code_fingerprint(("methods.swag",)) == before
    finally:
        moved.rename(source_copy)


def test_stable_hash_is_key_order_free_and_hashes_enums_by_value():
    from benchmark.config import ModeChoice

    assert stable_hash({"a": 1, "b": [1, 2]}) == stable_hash({"b": [1, 2], "a": 1})
    assert stable_hash({"mode": ModeChoice.one}) == stable_hash({"mode": "one"})
    assert stable_hash({"a": 1}) != stable_hash({"a": 2})


def test_the_cheap_caches_key_leaves_out_the_references_report_and_figure_hooks(tmp_path, monkeypatch):
    """A reference's hooks (``Reference.hooks``) write tables and figures from metrics.csv: editing
    them recomputes no cache, while an edit of the reference's scoring code does."""
    for name in SOURCE_PACKAGES:
        path = Path(*name.split("."))
        if (REPO / path).is_dir():
            shutil.copytree(REPO / path, tmp_path / path, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            (tmp_path / path.parent).mkdir(parents=True, exist_ok=True)
            shutil.copy(REPO / path.with_suffix(".py"), tmp_path / path.with_suffix(".py"))
    monkeypatch.setattr(fingerprint, "SOURCE_ROOT", tmp_path)
    counted = set(source_modules())
    hooks = {m for r in REFERENCES.values() for m in (r.hooks.report, r.hooks.analysis) if m is not None}
    assert hooks >= {"benchmark.references.hmc.report", "benchmark.references.hmc.figures"} and not hooks & counted
    assert {"benchmark.references.base", "benchmark.references.zoo", "benchmark.references.hmc",
            "benchmark.references.other_zoo"} <= counted
    before = source_fingerprint()
    hmc = tmp_path / "benchmark" / "references" / "hmc"
    _edit(hmc / "report.py", "import torch\n", "import torch\nCHANGED = 1\n")
    _edit(hmc / "figures.py", "import logging\n", "import logging\nCHANGED = 1\n")
    assert source_fingerprint() == before
    _edit(hmc / "__init__.py", "import torch\n", "import torch\nCHANGED = 1\n")
    assert source_fingerprint() != before
