"""The analyses' package and the references' hooks import in any order, and importing
``benchmark.analyses`` declares every kind of plug-in to the schema (references, analyses,
baselines) by itself, not through what a hook happens to import: each in a fresh interpreter."""
from __future__ import annotations

import subprocess
import sys

import pytest

import benchmark.config as config
from benchmark.config import ConfigError, register_configs
from tests.conftest import REPO


def _fresh(code: str) -> subprocess.CompletedProcess:
    """``code`` run by a fresh interpreter in the repository (nothing imported before it)."""
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)


@pytest.mark.slow
def test_a_reference_hook_imported_first_is_the_analysis_of_its_reference():
    done = _fresh("import benchmark.analyses.hmc as hook\n"
                  "from benchmark.analyses import ANALYSES\n"
                  "assert ANALYSES['hmc'] is hook, ANALYSES['hmc']\n"
                  "assert list(ANALYSES)[-1] == 'hmc', list(ANALYSES)\n")
    assert done.returncode == 0, done.stderr


@pytest.mark.slow
def test_importing_the_analyses_declares_the_baselines_without_importing_a_hook():
    done = _fresh("import sys\n"
                  "import benchmark.analyses\n"
                  "from benchmark.config import BASELINE_NAMES\n"
                  "assert 'benchmark.analyses.hmc' not in sys.modules\n"
                  "assert BASELINE_NAMES[:2] == ['prior', 'init'], BASELINE_NAMES\n")
    assert done.returncode == 0, done.stderr


def test_the_schema_is_refused_without_a_declared_baseline(monkeypatch):
    monkeypatch.setattr(config, "BASELINE_NAMES", [])
    with pytest.raises(ConfigError, match="no baseline is declared.*import benchmark.baselines"):
        register_configs()
