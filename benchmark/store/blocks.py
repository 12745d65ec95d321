"""Positional reads of row blocks from safetensors files, without memory-mapping them.

safetensors' ``get_slice`` returns views of a memory-mapped file: every page a slice
touches stays mapped into the process, so streaming a 10 GB layer still drives resident
memory to 10 GB. Reading the needed byte ranges with ``os.pread`` keeps resident memory
at the size of the block being read (the kernel's page cache is not charged to us).
"""
from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass

import torch

from benchmark.store.errors import CheckpointError

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class TensorLocation:
    """Where a tensor's bytes lie in a safetensors file."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offset of element 0

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


def locate(path: str | os.PathLike, key: str) -> TensorLocation:
    """Parse the header of ``path`` and return where tensor ``key`` lies."""
    try:
        with open(path, "rb") as fh:
            (length,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(length))
    except (OSError, struct.error, ValueError) as err:
        raise CheckpointError(f"{path}: corrupt or truncated safetensors header ({err})") from err
    if key not in header or key == "__metadata__":
        raise CheckpointError(f"{path}: no key {key!r}")
    entry = header[key]
    if entry["dtype"] not in _DTYPES:
        raise CheckpointError(f"{path}: key {key!r} has unsupported dtype {entry['dtype']}")
    return TensorLocation(_DTYPES[entry["dtype"]], tuple(entry["shape"]), 8 + length + entry["data_offsets"][0])


def _read_ranges(path: str | os.PathLike, ranges: list[tuple[int, int]], total: int) -> bytearray:
    buffer = bytearray(total)
    view = memoryview(buffer)
    fd = os.open(path, os.O_RDONLY)
    try:
        at = 0
        for offset, size in ranges:
            got = os.preadv(fd, [view[at : at + size]], offset)
            if got != size:
                raise CheckpointError(f"{path}: truncated data (wanted {size} bytes at {offset}, got {got})")
            at += size
    finally:
        os.close(fd)
    return buffer


def read_rows(path: str | os.PathLike, key: str, axis: int, start: int, stop: int) -> torch.Tensor:
    """Rows ``start:stop`` of ``axis`` (0 or 1) of tensor ``key``, all leading indices kept.

    ``axis=0``: ``tensor[start:stop]`` (one contiguous range). ``axis=1``: ``tensor[:, start:stop]``
    of a sample set ``[S, a, ...]`` (S contiguous ranges). Returns a new tensor.
    """
    loc = locate(path, key)
    shape = loc.shape
    if axis not in (0, 1) or len(shape) <= axis:
        raise ValueError(f"read_rows: axis {axis} out of range for {key!r} of shape {shape}")
    stop = min(stop, shape[axis])
    inner = math.prod(shape[axis + 1 :]) * loc.itemsize
    rows = max(0, stop - start)
    if axis == 0:
        ranges = [(loc.begin + start * inner, rows * inner)]
        out_shape = (rows, *shape[1:])
    else:
        stride = shape[1] * inner
        ranges = [(loc.begin + s * stride + start * inner, rows * inner) for s in range(shape[0])]
        out_shape = (shape[0], rows, *shape[2:])
    total = sum(size for _, size in ranges)
    if total == 0:
        return torch.empty(out_shape, dtype=loc.dtype)
    return torch.frombuffer(_read_ranges(path, ranges, total), dtype=loc.dtype).reshape(out_shape)
