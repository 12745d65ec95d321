"""Sample sets: state-dict-keyed tensors stacked with a leading sample axis ``[S, ...]``.

A sample set lives in one safetensors file; a zoo lives in many single-checkpoint files.
Both can be read one key (layer) at a time, and a key can be read in column blocks, so
a layer of a large zoo never has to be in memory whole.
"""
from __future__ import annotations

import math
import os
from typing import Any, Iterator, Mapping, Sequence

import torch
from safetensors import SafetensorError

from benchmark.core.store.blocks import locate, read_rows
from benchmark.core.store.checkpoint import check_finite, open_safetensors, plain_tensors, write_safetensors
from benchmark.core.store.checksum import file_identity, verify_tensors
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
                    exclusive: bool = False) -> None:
    """Write a sample set (``{key: [S, ...]}``, finite) to one safetensors file atomically, with
    the content checksums of its tensors in the metadata (``exclusive``: fenced publication,
    ``AlreadyPublishedError`` if ``path`` exists; ``atomic.py``)."""
    sample_count(sample_set, source=str(path))
    check_finite(sample_set, source=str(path))
    write_safetensors(path, plain_tensors(sample_set), metadata, exclusive)


def load_sample_set(path: str | os.PathLike, keys: Sequence[str] | None = None) -> SampleSet:
    """Read a sample set (all keys, or only ``keys``) from one safetensors file; the tensors read
    are checked against their checksums (``ChecksumError`` naming the file and key)."""
    with open_safetensors(path) as fh:
        identity = file_identity(path)
        available = list(fh.keys())
        wanted = available if keys is None else list(keys)
        unknown = [k for k in wanted if k not in available]
        if unknown:
            raise CheckpointError(f"{path}: no key {unknown[0]!r}; the file holds {available}")
        try:
            tensors = {k: fh.get_tensor(k) for k in wanted}
        except SafetensorError as err:
            raise CheckpointError(f"{path}: corrupt or truncated safetensors data ({err})") from err
        metadata = dict(fh.metadata() or {})
    verify_tensors(path, tensors, metadata, identity)
    return tensors


def sample_set_keys(path: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """Key -> full shape (sample axis included) of a safetensors file, without reading data."""
    with open_safetensors(path) as fh:
        return {k: tuple(fh.get_slice(k).get_shape()) for k in fh.keys()}


def _rows_per_block(row_shape: Sequence[int], max_columns: int) -> int:
    """Rows of a tensor whose rows have shape ``row_shape`` that fit in ``max_columns`` columns (>= 1)."""
    return max(1, max_columns // max(1, math.prod(row_shape)))


def iter_column_chunks(path: str | os.PathLike, key: str, max_columns: int = 2**20) -> Iterator[torch.Tensor]:
    """Yield tensor ``key`` of a sample-set file as consecutive column blocks ``[S, d_i]``.

    The tensor ``[S, a, b, ...]`` is viewed as ``[S, D]`` (row-major flattening per sample);
    blocks follow its second axis, whole rows ``b * ...`` at a time, at most ``max_columns``
    columns unless a single row is wider. Only the block's bytes are read from disk
    (positional reads, no memory map), so resident memory stays at the block size. The whole
    tensor is checked against its checksum (in chunks) before the first block, once per process
    and version of the file.
    """
    shape = locate(path, key).shape
    verify_file_tensors(path, [key])
    samples = shape[0]
    if len(shape) == 1:
        yield read_rows(path, key, 0, 0, samples).reshape(samples, 1)
        return
    step = _rows_per_block(shape[2:], max_columns)
    for start in range(0, shape[1], step):
        yield read_rows(path, key, 1, start, start + step).reshape(samples, -1)


def load_layer(paths: Sequence[str | os.PathLike], key: str) -> torch.Tensor:
    """Tensor ``key`` from each single-checkpoint file in ``paths``, stacked: ``[S, ...]``."""
    out = []
    for p in paths:
        with open_safetensors(p) as fh:
            identity = file_identity(p)
            if key not in fh.keys():
                raise CheckpointError(f"{p}: no key {key!r}")
            tensor, metadata = fh.get_tensor(key), dict(fh.metadata() or {})
        verify_tensors(p, {key: tensor}, metadata, identity)
        out.append(tensor)
    return torch.stack(out)


def iter_layer_column_chunks(
    paths: Sequence[str | os.PathLike], key: str, max_columns: int = 2**20
) -> Iterator[torch.Tensor]:
    """Like ``iter_column_chunks`` but over a zoo of single-checkpoint files: blocks ``[S, d_i]``
    (S = number of files), each the same rows of the per-checkpoint tensor's first axis read
    from every file. Each file's tensor is checked against its checksum first (once per process
    and version of the file)."""
    if not paths:
        raise ValueError("iter_layer_column_chunks: no checkpoint paths given")
    shape = locate(paths[0], key).shape
    for p in paths[1:]:
        other = locate(p, key).shape
        if other != shape:
            raise CheckpointError(f"{p}: key {key!r} has shape {other}, expected {shape} as in {paths[0]}")
    for p in paths:
        verify_file_tensors(p, [key])
    if len(shape) == 0:
        yield load_layer(paths, key).reshape(len(paths), 1)
        return
    step = _rows_per_block(shape[1:], max_columns)
    for start in range(0, shape[0], step):
        yield torch.stack([read_rows(p, key, 0, start, start + step).reshape(-1) for p in paths])


def iter_checkpoint_batches(
    paths: Sequence[str | os.PathLike], batch_size: int, keys: Sequence[str] | None = None
) -> Iterator[SampleSet]:
    """Yield stacked sample sets of up to ``batch_size`` checkpoints each, in ``paths`` order."""
    if batch_size < 1:
        raise ValueError(f"iter_checkpoint_batches: batch_size must be >= 1, got {batch_size}")
    for start in range(0, len(paths), batch_size):
        yield stack_state_dicts([load_sample_set(p, keys) for p in paths[start : start + batch_size]])


def load_checkpoints_as_sample_set(paths: Sequence[str | os.PathLike], keys: Sequence[str] | None = None) -> SampleSet:
    """All checkpoints in ``paths`` as one sample set ``{key: [len(paths), ...]}``."""
    return stack_state_dicts([load_sample_set(p, keys) for p in paths])
