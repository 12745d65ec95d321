"""Claims on units of work that hold across the nodes of a cluster (NFS, Lustre, GPFS).

``fcntl.flock`` is not honoured across nodes by many cluster file systems. A claim on unit U is
one file with two names in the claims folder: its own unique name ``U.claim.<token>`` and the
shared name ``U.claim``. It holds the claimant's host, pid, start time, boot id, PID namespace
and a random token. While the claim is held, a background thread refreshes its mtime every
``heartbeat_s`` seconds (through the unique name, so it can never touch another claim).

Protocol (every step is one atomic operation on NFSv3+, Lustre, GPFS and local disks):
- **Create**: write the body to ``U.claim.<token>`` (``O_EXCL``), then ``os.link`` it to
  ``U.claim``, which fails when the shared name exists: exactly one creator wins.
- **Ticket**: whoever removes or replaces generation X of ``U.claim`` (a taker of a stale
  claim, or X's holder releasing it) first renames X's unique name ``U.claim.<X>`` to a ticket
  ``U.claim.<X>.taken-<own token>``. Only one rename of one name can succeed, so generation X
  has at most one ticket holder; a holder whose unique name is gone has lost. Nobody modifies
  ``U.claim`` without the ticket of the generation it holds, and creators only make it when it
  is absent, so while a ticket is held ``U.claim`` is still X (checked by inode anyway).
- **Take over** (X stale, see below): take X's ticket; write one's own claim under its unique
  name; link it to a swap name and ``os.rename`` that onto ``U.claim``, which replaces X in one
  step: ``U.claim`` is never absent, so no third process can slip a claim into a gap, and a
  holder never reads a gap. Then drop the ticket (X's inode).
- **Release**: take one's own ticket (fails: taken over, touch nothing), unlink ``U.claim``
  (still this claim's inode), drop the ticket.
- **Lost**: ``Claim.lost`` only after ``LOST_READS`` consecutive reads of ``U.claim`` that
  found it absent or holding another token; a read that fails otherwise (a transient NFS error)
  proves nothing and is not counted.
- A ticket whose taker died between its two steps is stolen (renamed to the stealer's ticket)
  once it is older than the timeout; the paused taker checks its ticket before the swap. A
  process paused for longer than the timeout exactly between that check and its swap is the one
  case a claim cannot fence; publication itself is fenced (``atomic.py``).
- An old-format claim (one name only) has a ticket of a fixed name, made by ``os.link`` from the
  shared name (exclusive) and kept only if it is the inode judged stale.

A claim is stale, and may be taken over, when
- its heartbeat is older than ``timeout_s`` (the claimant died, hung, or lost its node), judged
  against the file server's clock (the mtime of a probe file just written), not the local one;
- or it was made on this host, in this boot (``/proc/sys/kernel/random/boot_id``) and this PID
  namespace, by a process that no longer exists (taken over at once). A claim of another boot or
  namespace on the same host name (containers) is judged by its heartbeat only.

Waiting (``wait_for_claims``): a stage that found units claimed by live processes elsewhere does
not report done while they are unpublished: it polls their claims until each unit is published,
or its claim is released or goes stale (then it takes the unit over), and raises
``HeldElsewhereError`` naming the units and their holders after ``claims.wait_s``.

Litter (``litter``): tickets, orphaned unique names and probes older than the timeout; reaped
by the next run of a stage, counted by verify.

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
from typing import Callable, Hashable, Iterator, Mapping, TypeVar

import psutil

from benchmark.core.store.errors import StoreError

HOST_ENV = "POSTERIOR_BENCH_HOST"
DEFAULT_TIMEOUT_S = 300.0  # a claim not refreshed for this long is taken over (config: claims.timeout_s)
DEFAULT_HEARTBEAT_S = 30.0  # a held claim is refreshed this often (config: claims.heartbeat_s)
LOST_READS = 3  # consecutive reads that must find another token before a claim counts as lost
LOST_READ_GAP_S = 0.05  # pause between those reads
TICKET = ".taken-"
SWAP = ".swap-"
log = logging.getLogger(__name__)


def _pause(point: str) -> None:
    """Test hook: called at the protocol's dangerous points (tests interleave processes there)."""


def host_name() -> str:
    """This process's host name for claims: ``$POSTERIOR_BENCH_HOST`` or the machine's name."""
    return os.environ.get(HOST_ENV) or socket.gethostname()


def boot_id() -> str:
    """This machine's boot id (Linux), ``""`` where there is none."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def pid_namespace() -> str:
    """This process's PID namespace (``pid:[4026531836]`` on Linux), ``""`` where unknown."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


