"""Sample sets: state-dict-keyed tensors stacked with a leading sample axis ``[S, ...]``.

A sample set lives in one safetensors file; a zoo lives in many single-checkpoint files.
Both can be read one key (layer) at a time, and a key can be read in column blocks, so
a layer of a large zoo never has to be in memory whole.
"""
from __future__ import annotations

import math
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import torch

from benchmark.core.store.blocks import FileReader, read_header
from benchmark.core.store.checkpoint import (
    ShapeSpec, all_finite, check_finite, plain_tensors, validate_tensors, write_safetensors,
)
from benchmark.core.store.checksum import content_digest, verify_tensors
from benchmark.core.store.errors import CheckpointError
from benchmark.core.store.validate import verify_file_tensors

SampleSet = dict[str, torch.Tensor]


def sample_count(sample_set: Mapping[str, torch.Tensor], source: str = "sample set") -> int:
    """Number of samples S shared by every tensor of ``sample_set``; raises if they disagree."""
    counts = {k: int(v.shape[0]) for k, v in sample_set.items() if v.dim() > 0}
    if not counts or len(counts) != len(sample_set):
        raise CheckpointError(f"{source}: every tensor needs a leading sample axis [S, ...]")
    if len(set(counts.values())) != 1:
        raise CheckpointError(f"{source}: tensors disagree on the sample count: {counts}")
    return next(iter(counts.values()))


def stack_state_dicts(state_dicts: Sequence[Mapping[str, torch.Tensor]]) -> SampleSet:
    """Stack S state dicts with identical keys into a sample set ``{key: [S, ...]}``."""
    if not state_dicts:
        raise ValueError("stack_state_dicts: no state dicts given")
    keys = list(state_dicts[0])
    for i, sd in enumerate(state_dicts[1:], start=1):
        if list(sd) != keys:
            raise CheckpointError(f"state dict {i} has keys {sorted(set(sd) ^ set(keys))} that differ from state dict 0")
    return {k: torch.stack([sd[k] for sd in state_dicts]) for k in keys}


def unstack(sample_set: Mapping[str, torch.Tensor], index: int) -> dict[str, torch.Tensor]:
    """The state dict of sample ``index`` of a sample set."""
    return {k: v[index] for k, v in sample_set.items()}


def save_sample_set(path: str | os.PathLike, sample_set: Mapping[str, torch.Tensor], metadata: Mapping[str, Any],
                    exclusive: bool = False) -> str:
    """Write a sample set (``{key: [S, ...]}``, finite) to one safetensors file atomically, with
    the content checksums of its tensors and metadata in the metadata (``exclusive``: fenced
    publication, ``AlreadyPublishedError`` if ``path`` exists; ``atomic.py``). Returns the digest
    of the file's content (``checksum.content_digest``): what files computed from it record."""
    sample_count(sample_set, source=str(path))
    check_finite(sample_set, source=str(path))
    return content_digest(write_safetensors(path, plain_tensors(sample_set), metadata, exclusive))


def load_sample_set(
    path: str | os.PathLike,
    keys: Sequence[str] | None = None,
    shapes: ShapeSpec | None = None,
    leading: int = 1,
    validated: bool = False,
) -> SampleSet:
    """Read a sample set (all keys, or only ``keys``) from one safetensors file. The tensors read
    and the metadata are checked against their checksums (``ChecksumError`` naming the file and
    key) and the values finite, unless ``validated`` (the caller validated the file whole); with
    ``shapes`` (key -> shape after ``leading`` sample axes), keys and shapes too."""
    with FileReader(path) as reader:
        available = list(reader.header.entries)
        wanted = available if keys is None else list(keys)
        unknown = [k for k in wanted if k not in available]
        if unknown:
            raise CheckpointError(f"{path}: no key {unknown[0]!r}; the file holds {available}")
        tensors = reader.tensors(wanted)
        metadata, identity = reader.header.metadata, reader.identity
    verify_tensors(path, tensors, metadata, identity)
    if shapes is not None:
        validate_tensors(tensors, {k: shapes[k] for k in wanted if k in shapes} if keys is not None else shapes,
                         source=str(path), leading=leading)
    elif not validated:
        check_finite(tensors, str(path))
    return tensors


