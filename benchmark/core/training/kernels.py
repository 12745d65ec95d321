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

Each convolution shape (channels per group, kernel size, pool; for an un-pooled convolution's
input gradient also the input size) gets its own kernels, written out as straight-line Python
(every tap, every position of a pooling window or of an ``R x J`` block of outputs, every cell of
an input row spelled out: ``*_source`` below) into a module file under ``kernel_dir()`` and
compiled by numba with its disk cache (``cache=True``), so a new process loads them instead of
compiling again (a second or two per shape the first time). Inside the network loop (the one
LLVM vectorises: 8 networks per 256-bit vector, 16 per 512-bit one; LLVM's tuning for Intel's
server cores picks 256 bits even where AVX-512 is present, see docs/performance.md "Training the zoo" for the
NUMBA_CPU_FEATURES setting that widens it) a pooling window's or a block's outputs share
each weight load, the weight gradients add a window's (a block's) products to each tap once, and
the input gradient keeps a row of input cells in registers while a row of taps adds to it. Sums
that a loop builds go to stack arrays (``stack_array``), which no argument can overlap: LLVM
vectorises a loop only while the run-time overlap checks between its stores and its loads stay
under its limit, which a block's many loads exceed when it stores to an argument.
Every kernel releases the GIL (``nogil``), so stacks trained on threads of one process run their
kernels on as many cores (``benchmark.stages.zoo``).
The only floating-point licence is ``contract`` (a multiply and the add after it may become one
fused multiply-add); every lane computes the same operations in the same order whatever K is, so
a network's result does not depend on how many others share the kernel.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import sys
import tempfile
import threading
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

KERNEL_DIR_ENV = "POSTERIOR_BENCH_KERNEL_DIR"


@intrinsic
def stack_array(typingctx, like, size):
    """``stack_array(like, size)``: a 1-D array of ``size`` (a literal integer) elements of ``like``'s
    dtype on the stack of the calling kernel (uninitialised). LLVM knows that no argument overlaps
    it, so loops that store to it are vectorised without run-time overlap checks."""
    if not isinstance(size, types.IntegerLiteral):
        return None
    count = size.literal_value
    array = types.Array(like.dtype, 1, "C")

    def codegen(context, builder, signature, args):
        item = context.get_data_type(like.dtype)
        data = cgutils.alloca_once(builder, item, size=context.get_constant(types.intp, count))
        out = context.make_array(array)(context, builder)
        nbytes = context.get_abi_sizeof(item)
        context.populate_array(out, data=data, shape=cgutils.pack_array(builder, [context.get_constant(types.intp, count)]),
                               strides=cgutils.pack_array(builder, [context.get_constant(types.intp, nbytes)]),
                               itemsize=context.get_constant(types.intp, nbytes), meminfo=None)
        return out._getvalue()

    return array(like, size), codegen


def _pixel(flat, levels, channel, at):  # pragma: no cover - replaced by its overload inside compiled code
    """Pixel ``at`` of ``flat``: its value, or for uint8 codes ``levels[channel, code]``."""


@overload(_pixel)
def _pixel_of(flat, levels, channel, at):
    if isinstance(flat.dtype, types.Integer):
        return lambda flat, levels, channel, at: levels[channel, flat[at]]
    return lambda flat, levels, channel, at: flat[at]


GATHER_TILE = 16  # networks whose image rows ``gather_batch`` reads together before writing them transposed


