"""Reads of safetensors files through one open handle, without memory-mapping them.

Row blocks: safetensors' ``get_slice`` returns views of a memory-mapped file: every page a slice
touches stays mapped into the process, so streaming a 10 GB layer still drives resident
memory to 10 GB. Reading the needed byte ranges with ``os.pread`` keeps resident memory
at the size of the block being read (the kernel's page cache is not charged to us).

Whole files (``FileReader.tensors``): safetensors' ``get_tensor`` hands out tensors backed by the
mapping, so what was read changes when the file changes on disk, and a file removed or replaced on
another NFS node kills the reader with ``SIGBUS`` at its next page fault. Reading into fresh memory
costs one copy (a few ms per 45 MB ResNet-18 checkpoint from the page cache, with the checksum pass
every read makes: ``bench/bench_store.py`` measures it) and turns such failures into ``CheckpointError``.
"""
from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass

import torch

from benchmark.core.store.errors import CheckpointError

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}  # torch dtype -> safetensors name
MAX_HEADER = 100 * 2**20  # safetensors' own limit on the JSON header


@dataclass(frozen=True)
class Header:
    """The parsed header of a safetensors file: tensor entries, metadata, and where data starts."""

    entries: dict[str, dict]  # key -> {"dtype", "shape", "data_offsets"}
    metadata: dict[str, str]
    data_start: int  # absolute byte offset of the data section

    @property
    def data_size(self) -> int:
        """Bytes of the data section the entries account for."""
        return max((e["data_offsets"][1] for e in self.entries.values()), default=0)

    def location(self, path: str | os.PathLike, key: str) -> "TensorLocation":
        if key not in self.entries:
            raise CheckpointError(f"{path}: no key {key!r}")
        entry = self.entries[key]
        if entry["dtype"] not in _DTYPES:
            raise CheckpointError(f"{path}: key {key!r} has unsupported dtype {entry['dtype']}")
        location = TensorLocation(_DTYPES[entry["dtype"]], tuple(entry["shape"]), self.data_start + entry["data_offsets"][0])
        begin, end = entry["data_offsets"]
        if end - begin != math.prod(location.shape) * location.itemsize:
            raise CheckpointError(f"{path}: key {key!r} spans {end - begin} bytes, its dtype and shape "
                                  f"{list(location.shape)} need {math.prod(location.shape) * location.itemsize} (corrupt header)")
        return location


def read_header(path: str | os.PathLike, fd: int | None = None) -> Header:
    """Parse the header of safetensors file ``path`` (no data read; from the open descriptor
    ``fd`` when given); ``CheckpointError`` naming the file when it is missing, unreadable, or its
    header is corrupt or truncated."""
    try:
        if fd is None:
            with open(path, "rb") as fh:
                return _parse_header(path, fh.read(8), fh.read)
        return _parse_header(path, os.pread(fd, 8, 0), lambda n: os.pread(fd, n, 8))
    except FileNotFoundError as err:
        raise CheckpointError(f"{path}: no such file") from err
    except (OSError, struct.error, ValueError, KeyError, TypeError, AttributeError) as err:
        raise CheckpointError(f"{path}: corrupt or truncated safetensors header ({err})") from err


def _parse_header(path, prefix: bytes, read) -> Header:
    (length,) = struct.unpack("<Q", prefix)
    if length > MAX_HEADER:
        raise ValueError(f"header length {length} is implausible")
    raw = read(length)
    if len(raw) != length:
        raise ValueError(f"header of {length} bytes cut at {len(raw)}")
    header = json.loads(raw)
    metadata = header.pop("__metadata__", None) or {}
    for key, entry in header.items():
        begin, end = entry["data_offsets"]
        if not (isinstance(entry["shape"], list) and 0 <= begin <= end):
            raise ValueError(f"entry {key!r} is malformed")
    return Header(header, dict(metadata), 8 + length)


