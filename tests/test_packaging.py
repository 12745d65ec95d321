"""Packaging (pyproject.toml): a wheel built from the sources alone (what ``git archive`` gives, no
``.egg-info``) and installed without ``-e`` runs: it carries ``conf/`` as ``benchmark/conf`` (found by
``benchmark.config.CONF_DIR``), its ``posterior-bench`` command is ``python -m benchmark``, and no
runtime module needs a test-only dependency. The wheel test builds offline (``--no-build-isolation``
with this environment's setuptools) into a fresh venv whose dependencies are this venv's packages
(a ``.pth`` line), run from a folder outside the checkout."""
from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from benchmark.core.store import ExperimentStore
from tests.conftest import REPO

RUNTIME = ("benchmark", "methods", "metrics")
TEST_ONLY = ("cvxpy", "pytest", "hypothesis", "torchmetrics", "statsmodels")  # the test extra's imports
SOURCES = ("pyproject.toml", "README.md", *RUNTIME, "conf")  # what a build reads
TINY_ZOO = ("stage=zoo", "experiment=digits_optunet", "seeds.reference=[0,2]", "seeds.heldout=[100000,100001]",
            "train.epochs=1", "train.fail_rule.epoch=null", "threads=1", "zoo.vectorize=1")


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def test_the_listed_packages_are_the_packages_on_disk():
    """pyproject.toml lists the packages (``benchmark.conf`` maps ``conf/`` into the wheel, which
    automatic discovery cannot do): a package added on disk must be added there too."""
    tool = _pyproject()["tool"]["setuptools"]
    on_disk = {".".join(p.parent.relative_to(REPO).parts) for top in RUNTIME for p in (REPO / top).rglob("__init__.py")}
    assert set(tool["packages"]) - {"benchmark.conf"} == on_disk
    assert tool["package-dir"] == {"benchmark.conf": "conf"}


def test_the_posterior_bench_command_is_python_m_benchmark():
    """``[project.scripts]``'s ``posterior-bench`` calls what ``benchmark/__main__.py`` calls."""
    module, _, function = _pyproject()["project"]["scripts"]["posterior-bench"].partition(":")
    assert f"from {module} import {function}\n" in (REPO / "benchmark" / "__main__.py").read_text()


def test_no_runtime_module_imports_a_test_only_dependency():
    """cvxpy and the rest of the ``test`` extra are imported by tests/ and bench/ only (the exact
    min-mass reference is bench/minmass_cvxpy.py), function-level imports included."""
    found = []
    for path in sorted(p for top in RUNTIME for p in (REPO / top).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else [])
            found += [f"{path.relative_to(REPO)}: {n}" for n in names if n.split(".")[0] in TEST_ONLY]
    assert found == []
    runtime = [Requirement(r).name for r in _pyproject()["project"]["dependencies"]]
    assert not set(TEST_ONLY) & set(runtime)


def _venv_python(venv: Path) -> Path:
    return venv / ("Scripts" if os.name == "nt" else "bin") / "python"


def _run(command: list, cwd: Path, timeout: int = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    done = subprocess.run([str(c) for c in command], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(map(str, command))}\n{done.stdout}\n{done.stderr}"
    return done


@pytest.mark.slow
def test_the_wheel_installed_without_editable_runs_a_stage_outside_the_checkout(tmp_path):
    source, wheels, venv, work = (tmp_path / name for name in ("source", "wheels", "venv", "work"))
    for name in SOURCES:  # the tracked sources only: no .egg-info, no build/ of the checkout
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            source.mkdir(exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    _run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
          "-w", wheels, source], cwd=tmp_path)
    (wheel,) = wheels.glob("posterior_bench-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        metadata = Parser().parsestr(archive.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode())
        entry_points = archive.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    configs = {f"benchmark/conf/{p.relative_to(REPO / 'conf').as_posix()}" for p in (REPO / "conf").rglob("*.yaml")}
    assert configs and configs <= names, sorted(configs - names)
    assert not any(n.startswith(("tests/", "bench/", "studies/", "conf/")) for n in names)
    assert "posterior-bench = benchmark.cli:main" in entry_points
    requires = [Requirement(r) for r in metadata.get_all("Requires-Dist")]
    runtime = {r.name: r for r in requires if r.marker is None}
    assert "cvxpy" not in runtime and "cvxpy" in {r.name for r in requires}  # in the test extra
    from importlib.metadata import version
    for name in ("torch", "torchvision"):  # ranges that hold this venv's tested versions (pinned in requirements-offline.txt)
        assert "==" not in str(runtime[name].specifier) and runtime[name].specifier.contains(version(name)), runtime[name]

    # A fresh venv with the wheel only; then this venv's site-packages after its own for the dependencies
    # (a plain path line: the .pth files there, the editable install's among them, are not run).
    _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=tmp_path)
    python = _venv_python(venv)
    _run([sys.executable, "-m", "pip", "--python", python, "install", "--quiet", "--no-index", "--no-deps", wheel],
         cwd=tmp_path)
    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp_path).stdout.strip())
    (site / "_posterior_bench_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    work.mkdir()
    where = _run([python, "-c", "import benchmark; print(benchmark.__file__)"], cwd=work).stdout.strip()
    package = Path(where).parent
    assert package.resolve().is_relative_to(venv.resolve()), where  # the wheel's, not the checkout's
    assert (package / "conf" / "config.yaml").is_file() and not (package.parent / "conf").exists()  # CONF_DIR
    script = venv / ("Scripts" if os.name == "nt" else "bin") / "posterior-bench"
    shown = _run([script, "--help"], cwd=work).stdout  # its experiments are the yaml files of CONF_DIR
    assert "posterior-bench" in shown and "digits_optunet" in shown and "mnist_optunet" in shown, shown
    store, results = tmp_path / "store", tmp_path / "results"
    _run([script, *TINY_ZOO, f"store={store}", f"results={results}", f"hydra.run.dir={tmp_path / 'hydra'}"], cwd=work,
         timeout=300)
    assert sorted(ExperimentStore(store, "digits_optunet").completed_seeds()) == [0, 1, 100000]
    assert not (work / "outputs").exists() and list(work.iterdir()) == []  # nothing written where it ran
