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

pytestmark = pytest.mark.slow  # real processes hold and lose claims: make test, not make test-fast

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


def test_a_claimant_whose_claim_was_taken_over_knows_it_and_leaves_the_one_line_to_its_stage(tmp_path, caplog):
    """Issue #30, item 7: a lost claim logged a line from the heartbeat and another from the stage."""
    import logging

    path = tmp_path / "x.claim"
    with caplog.at_level(logging.INFO), try_claim(path, timeout_s=1.0, heartbeat_s=0.05) as claim:
        path.unlink()
        _fake_claim(path, "node-z", 123)
        assert claim.lost
        time.sleep(0.3)  # heartbeats see it lost
    assert read_claim_info(path).host == "node-z"  # release left the new owner's claim alone
    assert not [r for r in caplog.records if r.levelno >= logging.INFO and "taken over" in r.getMessage()]


def _race(path, host, results):
    os.environ[HOST_ENV] = host
    # the fake claim is 100 s old: stale at 30 s, while the winner's stays live however slow the machine
    claim = acquire(path, timeout_s=30.0, heartbeat_s=0.2)
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
    with try_claim(tmp_path / "mine.claim", timeout_s=30) as mine:
        removed = reap_stale(tmp_path, timeout_s=30)
        assert sorted(i.path.name for i in removed) == ["dead.claim", "old.claim"]
        assert sorted(p.name for p in tmp_path.iterdir()) == ["live.claim", "mine.claim", f"mine.claim.{mine.token}"]


def test_a_transient_read_error_or_one_odd_read_does_not_lose_the_claim(tmp_path, monkeypatch):
    """A claim is lost only after a token mismatch on several consecutive reads: one failed read
    (NFS hiccup) or one read that found the shared name gone (another version's put-back gap)
    proves nothing."""
    from pathlib import Path

    path = tmp_path / "x.claim"
    real = Path.read_bytes
    with try_claim(path, timeout_s=60, heartbeat_s=60) as claim:
        odd = iter([OSError(5, "Input/output error"), FileNotFoundError(2, "No such file")])

        def flaky(self):
            if self == path:
                error = next(odd, None)
                if error is not None:
                    raise error
            return real(self)

        monkeypatch.setattr(Path, "read_bytes", flaky)
        assert not claim.lost  # the I/O error: inconclusive
        assert not claim.lost  # absent once, then back: not confirmed
        monkeypatch.setattr(Path, "read_bytes", real)
        path.unlink()
        _fake_claim(path, "node-z", 123)
        assert claim.lost  # another token on every read: lost


def test_a_claim_of_another_boot_or_pid_namespace_is_judged_by_its_heartbeat(tmp_path):
    """Containers share a host name but not pids: a dead-looking pid of another boot or PID
    namespace does not make a fresh claim stale."""
    from benchmark.core.store.claims import boot_id, pid_namespace, stale_reason

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    path = tmp_path / "x.claim"
    for other in ({"boot": "another-boot", "pidns": pid_namespace()}, {"boot": boot_id(), "pidns": "pid:[1]"}):
        path.write_text(json.dumps({"host": host_name(), "pid": int(dead.stdout), "started": time.time(),
                                    "token": "t", **other}))
        with try_claim(path, timeout_s=60) as claim:
            assert claim is None
        assert stale_reason(read_claim_info(path), timeout_s=0.0001) is not None  # by heartbeat age it would be
    path.write_text(json.dumps({"host": host_name(), "pid": int(dead.stdout), "started": time.time(), "token": "t",
                                "boot": boot_id(), "pidns": pid_namespace()}))
    with try_claim(path, timeout_s=60) as claim:  # same boot and namespace: the pid is judged, dead
        assert claim is not None
    assert boot_id() and pid_namespace().startswith("pid:")


def _stale_claim(path, fmt):
    """A claim of token ``x`` whose heartbeat is 100 s old: one name (``old`` format) or two."""
    body = json.dumps({"host": "node-dead", "pid": 9, "started": time.time() - 100, "token": "x"})
    target = path if fmt == "old" else path.with_name(path.name + ".x")
    target.write_text(body)
    os.utime(target, (time.time() - 100, time.time() - 100))
    if fmt == "new":
        os.link(target, path)


