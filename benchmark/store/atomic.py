"""Atomic file writes: write to a temp file in the target folder, fsync, then rename."""
from __future__ import annotations

import contextlib
import os
import uuid
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; on success rename it onto ``path``.

    The temp file lives in the same folder (same file system, so ``os.replace`` is atomic)
    and is removed if the body raises, so a killed or failed write never leaves a partial
    file under the final name. Readers either see the old file, the new one, or none.
    """
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        yield tmp
        with open(tmp, "rb+") as fh:
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
    return path.name.startswith(".") and ".tmp-" in path.name
