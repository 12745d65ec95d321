"""Provenance by construction: every module edit changes exactly the keys it can reach.

Each module of ``metrics/``, ``methods/`` and ``benchmark/core/`` (and the runner modules the
cheap caches count) is edited in turn in a copy of the source (a harmless statement appended: a
change to its syntax tree), and every key is computed again:

- the cheap caches' key (``source_fingerprint``: the reference's forms, the evaluate numbers)
  changes for every module;
- each method's samples key (``code_fingerprint(sample_code(method))``; the HMC chains' key
  holds it) changes exactly for the modules of its closure, never for another method's own
  module, and for every module a real run of the method executes: the run is traced
  (``sys.setprofile``), data loading, model factory and the bases' reading included, so that a
  module reached through data (a registry, a spec, a config name) and not through imports is
  caught here.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

import benchmark.core.fingerprint as fingerprint
from benchmark.core.fingerprint import (
    COMPUTATIONAL, SOURCE_PACKAGES, closure, code_fingerprint, source_fingerprint, source_modules,
)
from benchmark.experiment import Experiment
from benchmark.inventory import sample_code
from benchmark.stages.sample import load_base, predictions
from methods import METHODS
from methods.modes import ModePlan, run_mode
from tests.conftest import REPO
from tests.methods.conftest import build

TRACED = {"ensemble": {}, "hmc": {"descent_steps": 3, "warmup": 3, "max_leapfrog_steps": 3, "thinning": 1,
                                  "start_min_accuracy": None, "initial_mass": "identity"}}
"""The methods whose runs are traced, with settings that make the run short (ensemble: the bases
as they are; hmc: the chains and their store, the most expensive artifact)."""
ROUTING = {
    "methods.registry": "a name lookup: the module it resolves a method to is the root of the key",
    "benchmark.core.store.layout": "where the files of the store are, not what they hold",
    "benchmark.core.fingerprint": "computes the keys (and the config hash) themselves",
}
"""Modules a run executes that decide where or which, never what: a run's trace may hold them
outside the key (anything else it executes must be in the key)."""


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _within(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _traced_modules(run) -> set[str]:
    """The computational modules (``COMPUTATIONAL``) whose code ``run()`` executes."""
    files: set[str] = set()

    def profile(frame, event, arg):
        if event == "call":
            files.add(frame.f_code.co_filename)

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    modules = set()
    for name in files:
        path = Path(name)
        if path.suffix == ".py" and path.is_relative_to(REPO) and "tests" not in path.relative_to(REPO).parts:
            module = _module_name(path)
            if _within(module, COMPUTATIONAL):
                modules.add(module)
    return modules


@pytest.fixture(scope="module")
def traced(tiny_exp, tiny_bases) -> dict[str, set[str]]:
    """Method -> the computational modules a short run of it executes: a fresh experiment (data
    loaded again), the method built as the sample stage builds it, fitted around the first base
    (read from the store), sampled, and its predictions computed."""
    out = {}
    seeds = tuple(seed for seed, _ in tiny_bases[:2])
    for name, changes in TRACED.items():
        def run(name=name, changes=changes):
            exp = Experiment(tiny_exp.config)
            method = build(exp, name, **changes)
            per_base = method.samples_per_base or 2
            plan = ModePlan("one", seeds, 1, per_base)
            with torch.random.fork_rng():
                samples, _, _ = run_mode(method, plan, lambda seed: load_base(exp, seed), progress=False)
            predictions(exp, samples, method)
        out[name] = _traced_modules(run)
    return out


@pytest.fixture
def source_copy(tmp_path, monkeypatch) -> Path:
    """An editable copy of the source the keys read (``SOURCE_PACKAGES``)."""
    for package in ("methods", "metrics", "benchmark/core"):
        shutil.copytree(REPO / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    for name in SOURCE_PACKAGES:  # the runner modules and packages the cheap caches count
        path = Path(*name.split("."))
        if (REPO / path).is_dir() and not (tmp_path / path).exists():
            shutil.copytree(REPO / path, tmp_path / path, ignore=shutil.ignore_patterns("__pycache__"))
        elif (REPO / path.with_suffix(".py")).is_file():
            shutil.copy(REPO / path.with_suffix(".py"), tmp_path / path.with_suffix(".py"))
    (tmp_path / "benchmark" / "__init__.py").write_text("")
    monkeypatch.setattr(fingerprint, "SOURCE_ROOT", tmp_path)
    return tmp_path


def _keys() -> dict[str, str]:
    return {"cheap": source_fingerprint(), **{name: code_fingerprint(sample_code(name)) for name in METHODS}}


def test_every_module_edit_changes_exactly_the_keys_that_can_reach_it(source_copy, traced):
    modules = sorted(p for p in source_copy.rglob("*.py") if "__pycache__" not in p.parts)
    assert {p.relative_to(source_copy).parts[0] for p in modules} == {"benchmark", "methods", "metrics"}
    before = _keys()
    changed: dict[str, set[str]] = {key: set() for key in before}
    for path in modules:
        text = path.read_text()
        path.write_text(text + "\n_PROVENANCE_PROBE = 1\n")
        try:
            after = _keys()
        finally:
            path.write_text(text)
        for key in before:
            if after[key] != before[key]:
                changed[key].add(_module_name(Path(REPO / path.relative_to(source_copy))))
    names = {_module_name(Path(REPO / p.relative_to(source_copy))) for p in modules}
    drawing = {n for n in names if n == "benchmark.core.figures" or n.startswith("benchmark.core.figures.")}
    assert drawing, "the figure writer is part of the copy"  # it draws, never computes: fingerprint.SOURCE_EXCLUDED
    assert changed["cheap"] == names - {"benchmark"} - drawing == set(source_modules(source_copy)), \
        "an edit the cheap caches' key does not see"
    own = {cls.__module__ for cls in METHODS.values()}
    for name in METHODS:
        reach = set(closure(sample_code(name), source_copy))
        assert changed[name] == reach, f"{name}: the key changes for other modules than its closure"
        assert own & reach == {METHODS[name].__module__} | (own & set(closure([METHODS[name].__module__], source_copy)))
        missed = traced.get(name, set()) - changed[name] - set(ROUTING)
        assert not missed, f"{name}: a run executes {sorted(missed)}, whose edits do not change its key"
    assert traced["hmc"] >= {"methods.hmc", "methods.hmc_kernel", "benchmark.core.models.optunet"}
    assert "metrics.symmetries.architectures" in changed["cheap"]