@dataclass(frozen=True)
class ClaimInfo:
    """What a claim file says, and how old its heartbeat is (seconds, by the file server's clock)."""

    path: Path
    host: str
    pid: int
    started: float
    token: str
    heartbeat_age_s: float
    boot: str = ""
    pidns: str = ""


def _parse(raw: bytes) -> dict | None:
    try:
        data = json.loads(raw)
        return data if isinstance(data, dict) else None
    except ValueError:
        return None


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
        data = _parse(raw) or {}
        host, pid, started, token = str(data["host"]), int(data["pid"]), float(data["started"]), str(data["token"])
        boot, pidns = str(data.get("boot", "")), str(data.get("pidns", ""))
    except (KeyError, TypeError, ValueError):
        host, pid, started, token, boot, pidns = "?", 0, mtime, "", "", ""
    return ClaimInfo(path, host, pid, started, token, max(0.0, _fs_now(path.parent) - mtime), boot, pidns)


def same_process_space(info: ClaimInfo) -> bool:
    """Whether ``info``'s pid can be judged here: same host name, and the same boot and PID
    namespace where the claim records them (a claim without them, of an older version, is
    judged by host name alone, as that version did)."""
    if info.host != host_name():
        return False
    if info.boot and info.boot != boot_id():
        return False
    return not (info.pidns and info.pidns != pid_namespace())


def stale_reason(info: ClaimInfo, timeout_s: float) -> str | None:
    """Why claim ``info`` may be taken over, or ``None`` while it is live."""
    if info.heartbeat_age_s > timeout_s:
        return f"heartbeat {info.heartbeat_age_s:.0f} s old (timeout {timeout_s:g} s)"
    if info.pid and same_process_space(info) and not _process_alive(info.pid, info.started):
        return f"process {info.pid} on this host ({info.host}) is gone"
    return None


class HeldElsewhereError(StoreError):
    """Units a stage was asked for stayed claimed by live processes elsewhere, unpublished, past
    ``claims.wait_s``: the stage did not finish them and must not report done."""


K = TypeVar("K", bound=Hashable)


def describe_holder(info: ClaimInfo | None, timeout_s: float) -> str:
    """Who holds a claim, in words (host, pid, heartbeat age; stale or not)."""
    if info is None:
        return "no claim (released)"
    stale = stale_reason(info, timeout_s)
    return (f"{info.host} pid {info.pid}, heartbeat {info.heartbeat_age_s:.0f} s old"
            + (f", stale: {stale}" if stale else ""))


def held_elsewhere(what: str, claims: Mapping[K, Path], timeout_s: float,
                   name: Callable[[K], str] = str) -> HeldElsewhereError:
    """The error of a stage (``what``) whose units ``claims`` (unit -> its claim's shared name) are
    still not published after ``claims.wait_s``, naming each unit and its holder."""
    holders = "; ".join(f"{name(key)}: {describe_holder(read_claim(path), timeout_s)}" for key, path in claims.items())
    return HeldElsewhereError(
        f"{what}: {len(claims)} unit(s) this job was asked for are still claimed by other processes and not "
        f"published after claims.wait_s: {holders}. This job did not do them: if those processes are gone, "
        f"their claims go stale after claims.timeout_s={timeout_s:g} s and the same command then takes them "
        "over; stage=verify lists what is missing")


def wait_for_claims(claims: Mapping[K, Path], done: Callable[[K], bool], timeout_s: float, deadline: float,
                    poll_s: float, what: str, name: Callable[[K], str] = str) -> list[K]:
    """Wait for units claimed elsewhere (``claims``: unit -> its claim's shared name) until each is
    ``done`` (published) or some can be taken: return those not done whose claim is released or
    stale (the caller claims them, taking a stale one over), ``[]`` once all are done. Logs what it
    waits for (once a minute); after ``deadline`` (``time.monotonic()``) raises
    ``HeldElsewhereError`` naming each unit still held (``name``) and its holder (``what`` names the stage)."""
    logged = None
    while True:
        pending = [k for k in claims if not done(k)]
        if not pending:
            return []
        held: dict[K, ClaimInfo] = {}
        free = []
        for key in pending:
            info = read_claim(claims[key])
            if info is None or stale_reason(info, timeout_s):
                free.append(key)
            else:
                held[key] = info
        if free:
            return free
        now = time.monotonic()
        holders = "; ".join(f"{name(key)}: {describe_holder(info, timeout_s)}" for key, info in held.items())
        if now >= deadline:
            raise held_elsewhere(what, {key: claims[key] for key in held}, timeout_s, name)
        if logged is None or now - logged >= 60:
            log.info("%s: waiting for %d unit(s) claimed by other processes (until each is published or its claim "
                     "goes stale, claims.timeout_s=%g s; at most %.0f s more): %s", what, len(held), timeout_s,
                     deadline - now, holders)
            logged = now
        time.sleep(max(0.0, min(poll_s, deadline - now)))


