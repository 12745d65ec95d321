"""Quarantine: a file that fails validation is moved to ``quarantine/`` beside it, with a JSON
record of why, when and by whom, so that the stage that owns it redoes its unit of work and
the evidence is kept for a person to look at (or to move back by hand).

```
<folder>/seed_000007.safetensors  ->  <folder>/quarantine/seed_000007.safetensors
                                      <folder>/quarantine/seed_000007.json   {"reason", "time", "host", ...}
```

A second quarantine of the same name gets ``seed_000007-2.safetensors`` and so on. The
destination is reserved atomically (``os.link``, which fails when the name exists, then the
original name is removed), so two quarantines of one name, by two processes or nodes at once,
never overwrite each other's evidence. Move a file only while holding the claim on its unit of
work (``claims.py``), so that no other process is writing it at the same moment.
"""
from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from benchmark.core.store.atomic import NO_HARD_LINKS, atomic_write_text, is_temp_file
from benchmark.core.store.claims import host_name

FOLDER = "quarantine"


@dataclass(frozen=True)
class Quarantined:
    """A quarantined file and its record (``reason`` etc.; empty if the record is missing)."""

    path: Path
    record: dict

    @property
    def reason(self) -> str:
        return str(self.record.get("reason", "unknown (no record)"))


def _record_path(dest: Path) -> Path:
    return dest.with_name(dest.name + ".reason.json") if dest.suffix == ".json" else dest.with_suffix(".json")


def _candidates(folder: Path, name: str) -> Iterator[Path]:
    stem, dot, suffix = name.partition(".")
    for n in range(1, 10_000):
        yield folder / (name if n == 1 else f"{stem}-{n}{dot}{suffix}")


def _move_to_free_name(path: Path, folder: Path) -> Path:
    """Move ``path`` to the first free name in ``folder``; the name is taken by ``os.link``
    (atomic, fails if it exists), so a concurrent quarantine can never take the same one."""
    for dest in _candidates(folder, path.name):
        if _record_path(dest).exists():
            continue
        try:
            os.link(path, dest, follow_symlinks=False)  # a symlink is moved as itself, even one leading nowhere
        except FileExistsError:
            continue
        except OSError as err:
            if err.errno not in NO_HARD_LINKS:
                raise
            stem, dot, suffix = path.name.partition(".")
            dest = folder / f"{stem}-{host_name()}-{os.getpid()}-{uuid.uuid4().hex[:8]}{dot}{suffix}"
            os.rename(path, dest)  # no hard links here: a name of its own instead
            return dest
        path.unlink()
        return dest
    raise FileExistsError(f"{folder}: no free name for {path.name}")


def quarantine(path: str | os.PathLike, reason: str) -> Path:
    """Move ``path`` into ``quarantine/`` beside it and write its record; return the new path.

    Raises ``FileNotFoundError`` if ``path`` is gone (another process moved or replaced it).
    """
    path = Path(path)
    folder = path.parent / FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    dest = _move_to_free_name(path, folder)
    record = {
        "file": path.name, "from": str(path), "reason": reason, "host": host_name(), "pid": os.getpid(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    atomic_write_text(_record_path(dest), json.dumps(record, indent=2, sort_keys=True) + "\n")
    return dest


def quarantined(folder: str | os.PathLike, suffix: str = ".safetensors") -> list[Quarantined]:
    """The files ending in ``suffix`` quarantined from ``folder``, with their records, sorted by name."""
    qdir = Path(folder) / FOLDER
    if not qdir.is_dir():
        return []
    out = []
    for path in sorted(qdir.iterdir()):
        if not path.name.endswith(suffix) or path.name.endswith(".reason.json") or is_temp_file(path):
            continue
        if suffix != ".json" and path.suffix == ".json":
            continue
        try:
            record = json.loads(_record_path(path).read_text())
        except (OSError, ValueError):
            record = {}
        out.append(Quarantined(path, record))
    return out

