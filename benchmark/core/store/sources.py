"""Sample sets on disk as column sources: what ``metrics.mmd.mmd`` streams a layer from.

``SampleSetFile`` is one sample-set file ``{key: [S, ...]}``; ``CheckpointFiles`` is a zoo,
one checkpoint per file (S = number of files). Both read headers for shapes and only the
bytes of one block at a time for data (see ``sampleset.iter_column_chunks``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch

from benchmark.core.store.errors import CheckpointError
from benchmark.core.store.sampleset import iter_column_chunks, iter_layer_column_chunks, sample_set_keys


@dataclass(frozen=True)
class SampleSetFile:
    """A sample-set file read in column blocks."""

    path: Path

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Key -> full shape ``[S, ...]`` from the file header."""
        return sample_set_keys(self.path)

    def columns(self, key: str, max_columns: int) -> Iterator[torch.Tensor]:
        """Tensor ``key`` as blocks ``[S, d_i]`` of at most ``max_columns`` columns (whole rows)."""
        return iter_column_chunks(self.path, key, max_columns)


@dataclass(frozen=True)
class CheckpointFiles:
    """A zoo of single-checkpoint files read as one sample set, in column blocks."""

    paths: tuple[Path, ...]

    def __init__(self, paths: Sequence[str | os.PathLike]) -> None:
        object.__setattr__(self, "paths", tuple(Path(p) for p in paths))
        if not self.paths:
            raise CheckpointError("empty zoo: no checkpoint files given")

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Key -> ``(number of files, *shape)``; every file must hold the same keys and shapes
        (the error names the first that does not)."""
        first = sample_set_keys(self.paths[0])
        for path in self.paths[1:]:
            shapes = sample_set_keys(path)
            if shapes != first:
                differing = sorted(k for k in set(first) | set(shapes) if first.get(k) != shapes.get(k))
                raise CheckpointError(f"{path}: keys/shapes {differing} differ from {self.paths[0]}")
        return {key: (len(self.paths), *shape) for key, shape in first.items()}

    def columns(self, key: str, max_columns: int) -> Iterator[torch.Tensor]:
        """Tensor ``key`` of every file as blocks ``[S, d_i]`` of at most ``max_columns`` columns."""
        return iter_layer_column_chunks(self.paths, key, max_columns)
