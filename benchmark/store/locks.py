"""Advisory per-item locks so several processes can share one store without duplicated work.

``fcntl.flock`` locks are released by the kernel when their process dies, so a killed run
never leaves a stale lock behind (the empty lock files themselves are harmless).
"""
from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def try_lock(path: str | os.PathLike) -> Iterator[bool]:
    """Try to take an exclusive lock on ``path`` without waiting; yield whether it was taken."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
