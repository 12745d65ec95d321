"""Benchmark of metrics.mmd (run by ``make bench``; prints its figures, exits 0).

1. Speed and agreement: one layer of 1000 reference + 100 method samples x 20,000 dims,
   ``metrics.mmd`` against a straightforward NumPy/SciPy version of the same 20 statistics
   (scipy ``cdist`` per distance type on the pooled sample, dense kernel matrices and block
   sums, bandwidths from ``cdist`` of the first 500 rows, as MMDAgg's reference code).
   Goals: >= 10x faster, max relative difference of the 20 values <= 1e-6.
2. Memory: one layer of 1100 x 2,359,296 (ResNet-18's largest conv, [512, 512, 3, 3]) read
   from two sample-set files in column blocks, in a subprocess so that generating the data
   does not count; prints wall time and peak RSS. Goal: peak RSS <= 4 GiB.

Usage: ``python bench/bench_mmd.py [--dims 20000] [--disk-shape 512 512 3 3] [--skip-disk]``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch
from scipy.spatial.distance import cdist

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmark.core.store import SampleSetFile, sample_set_keys  # noqa: E402
from metrics.mmd import layer_mmd, mmd, split_columns  # noqa: E402
from summary import record  # noqa: E402  (bench/summary.py, next to this file)

WORK = REPO / "bench" / "_work" / "mmd"  # bench/_work is shared with other benches: only this folder is ours
M, N = 1000, 100
KEY = "layer4.0.conv2.weight"
GIB = 2**30


def scipy_mmd_values(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """The 20 MMD^2 U-statistics the plain way: float64 cdist matrices and dense kernel sums."""
    m, n = len(x), len(y)
    pooled = np.concatenate([x, y]).astype(np.float64)
    values = []
    for metric, kernel in (("cityblock", lambda d, l: np.exp(-d / l)), ("euclidean", lambda d, l: np.exp(-((d / l) ** 2)))):
        cross = np.sort(cdist(pooled[:500], pooled[m : m + 500], metric).ravel())
        low = cross[0] if cross[0] >= 0.1 else max(cross[int(math.floor(0.05 * cross.size))], 0.1)
        low, high = low / 2, 2 * max(cross[-1], 0.3)
        distances = cdist(pooled, pooled, metric)
        for i in range(10):
            k = kernel(distances, low * (high / low) ** (i / 9))
            np.fill_diagonal(k, 0.0)
            values.append(k[:m, :m].sum() / (m * (m - 1)) + k[m:, m:].sum() / (n * (n - 1)) - 2 * k[:m, m:].sum() / (m * n))
    return np.array(values)


def speed_and_agreement(dims: int) -> None:
    gen = torch.Generator().manual_seed(0)
    x = 0.05 * torch.randn(M, dims, generator=gen)
    y = 0.05 * (1.1 * torch.randn(N, dims, generator=gen) + 0.01)
    layer_mmd(split_columns(x[:8, :64], y[:8, :64]))  # load the compiled L1 kernel once

    # Ours runs in parallel and suffers most from other jobs on the machine: median of 3 runs.
    times = []
    for _ in range(3):
        start = time.perf_counter()
        ours = layer_mmd(split_columns(x, y)).values.numpy()
        times.append(time.perf_counter() - start)
    ours_s = float(np.median(times))
    start = time.perf_counter()
    reference = scipy_mmd_values(x.numpy(), y.numpy())
    scipy_s = time.perf_counter() - start

    ratio = scipy_s / ours_s
    rel_diff = float(np.max(np.abs(ours - reference) / np.abs(reference)))
    load = os.getloadavg()[0]
    print(f"[speed] {M}+{N} samples x {dims} dims, {torch.get_num_threads()} torch threads, "
          f"load average {load:.1f} on {os.cpu_count()} cores")
    print(f"  metrics.mmd: {ours_s:.2f} s (median of {min(times):.2f}..{max(times):.2f})   "
          f"numpy/scipy: {scipy_s:.2f} s   speed-up: {ratio:.1f}x (best run {scipy_s / min(times):.1f}x) "
          f"(goal >= 10x: {'met' if ratio >= 10 else 'NOT met'})")
    print(f"  max relative difference of the 20 values: {rel_diff:.2e} "
          f"(goal <= 1e-6: {'met' if rel_diff <= 1e-6 else 'NOT met'}); median MMD {np.median(ours):.4g}")
    record("mmd", f"MMD of one layer ({M}+{N} x {dims}): metrics.mmd vs numpy/scipy", ratio, 10.0)
    record("mmd", "MMD: largest relative difference to numpy/scipy", rel_diff, 1e-6, unit="", higher_is_better=False)


def write_sample_set_in_row_blocks(path: Path, key: str, shape: tuple[int, ...], seed: int, shift: float) -> None:
    """Write a one-key float32 sample set of ``shape`` without holding it in memory.

    ``save_sample_set`` needs the whole tensor (here up to 9.4 GB, plus its copy). The
    safetensors format is an 8-byte little-endian header length, a JSON header, then the
    raw little-endian data in row-major order; the sample axis is outermost, so rows can be
    generated and appended a block at a time.
    """
    row = math.prod(shape[1:])
    header = {"__metadata__": {"method": "bench"}, key: {"dtype": "F32", "shape": list(shape), "data_offsets": [0, 4 * row * shape[0]]}}
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    gen = torch.Generator().manual_seed(seed)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(encoded)))
        fh.write(encoded)
        for start in range(0, shape[0], 25):
            rows = min(25, shape[0] - start)
            block = 0.05 * (torch.randn(rows, row, generator=gen) + shift)
            fh.write(memoryview(block.numpy()).cast("B"))
    if sample_set_keys(path) != {key: shape}:
        raise RuntimeError(f"{path}: written file does not read back as {key} {shape}")


class AnonymousMemoryPeak(threading.Thread):
    """Samples ``RssAnon`` (memory the process allocated, not file pages) every 50 ms; Linux only.

    ``ru_maxrss`` also counts the pages of memory-mapped files, which is how safetensors reads.
    """

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak_bytes = 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.05):
            with open("/proc/self/status") as fh:
                for line in fh:
                    if line.startswith("RssAnon:"):
                        self.peak_bytes = max(self.peak_bytes, int(line.split()[1]) * 1024)


def disk_worker(x_path: str, y_path: str) -> None:
    """Subprocess body: stream one layer from disk, print wall time and peak memory as JSON."""
    sampler = AnonymousMemoryPeak()
    sampler.start()
    start = time.perf_counter()
    result = mmd(SampleSetFile(Path(x_path)), SampleSetFile(Path(y_path))).layers[0]
    wall = time.perf_counter() - start
    sampler.done.set()
    sampler.join()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    print(json.dumps({"wall_s": wall, "peak_rss_bytes": peak, "peak_anon_bytes": sampler.peak_bytes,
                      "n_params": result.n_params, "median": float(np.median(result.values.numpy()))}))


def from_disk(shape: tuple[int, ...]) -> None:
    WORK.mkdir(parents=True, exist_ok=True)
    x_path, y_path = WORK / "x.safetensors", WORK / "y.safetensors"
    try:
        start = time.perf_counter()
        write_sample_set_in_row_blocks(x_path, KEY, (M, *shape), seed=1, shift=0.0)
        write_sample_set_in_row_blocks(y_path, KEY, (N, *shape), seed=2, shift=0.02)
        print(f"[disk] wrote {(x_path.stat().st_size + y_path.stat().st_size) / GIB:.1f} GiB in "
              f"{time.perf_counter() - start:.0f} s")
        out = subprocess.run(
            [sys.executable, __file__, "--disk-worker", str(x_path), str(y_path)],
            check=True, capture_output=True, text=True,
        )
        figures = json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(WORK, ignore_errors=True)
    peak, anon = figures["peak_rss_bytes"] / GIB, figures["peak_anon_bytes"] / GIB
    print(f"  one layer {M}+{N} x {figures['n_params']:,} from disk in column blocks: "
          f"wall {figures['wall_s']:.0f} s, peak RSS {peak:.2f} GiB "
          f"(goal <= 4 GiB: {'met' if peak <= 4 else 'NOT met'}), of which allocated (RssAnon) "
          f"{anon:.2f} GiB (the rest is file-backed: libraries and memory-mapped data); median MMD {figures['median']:.4g}")
    record("mmd", f"MMD of one ResNet-18 layer ({M}+{N} x {figures['n_params']:,}) from disk: peak RSS", peak, 4.0,
           unit="GiB", higher_is_better=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=int, default=20_000)
    parser.add_argument("--disk-shape", type=int, nargs="+", default=[512, 512, 3, 3])
    parser.add_argument("--skip-disk", action="store_true")
    parser.add_argument("--disk-worker", nargs=2, metavar=("X", "Y"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.disk_worker:
        disk_worker(*args.disk_worker)
        return
    speed_and_agreement(args.dims)
    if not args.skip_disk:
        from_disk(tuple(args.disk_shape))


if __name__ == "__main__":
    main()
