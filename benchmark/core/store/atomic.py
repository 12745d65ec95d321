"""Atomic file writes: write to a temp file in the target folder, fsync, then rename.

Files get the permissions any other tool writing the folder would give them: the temp file is
created with mode 0666 filtered by the process umask (or the folder's default ACL), and that
mode is restored if the writer (safetensors creates its files 0600) changed it.
"""
from __future__ import annotations

import contextlib
import os
import uuid
from pathlib import Path
from typing import Iterator

TEMP_MARK = ".tmp-"


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; on success rename it onto ``path``.

    The temp file lives in the same folder (same file system, so ``os.replace`` is atomic)
    and is removed if the body raises, so a killed or failed write never leaves a partial
    file under the final name. Readers either see the old file, the new one, or none.
    """
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}{TEMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the kernel applies umask / default ACL
    mode = os.fstat(fd).st_mode & 0o7777
    os.close(fd)
    try:
        yield tmp
        with open(tmp, "rb+") as fh:
            if os.fstat(fh.fileno()).st_mode & 0o7777 != mode:
                os.fchmod(fh.fileno(), mode)
            os.fsync(fh.fileno())
        os.replace(tmp, final)
        _fsync_dir(final.parent)
    finally:
        if tmp.exists():
            tmp.unlink()


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def _fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


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
