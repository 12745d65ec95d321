"""Code fingerprints narrowed to the modules that compute a result: a docstring edit changes
nothing, a code change changes the fingerprints of what depends on it and of nothing else; a
library's version is in exactly the keys whose modules import it."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import benchmark.core.fingerprint as fingerprint
from benchmark.core.fingerprint import (
    SOURCE_PACKAGES, closure, code_fingerprint, distribution_versions, libraries, library_versions, source_fingerprint,
    source_modules, stable_hash,
)
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
    """A reference's hooks (``Reference.hooks``, modules of the report and the analyses) and the figure
    writer (``benchmark.core.figures``) write tables and figures from metrics.csv: editing them
    recomputes no cache, while an edit of the reference's scoring code does."""
    for name in (*SOURCE_PACKAGES, "benchmark.report", "benchmark.analyses"):
        path = Path(*name.split("."))
        if (REPO / path).is_dir():
            shutil.copytree(REPO / path, tmp_path / path, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            (tmp_path / path.parent).mkdir(parents=True, exist_ok=True)
            shutil.copy(REPO / path.with_suffix(".py"), tmp_path / path.with_suffix(".py"))
    monkeypatch.setattr(fingerprint, "SOURCE_ROOT", tmp_path)
    counted = set(source_modules())
    hooks = {m for r in REFERENCES.values() for m in (r.hooks.report, r.hooks.analysis) if m is not None}
    assert hooks >= {"benchmark.report.hmc", "benchmark.analyses.hmc"} and not hooks & counted
    assert not {m for m in counted if m.startswith("benchmark.core.figures")}
    assert {"benchmark.references.base", "benchmark.references.zoo", "benchmark.references.hmc",
            "benchmark.references.other_zoo"} <= counted
    before = source_fingerprint()
    _edit(tmp_path / "benchmark" / "report" / "hmc.py", "import torch\n", "import torch\nCHANGED = 1\n")
    _edit(tmp_path / "benchmark" / "analyses" / "hmc.py", "import logging\n", "import logging\nCHANGED = 1\n")
    _edit(tmp_path / "benchmark" / "core" / "figures" / "canvas.py", "import math\n", "import math\nCHANGED = 1\n")
    assert source_fingerprint() == before
    _edit(tmp_path / "benchmark" / "references" / "hmc" / "__init__.py", "import torch\n", "import torch\nCHANGED = 1\n")
    assert source_fingerprint() != before


def _upgraded(monkeypatch, distribution: str) -> None:
    """Pretend ``distribution`` was upgraded: the version every key reads of it changes."""
    real = fingerprint._version
    monkeypatch.setattr(fingerprint, "_version", lambda name: "upgraded" if name == distribution else real(name))


@pytest.mark.parametrize("distribution, methods", [
    ("pyro-ppl", {"hmc"}),  # HMC's dual averaging
    ("arviz", {"sghmc", "sghmc_sa"}),  # R-hat, ESS of the chains
    ("laplace-torch", {"laplace"}),
    ("blitz-bayesian-pytorch", {"bnn", "bnn_ordered", "bnn_skip"}),
    ("scikit-learn", set(METHODS)),  # the digits split: every method's data
    ("cvxpy", set()),  # only min_mass_cvxpy (bench/minmass_cvxpy.py, a test dependency) imports it: no sample's code
    ("matplotlib", set()),  # only the figures import it
])
def test_a_library_upgrade_changes_the_sample_keys_of_exactly_the_methods_whose_code_imports_it(
        monkeypatch, distribution, methods):
    before = _sample_fingerprints()
    _upgraded(monkeypatch, distribution)
    after = _sample_fingerprints()
    assert {name for name in METHODS if after[name] != before[name]} == methods


@pytest.mark.parametrize("distribution, counted", [
    ("pyro-ppl", True), ("arviz", True), ("scikit-learn", True), ("torch", True),
    ("cvxpy", False),  # only bench/minmass_cvxpy.py imports it (a test dependency): no runtime module
    ("matplotlib", False),  # only the figure writer, the report and the analyses import it: none is hashed
])
def test_a_library_upgrade_changes_the_cheap_caches_key_when_a_hashed_module_imports_it(
        monkeypatch, distribution, counted):
    before = source_fingerprint()
    _upgraded(monkeypatch, distribution)
    assert (source_fingerprint() != before) == counted
    assert (distribution in library_versions()) == counted  # what stored metadata records


def test_a_module_that_starts_importing_a_library_puts_the_library_in_its_keys(source_copy, monkeypatch):
    """A function-level import counts: ``methods/swag.py`` importing cvxpy in a function puts
    cvxpy's version in SWAG's key (an upgrade of it then makes SWAG's samples stale, and no
    other method's)."""
    assert "cvxpy" not in library_versions(closure(sample_code("swag")))
    _edit(source_copy / "methods" / "swag.py", "import math\n", "import math\n\n\ndef _solver():\n    import cvxpy.atoms\n")
    assert "cvxpy" in libraries(closure(sample_code("swag"))) and "cvxpy" in library_versions(closure(sample_code("swag")))
    before = _sample_fingerprints()
    _upgraded(monkeypatch, "cvxpy")
    after = _sample_fingerprints()
    assert [name for name in METHODS if after[name] != before[name]] == ["swag"]


def test_a_library_no_hashed_module_imports_is_in_no_key():
    """Nor the standard library's modules, nor the project's own packages."""
    whole = library_versions()
    assert "cvxpy" not in {d for name in METHODS for d in library_versions(closure(sample_code(name)))}
    assert not {"matplotlib", "posterior-bench", "json", "benchmark", "methods", "metrics"} & set(whole)
    assert {"python", "torch", "numpy", "scipy", "pyro-ppl", "scikit-learn", "arviz"} <= set(whole)
    assert library_versions(source_modules()) == whole


def test_import_names_map_to_their_distributions():
    versions = distribution_versions({"sklearn", "pyro", "laplace", "no_such_library_xyz"})
    assert {"scikit-learn", "pyro-ppl", "laplace-torch"} <= set(versions) and "sklearn" not in versions
    assert versions["no_such_library_xyz"] == "absent"  # a name no installed distribution provides