def _unique(path: Path, token: str) -> Path:
    return path.with_name(f"{path.name}.{token}")


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
        """True once the claim was found taken over (or removed) on ``LOST_READS`` consecutive
        reads: do not publish the result."""
        if not self._lost and self._confirmed_lost():
            self._lost = True
        return self._lost

    def _read_token(self) -> str | None:
        """The token at the shared name; ``""`` when absent; ``None`` when the read failed."""
        try:
            data = _parse(self.path.read_bytes())
        except FileNotFoundError:
            return ""
        except OSError:
            return None
        return str(data.get("token", "")) if data else None  # half-written: proves nothing

    def _confirmed_lost(self) -> bool:
        for attempt in range(LOST_READS):
            token = self._read_token()
            if token is None or token == self.token:
                return False
            if attempt + 1 < LOST_READS:
                time.sleep(LOST_READ_GAP_S)
        return True

    def _beat(self, interval: float) -> None:
        while not self._stop.wait(interval):
            if self.lost:  # the stage that holds it says so, once, naming its unit
                log.debug("%s: this claim was taken over by another process; its unit is stopped", self.path)
                return
            with contextlib.suppress(OSError):
                os.utime(_unique(self.path, self.token))

    def release(self) -> None:
        """Stop the heartbeat and remove the claim if it is still this claim (module doc: release)."""
        self._stop.set()
        self._thread.join()
        ticket = _take_ticket(self.path, self.token, self.token)
        if ticket is None:
            return  # taken over: the shared name is another claim's now
        _pause("release-ticket")
        try:
            if _same_file(self.path, ticket):
                self.path.unlink()
        finally:
            with contextlib.suppress(FileNotFoundError):
                ticket.unlink()


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
    """Claim ``path`` (create, or take over a stale claim); ``None`` if it is held."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(3):
        token = uuid.uuid4().hex
        own = _write_body(path, token)
        try:
            os.link(own, path)
        except FileExistsError:
            pass
        else:
            return Claim(path, token, heartbeat_s)
        info = read_claim(path)
        if info is None:
            own.unlink()
            continue  # released meanwhile: compete again
        try:
            st = path.stat()
        except FileNotFoundError:
            own.unlink()
            continue
        reason = stale_reason(info, timeout_s)
        if reason is None:
            own.unlink()
            return None
        _pause("examined")
        if _take_over(path, info, st.st_ino, st.st_nlink, own, timeout_s):
            log.warning("%s: took over the claim of %s pid %d (%s)", path, info.host, info.pid, reason)
            return Claim(path, token, heartbeat_s)
        own.unlink()
        return None
    return None


def _write_body(path: Path, token: str) -> Path:
    own = _unique(path, token)
    fd = os.open(own, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        body = {"host": host_name(), "pid": os.getpid(), "started": time.time(), "token": token,
                "boot": boot_id(), "pidns": pid_namespace()}
        os.write(fd, json.dumps(body).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    return own


def _same_file(a: Path, b: Path) -> bool:
    try:
        sa, sb = a.stat(), b.stat()
    except FileNotFoundError:
        return False
    return (sa.st_ino, sa.st_dev) == (sb.st_ino, sb.st_dev)


def _take_ticket(path: Path, token: str, taker: str) -> Path | None:
    """Rename generation ``token``'s unique name to ``taker``'s ticket; ``None`` if another
    process took it first (or the generation is gone)."""
    ticket = path.with_name(f"{path.name}.{token}{TICKET}{taker}")
    try:
        os.rename(_unique(path, token), ticket)
    except FileNotFoundError:
        return None
    return ticket


def _ticket_for(path: Path, info: ClaimInfo, inode: int, nlink: int, taker: str, timeout_s: float) -> Path | None:
    """The ticket of the generation ``info`` (``inode``) of ``path`` for ``taker``, or ``None``.

    A claim of this protocol has two names (``nlink >= 2``): its ticket is a rename of its unique
    name (or the theft of a dead taker's ticket). An old-format claim (one name) gets a ticket of
    a fixed name by ``os.link`` from the shared name (exclusive), kept only if it is ``inode``."""
    token = info.token or "unnamed"
    if nlink >= 2:
        return _take_ticket(path, token, taker) or _steal_ticket(path, token, taker, timeout_s)
    ticket = path.with_name(f"{path.name}.{token}{TICKET}old-format")
    try:
        os.link(path, ticket)
    except (FileExistsError, FileNotFoundError):
        return None
    if ticket.stat().st_ino != inode:  # the shared name was replaced meanwhile: not ours
        ticket.unlink()
        return None
    return ticket


def _steal_ticket(path: Path, token: str, taker: str, timeout_s: float) -> Path | None:
    """Take over a ticket of generation ``token`` whose taker died (older than ``timeout_s``)."""
    now = _fs_now(path.parent)
    for old in sorted(path.parent.glob(f"{path.name}.{token}{TICKET}*")):
        try:
            if now - old.stat().st_ctime <= timeout_s:
                continue
            ticket = path.with_name(f"{path.name}.{token}{TICKET}{taker}")
            os.rename(old, ticket)
            return ticket
        except FileNotFoundError:
            continue
    return None


def _take_over(path: Path, info: ClaimInfo, inode: int, nlink: int, own: Path, timeout_s: float) -> bool:
    """Replace stale generation ``info.token`` (``inode``) of ``path`` by the claim at ``own``
    (module doc: ticket, then one rename onto the shared name). False: someone else did."""
    taker = own.name.rsplit(".", 1)[1]
    ticket = _ticket_for(path, info, inode, nlink, taker, timeout_s)
    if ticket is None:
        return False
    try:
        if ticket.stat().st_ino != inode or not _same_file(path, ticket):
            return False  # not the generation judged stale
        _pause("ticket")
        swap = path.with_name(f"{own.name}{SWAP}{uuid.uuid4().hex[:8]}")
        os.link(own, swap)
        if not ticket.exists():  # stolen while this process was paused: not ours to replace
            swap.unlink()
            return False
        os.rename(swap, path)
        return True
    finally:
        with contextlib.suppress(FileNotFoundError):
            ticket.unlink()


def fs_now(folder: str | os.PathLike) -> float:
    """The current time by the clock that stamps mtimes in ``folder`` (the file server's)."""
    return _fs_now(Path(folder))


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
    published, which no later run would otherwise touch); return what was removed. Uses the
    ticket of each stale generation (module doc), so a claim refreshed or replaced meanwhile is
    left alone."""
    removed = []
    for path in sorted(Path(folder).glob("*.claim")) if Path(folder).is_dir() else ():
        info = read_claim(path)
        if info is None or not stale_reason(info, timeout_s):
            continue
        try:
            st = path.stat()
        except FileNotFoundError:
            continue
        ticket = _ticket_for(path, info, st.st_ino, st.st_nlink, uuid.uuid4().hex, timeout_s)
        if ticket is None:
            continue
        try:
            if ticket.stat().st_ino == st.st_ino and _same_file(path, ticket):
                path.unlink()
                removed.append(info)
        finally:
            with contextlib.suppress(FileNotFoundError):
                ticket.unlink()
    return removed


def litter(folder: str | os.PathLike, timeout_s: float) -> list[Path]:
    """Files of the claim protocol left behind in ``folder`` by killed processes, older than
    ``timeout_s``: tickets, swap names, unique names whose claim is gone, old-format
    ``*.claim.stale-*``, clock and write probes. Never a live claim's names."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    now, out = _fs_now(folder), []
    for entry in sorted(folder.iterdir()):
        name = entry.name
        probe = name.startswith((".clock-", ".write-probe-"))
        if not (probe or ".claim." in name):
            continue
        try:
            st = entry.stat()
        except FileNotFoundError:
            continue
        changed = max(st.st_mtime, st.st_ctime) if TICKET in name else st.st_mtime  # a ticket keeps the stale claim's mtime
        unique = not probe and TICKET not in name and SWAP not in name and ".stale-" not in name
        if unique:
            shared = folder / name[: name.index(".claim.") + len(".claim")]
            if _same_file(shared, entry):
                continue  # the unique name of a (stale but not yet reaped) claim: reap_stale's job
            if now - changed <= timeout_s and not _dead_here(entry):
                continue  # a claim being created (its link to the shared name comes next)
        elif now - changed <= timeout_s:
            continue
        out.append(entry)
    return out


def _dead_here(path: Path) -> bool:
    """Whether the claim body at ``path`` was written by a process of this host, boot and PID
    namespace that is gone (its creator was killed before linking it)."""
    info = read_claim(path)
    return info is not None and bool(info.pid) and same_process_space(info) and not _process_alive(info.pid, info.started)


def claims_in(folder: str | os.PathLike) -> list[ClaimInfo]:
    """Every claim in ``folder`` (for ``stage=verify``)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    infos = (read_claim(p) for p in sorted(folder.glob("*.claim")))
    return [i for i in infos if i is not None]
