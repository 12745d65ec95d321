"""Claims on units of work that hold across the nodes of a cluster (NFS, Lustre, GPFS).

``fcntl.flock`` is not honoured across nodes by many cluster file systems. A claim is instead a
file created with ``O_CREAT | O_EXCL`` (atomic on NFSv3+, Lustre, GPFS and local disks: exactly
one creator wins) holding the claimant's host, pid, start time and a random token. While the
claim is held, a background thread refreshes the file's mtime every ``heartbeat_s`` seconds.

A claim is stale, and may be taken over, when
- its heartbeat is older than ``timeout_s`` (the claimant died, hung, or lost its node), judged
  against the file server's clock (the mtime of a probe file just written), not the local one;
- or it was made on this host by a process that no longer exists (taken over at once).

Taking over is atomic: the stale claim is renamed to a unique name (only one of several takers'
renames can succeed), checked to be the very claim judged stale, deleted, and then the taker
competes with ``O_EXCL`` like everyone else, so two takers cannot both win. A claimant whose
claim was taken over notices at its next heartbeat (``Claim.lost``) and must not publish its
result. Results themselves are published by atomic rename (``atomic.py``).

The host name is ``socket.gethostname()``, or ``$POSTERIOR_BENCH_HOST`` when set (tests pretend
to be several hosts with it).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import psutil

HOST_ENV = "POSTERIOR_BENCH_HOST"
DEFAULT_TIMEOUT_S = 300.0  # a claim not refreshed for this long is taken over (config: claims.timeout_s)
DEFAULT_HEARTBEAT_S = 30.0  # a held claim is refreshed this often (config: claims.heartbeat_s)
log = logging.getLogger(__name__)


def host_name() -> str:
    """This process's host name for claims: ``$POSTERIOR_BENCH_HOST`` or the machine's name."""
    return os.environ.get(HOST_ENV) or socket.gethostname()


@dataclass(frozen=True)
class ClaimInfo:
    """What a claim file says, and how old its heartbeat is (seconds, by the file server's clock)."""

    path: Path
    host: str
    pid: int
    started: float
    token: str
    heartbeat_age_s: float


def read_claim(path: str | os.PathLike) -> ClaimInfo | None:
    """The claim at ``path``, or ``None`` if there is none. A claim still being written reads as
    host ``?`` with its file's age."""
    path = Path(path)
    try:
        raw = path.read_bytes()
        mtime = path.stat().st_mtime
    except FileNotFoundError:
        return None
    try:
        data = json.loads(raw)
        host, pid, started, token = str(data["host"]), int(data["pid"]), float(data["started"]), str(data["token"])
    except (ValueError, KeyError, TypeError):
        host, pid, started, token = "?", 0, mtime, ""
    return ClaimInfo(path, host, pid, started, token, max(0.0, _fs_now(path.parent) - mtime))


def stale_reason(info: ClaimInfo, timeout_s: float) -> str | None:
    """Why claim ``info`` may be taken over, or ``None`` while it is live."""
    if info.heartbeat_age_s > timeout_s:
        return f"heartbeat {info.heartbeat_age_s:.0f} s old (timeout {timeout_s:g} s)"
    if info.host == host_name() and info.pid and not _process_alive(info.pid, info.started):
        return f"process {info.pid} on this host ({info.host}) is gone"
    return None


class Claim:
    """A held claim: its file, and a heartbeat thread that refreshes it until ``release``."""

    def __init__(self, path: Path, token: str, heartbeat_s: float) -> None:
        self.path, self.token = path, token
        self._lost = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, args=(heartbeat_s,), daemon=True,
                                        name=f"claim-heartbeat-{path.name}")
        self._thread.start()

    @property
    def lost(self) -> bool:
        """True once the claim was found taken over (or removed): do not publish the result."""
        if not self._lost and not self._mine():
            self._lost = True
        return self._lost

    def _mine(self) -> bool:
        try:
            return json.loads(self.path.read_bytes()).get("token") == self.token
        except (OSError, ValueError, AttributeError):
            return False

    def _beat(self, interval: float) -> None:
        while not self._stop.wait(interval):
            if not self._mine():
                self._lost = True
                log.warning("%s: this claim was taken over by another process", self.path)
                return
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def release(self) -> None:
        """Stop the heartbeat and remove the claim file if it is still this claim's."""
        self._stop.set()
        self._thread.join()
        if self._mine():
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()


