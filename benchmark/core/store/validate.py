"""Whole-file validation of a checkpoint or sample set without loading it: header, size, content
checksums, finite values, keys and shapes, metadata. Reads the file once in bounded chunks, so a
sample set of several GB is checked with a few MB of memory."""
from __future__ import annotations

import os
from typing import Iterable, Mapping

import torch

from benchmark.core.store.blocks import FileReader, Header, read_range
from benchmark.core.store.checkpoint import all_finite, check_metadata
from benchmark.core.store.checksum import (
    CHUNK_BYTES, ChecksumError, digest_chunks, is_verified, mismatch, remember, stored_checksums,
)
from benchmark.core.store.errors import CheckpointError

ShapeSpec = Mapping[str, tuple[int, ...]]


def check_file(
    path: str | os.PathLike,
    shapes: ShapeSpec | None = None,
    leading: int = 0,
    expect: Mapping[str, str] | None = None,
    samples: int | None = None,
    reader: FileReader | None = None,
) -> dict[str, str]:
    """Validate safetensors file ``path`` whole; return its metadata. ``reader``: an open handle on
    it (``blocks.FileReader``) whose version is the one to check (its ``identity`` was taken
    before anything was read); by default the file is opened here.

    Checks, in order: the header parses and the file size matches it (truncation, appended
    garbage); every ``expect`` metadata entry the file holds (e.g. ``{"experiment": "digits_optunet"}``:
    not another experiment's file, see ``checkpoint.check_metadata``); with
    ``shapes``, the keys, and each tensor's shape after ``leading`` sample axes (and, with
    ``samples``, that the sample axis has that length); then every tensor's bytes against its
    checksum and, for floating tensors, that they are finite. Raises ``CheckpointError`` (or its
    ``ChecksumError``) whose message names the file, the key and what is wrong.
    """
    if reader is None:
        with FileReader(path) as own:  # header, identity and data all from one version of the file
            return check_file(path, shapes, leading, expect, samples, own)
    header, identity, fd = reader.header, reader.identity, reader.fd
    _check_size(path, header, identity[3])
    digests = stored_checksums(header.metadata, str(path))  # damaged metadata are named as damage
    check_metadata(header.metadata, expect or {}, str(path))
    if shapes is not None:
        _check_shapes(path, header, shapes, leading, samples)
    if digests is not None and set(digests) != set(header.entries):
        lost = sorted(set(digests) - set(header.entries))
        if lost:
            raise ChecksumError(f"{path}: its checksums name tensor {lost[0]!r}, which the file does not hold "
                                "(a tensor entry was renamed or removed after writing)")
        raise mismatch(str(path), sorted(set(header.entries) - set(digests))[0], None, "")
    for key in sorted(header.entries):
        digest = _scan_tensor(fd, path, header, key, finite=True)
        if digests is not None:
            if digests.get(key) != digest:
                raise mismatch(str(path), key, digests.get(key), digest)
            remember(identity, key)
    return dict(header.metadata)


def verify_file_tensors(path: str | os.PathLike, keys: Iterable[str] | None = None, reader: FileReader | None = None) -> None:
    """Check the bytes of tensors ``keys`` (all by default) of ``path`` against their checksums,
    reading them in chunks; tensors this process already verified in this version of the file are
    skipped. What the streamed (positional block) readers call before reading a tensor, with the
    ``reader`` (open handle) they then read the blocks through."""
    if reader is None:
        with FileReader(path) as own:
            return verify_file_tensors(path, keys, own)
    identity, header = reader.identity, reader.header
    wanted = None if keys is None else list(keys)
    if wanted is not None and all(is_verified(identity, k) for k in wanted):
        return
    digests = stored_checksums(header.metadata, str(path))
    if digests is None:
        return
    _check_size(path, header, identity[3])
    for key in sorted(header.entries) if wanted is None else wanted:
        if key not in header.entries or is_verified(identity, key):
            continue
        digest = _scan_tensor(reader.fd, path, header, key, finite=False)
        if digests.get(key) != digest:
            raise mismatch(str(path), key, digests.get(key), digest)
        remember(identity, key)


def _check_size(path: str | os.PathLike, header: Header, size: int) -> None:
    expected = header.data_start + header.data_size
    if size < expected:
        raise CheckpointError(f"{path}: truncated file ({size} bytes, its header describes {expected})")
    if size > expected:
        raise CheckpointError(f"{path}: {size - expected} unexpected bytes after the data its header describes")


def _check_shapes(path, header: Header, shapes: ShapeSpec, leading: int, samples: int | None) -> None:
    missing = sorted(set(shapes) - set(header.entries))
    unexpected = sorted(set(header.entries) - set(shapes))
    if missing:
        raise CheckpointError(f"{path}: missing key {missing[0]!r} (expected shape {tuple(shapes[missing[0]])}); "
                              f"all missing: {missing}")
    if unexpected:
        raise CheckpointError(f"{path}: unexpected key {unexpected[0]!r}; all unexpected: {unexpected}")
    counts = set()
    for key, shape in shapes.items():
        got = tuple(header.entries[key]["shape"])
        if len(got) < leading or got[leading:] != tuple(shape):
            raise CheckpointError(f"{path}: key {key!r} has shape {got[leading:] if len(got) >= leading else got}, "
                                  f"expected {tuple(shape)}")
        counts.add(got[:leading])
    if leading and len(counts) > 1:
        raise CheckpointError(f"{path}: tensors disagree on the sample count: {sorted(counts)}")
    if leading and samples is not None and counts and next(iter(counts))[0] != samples:
        raise CheckpointError(f"{path}: {next(iter(counts))[0]} samples, its metadata says {samples}")


def _scan_tensor(fd: int, path, header: Header, key: str, finite: bool) -> str:
    """Read tensor ``key`` in chunks; return its digest; with ``finite``, raise on NaN/Inf."""
    entry = header.entries[key]
    location = header.location(path, key)
    begin, end = entry["data_offsets"]
    total = end - begin
    buffer = bytearray(min(CHUNK_BYTES, max(total, 1)))
    check = finite and location.dtype.is_floating_point

    def chunks():
        at = 0
        while at < total:
            size = min(len(buffer), total - at)
            view = memoryview(buffer)[:size]
            read_range(fd, path, view, location.begin + at)
            if check and not all_finite(torch.frombuffer(buffer, dtype=location.dtype, count=size // location.itemsize)):
                raise CheckpointError(f"{path}: tensor {key!r} contains NaN or Inf values")
            yield view
            at += size

    return digest_chunks(entry["dtype"], entry["shape"], chunks())