@njit(cache=True, nogil=True)
def gather_batch(source: np.ndarray, levels: np.ndarray, index: np.ndarray, rows: np.ndarray, cols: np.ndarray,
                 out: np.ndarray) -> None:  # pragma: no cover - compiled
    """The batch ``out [B, C, H, W, K]`` of K networks: ``out[b, c, i, j, k] = source[index[b, k], c,
    rows[b, k] + i, cols[b, k] + j]`` (``source [N, C, H', W']``, the images or, for random crops,
    the images padded with the fill: then ``rows``/``cols`` are the crop offsets, else zeros). A
    uint8 ``source`` holds codes: the value is ``levels[c, code]`` (``levels [C, L]``; a quarter of the
    bytes of float32 images to fetch from memory; ignored for float images).

    ``GATHER_TILE`` networks at a time, one image row each is read along the row (contiguous bytes,
    one cache line or two per image) into a small ``[W, GATHER_TILE]`` tile, which then
    goes to ``out`` as whole vectors of networks. Reading the networks' pixels across images (one
    gathered load per pixel and network, the previous loop order) took about twice as long: the
    gather dominated an MNIST epoch's data movement (docs/performance.md)."""
    n_b, n_k = index.shape
    n_c, n_h, n_w = out.shape[1], out.shape[2], out.shape[3]
    height, width = source.shape[2], source.shape[3]
    flat = source.reshape(source.size)
    tile = np.empty((n_w, GATHER_TILE), dtype=out.dtype)
    start = np.empty(GATHER_TILE, dtype=np.int64)
    for b in range(n_b):
        for kc in range(0, n_k, GATHER_TILE):
            n_l = min(GATHER_TILE, n_k - kc)
            for l in range(n_l):
                start[l] = (index[b, kc + l] * n_c * height + rows[b, kc + l]) * width + cols[b, kc + l]
            for c in range(n_c):
                for i in range(n_h):
                    row = (c * height + i) * width
                    for l in range(n_l):
                        at = start[l] + row
                        for j in range(n_w):
                            tile[j, l] = _pixel(flat, levels, c, np.uint64(at + j))
                    for j in range(n_w):
                        for l in range(n_l):
                            out[b, c, i, j, kc + l] = tile[j, l]


