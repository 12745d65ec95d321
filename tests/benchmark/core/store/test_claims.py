"""Claims that hold across nodes: exclusive creation, heartbeats, takeover of stale claims (dead
process on this host at once, another host's after the timeout), and no two winners."""
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time

import pytest

from benchmark.core.store import read_claim_info, try_claim
from benchmark.core.store.claims import HOST_ENV, acquire, host_name, reap_stale
from tests.conftest import REPO

HOLD = """
import sys, time
from benchmark.core.store import try_claim
with try_claim(sys.argv[1], timeout_s=float(sys.argv[2]), heartbeat_s=0.2) as claim:
    print("claimed" if claim else "busy", flush=True)
    time.sleep(600 if claim else 0)
"""


def _holder(path, host, timeout_s=1.5):
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(path), str(timeout_s)], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, env={**os.environ, HOST_ENV: host})
    assert proc.stdout.readline().strip() == "claimed"
    return proc


def _fake_claim(path, host, pid, age_s=0.0):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"host": host, "pid": pid, "started": time.time() - age_s, "token": "t"}))
    os.utime(path, (time.time() - age_s, time.time() - age_s))


def test_a_claim_is_exclusive_carries_who_holds_it_and_is_released(tmp_path, monkeypatch):
    monkeypatch.setenv(HOST_ENV, "node-a")
    path = tmp_path / "claims" / "zoo-seed_000001.claim"
    with try_claim(path) as first:
        assert first is not None and not first.lost
        info = read_claim_info(path)
        assert (info.host, info.pid, info.token) == ("node-a", os.getpid(), first.token)
        assert time.time() - 5 < info.started <= time.time()
        with try_claim(path) as second:  # this process holds it: busy, even for itself
            assert second is None
    assert not path.exists()
    with try_claim(path) as again:
        assert again is not None


def test_the_heartbeat_refreshes_the_claim(tmp_path):
    path = tmp_path / "x.claim"
    with try_claim(path, timeout_s=1.0, heartbeat_s=0.1):
        os.utime(path, (time.time() - 100, time.time() - 100))
        time.sleep(0.4)
        assert read_claim_info(path).heartbeat_age_s < 0.5


def test_a_dead_process_on_this_host_is_taken_over_at_once(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    path = tmp_path / "x.claim"
    _fake_claim(path, host_name(), int(dead.stdout))
    with try_claim(path, timeout_s=600) as claim:
        assert claim is not None


def test_another_hosts_claim_is_taken_over_only_after_the_timeout(tmp_path, monkeypatch):
    monkeypatch.setenv(HOST_ENV, "node-b")
    path = tmp_path / "x.claim"
    _fake_claim(path, "node-a", 1, age_s=5)  # pid 1 exists here, but node-a's pid 1 is not ours to judge
    with try_claim(path, timeout_s=60) as claim:
        assert claim is None
    with try_claim(path, timeout_s=2) as claim:
        assert claim is not None and read_claim_info(path).host == "node-b"


def test_a_claimant_whose_claim_was_taken_over_knows_it(tmp_path):
    path = tmp_path / "x.claim"
    with try_claim(path, timeout_s=1.0, heartbeat_s=0.5) as claim:
        path.unlink()
        _fake_claim(path, "node-z", 123)
        assert claim.lost
    assert read_claim_info(path).host == "node-z"  # release left the new owner's claim alone


def _race(path, host, results):
    os.environ[HOST_ENV] = host
    claim = acquire(path, timeout_s=1.0, heartbeat_s=0.2)
    results.put(claim is not None)
    time.sleep(1.0)  # hold it while the others try
    if claim:
        claim.release()


@pytest.mark.slow
def test_many_takers_of_one_stale_claim_yield_one_winner(tmp_path):
    path = tmp_path / "x.claim"
    _fake_claim(path, "node-dead", 99, age_s=100)
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    procs = [context.Process(target=_race, args=(path, f"node-{i}", results)) for i in range(8)]
    for p in procs:
        p.start()
    wins = [results.get(timeout=30) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    assert sum(wins) == 1, wins


@pytest.mark.slow
def test_a_claimant_killed_on_another_host_is_taken_over_after_the_timeout(tmp_path, monkeypatch):
    path = tmp_path / "zoo-seed_000003.claim"
    holder = _holder(path, "node-a", timeout_s=1.5)
    monkeypatch.setenv(HOST_ENV, "node-b")
    try:
        time.sleep(0.6)  # heartbeats keep it live past the first ones
        with try_claim(path, timeout_s=1.5) as claim:
            assert claim is None
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with try_claim(path, timeout_s=1.5) as claim:  # its heartbeat is still fresh: node-b must wait
        assert claim is None
    time.sleep(1.8)
    with try_claim(path, timeout_s=1.5) as claim:
        assert claim is not None and read_claim_info(path).host == "node-b"
    same_host = _holder(path, "node-b", timeout_s=600)  # killed on *this* host: taken over at once
    same_host.send_signal(signal.SIGKILL)
    same_host.wait()
    with try_claim(path, timeout_s=600) as claim:
        assert claim is not None


def test_stale_claims_left_by_killed_runs_are_reaped_and_live_ones_kept(tmp_path, monkeypatch):
    monkeypatch.setenv(HOST_ENV, "node-b")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    _fake_claim(tmp_path / "dead.claim", "node-b", int(dead.stdout))  # this host, process gone
    _fake_claim(tmp_path / "old.claim", "node-a", 1, age_s=100)  # another host, heartbeat timed out
    _fake_claim(tmp_path / "live.claim", "node-a", 1, age_s=1)
    with try_claim(tmp_path / "mine.claim", timeout_s=30):
        removed = reap_stale(tmp_path, timeout_s=30)
        assert sorted(i.path.name for i in removed) == ["dead.claim", "old.claim"]
        assert sorted(p.name for p in tmp_path.iterdir()) == ["live.claim", "mine.claim"]