def stat_identity(path: str | os.PathLike, st: os.stat_result) -> tuple:
    """What identifies one version of a file: (real path, device, inode, size, mtime in ns)."""
    return (os.path.realpath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class FileReader:
    """One open handle on a safetensors file: its header and identity are taken from the handle,
    so every block read through it comes from the version that was validated, even when the path
    is replaced meanwhile (a healed or republished file). Use as a context manager."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = path
        try:
            self.fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError as err:
            raise CheckpointError(f"{path}: no such file") from err
        try:
            self.identity = stat_identity(path, os.fstat(self.fd))
            self.header = read_header(path, self.fd)
        except BaseException:
            os.close(self.fd)
            raise

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "FileReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def check_identity(self, expected: tuple) -> None:
        """Raise ``CheckpointError`` when this handle's file is not the version ``expected``."""
        if self.identity[1:] != tuple(expected)[1:]:
            raise CheckpointError(f"{self.path}: the file changed while it was being read (identity {self.identity[1:]}, "
                                  f"validated {tuple(expected)[1:]})")

    def tensors(self, keys: "list[str] | None" = None) -> dict[str, torch.Tensor]:
        """Tensors ``keys`` (default: all) whole, read through this handle into fresh memory (no
        memory map: a file replaced or removed on another node meanwhile gives a catchable
        ``CheckpointError``, never a ``SIGBUS`` in the middle of a read).

        The header must index the data section exactly, as safetensors requires (no holes, no
        overlaps, the file's size); ``CheckpointError`` naming the file and key otherwise."""
        self._check_layout()
        wanted = list(self.header.entries) if keys is None else list(keys)
        return {key: self._whole(key) for key in wanted}

    def _check_layout(self) -> None:
        spans = sorted(tuple(e["data_offsets"]) for e in self.header.entries.values())
        at = 0
        for begin, end in spans:
            if begin != at:
                raise CheckpointError(f"{self.path}: corrupt safetensors header (data offsets leave a hole or overlap at byte {at})")
            at = end
        size = self.identity[3]
        if self.header.data_start + at != size:
            raise CheckpointError(f"{self.path}: corrupt or truncated safetensors file ({size} bytes, the header "
                                  f"indexes {self.header.data_start + at})")

    def _whole(self, key: str) -> torch.Tensor:
        loc = self.header.location(self.path, key)
        size = math.prod(loc.shape) * loc.itemsize
        raw = torch.empty(size, dtype=torch.uint8, device="cpu")  # uninitialised: pread fills it
        if size:
            read_range(self.fd, self.path, memoryview(raw.numpy()), loc.begin)
        return raw.view(loc.dtype).reshape(loc.shape)

    def rows(self, key: str, axis: int, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of ``axis`` (0 or 1) of tensor ``key``, all leading indices kept: ``axis=0``
        gives ``tensor[start:stop]`` (one contiguous range), ``axis=1`` ``tensor[:, start:stop]`` of a sample
        set ``[S, a, ...]`` (S contiguous ranges). A new tensor."""
        return _rows(self.fd, self.path, self.header.location(self.path, key), key, axis, start, stop)

    def tensor(self, key: str) -> torch.Tensor:
        """Tensor ``key`` whole (any shape, scalars included) through this handle."""
        loc = self.header.location(self.path, key)
        size = math.prod(loc.shape) * loc.itemsize
        if size == 0:
            return torch.empty(loc.shape, dtype=loc.dtype, device="cpu")
        return torch.frombuffer(_read_ranges(self.fd, self.path, [(loc.begin, size)], size), dtype=loc.dtype).reshape(loc.shape)


@dataclass(frozen=True)
class TensorLocation:
    """Where a tensor's bytes lie in a safetensors file."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offset of element 0

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype, device="cpu").element_size()


def read_range(fd: int, path: str | os.PathLike, view: memoryview, offset: int) -> None:
    """Fill ``view`` with the bytes of open file ``fd`` at ``offset``; ``CheckpointError`` naming
    the file if it ends first or the read fails (e.g. a stale NFS handle)."""
    view = view.cast("B")
    done = 0
    try:
        while done < len(view):  # one call reads at most ~2 GiB on Linux
            got = os.preadv(fd, [view[done:]], offset + done)
            if got == 0:
                break
            done += got
    except OSError as err:
        raise CheckpointError(f"{path}: read failed at byte {offset + done} ({err})") from err
    if done != len(view):
        raise CheckpointError(f"{path}: truncated data (wanted {len(view)} bytes at {offset}, got {done})")


def _read_ranges(fd: int, path: str | os.PathLike, ranges: list[tuple[int, int]], total: int) -> bytearray:
    buffer = bytearray(total)
    view = memoryview(buffer)
    at = 0
    for offset, size in ranges:
        read_range(fd, path, view[at : at + size], offset)
        at += size
    return buffer


def _rows(fd: int, path, loc: "TensorLocation", key: str, axis: int, start: int, stop: int) -> torch.Tensor:
    shape = loc.shape
    if axis not in (0, 1) or len(shape) <= axis:
        raise ValueError(f"rows: axis {axis} out of range for {key!r} of shape {shape}")
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
        return torch.empty(out_shape, dtype=loc.dtype, device="cpu")
    return torch.frombuffer(_read_ranges(fd, path, ranges, total), dtype=loc.dtype).reshape(out_shape)
