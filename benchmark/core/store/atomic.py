"""Atomic file writes: write to a temp file in the target folder, fsync, then rename.

Fenced publication (``atomic_path(path, exclusive=True)``) for the results of units of work
(checkpoints, failure records, sample sets, predictions): the temp file is published with
``os.link(tmp, final)``, which fails when ``final`` exists, so a late writer (a worker paused
past its claim's timeout, whose unit another worker redid and published) can never replace a
published file. "Already exists" means someone published the unit first; results are
deterministic, so the first stands: the late writer's temp file is dropped and
``AlreadyPublishedError`` is raised for its caller to log in one line. A unit's stale files
must be removed (under its claim) before it is redone. On a file system without hard links
(``os.link`` fails with EPERM/EOPNOTSUPP: some FUSE and SMB mounts) the fallback checks that
``final`` is absent, then renames: a window of microseconds instead of none, logged once.

Files get the permissions any other tool writing the folder would give them: the temp file is
created with mode 0666 filtered by the process umask (or the folder's default ACL), and that
mode is restored if the writer (safetensors creates its files 0600) changed it.
"""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Iterator

TEMP_MARK = ".tmp-"
NO_HARD_LINKS = frozenset({errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV, errno.EMLINK})
log = logging.getLogger(__name__)
_warned_no_links: set[str] = set()


class AlreadyPublishedError(FileExistsError):
    """A fenced publication found its final file already published (by another worker)."""


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, exclusive: bool = False) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; on success rename it onto ``path``.

    The temp file lives in the same folder (same file system, so ``os.replace`` is atomic)
    and is removed if the body raises, so a killed or failed write never leaves a partial
    file under the final name. Readers either see the old file, the new one, or none.
    ``exclusive``: fenced publication (module doc): never replace an existing ``path``; raises
    ``AlreadyPublishedError`` (the temp file removed) when it exists.
    """
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}{TEMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the kernel applies umask / default ACL
    mode = os.fstat(fd).st_mode & 0o7777
    os.close(fd)
    try:
        try:
            yield tmp
            with open(tmp, "rb+") as fh:
                if os.fstat(fh.fileno()).st_mode & 0o7777 != mode:
                    os.fchmod(fh.fileno(), mode)
                os.fsync(fh.fileno())
            if exclusive:
                _publish_exclusive(tmp, final)
            else:
                os.replace(tmp, final)
            _fsync_dir(final.parent)
        except OSError as err:
            if err.filename is not None or isinstance(err, AlreadyPublishedError):
                raise
            # e.g. "No space left on device" from a writer that names no file: name the one being written
            raise type(err)(err.errno, f"{err.strerror or err} (writing {final})", str(final)) from err
    finally:
        if tmp.exists():
            tmp.unlink()


def _publish_exclusive(tmp: Path, final: Path) -> None:
    try:
        os.link(tmp, final)
    except FileExistsError:
        raise AlreadyPublishedError(f"{final}: already published by another worker; this copy was dropped") from None
    except OSError as err:
        if err.errno not in NO_HARD_LINKS:
            raise
        if str(final.parent) not in _warned_no_links:
            _warned_no_links.add(str(final.parent))
            log.warning("%s: no hard links on this file system; publishing by check-then-rename", final.parent)
        if final.exists():
            raise AlreadyPublishedError(f"{final}: already published by another worker; this copy was dropped") from None
        os.rename(tmp, final)
        return
    tmp.unlink()


def atomic_write_text(path: str | os.PathLike, text: str, exclusive: bool = False) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically (``exclusive``: fenced, see ``atomic_path``)."""
    with atomic_path(path, exclusive) as tmp:
        tmp.write_text(text, encoding="utf-8")


def _fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def broken_link(path: str | os.PathLike) -> str | None:
    """Why ``path`` is a symlink that leads nowhere (its target missing, or a loop of links), in
    one line naming it; ``None`` for anything else (a symlink to a file is followed)."""
    path = Path(path)
    if not path.is_symlink():
        return None
    try:
        path.stat()
    except OSError as err:
        return f"{path}: a symlink that leads nowhere ({err.strerror or err})"
    return None


def clear_non_file(path: str | os.PathLike) -> str | None:
    """Remove what stands at ``path`` in place of a regular file (a directory, a dangling
    symlink or a symlink loop), so that a cache can be written there again; what was removed
    (``None``: nothing there, or a regular file, or a symlink to one)."""
    path = Path(path)
    broken = broken_link(path)
    if broken:
        path.unlink()
        return f"{broken}; removed"
    if path.is_symlink():
        return None  # a symlink to a file: followed
    if path.is_dir():
        shutil.rmtree(path)
        return f"{path}: a directory in place of a file; removed"
    return None


def is_temp_file(path: Path) -> bool:
    """True for the hidden temp files ``atomic_path`` creates (left only by a hard kill)."""
    return path.name.startswith(".") and TEMP_MARK in path.name


def temp_files_of(path: str | os.PathLike) -> list[Path]:
    """Temp files that writes of ``path`` left behind (a writer killed mid-write), sorted."""
    final = Path(path)
    if not final.parent.is_dir():
        return []
    return sorted(final.parent.glob(f".{final.name}{TEMP_MARK}*"))


def remove_temp_files_of(path: str | os.PathLike) -> list[Path]:
    """Remove what ``temp_files_of(path)`` lists; return them. Call it only while holding the
    claim on ``path``'s unit of work: a temp file of a live writer would be pulled from under it."""
    removed = []
    for tmp in temp_files_of(path):
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
            removed.append(tmp)
    return removed
