"""Where MMD reads a sample set from: anything that can give a layer as column blocks.

A *source* is an in-memory sample set (``{key: [S, ...]}``) or any object with the
``ColumnSource`` methods (the store's sample-set files and zoo file lists have them), so
a layer is never in memory whole when it comes from disk. X (m rows) and Y (n rows) may
arrive in blocks of different widths; ``zip_column_blocks`` re-cuts them into equal widths.
"""
from __future__ import annotations

from itertools import chain
from typing import Iterable, Iterator, Mapping, Protocol, Sequence, Union, runtime_checkable

import torch

from metrics.mmd.layers import MMDInputError


@runtime_checkable
class ColumnSource(Protocol):
    """A sample set readable key by key in column blocks."""

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Key -> full shape ``[S, ...]`` (S = number of samples), without reading the data."""

    def columns(self, key: str, max_columns: int) -> Iterator[torch.Tensor]:
        """Tensor ``key`` flattened per sample, as consecutive blocks ``[S, d_i]``; each block
        holds at most ``max_columns`` columns unless one indivisible row of the tensor is wider."""


class InMemorySource:
    """A ``ColumnSource`` over an in-memory sample set ``{key: [S, ...]}`` (blocks are views)."""

    def __init__(self, sample_set: Mapping[str, torch.Tensor]) -> None:
        self.sample_set = sample_set

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: tuple(v.shape) for k, v in self.sample_set.items()}

    def columns(self, key: str, max_columns: int) -> Iterator[torch.Tensor]:
        value = self.sample_set[key]
        flat = value.reshape(value.shape[0], -1)
        for start in range(0, flat.shape[1], max_columns):
            yield flat[:, start : start + max_columns]


Source = Union[Mapping[str, torch.Tensor], ColumnSource]


def as_column_source(source: Source) -> ColumnSource:
    """``source`` itself when it is a ``ColumnSource``, an ``InMemorySource`` around a sample set."""
    if isinstance(source, ColumnSource):
        return source
    if isinstance(source, Mapping):
        return InMemorySource(source)
    raise MMDInputError(
        f"MMD source: expected a sample set {{key: [S, ...]}} or a column source (shapes(), columns()), "
        f"got {type(source).__name__}"
    )


def layer_columns(source: ColumnSource, keys: Sequence[str], max_columns: int) -> Iterator[torch.Tensor]:
    """The layer made of ``keys`` (each flattened per sample, concatenated) as blocks ``[S, d_i]``."""
    return chain.from_iterable(source.columns(key, max_columns) for key in keys)


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