@njit(cache=True, nogil=True, fastmath={"contract"})
def average_positions(x: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover - compiled
    """Global average pool ``x [B, C, H, W, K] -> out [B, C, K]``, summed position by position in
    row-major order, then divided by ``H W``."""
    n_b, n_c, n_h, n_w, n_k = x.shape
    for b in range(n_b):
        for c in range(n_c):
            for k in range(n_k):
                out[b, c, k] = x[b, c, 0, 0, k]
            for position in range(1, n_h * n_w):
                i, j = position // n_w, position % n_w
                for k in range(n_k):
                    out[b, c, k] += x[b, c, i, j, k]
            for k in range(n_k):
                out[b, c, k] /= n_h * n_w


@njit(cache=True, nogil=True, fastmath={"contract"})
def spread_positions(grad: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover - compiled
    """The average pool's backward: ``out [B, C, H, W, K] = grad [B, C, K] / (H W)`` at every position."""
    n_b, n_c, n_h, n_w, n_k = out.shape
    for b in range(n_b):
        for c in range(n_c):
            for i in range(n_h):
                for j in range(n_w):
                    for k in range(n_k):
                        out[b, c, i, j, k] = grad[b, c, k] / (n_h * n_w)


@njit(cache=True, nogil=True, fastmath={"contract"})
def dense_forward(x: np.ndarray, w: np.ndarray, bias: np.ndarray, has_bias: bool, relu: bool,
                  out: np.ndarray) -> None:  # pragma: no cover - compiled
    """K linear layers: ``out [B, O, K] = [relu](bias + sum_i w[:, i] x[:, i])`` with ``x [B, I, K]``,
    ``w [O, I, K]``, ``bias [O, K]`` (added first, then the inputs in order)."""
    n_b, n_i, n_k = x.shape
    zero = x.dtype.type(0)
    for b in range(n_b):
        for o in range(w.shape[0]):
            for k in range(n_k):
                out[b, o, k] = bias[o, k] if has_bias else zero
            for i in range(n_i):
                for k in range(n_k):
                    out[b, o, k] += w[o, i, k] * x[b, i, k]
            if relu:
                for k in range(n_k):
                    out[b, o, k] = zero if out[b, o, k] <= 0 else out[b, o, k]


@njit(cache=True, nogil=True, fastmath={"contract"})
def dense_backward(x: np.ndarray, w: np.ndarray, out: np.ndarray, grad_out: np.ndarray, relu: bool, grad_x: np.ndarray,
                   grad_w: np.ndarray, grad_b: np.ndarray, need_x: bool) -> None:  # pragma: no cover - compiled
    """``dense_forward``'s backward: ``grad_out [B, O, K]`` (masked where a ReLU output is not > 0, in
    place) -> ``grad_w [O, I, K]`` and ``grad_b [O, K]`` (added to, image by image) and, with
    ``need_x``, ``grad_x [B, I, K]`` (written)."""
    n_b, n_i, n_k = x.shape
    n_o = w.shape[0]
    zero = x.dtype.type(0)
    for b in range(n_b):
        if relu:
            for o in range(n_o):
                for k in range(n_k):
                    grad_out[b, o, k] = grad_out[b, o, k] if out[b, o, k] > 0 else zero
        for o in range(n_o):
            for k in range(n_k):
                grad_b[o, k] += grad_out[b, o, k]
            for i in range(n_i):
                for k in range(n_k):
                    grad_w[o, i, k] += grad_out[b, o, k] * x[b, i, k]
        if need_x:
            for i in range(n_i):
                for k in range(n_k):
                    grad_x[b, i, k] = zero
                for o in range(n_o):
                    for k in range(n_k):
                        grad_x[b, i, k] += w[o, i, k] * grad_out[b, o, k]


@njit(cache=True, nogil=True, fastmath={"contract"})
def cross_entropy(logits: np.ndarray, labels: np.ndarray, losses: np.ndarray, grad: np.ndarray,
                  count: int) -> None:  # pragma: no cover - compiled
    """Per network, the cross-entropy of ``B`` images of a batch of ``count``: ``logits [B, O, K]``,
    ``labels [B, K]`` -> each image's loss added to ``losses [K]`` in image order (the batch's mean
    is then ``losses / count``, taken by the caller once every part of the batch is in) and
    ``grad [B, O, K]``, the gradient of each network's mean loss over the batch
    (``(softmax - onehot) / count``). NaN/Inf logits give a NaN/Inf loss."""
    n_b, n_o, n_k = logits.shape
    zero = logits.dtype.type(0)
    for b in range(n_b):
        for k in range(n_k):
            top = logits[b, 0, k]
            for o in range(1, n_o):
                top = max(top, logits[b, o, k])
            total = zero
            for o in range(n_o):
                grad[b, o, k] = np.exp(logits[b, o, k] - top)
                total += grad[b, o, k]
            label = labels[b, k]
            losses[k] += top + np.log(total) - logits[b, label, k]
            for o in range(n_o):
                grad[b, o, k] = (grad[b, o, k] / total - (o == label)) / count


class ConvKernels(NamedTuple):
    """The compiled kernels of one convolution shape. Arguments are NumPy views of contiguous
    tensors; outputs are written in place; gradients are added to ``grad_w`` / ``grad_x``."""

    forward: Callable[..., None]
    """``forward(x, w, bias, has_bias, groups, relu, out)``: ``out [B, C_out, Ho, Wo, K] = [relu](conv2d(x, w) + bias)``."""
    backward: Callable[..., None]
    """``backward(x, w, out, grad_out, groups, relu, grad_w)``: the weight gradient (the input
    gradient: ``input_grad_kernel``)."""
    pool_forward: Callable[..., None]
    """``pool_forward(x, w, bias, has_bias, groups, relu, out, arg)``: ``out [B, C_out, Hp, Wp, K] =
    [relu](max_pool2d(conv2d(x, w) + bias, pool))``; ``arg`` (int8): the winner ``r * pool + s``."""
    pool_backward: Callable[..., None]
    """``pool_backward(x, w, out, grad_out, arg, groups, relu, grad_x, grad_w, need_x)``."""


CHUNK = 64  # networks whose weight-gradient sums one stack array holds (per tap)
J = 4  # adjacent output columns of an un-pooled convolution computed (forward) or added to a tap (backward) at once
R = 2  # adjacent output rows of an un-pooled convolution's forward block (R x J positions share each weight load)
HEAD = ('"""Packed convolution kernels generated by benchmark/core/training/kernels.py (do not edit)."""\n'
        "import numpy as np\nfrom numba import njit\n\nfrom benchmark.core.training.kernels import stack_array\n\n\n")


def _taps(cpg: int, kh: int, kw: int) -> list[tuple[int, int, int]]:
    return [(c, p, q) for c in range(cpg) for p in range(kh) for q in range(kw)]


def _block(lines: list[str], depth: int) -> list[str]:
    return [" " * 4 * depth + line for line in lines]


def _nest(loops: list[str], body: list[str]) -> list[str]:
    """``loops`` nested in order around ``body``."""
    return [" " * 4 * depth + line for depth, line in enumerate(loops)] + _block(body, len(loops))


def _kernel(name: str, args: str, dims: list[str], body: list[str]) -> str:
    """One kernel: the shapes, then ``body`` inside the loops over images and output channels."""
    lines = ["@njit(cache=True, nogil=True, fastmath={'contract'})", f"def {name}({args}):  # pragma: no cover - compiled",
             "    n_b, n_k = x.shape[0], x.shape[4]", "    c_out, cpg = w.shape[0], w.shape[1]", "    opg = c_out // groups",
             *_block(dims, 1), "    zero = x.dtype.type(0)", "    for b in range(n_b):", "        for o in range(c_out):",
             "            first = (o // opg) * cpg"]
    return "\n".join(lines + _block(body, 3)) + "\n"


def _tap_sums(taps: list[tuple[int, int, int]], terms) -> list[str]:
    """In the network loop: ``acc[tap, l] += sum of terms(c, p, q)`` for every tap (``k``: unsigned,
    so numba indexes without wrapping negative indices and LLVM sees consecutive networks at
    consecutive addresses, without gathers)."""
    lines = ["k = np.uint64(kc + l)"]
    for t, (c, p, q) in enumerate(taps):
        lines += [f"t_ = acc[{t * CHUNK} + l]", *[f"t_ += {term}" for term in terms(c, p, q)], f"acc[{t * CHUNK} + l] = t_"]
    return lines


def _chunks(taps: list[tuple[int, int, int]], passes: list[str]) -> list[str]:
    """The weight gradient of one image and output channel, ``CHUNK`` networks at a time: sums per
    tap in ``acc`` (a stack array, which no argument can overlap: the network loops that add to it
    need no run-time overlap checks), made by ``passes``, then added to ``grad_w``."""
    lines = [f"for kc in range(0, n_k, {CHUNK}):", f"    n_l = min({CHUNK}, n_k - kc)",
             f"    for t in range({len(taps) * CHUNK}):", "        acc[t] = zero", *_block(passes, 1)]
    for t, (c, p, q) in enumerate(taps):
        lines += ["    for l in range(n_l):", f"        grad_w[o, {c}, {p}, {q}, np.uint64(kc + l)] += acc[{t * CHUNK} + l]"]
    return lines


def forward_source(cpg: int, kh: int, kw: int) -> str:
    """``forward(x, w, bias, has_bias, groups, relu, out)``: blocks of ``R x J`` output positions per
    network loop (then the positions left over, one at a time), each weight loaded once for the
    block; the block's sums go to a stack array first (``acc``) and from there, through the ReLU, to
    ``out``, so that the loop that computes them stores to no argument (LLVM gives up vectorising a
    loop when the run-time overlap checks of its stores against its many loads exceed its limit)."""

    def block(rows: int, width: int) -> list[str]:
        pos = [(r, s) for r in range(rows) for s in range(width)]
        body = ["k = np.uint64(kc + l)", "b0 = bias[o, k] if has_bias else zero", *[f"a{r}_{s} = b0" for r, s in pos]]
        for c, p, q in _taps(cpg, kh, kw):
            body.append(f"w_ = w[o, {c}, {p}, {q}, k]")
            body += [f"a{r}_{s} += w_ * x[b, first + {c}, i + {r + p}, j + {s + q}, k]" for r, s in pos]
        body += [f"acc[{n * CHUNK} + l] = a{r}_{s}" for n, (r, s) in enumerate(pos)]
        lines = [f"for kc in range(0, n_k, {CHUNK}):", f"    n_l = min({CHUNK}, n_k - kc)", "    for l in range(n_l):",
                 *_block(body, 2)]
        for n, (r, s) in enumerate(pos):
            lines += ["    for l in range(n_l):", f"        a_ = acc[{n * CHUNK} + l]",
                      f"        out[b, o, i + {r}, j + {s}, np.uint64(kc + l)] = zero if relu and a_ <= 0 else a_"]
        return lines

    # The positions outside whole blocks one at a time (two block shapes, not four: compile time
    # grows faster than the code, ~5 s for OptuNet's 5 x 5 convolution).
    loops = [f"for ib in range(ho // {R}):", f"    i = ib * {R}", f"    for jb in range(wo // {J}):", f"        j = jb * {J}",
             *_block(block(R, J), 2), "for i in range(ho):", "    for j in range(wo):",
             f"        if i < ho - ho % {R} and j < wo - wo % {J}:", "            continue", *_block(block(1, 1), 2)]
    return _kernel("forward", "x, w, bias, has_bias, groups, relu, out",
                   ["ho, wo = out.shape[2], out.shape[3]", f"acc = stack_array(x, {R * J * CHUNK})"], loops)


def backward_source(cpg: int, kh: int, kw: int) -> str:
    """``backward(x, w, out, grad_out, groups, relu, grad_w)``: the weight gradient, the products of
    ``J`` adjacent columns (then of one) added to each tap at once (the input gradient is
    ``input_grad_source``'s kernel)."""
    taps = _taps(cpg, kh, kw)

    def columns(width: int) -> list[str]:
        head = [f"g{s} = grad_out[b, o, i, j + {s}, k]" for s in range(width)]
        head += [f"g{s} = g{s} if not relu or out[b, o, i, j + {s}, k] > 0 else zero" for s in range(width)]
        sums = _tap_sums(taps, lambda c, p, q: [f"g{s} * x[b, first + {c}, i + {p}, j + {s + q}, k]" for s in range(width)])
        return ["for l in range(n_l):", *_block(sums[:1] + head + sums[1:], 1), f"j += {width}"]

    passes = ["for i in range(ho):", "    j = 0", f"    while j + {J} <= wo:", *_block(columns(J), 2),
              "    while j < wo:", *_block(columns(1), 2)]
    return _kernel("backward", "x, w, out, grad_out, groups, relu, grad_w",
                   ["ho, wo = grad_out.shape[2], grad_out.shape[3]", f"acc = stack_array(x, {len(taps) * CHUNK})"],
                   _chunks(taps, passes))


def input_grad_source(cpg: int, kh: int, kw: int, height: int, width: int) -> str:
    """``input_grad(w, out, grad_out, groups, relu, grad_x)``: the input gradient of an un-pooled
    convolution of ``height x width`` inputs, added to ``grad_x``. For each image, input channel and
    ``CHUNK`` networks, the input plane lives in a stack array (``plane``) while every output
    channel of its group adds to it: output row ``i`` (last row first) adds tap row ``p`` to input
    row ``i + p``, whose ``width`` cells stay in registers for all the ``kw`` taps of the row. Each
    input cell receives its terms in one fixed order (output channel, then ``p``, then ``q``: the
    last output row first means ``p`` ascending), the order of the kernel this one replaced, whose
    checkpoints it reproduces to the bit."""
    ho, wo = height - kh + 1, width - kw + 1
    row = width * CHUNK
    body = ["k = np.uint64(kc + l)", *[f"g{j} = grad_out[b, o, i, {j}, k]" for j in range(wo)],
            *[f"g{j} = g{j} if not relu or out[b, o, i, {j}, k] > 0 else zero" for j in range(wo)]]
    for p in range(kh):
        cell = [f"plane[np.uint64(base + {p * row + x * CHUNK} + l)]" for x in range(width)]
        body += [f"v{x} = {cell[x]}" for x in range(width)]
        for q in range(kw):
            body += [f"w_ = w[o, c, {p}, {q}, k]", *[f"v{j + q} += w_ * g{j}" for j in range(wo)]]
        body += [f"{cell[x]} = v{x}" for x in range(width)]
    plane_at = f"plane[(y * {width} + x) * {CHUNK} + l]"
    grad_at = "grad_x[b, first + c, y, x, np.uint64(kc + l)]"
    cells = ["for y in range(h):", "for x in range(wd):", "for l in range(n_l):"]
    nest = ["for b in range(n_b):", "    for grp in range(groups):", "        first = grp * cpg", "        for c in range(cpg):",
            f"            for kc in range(0, n_k, {CHUNK}):", f"                n_l = min({CHUNK}, n_k - kc)",
            *_block(_nest(cells, [f"{plane_at} = {grad_at}"]), 4),
            "                for o in range(grp * opg, (grp + 1) * opg):", "                    for i in range(ho - 1, -1, -1):",
            f"                        base = i * {row}", "                        for l in range(n_l):", *_block(body, 7),
            *_block(_nest(cells, [f"{grad_at} = {plane_at}"]), 4)]
    lines = ["@njit(cache=True, nogil=True, fastmath={'contract'})",
             "def input_grad(w, out, grad_out, groups, relu, grad_x):  # pragma: no cover - compiled",
             "    n_b, n_k = grad_x.shape[0], grad_x.shape[4]", "    c_out, cpg = w.shape[0], w.shape[1]", "    opg = c_out // groups",
             "    h, wd, ho = grad_x.shape[2], grad_x.shape[3], grad_out.shape[2]",
             f"    plane = stack_array(grad_x, {height * width * CHUNK})", "    zero = grad_x.dtype.type(0)", *_block(nest, 1)]
    return "\n".join(lines) + "\n"


def pool_forward_source(cpg: int, kh: int, kw: int, pool: int) -> str:
    """``pool_forward(x, w, bias, has_bias, groups, relu, out, arg)``: one pooling window per network
    loop, its positions side by side (each weight loaded once for all of them)."""
    window = [(r, s) for r in range(pool) for s in range(pool)]
    body = [f"i0, j0 = pi * {pool}, pj * {pool}", "b0 = bias[o, k] if has_bias else zero", *[f"a{r}_{s} = b0" for r, s in window]]
    for c, p, q in _taps(cpg, kh, kw):
        body.append(f"w_ = w[o, {c}, {p}, {q}, k]")
        body += [f"a{r}_{s} += w_ * x[b, first + {c}, i0 + {r + p}, j0 + {s + q}, k]" for r, s in window]
    body += ["best = a0_0", "win = 0"]
    for r, s in window[1:]:  # row-major; the first maximum wins ties; NaN wins (as max_pool2d)
        body += [f"take = a{r}_{s} > best or a{r}_{s} != a{r}_{s}", f"best = a{r}_{s} if take else best",
                 f"win = {r * pool + s} if take else win"]
    body += ["out[b, o, pi, pj, k] = zero if relu and best <= 0 else best", "arg[b, o, pi, pj, k] = win"]
    return _kernel("pool_forward", "x, w, bias, has_bias, groups, relu, out, arg", ["hp, wp = out.shape[2], out.shape[3]"],
                   _nest(["for pi in range(hp):", "for pj in range(wp):", "for k in range(n_k):"], body))


def pool_backward_source(cpg: int, kh: int, kw: int, pool: int) -> str:
    """``pool_backward(x, w, out, grad_out, arg, groups, relu, grad_x, grad_w, need_x)``: each pooled
    gradient at its window's winner, a whole window's products added to each tap at once."""
    window = [(r, s) for r in range(pool) for s in range(pool)]
    taps = _taps(cpg, kh, kw)
    head = [f"i0, j0 = pi * {pool}, pj * {pool}", "g = grad_out[b, o, pi, pj, k]",
            "g = g if not relu or out[b, o, pi, pj, k] > 0 else zero", "won = arg[b, o, pi, pj, k]",
            *[f"g{r}_{s} = g if won == {r * pool + s} else zero" for r, s in window]]
    sums = _tap_sums(taps, lambda c, p, q: [f"g{r}_{s} * x[b, first + {c}, i0 + {r + p}, j0 + {s + q}, k]" for r, s in window])
    passes = _nest(["for pi in range(hp):", "for pj in range(wp):", "for l in range(n_l):"], sums[:1] + head + sums[1:])
    need_x = ["if need_x:", *_block(_nest(
        ["for c in range(cpg):", "for p in range(w.shape[2]):", "for q in range(w.shape[3]):", f"for rs in range({pool * pool}):",
         "for pi in range(hp):", "for pj in range(wp):", "for k in range(n_k):"],
        ["passes = arg[b, o, pi, pj, k] == rs and (not relu or out[b, o, pi, pj, k] > 0)",
         "g = grad_out[b, o, pi, pj, k] if passes else zero",
         f"grad_x[b, first + c, pi * {pool} + rs // {pool} + p, pj * {pool} + rs % {pool} + q, k] += w[o, c, p, q, k] * g"]), 1)]
    return _kernel("pool_backward", "x, w, out, grad_out, arg, groups, relu, grad_x, grad_w, need_x",
                   ["hp, wp = grad_out.shape[2], grad_out.shape[3]", f"acc = stack_array(x, {len(taps) * CHUNK})"],
                   _chunks(taps, passes) + need_x)


def kernel_dir() -> Path:
    """Where the generated kernel modules (and numba's cache of them, in ``__pycache__``) live:
    ``$POSTERIOR_BENCH_KERNEL_DIR``, else ``~/.cache/posterior-bench/kernels``, else a folder of
    the temp dir when the home cannot be written."""
    candidates = [os.environ.get(KERNEL_DIR_ENV), Path.home() / ".cache" / "posterior-bench" / "kernels",
                  Path(tempfile.gettempdir()) / f"posterior-bench-kernels-{os.getuid() if hasattr(os, 'getuid') else 0}"]
    for candidate in candidates:
        if not candidate:
            continue
        path = Path(candidate).expanduser()
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(path, os.W_OK):
            return path
    raise OSError(f"no writable folder for the packed kernels; set {KERNEL_DIR_ENV}")


_IMPORTING = threading.Lock()  # stacks on threads ask for the same kernels at once: one imports, the others wait


def _module(source: str, stem: str):
    """Import ``source`` as a module file named after ``stem`` and its hash, written (atomically,
    and only when missing or different, so numba's cache of it stays valid) under ``kernel_dir()``.
    One thread at a time: a module is in ``sys.modules`` before its kernels are defined."""
    with _IMPORTING:
        digest = hashlib.sha256(source.encode()).hexdigest()[:16]
        name = f"{stem}_{digest}"
        path = kernel_dir() / f"{name}.py"
        if not path.is_file() or path.read_text() != source:
            temp = path.with_name(f".{name}.{os.getpid()}.tmp")
            temp.write_text(source)
            os.replace(temp, path)
        module_name = f"posterior_bench_kernels_{name}"  # importable by name, as numba's cache needs
        if module_name in sys.modules:
            return sys.modules[module_name]
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
        return module


@functools.lru_cache(maxsize=None)
def conv_kernels(cpg: int, kh: int, kw: int, pool: int = 1) -> ConvKernels:
    """The kernels of a convolution with ``cpg`` input channels per group, a ``kh x kw``
    kernel and (for the pooled pair) a ``pool x pool`` max-pool after it."""
    if min(cpg, kh, kw, pool) < 1:
        raise ValueError(f"conv_kernels: sizes must be positive, got cpg={cpg} kernel={kh}x{kw} pool={pool}")
    plain = _module(HEAD + forward_source(cpg, kh, kw) + "\n\n" + backward_source(cpg, kh, kw), f"conv_c{cpg}_k{kh}x{kw}")
    pooled = _module(HEAD + pool_forward_source(cpg, kh, kw, pool) + "\n\n" + pool_backward_source(cpg, kh, kw, pool),
                     f"conv_c{cpg}_k{kh}x{kw}_pool{pool}")
    return ConvKernels(plain.forward, plain.backward, pooled.pool_forward, pooled.pool_backward)


@functools.lru_cache(maxsize=None)
def input_grad_kernel(cpg: int, kh: int, kw: int, height: int, width: int) -> Callable[..., None]:
    """``input_grad(w, out, grad_out, groups, relu, grad_x)`` of an un-pooled convolution with
    ``cpg`` input channels per group and a ``kh x kw`` kernel on ``height x width`` inputs
    (``input_grad_source``): ``grad_x [B, C_in, height, width, K]`` += the gradient that
    ``grad_out [B, C_out, Ho, Wo, K]`` (zeroed where a ReLU output ``out`` is not > 0) sends back."""
    if min(cpg, kh, kw) < 1 or height < kh or width < kw:
        raise ValueError(f"input_grad_kernel: need positive sizes and an input of at least the kernel, got cpg={cpg} "
                         f"kernel={kh}x{kw} input={height}x{width}")
    module = _module(HEAD + input_grad_source(cpg, kh, kw, height, width), f"conv_c{cpg}_k{kh}x{kw}_input{height}x{width}")
    return module.input_grad
