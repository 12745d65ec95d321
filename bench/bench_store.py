"""Benchmark of the store's content checksums (run by ``make bench``; prints ratios, exits 0).

The cost of verifying a checkpoint's checksums on read, on a ResNet-18 (CIFAR-100 head, 45 MB):
``load_checkpoint(path, model)`` (keys, shapes, finite values) of a file without checksums vs the
same file with them (XXH3-64 of every tensor, verified on every read; the per-process memo of
verified files is cleared before each read). Both from the page cache ("warm", the worst case for
the ratio: the load itself runs at memory speed) and from disk ("cold": the file's pages dropped
with ``posix_fadvise(DONTNEED)`` before each read, as on a first read from a cluster file system).
For comparison, the time zlib.crc32 and BLAKE2b (hashlib) take over the same bytes, as a ratio of
the warm load. Goal: verification under 10% of the load time (see the printed verdict).

Usage: ``python bench/bench_store.py [--repeats 15]``. One torch thread; medians of interleaved runs.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import sys
import time
import zlib
from pathlib import Path

import torch
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmark.models import resnet18  # noqa: E402
from benchmark.store import load_checkpoint, save_checkpoint  # noqa: E402
from benchmark.store.checksum import forget_all, tensor_digest  # noqa: E402

WORK = REPO / "bench" / "_work" / "store"  # bench/_work is shared with other benches: only this folder is ours


def drop_cache(path: Path) -> None:
    """Evict ``path`` from the page cache (the next read comes from disk)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    torch.manual_seed(0)
    model = resnet18(num_classes=100)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    plain, checked = WORK / "plain.safetensors", WORK / "checked.safetensors"
    save_file(state, str(plain))
    save_checkpoint(checked, state, {"seed": 0})
    size_mb = checked.stat().st_size / 1e6
    loaded = {k: v.clone() for k, v in load_checkpoint(checked, model)[0].items()}  # no live mmap of the file
    buffers = [v.reshape(-1).view(torch.uint8).numpy() for v in loaded.values()]

    def verified_load():
        forget_all()
        load_checkpoint(checked, model)

    def crc32():
        value = 0
        for b in buffers:
            value = zlib.crc32(b, value)

    def blake2b():
        digest = hashlib.blake2b()
        for b in buffers:
            digest.update(b)

    times: dict[str, list[float]] = {k: [] for k in ("warm plain", "warm checked", "cold plain", "cold checked",
                                                      "xxh3 only", "crc32 only", "blake2b only")}
    verified_load()  # warm-up
    for _ in range(args.repeats):
        times["warm plain"].append(timed(lambda: load_checkpoint(plain, model)))
        times["warm checked"].append(timed(verified_load))
        drop_cache(plain)
        times["cold plain"].append(timed(lambda: load_checkpoint(plain, model)))
        drop_cache(checked)
        times["cold checked"].append(timed(verified_load))
        times["xxh3 only"].append(timed(lambda: [tensor_digest(v) for v in loaded.values()]))
        times["crc32 only"].append(timed(crc32))
        times["blake2b only"].append(timed(blake2b))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"ResNet-18 checkpoint ({size_mb:.1f} MB, {len(state)} tensors), median of {args.repeats} interleaved runs:")
    for k, v in med.items():
        print(f"  {k:<14} {v * 1e3:8.2f} ms")
    warm = med["warm checked"] / med["warm plain"] - 1
    cold = med["cold checked"] / med["cold plain"] - 1
    print(f"checksum verification cost, warm page cache: {warm:+.1%} of load_checkpoint (validation included)")
    print(f"checksum verification cost, from disk:       {cold:+.1%} of load_checkpoint")
    for name in ("xxh3", "crc32", "blake2b"):
        print(f"  {name:<8} hashing alone = {med[f'{name} only'] / med['warm plain']:.1%} of the warm load, "
              f"{med[f'{name} only'] / med['xxh3 only']:.1f}x xxh3")
    verdict = "under" if max(warm, cold) < 0.10 else "over"
    print(f"verdict: {verdict} the 10% goal (warm {warm:+.1%}, disk {cold:+.1%})")
    shutil.rmtree(WORK, ignore_errors=True)


if __name__ == "__main__":
    main()
