"""Benchmark of the store's content checksums (run by ``make bench``; prints ratios, exits 0).

The cost of verifying a checkpoint's checksums on read, on a ResNet-18 (CIFAR-100 head, 45 MB):
``load_checkpoint(path, model)`` (which also checks keys, shapes and finite values) of one file,
once with its checksums verified (the per-process memo of verified files cleared first) and once
without (the memo filled: what a second read of an unchanged file costs). Both from the page cache
("warm": the load runs at memory speed, the worst case for the ratio) and from disk ("cold": the
file's pages dropped with ``posix_fadvise(DONTNEED)`` before each read, as on a first read from a
cluster file system). The two reads of each pair run back to back; the printed cost is the median
over pairs of (verified / unverified - 1). For comparison, the time zlib.crc32 and BLAKE2b
(hashlib) take over the same bytes. Goal: verification under 10% of the load time. Then what
reading into the process's own memory (the store's readers) costs against a memory-mapped read,
both with the checksum pass (no goal: the price of never being killed by a file changed under a
mapping).

Usage: ``python bench/bench_store.py [--repeats 30]``. One torch thread.
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

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmark.core.models import resnet18  # noqa: E402
from benchmark.core.store import load_checkpoint, save_checkpoint  # noqa: E402
from benchmark.core.store.checksum import forget_all, tensor_digest  # noqa: E402
from summary import record  # noqa: E402  (bench/summary.py, next to this file)

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
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    torch.manual_seed(0)
    model = resnet18(num_classes=100)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    path = WORK / "seed_000000.safetensors"
    save_checkpoint(path, state, {"seed": 0})
    size_mb = path.stat().st_size / 1e6
    loaded = {k: v.clone() for k, v in load_checkpoint(path, model)[0].items()}  # no live mmap of the file
    buffers = [v.reshape(-1).view(torch.uint8).numpy() for v in loaded.values()]

    def verified() -> None:
        forget_all()
        load_checkpoint(path, model)

    def unverified() -> None:  # the memo holds this version of the file: no hashing
        load_checkpoint(path, model)

    def crc32() -> None:
        value = 0
        for b in buffers:
            value = zlib.crc32(b, value)

    def blake2b() -> None:
        digest = hashlib.blake2b()
        for b in buffers:
            digest.update(b)

    times: dict[str, list[float]] = {k: [] for k in ("warm unverified", "warm verified", "cold unverified",
                                                      "cold verified", "xxh3 alone", "crc32 alone", "blake2b alone")}
    verified()  # warm-up; fills the memo
    for i in range(args.repeats):
        order = ("unverified", "verified") if i % 2 == 0 else ("verified", "unverified")
        for which in order:
            fn = verified if which == "verified" else unverified
            times[f"warm {which}"].append(timed(fn))
        for which in order:
            fn = verified if which == "verified" else unverified
            if which == "unverified":
                verified()  # refill the memo (it is the real second-read path)
            drop_cache(path)
            times[f"cold {which}"].append(timed(fn))
        times["xxh3 alone"].append(timed(lambda: [tensor_digest(v) for v in loaded.values()]))
        times["crc32 alone"].append(timed(crc32))
        times["blake2b alone"].append(timed(blake2b))
    print(f"ResNet-18 checkpoint ({size_mb:.1f} MB, {len(state)} tensors), {args.repeats} pairs, median (fastest):")
    for k, v in times.items():
        print(f"  {k:<16} {statistics.median(v) * 1e3:8.2f} ms ({min(v) * 1e3:.2f} ms)")
    cost = {}
    for where in ("warm", "cold"):
        pairs = [v / u - 1 for v, u in zip(times[f"{where} verified"], times[f"{where} unverified"])]
        cost[where] = statistics.median(pairs)
        print(f"checksum verification cost, {where:<4}: {cost[where]:+.1%} of load_checkpoint (median over pairs; "
              f"quartiles {statistics.quantiles(pairs, n=4)[0]:+.1%} .. {statistics.quantiles(pairs, n=4)[2]:+.1%})")
    warm_load = statistics.median(times["warm unverified"])
    for name in ("xxh3", "crc32", "blake2b"):
        alone = statistics.median(times[f"{name} alone"])
        print(f"  {name:<8} hashing alone = {alone / warm_load:.1%} of the warm load, "
              f"{alone / statistics.median(times['xxh3 alone']):.1f}x xxh3")
    for where, label in (("cold", "from disk"), ("warm", "page-cached")):
        record("store", f"checksum verification cost of a ResNet-18 checkpoint read, {label}", cost[where], 0.10,
               unit="", higher_is_better=False)
    verdict = "under" if max(cost.values()) < 0.10 else "over"
    print(f"verdict: {verdict} the 10% goal (warm {cost['warm']:+.1%}, disk {cost['cold']:+.1%})")
    own_memory_cost(path, args.repeats)
    shutil.rmtree(WORK, ignore_errors=True)


def own_memory_cost(path: Path, repeats: int) -> None:
    """What reading into fresh memory (``FileReader.tensors``, what the store's readers do: a file
    changed or removed on another node cannot alter what was read or kill the reader with SIGBUS)
    costs against safetensors' memory-mapped ``get_tensor``, each followed by the checksum pass that
    every read makes (which touches every page of the mapping), page-cached, alternating."""
    from safetensors import safe_open

    from benchmark.core.store.blocks import FileReader

    def mapped() -> None:
        with safe_open(str(path), framework="pt") as fh:
            [tensor_digest(fh.get_tensor(k)) for k in fh.keys()]

    def own() -> None:
        with FileReader(path) as reader:
            [tensor_digest(v) for v in reader.tensors().values()]

    mapped(), own()
    pairs = []
    for i in range(repeats):
        a, b = (timed(mapped), timed(own)) if i % 2 == 0 else tuple(reversed((timed(own), timed(mapped))))
        pairs.append((a, b))
    ratio = statistics.median(b / a for a, b in pairs)
    print(f"read + checksums, page-cached: memory-mapped {statistics.median(a for a, _ in pairs) * 1e3:.2f} ms, "
          f"own memory {statistics.median(b for _, b in pairs) * 1e3:.2f} ms ({ratio:.2f}x, median over pairs)")
    record("store", "own-memory read + checksums vs memory-mapped, a page-cached ResNet-18 checkpoint", ratio, None,
           higher_is_better=False)


if __name__ == "__main__":
    main()
