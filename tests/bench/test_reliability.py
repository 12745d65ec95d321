"""Short forms of the fenced-publication and claim scenarios of ``make reliability`` (bench/reliability.py)."""
from __future__ import annotations

import pytest

from tests.conftest import REPO  # noqa: F401  (puts the repository on sys.path)
from bench import reliability

pytestmark = pytest.mark.slow  # runs stages end to end or trains networks: make test, not make test-fast


@pytest.fixture(autouse=True)
def work(tmp_path, monkeypatch):
    monkeypatch.setattr(reliability, "WORK", tmp_path)
    monkeypatch.setattr(reliability, "FAILURES", [])


def test_a_paused_worker_never_replaces_the_new_holders_file():
    assert reliability.scenario_paused_worker(rounds=1) and reliability.FAILURES == []


def test_takeover_races_among_three_processes_have_one_holder():
    assert reliability.scenario_takeover_races(rounds=2, takers=3) and reliability.FAILURES == []


def test_a_diverging_seed_is_recorded_after_max_attempts(single_torch_thread):
    assert reliability.scenario_diverging_seed(max_attempts=1) and reliability.FAILURES == []


def test_litter_is_counted_and_reaped():
    assert reliability.scenario_litter_reaped() and reliability.FAILURES == []