@contextlib.contextmanager
def try_claim(path: str | os.PathLike, timeout_s: float = DEFAULT_TIMEOUT_S, heartbeat_s: float = DEFAULT_HEARTBEAT_S) -> Iterator[Claim | None]:
    """Try to claim ``path`` without waiting: yield the ``Claim``, or ``None`` if another live
    claimant holds it. A stale claim (see the module doc) is taken over. The claim is released
    when the block ends, however it ends."""
    claim = acquire(Path(path), timeout_s, heartbeat_s)
    try:
        yield claim
    finally:
        if claim is not None:
            claim.release()


def acquire(path: Path, timeout_s: float, heartbeat_s: float) -> Claim | None:
    """Claim ``path`` (``O_EXCL`` create, or take over a stale claim); ``None`` if it is held."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(3):
        token = uuid.uuid4().hex
        if _create(path, token):
            return Claim(path, token, heartbeat_s)
        try:
            raw, inode = path.read_bytes(), path.stat().st_ino
        except FileNotFoundError:
            continue  # released meanwhile: compete again
        info = read_claim(path)
        reason = stale_reason(info, timeout_s) if info else None
        if reason is None:
            return None
        if _take_over(path, raw, inode):
            log.warning("%s: took over the claim of %s pid %d (%s)", path, info.host, info.pid, reason)
    return None


def _create(path: Path, token: str) -> bool:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except FileExistsError:
        return False
    try:
        body = {"host": host_name(), "pid": os.getpid(), "started": time.time(), "token": token}
        os.write(fd, json.dumps(body).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    return True


def _take_over(path: Path, examined: bytes, inode: int) -> bool:
    """Remove the stale claim at ``path`` if it is still the one examined (content and inode)."""
    aside = path.with_name(f"{path.name}.stale-{uuid.uuid4().hex[:12]}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return False  # another taker moved it first
    try:
        same = aside.read_bytes() == examined and aside.stat().st_ino == inode
        if not same:  # a fresh claim replaced the stale one meanwhile: put it back, never over a newer one
            with contextlib.suppress(FileExistsError):
                os.link(aside, path)
        return same
    finally:
        with contextlib.suppress(FileNotFoundError):
            aside.unlink()


def _fs_now(folder: Path) -> float:
    """The current time by the clock that stamps mtimes in ``folder`` (the file server's)."""
    probe = folder / f".clock-{host_name()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError:
        return time.time()
    try:
        return os.fstat(fd).st_mtime
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            probe.unlink()


def _process_alive(pid: int, started: float) -> bool:
    """Whether process ``pid`` on this host exists and is the one that started at ``started``."""
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return False
        return process.create_time() <= started + 1.0  # a later process reuses the pid
    except psutil.NoSuchProcess:
        return False
    except (psutil.AccessDenied, OSError):
        return True


def reap_stale(folder: str | os.PathLike, timeout_s: float) -> list[ClaimInfo]:
    """Remove the stale claims in ``folder`` (left by processes killed after their result was
    published, which no later run would otherwise touch); return what was removed. Uses the same
    atomic takeover as ``acquire``, so a claim refreshed meanwhile is left alone."""
    removed = []
    for path in sorted(Path(folder).glob("*.claim")) if Path(folder).is_dir() else ():
        try:
            raw, inode = path.read_bytes(), path.stat().st_ino
        except FileNotFoundError:
            continue
        info = read_claim(path)
        if info is not None and stale_reason(info, timeout_s) and _take_over(path, raw, inode):
            removed.append(info)
    return removed


def claims_in(folder: str | os.PathLike) -> list[ClaimInfo]:
    """Every claim in ``folder`` (for ``stage=verify``)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    infos = (read_claim(p) for p in sorted(folder.glob("*.claim")))
    return [i for i in infos if i is not None]