@pytest.mark.parametrize("fmt", ["old", "new"])
def test_takeover_races_among_three_processes_never_remove_the_rightful_holder(tmp_path, fmt):
    """B judges the stale claim X stale and is held there; C takes X over (claim Y) and holds it;
    B resumes. If B touches the shared name at all, D is let in at exactly that moment. The
    rightful holder C must never be lost, the shared name must stay C's, and nobody else wins."""
    from benchmark.core.store import claims
    from tests.processes import Forked

    path = tmp_path / "u.claim"
    _stale_claim(path, fmt)
    context = multiprocessing.get_context("fork")
    examined, c_holds, d_go, d_tried, end = (context.Event() for _ in range(5))

    def hold_until_end(claim):
        if claim is None:
            return None
        end.wait(30)
        lost = claim.lost
        claim.release()
        return {"token": claim.token, "lost": lost}

    def taker_b():
        judge, rename = claims.stale_reason, os.rename

        def judged(info, timeout_s):
            reason = judge(info, timeout_s)
            if reason and not examined.is_set():
                examined.set()
                c_holds.wait(30)  # held right after its judgment until C has taken X over
            return reason

        def watched(src, dst, *args, **kwargs):
            done = rename(src, dst, *args, **kwargs)
            if path.name in (os.path.basename(src), os.path.basename(dst)) and not d_go.is_set():
                d_go.set()
                d_tried.wait(30)  # D tries right after B moved something onto or off the shared name
            return done

        claims.stale_reason, os.rename = judged, watched
        claim = claims.acquire(path, timeout_s=30, heartbeat_s=0.2)
        d_go.set()
        return hold_until_end(claim)

    def taker_c():
        examined.wait(30)
        claim = claims.acquire(path, timeout_s=30, heartbeat_s=0.2)
        c_holds.set()
        return hold_until_end(claim)

    def taker_d():
        d_go.wait(30)
        claim = claims.acquire(path, timeout_s=30, heartbeat_s=0.2)
        d_tried.set()
        return hold_until_end(claim)

    procs = {name: Forked(target) for name, target in (("B", taker_b), ("C", taker_c), ("D", taker_d))}
    d_tried.wait(30)
    holder = read_claim_info(path)
    end.set()
    results = {name: p.result(timeout=30)[1] for name, p in procs.items()}
    assert results["C"] is not None and not results["C"]["lost"], results
    assert results["B"] is None and results["D"] is None, results
    assert holder.token == results["C"]["token"]
    assert not path.exists() and not list(tmp_path.iterdir())  # released: nothing left behind


@pytest.mark.parametrize("fmt", ["old", "new"])
def test_a_taker_held_between_its_ticket_and_its_swap_is_the_only_winner(tmp_path, fmt):
    """B holds X's ticket and is stopped before its swap; C and D try meanwhile (X still stale,
    the shared name never absent): both are refused, and B's swap makes B the only holder."""
    from benchmark.core.store import claims
    from tests.processes import Forked

    path = tmp_path / "u.claim"
    _stale_claim(path, fmt)
    context = multiprocessing.get_context("fork")
    at_ticket, others_done, end = (context.Event() for _ in range(3))

    def b():
        claims._pause = lambda point: (at_ticket.set(), others_done.wait(30)) if point == "ticket" else None
        claim = claims.acquire(path, timeout_s=30, heartbeat_s=0.2)
        end.wait(30)
        result = claim is not None and not claim.lost
        claim.release()
        return result

    def other():
        at_ticket.wait(30)
        claim = claims.acquire(path, timeout_s=30, heartbeat_s=0.2)
        return claim is not None

    taker = Forked(b)
    at_ticket.wait(30)
    assert path.exists() and read_claim_info(path).token == "x"  # no gap while the ticket is held
    assert [Forked(other).result(30)[1] for _ in range(2)] == [False, False]
    others_done.set()
    for _ in range(3000):  # B's swap, polled
        info = read_claim_info(path)
        if info is not None and info.token != "x":
            break
        time.sleep(0.01)
    assert info.host == host_name()
    end.set()
    assert taker.result(30)[1] is True
    assert not list(tmp_path.iterdir())


def test_the_body_of_a_claim_whose_creator_was_killed_before_linking_it_is_litter_at_once(tmp_path):
    from benchmark.core.store.claims import boot_id, litter, pid_namespace

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    body = {"host": host_name(), "started": time.time(), "token": "k", "boot": boot_id(), "pidns": pid_namespace()}
    orphan = tmp_path / "u.claim.k"
    orphan.write_text(json.dumps({**body, "pid": int(dead.stdout)}))
    creating = tmp_path / "v.claim.k"  # this process, about to link it: not litter
    creating.write_text(json.dumps({**body, "pid": os.getpid()}))
    assert litter(tmp_path, timeout_s=60) == [orphan]
