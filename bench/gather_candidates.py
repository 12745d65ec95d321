"""The two ways to gather a training batch of K networks that ``bench_zoo.py`` times side by side.

- ``tiled``: the suite's ``gather_batch`` (``benchmark/core/training/kernels.py``): 16 networks at a
  time, each image row read along the row, then written out as vectors of networks;
- ``per pixel``: the loop order it replaced (the baseline), every pixel read across the K networks'
  images (one gathered load per pixel and network), kept here only to be timed against.

Both write the same ``out [B, C, H, W, K]`` to the bit (checked before timing).
"""
from __future__ import annotations

import time

import numpy as np
from numba import njit

from benchmark.core.training.kernels import gather_batch


@njit(cache=True)
def gather_per_pixel(source, levels, index, rows, cols, out):  # pragma: no cover - compiled
    """``gather_batch``'s result, the networks innermost: ``out[b, c, i, j, k]`` for every ``k`` at
    once, read from K images (uint8 ``source`` codes decoded by ``levels``)."""
    n_b, n_k = index.shape
    n_c, n_h, n_w = out.shape[1], out.shape[2], out.shape[3]
    height, width = source.shape[2], source.shape[3]
    flat = source.reshape(source.size)
    base = np.empty(n_k, dtype=np.int64)
    for b in range(n_b):
        for k in range(n_k):
            base[k] = (index[b, k] * n_c * height + rows[b, k]) * width + cols[b, k]
        for c in range(n_c):
            for i in range(n_h):
                for j in range(n_w):
                    at = (c * height + i) * width + j
                    for k in range(n_k):
                        out[b, c, i, j, k] = levels[c, flat[np.uint64(base[k] + at)]]


def seconds_per_batch(images: int = 55_000, size: int = 28, padding: int = 4, networks: int = 128, batch: int = 64,
                      batches: int = 20, rounds: int = 3, seed: int = 0) -> dict[str, float]:
    """Seconds per training batch of ``networks`` networks (``batch`` random crops of ``size`` x
    ``size`` from ``images`` uint8 images padded by ``padding``: MNIST's zoo recipe), best of
    ``rounds`` alternating rounds of ``batches`` batches each, one thread."""
    rng = np.random.default_rng(seed)
    side = size + 2 * padding
    source = rng.integers(0, 256, (images, 1, side, side)).astype(np.uint8)
    levels = rng.standard_normal((1, 256)).astype(np.float32)
    index = [rng.integers(0, images, (batch, networks)).astype(np.uint32) for _ in range(batches)]
    offsets = [rng.integers(0, 2 * padding + 1, (2, batch, networks)) for _ in range(batches)]
    outs = {name: np.empty((batch, 1, size, size, networks), np.float32) for name in ("tiled", "per pixel")}
    ways = {"tiled": gather_batch, "per pixel": gather_per_pixel}
    for name, way in ways.items():
        way(source, levels, index[0], offsets[0][0], offsets[0][1], outs[name])
    if not np.array_equal(outs["tiled"], outs["per pixel"]):
        raise AssertionError("gather_candidates: the tiled and per-pixel gathers disagree")
    best = {name: float("inf") for name in ways}
    for _ in range(rounds):
        for name, way in ways.items():
            start = time.perf_counter()
            for i in range(batches):
                way(source, levels, index[i], offsets[i][0], offsets[i][1], outs[name])
            best[name] = min(best[name], (time.perf_counter() - start) / batches)
    return best