def sample_set_keys(path: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """Key -> full shape (sample axis included) of a safetensors file, without reading data."""
    return {k: tuple(entry["shape"]) for k, entry in read_header(path).entries.items()}


def _rows_per_block(row_shape: Sequence[int], max_columns: int) -> int:
    """Rows of a tensor whose rows have shape ``row_shape`` that fit in ``max_columns`` columns (>= 1)."""
    return max(1, max_columns // max(1, math.prod(row_shape)))


def iter_column_chunks(
    path: str | os.PathLike, key: str, max_columns: int = 2**20, validated: bool = False
) -> Iterator[torch.Tensor]:
    """Yield tensor ``key`` of a sample-set file as consecutive column blocks ``[S, d_i]``.

    The tensor ``[S, a, b, ...]`` is viewed as ``[S, D]`` (row-major flattening per sample);
    blocks follow its second axis, whole rows ``b * ...`` at a time, at most ``max_columns``
    columns unless a single row is wider. Only the block's bytes are read from disk
    (positional reads, no memory map), so resident memory stays at the block size. All blocks
    are read through one open handle (``blocks.FileReader``), so they come from the version of
    the file that was verified even when the path is replaced meanwhile. The whole tensor is
    checked against its checksum (in chunks) before the first block, once per process and
    version of the file; each block is checked finite unless ``validated``.
    """
    with FileReader(path) as reader:
        shape = reader.header.location(path, key).shape
        verify_file_tensors(path, [key], reader)
        samples = shape[0]
        if len(shape) == 1:
            yield _finite(reader.rows(key, 0, 0, samples).reshape(samples, 1), path, key, validated)
            return
        step = _rows_per_block(shape[2:], max_columns)
        for start in range(0, shape[1], step):
            yield _finite(reader.rows(key, 1, start, start + step).reshape(samples, -1), path, key, validated)


def _finite(block: torch.Tensor, path, key: str, validated: bool) -> torch.Tensor:
    if not validated:
        check_finite({key: block}, str(path))
    return block


MAX_OPEN = 256
"""Files a streamed zoo reader keeps open at once; past it, a file is reopened for its next
block and its identity checked against the version that was verified."""


class _Handles:
    """Open ``FileReader``s of a zoo's files, at most ``limit`` at a time. A file reopened after
    its handle was closed must still be the version first opened (``CheckpointError`` if not)."""

    def __init__(self, limit: int | None = None) -> None:
        self.limit, self.identities, self.open = limit or MAX_OPEN, {}, OrderedDict()

    def get(self, path) -> FileReader:
        reader = self.open.get(path)
        if reader is not None:
            self.open.move_to_end(path)
            return reader
        reader = FileReader(path)
        try:
            if path in self.identities:
                reader.check_identity(self.identities[path])
            else:
                self.identities[path] = reader.identity
        except BaseException:
            reader.close()
            raise
        self.open[path] = reader
        while len(self.open) > self.limit:
            self.open.popitem(last=False)[1].close()
        return reader

    def close(self) -> None:
        while self.open:
            self.open.popitem()[1].close()


def load_layer(paths: Sequence[str | os.PathLike], key: str, validated: bool = False) -> torch.Tensor:
    """Tensor ``key`` from each single-checkpoint file in ``paths``, stacked: ``[S, ...]``; each
    checked against its checksum and, unless ``validated``, finite."""
    out = []
    for p in paths:
        with FileReader(p) as reader:
            tensor = reader.tensors([key])[key]
            metadata, identity = reader.header.metadata, reader.identity
        verify_tensors(p, {key: tensor}, metadata, identity)
        out.append(_finite(tensor, p, key, validated))
    return torch.stack(out)


def iter_layer_column_chunks(
    paths: Sequence[str | os.PathLike], key: str, max_columns: int = 2**20, validated: bool = False
) -> Iterator[torch.Tensor]:
    """Like ``iter_column_chunks`` but over a zoo of single-checkpoint files: blocks ``[S, d_i]``
    (S = number of files), each the same rows of the per-checkpoint tensor's first axis read
    from every file. Each file's tensor is checked against its checksum first (once per process
    and version of the file) and every block is read through the handle that was verified (up
    to ``MAX_OPEN`` files held open; past it, reopened with their identity checked); each block
    is checked finite unless ``validated``."""
    if not paths:
        raise ValueError("iter_layer_column_chunks: no checkpoint paths given")
    handles = _Handles()
    current = paths[0]
    try:
        shape = handles.get(paths[0]).header.location(paths[0], key).shape
        for p in paths:
            current = p
            reader = handles.get(p)
            other = reader.header.location(p, key).shape
            if other != shape:
                raise CheckpointError(f"{p}: key {key!r} has shape {other}, expected {shape} as in {paths[0]}")
            verify_file_tensors(p, [key], reader)
        rows = 1 if len(shape) == 0 else shape[0]
        step = 1 if len(shape) == 0 else _rows_per_block(shape[1:], max_columns)
        for start in range(0, rows, step):
            current = paths[0]
            if len(shape) == 0:
                block = torch.stack([handles.get(p).tensor(key) for p in paths]).reshape(len(paths), 1)
            else:
                block = torch.stack([handles.get(p).rows(key, 0, start, start + step).reshape(-1) for p in paths])
            if not validated and not all_finite(block):
                for row, p in enumerate(paths):  # name the file whose rows hold NaN/Inf, not the first one
                    current = p
                    check_finite({key: block[row]}, str(p))
            yield block
    except CheckpointError as err:
        if err.path is None:
            err.path = Path(current)
        raise
    except OSError as err:
        raise CheckpointError(f"{current}: unreadable ({err.strerror or err})", path=Path(current)) from err
    finally:
        handles.close()


def iter_checkpoint_batches(
    paths: Sequence[str | os.PathLike], batch_size: int, keys: Sequence[str] | None = None, validated: bool = False
) -> Iterator[SampleSet]:
    """Yield stacked sample sets of up to ``batch_size`` checkpoints each, in ``paths`` order
    (each checkpoint checked as by ``load_sample_set``)."""
    if batch_size < 1:
        raise ValueError(f"iter_checkpoint_batches: batch_size must be >= 1, got {batch_size}")
    for start in range(0, len(paths), batch_size):
        yield stack_state_dicts([load_sample_set(p, keys, validated=validated) for p in paths[start : start + batch_size]])


def load_checkpoints_as_sample_set(
    paths: Sequence[str | os.PathLike], keys: Sequence[str] | None = None, validated: bool = False
) -> SampleSet:
    """All checkpoints in ``paths`` as one sample set ``{key: [len(paths), ...]}`` (each checked
    as by ``load_sample_set``)."""
    return stack_state_dicts([load_sample_set(p, keys, validated=validated) for p in paths])
