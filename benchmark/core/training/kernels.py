"""numba kernels for K networks that each have their own weights and their own images.

PyTorch has no fast CPU kernel for this: a grouped convolution with K groups of 1-2 channels
(what ``torch.func.vmap`` turns the per-network convolution into) runs at a few percent of the
machine's matmul peak, and so does the loop over networks. These kernels keep the network
index innermost in memory, so each multiply-add is one SIMD lane per network:

- activations ``[B, C, H, W, K]`` (image b of network k at ``[b, :, :, :, k]``),
- weights ``[C_out, C_in / groups, kh, kw, K]``, biases ``[C_out, K]``.

A convolution is PyTorch's ``conv2d`` with stride 1, no padding, no dilation and any
``groups``, optionally followed by a ReLU (``relu``) and, in the ``pool_*`` kernels, by a
non-overlapping max-pool (kernel = stride = ``pool``, floor mode) applied before the ReLU
(``relu(maxpool(y)) = maxpool(relu(y))``, gradients included). The pooled kernels keep only
the pooled values and the winning window position, and send each pooled gradient to that
position alone, as ``max_pool2d``'s backward does (ties: the first maximum in row-major
order; NaN wins). ReLU keeps NaN and passes gradient where its output is > 0, as PyTorch's.

The convolution kernels are compiled for each (channels per group, kernel size, pool) (about
a second each) and cached on disk (numba's ``cache=True``, in ``__pycache__``), so a new process
loads them instead of compiling again: with those as compile-time constants the tap loops
unroll, the network loop is innermost with a straight-line body, and LLVM vectorises it with
the sums in registers. No fast-math flags: every lane computes the same operations in the
same order whatever K is, so a network's result does not depend on how many others share
the kernel.
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import numpy as np
from numba import njit


@njit(cache=True)
def gather_images(pixels: np.ndarray, index: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover - compiled
    """``out[b, c, i, j, k] = pixels[c, i, j, index[b, k]]``: the batch ``[B, C, H, W, K]`` of K
    networks from the data set stored pixel-major (``pixels [C, H, W, N]``, ``index [B, K]``)."""
    n_c, n_h, n_w, _ = pixels.shape
    n_b, n_k = index.shape
    for c in range(n_c):
        for i in range(n_h):
            for j in range(n_w):
                row = pixels[c, i, j]
                for b in range(n_b):
                    for k in range(n_k):
                        out[b, c, i, j, k] = row[index[b, k]]


@njit(cache=True)
def gather_crops(
    pixels: np.ndarray, index: np.ndarray, offsets: np.ndarray, padding: int, fill: float, out: np.ndarray
) -> None:  # pragma: no cover - compiled
    """Like ``gather_images``, each image cropped as ``benchmark.core.data.crop_at`` crops it:
    ``out[b, c, i, j, k] = image[c, i + oy - padding, j + ox - padding]`` (``fill`` outside),
    with ``(oy, ox) = offsets[:, b, k]`` (``offsets [2, B, K]``)."""
    n_c, n_h, n_w, _ = pixels.shape
    n_b, n_k = index.shape
    for b in range(n_b):
        for c in range(n_c):
            for i in range(n_h):
                for j in range(n_w):
                    for k in range(n_k):
                        r = i + offsets[0, b, k] - padding
                        s = j + offsets[1, b, k] - padding
                        inside = 0 <= r < n_h and 0 <= s < n_w
                        out[b, c, i, j, k] = pixels[c, r, s, index[b, k]] if inside else fill


@njit(cache=True)
def _weight_and_input_grads(x, w, g, first, grad_x, grad_w, need_x):  # pragma: no cover - compiled
    """One image and output channel: x ``[C_in, H, W, K]``, w ``[cpg, kh, kw, K]``, g ``[Ho, Wo, K]``;
    adds to ``grad_w [cpg, kh, kw, K]`` and (``need_x``) to ``grad_x [C_in, H, W, K]``. The network
    loop inside, a different accumulator (tap) for each of its runs. Module-level (tap counts from
    the shapes, not compile-time constants: the network loop is the one LLVM vectorises) so that
    the backward kernels that call it can be cached on disk: numba cannot cache a function whose
    closure holds another compiled function."""
    cpg, kh, kw = w.shape[0], w.shape[1], w.shape[2]
    ho, wo, n_k = g.shape
    for i in range(ho):
        for j in range(wo):
            for ci in range(cpg):
                for p in range(kh):
                    for q in range(kw):
                        for k in range(n_k):
                            grad_w[ci, p, q, k] += g[i, j, k] * x[first + ci, i + p, j + q, k]
    if need_x:
        for ci in range(cpg):
            for p in range(kh):
                for q in range(kw):
                    for i in range(ho):
                        for j in range(wo):
                            for k in range(n_k):
                                grad_x[first + ci, i + p, j + q, k] += w[ci, p, q, k] * g[i, j, k]


class ConvKernels(NamedTuple):
    """The compiled kernels of one convolution shape. Arguments are NumPy views of contiguous
    tensors; outputs are written in place; gradients are added to ``grad_w`` / ``grad_x``."""

    forward: Callable[..., None]
    """``forward(x, w, bias, has_bias, groups, relu, out)``: ``out [B, C_out, Ho, Wo, K] = [relu](conv2d(x, w) + bias)``."""
    backward: Callable[..., None]
    """``backward(x, w, out, grad_out, groups, relu, grad_x, grad_w, need_x)``."""
    pool_forward: Callable[..., None]
    """``pool_forward(x, w, bias, has_bias, groups, relu, out, arg)``: ``out [B, C_out, Hp, Wp, K] =
    [relu](max_pool2d(conv2d(x, w) + bias, pool))``; ``arg`` (int8): the winner ``r * pool + s``."""
    pool_backward: Callable[..., None]
    """``pool_backward(x, w, out, grad_out, arg, groups, relu, grad_x, grad_w, need_x)``."""


@functools.lru_cache(maxsize=None)
def conv_kernels(cpg: int, kh: int, kw: int, pool: int = 1) -> ConvKernels:
    """The kernels of a convolution with ``cpg`` input channels per group, a ``kh x kw``
    kernel and (for the pooled pair) a ``pool x pool`` max-pool after it."""
    if min(cpg, kh, kw, pool) < 1:
        raise ValueError(f"conv_kernels: sizes must be positive, got cpg={cpg} kernel={kh}x{kw} pool={pool}")

    @njit(cache=True)
    def forward(x, w, bias, has_bias, groups, relu, out):  # pragma: no cover - compiled
        n_b, _, _, _, n_k = x.shape
        c_out = w.shape[0]
        opg = c_out // groups
        ho, wo = out.shape[2], out.shape[3]
        for b in range(n_b):
            for o in range(c_out):
                first = (o // opg) * cpg
                for i in range(ho):
                    for j in range(wo):
                        for k in range(n_k):
                            acc = bias[o, k] if has_bias else x.dtype.type(0)
                            for ci in range(cpg):
                                for p in range(kh):
                                    for q in range(kw):
                                        acc += w[o, ci, p, q, k] * x[b, first + ci, i + p, j + q, k]
                            out[b, o, i, j, k] = 0 if relu and acc <= 0 else acc

    @njit(cache=True)
    def backward(x, w, out, grad_out, groups, relu, grad_x, grad_w, need_x):  # pragma: no cover - compiled
        c_out = w.shape[0]
        opg = c_out // groups
        _, _, ho, wo, n_k = grad_out.shape
        g = np.empty((ho, wo, n_k), dtype=grad_out.dtype)
        for b in range(x.shape[0]):
            for o in range(c_out):
                for i in range(ho):
                    for j in range(wo):
                        for k in range(n_k):
                            passes = not relu or out[b, o, i, j, k] > 0
                            g[i, j, k] = grad_out[b, o, i, j, k] if passes else 0
                _weight_and_input_grads(x[b], w[o], g, (o // opg) * cpg, grad_x[b] if need_x else grad_x[0],
                                        grad_w[o], need_x)

    @njit(cache=True)
    def pool_forward(x, w, bias, has_bias, groups, relu, out, arg):  # pragma: no cover - compiled
        n_b, _, _, _, n_k = x.shape
        c_out = w.shape[0]
        opg = c_out // groups
        hp, wp = out.shape[2], out.shape[3]
        for b in range(n_b):
            for o in range(c_out):
                first = (o // opg) * cpg
                for pi in range(hp):
                    for pj in range(wp):
                        for r in range(pool):
                            i = pi * pool + r
                            for k in range(n_k):
                                best = out[b, o, pi, pj, k]
                                winner = arg[b, o, pi, pj, k]
                                # The window's columns in one straight-line block: they share loads.
                                for s in range(pool):
                                    j = pj * pool + s
                                    acc = bias[o, k] if has_bias else x.dtype.type(0)
                                    for ci in range(cpg):
                                        for p in range(kh):
                                            for q in range(kw):
                                                acc += w[o, ci, p, q, k] * x[b, first + ci, i + p, j + q, k]
                                    take = (r == 0 and s == 0) or acc > best or acc != acc
                                    best = acc if take else best
                                    winner = r * pool + s if take else winner
                                last = r == pool - 1
                                out[b, o, pi, pj, k] = 0 if last and relu and best <= 0 else best
                                arg[b, o, pi, pj, k] = winner

    @njit(cache=True)
    def pool_backward(x, w, out, grad_out, arg, groups, relu, grad_x, grad_w, need_x):  # pragma: no cover - compiled
        n_b, _, _, _, n_k = x.shape
        c_out = w.shape[0]
        opg = c_out // groups
        hp, wp = grad_out.shape[2], grad_out.shape[3]
        # The un-pooled gradient of one image and channel: each pooled gradient at its window's
        # winner, zeros elsewhere. Then the dense weight gradient: more multiply-adds than
        # visiting the winners alone, but vectorised over the networks (the winners differ by network).
        dense = np.empty((hp * pool, wp * pool, n_k), dtype=grad_out.dtype)
        for b in range(n_b):
            for o in range(c_out):
                for pi in range(hp):
                    for pj in range(wp):
                        for r in range(pool):
                            for s in range(pool):
                                for k in range(n_k):
                                    won = arg[b, o, pi, pj, k] == r * pool + s
                                    passes = won and (not relu or out[b, o, pi, pj, k] > 0)
                                    dense[pi * pool + r, pj * pool + s, k] = grad_out[b, o, pi, pj, k] if passes else 0
                _weight_and_input_grads(x[b], w[o], dense, (o // opg) * cpg, grad_x[b] if need_x else grad_x[0],
                                        grad_w[o], need_x)

    return ConvKernels(forward, backward, pool_forward, pool_backward)
