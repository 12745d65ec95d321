"""Benchmark of reading an import archive (run by ``make bench``; prints figures, exits 0).

A ``.tgz`` of ``--members`` checkpoint files (``model_<i>.safetensors`` of ``--member-kb`` KB of
random float16, incompressible like trained weights) whose members are stored in a shuffled
order, as ``tar czf`` stores a folder (directory order, not sorted). Two ways to read every
member, side by side in one process:

- before: list the members (``getmembers``), then ``extractfile`` them in natural order of their
  names (what ``stage=import`` did): each member stored before the previous one seeks the gzip
  stream backwards, which decompresses it again from the start: quadratic in the archive;
- now: ``scan_source`` (one listing pass) then ``iter_checkpoints`` (one forward pass in the
  archive's own order; seeds are mapped from the names).

Prints the time of each (median of ``--repeats``) and the compressed bytes each read, as multiples
of the archive's size. Records the speed-up and the passes over the archive of the new reading.

Usage: ``python bench/bench_import.py [--members 300] [--member-kb 64] [--repeats 3]``. One torch thread.
"""
from __future__ import annotations

import argparse
import io
import shutil
import statistics
import sys
import tarfile
import time
from pathlib import Path

import torch
from safetensors.torch import save

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmark.core.store import importing  # noqa: E402
from benchmark.core.store.importing import iter_checkpoints, natural_key, scan_source  # noqa: E402
from summary import record  # noqa: E402  (bench/summary.py, next to this file)

WORK = REPO / "bench" / "_work" / "import"  # bench/_work is shared with other benches: only this folder is ours


def make_archive(path: Path, members: int, member_kb: int) -> list[str]:
    """Write the archive; the member names in natural order."""
    generator = torch.Generator().manual_seed(0)
    names = [f"zoo/model_{i}.safetensors" for i in range(members)]
    order = [names[i] for i in torch.randperm(members, generator=generator).tolist()]
    values = member_kb * 1024 // 2
    with tarfile.open(path, "w:gz") as tar:
        for name in order:
            data = save({"weight": torch.randn(values, generator=generator).half()})
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return names


class CountingFile(io.FileIO):
    """A file that counts the bytes read from it."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, "rb")
        self.bytes_read = 0

    def read(self, size: int = -1) -> bytes:
        data = super().read(size)
        self.bytes_read += len(data)
        return data

    def readinto(self, buffer) -> int:
        count = super().readinto(buffer) or 0
        self.bytes_read += count
        return count


def read_before(path: Path) -> int:
    """The reading pattern of stage=import before: list, then extract in natural order. Bytes read."""
    with CountingFile(path) as raw, tarfile.open(fileobj=raw) as archive:
        names = sorted((m.name for m in archive.getmembers() if m.isfile()), key=natural_key)
    with CountingFile(path) as second, tarfile.open(fileobj=second) as archive:
        members = {m.name: m for m in archive.getmembers() if m.isfile()}
        total = sum(len(archive.extractfile(members[name]).read()) for name in names)
    assert total > 0
    return raw.bytes_read + second.bytes_read


def read_now(path: Path) -> int:
    """``scan_source`` + ``iter_checkpoints`` (the listing cache cleared: a cold first run). Bytes read."""
    opened: list[CountingFile] = []
    real_open = tarfile.open

    def counting_open(name=None, mode="r", fileobj=None, **kwargs):
        if fileobj is None and name is not None:
            fileobj = CountingFile(Path(name))
            opened.append(fileobj)
        return real_open(name, mode, fileobj, **kwargs)

    importing._scan_archive.cache_clear()
    tarfile.open = counting_open
    try:
        names = list(scan_source(path).names)
        total = sum(len(file.data) for file in iter_checkpoints(path, names))
    finally:
        tarfile.open = real_open
        for handle in opened:
            handle.close()
    assert total > 0
    return sum(handle.bytes_read for handle in opened)


def timed(fn, path: Path) -> tuple[float, int]:
    start = time.perf_counter()
    read = fn(path)
    return time.perf_counter() - start, read


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--members", type=int, default=300)
    parser.add_argument("--member-kb", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    path = WORK / "zoo.tgz"
    make_archive(path, args.members, args.member_kb)
    size = path.stat().st_size
    before, now = [], []
    for _ in range(args.repeats):  # interleaved, so that a busy machine slows both alike
        before.append(timed(read_before, path))
        now.append(timed(read_now, path))
    t_before, t_now = statistics.median(t for t, _ in before), statistics.median(t for t, _ in now)
    passes_before, passes_now = before[0][1] / size, now[0][1] / size
    print(f"archive: {args.members} members of {args.member_kb} KB, {size / 2**20:.1f} MiB compressed, shuffled order")
    print(f"before (list, then natural order): {t_before:.3f} s, read {passes_before:.1f}x the archive")
    print(f"now (list, then one pass in archive order): {t_now:.3f} s, read {passes_now:.1f}x the archive")
    print(f"speed-up: {t_before / t_now:.1f}x")
    record("import", f"tgz of {args.members} members: reading speed-up (before / now)", t_before / t_now, None)
    record("import", f"tgz of {args.members} members: compressed bytes read / archive size", passes_now, 2.5,
           higher_is_better=False)
    shutil.rmtree(WORK, ignore_errors=True)


if __name__ == "__main__":
    main()
