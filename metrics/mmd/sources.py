"""Column blocks of a layer read from the store, aligned between the two sides.

A *source* is either one sample-set file (``{key: [S, ...]}``) or a zoo: a list of
single-checkpoint files (one sample each). Blocks are read with the store's column readers,
so a layer is never in memory whole. X (m rows) and Y (n rows) come in blocks of different
widths for the same element budget; ``zip_column_blocks`` re-cuts them into equal widths.
"""
from __future__ import annotations

import os
from itertools import chain
from typing import Iterable, Iterator, Sequence, Union

import torch

from benchmark.store import iter_column_chunks, iter_layer_column_chunks, sample_set_keys
from metrics.mmd.layers import MMDInputError

PathLike = Union[str, os.PathLike]
Source = Union[PathLike, Sequence[PathLike]]


def _is_zoo(source: Source) -> bool:
    return not isinstance(source, (str, os.PathLike))


def source_shapes(source: Source) -> dict[str, tuple[int, ...]]:
    """Key -> full shape ``[S, ...]`` of a source, from file headers only.

    For a zoo every file must hold the same keys and shapes (the error names the first that
    does not); S is the number of files.
    """
    if not _is_zoo(source):
        return sample_set_keys(source)
    paths = list(source)
    if not paths:
        raise MMDInputError("empty zoo: no checkpoint files given")
    first = sample_set_keys(paths[0])
    for path in paths[1:]:
        shapes = sample_set_keys(path)
        if shapes != first:
            differing = sorted(k for k in set(first) | set(shapes) if first.get(k) != shapes.get(k))
            raise MMDInputError(f"{path}: keys/shapes {differing} differ from {paths[0]}")
    return {key: (len(paths), *shape) for key, shape in first.items()}


def iter_source_columns(source: Source, keys: Sequence[str], max_elements: int) -> Iterator[torch.Tensor]:
    """The layer made of ``keys`` (flattened per sample, concatenated) as blocks ``[S, d_i]``."""
    if _is_zoo(source):
        paths = list(source)
        return chain.from_iterable(iter_layer_column_chunks(paths, key, max_elements) for key in keys)
    return chain.from_iterable(iter_column_chunks(source, key, max_elements) for key in keys)


def zip_column_blocks(
    x_blocks: Iterable[torch.Tensor], y_blocks: Iterable[torch.Tensor], layer: str = "layer"
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Pair two streams of column blocks ``[m, a_i]`` and ``[n, b_j]`` into equal-width pairs.

    Both streams must cover the same total number of columns; each yielded pair holds the same
    columns of X and Y. At most one block per side is held at a time.
    """
    x_iter, y_iter = iter(x_blocks), iter(y_blocks)
    x_block = y_block = None
    x_pos = y_pos = 0
    while True:
        if x_block is None or x_pos == x_block.shape[1]:
            x_block, x_pos = _next_nonempty(x_iter), 0
        if y_block is None or y_pos == y_block.shape[1]:
            y_block, y_pos = _next_nonempty(y_iter), 0
        if x_block is None or y_block is None:
            if x_block is not None or y_block is not None:
                raise MMDInputError(f"layer {layer!r}: X and Y have different numbers of columns")
            return
        width = min(x_block.shape[1] - x_pos, y_block.shape[1] - y_pos)
        yield x_block[:, x_pos : x_pos + width], y_block[:, y_pos : y_pos + width]
        x_pos += width
        y_pos += width


def _next_nonempty(blocks: Iterator[torch.Tensor]) -> torch.Tensor | None:
    for block in blocks:
        if block.dim() != 2:
            raise MMDInputError(f"column blocks must be 2-D [samples, columns], got shape {list(block.shape)}")
        if block.shape[1] > 0:
            return block
    return None
