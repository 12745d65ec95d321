"""Content checksums of the tensors of a safetensors file, kept in its own metadata.

Every checkpoint and sample set carries, under the metadata key ``checksums``, the JSON
``{"algorithm": "xxh3_64", "tensors": {key: hex digest}, "metadata": hex digest}``: one XXH3-64
digest per tensor over its dtype, its shape and its bytes, and one over every other metadata entry
(keys and values, ``metadata_digest``). The digests are computed from what is being written and go
into the same header, so file and checksums appear together in one atomic rename.

**Store format.** The metadata key ``format`` records the version of this layout (``FORMAT``). The
versions a reader meets:

- 2 (``format`` = "2"): tensor and metadata digests; both keys are required, so damage cannot
  switch the checks off: a file claiming format 2 without ``checksums`` (or whose ``checksums``
  lacks the metadata digest) is corrupt, and a file whose ``format`` key was damaged fails its
  metadata digest (the key and its value are covered).
- 1 (no ``format`` key, ``checksums`` without a ``metadata`` digest): written by the previous
  version; its tensors are verified, its metadata are not covered.
- 0 (neither key): written before checksums; read with keys, shapes and finite values checked.
  A metadata key one byte away from ``checksums`` or ``format`` (a damaged key name, not an old
  file) makes such a file corrupt.

XXH3 (the ``xxhash`` package) hashes at memory bandwidth: on a ResNet-18 checkpoint (45 MB) it is
~7x faster than ``zlib.crc32`` and ~30x faster than BLAKE2b (``bench/bench_store.py`` measures it).
It detects accidental damage (bit flips, truncation, garbage), not tampering.

One digest per tensor lets a streamed read verify exactly the tensor it streams. What was verified
is remembered per file identity (device, inode, size, mtime) for the life of the process, so a zoo
read one layer at a time is hashed once, not once per layer; a rewritten file is verified afresh.

``stage=verify`` reports files of format 0 as stale (unverified) and counts files of format 1
(usable; rewritten in the current format when their unit is redone).
"""
from __future__ import annotations

import json
import os
from collections import OrderedDict
from typing import Iterable, Mapping

import torch
import xxhash

from benchmark.core.store.blocks import DTYPE_NAMES, stat_identity
from benchmark.core.store.errors import CheckpointError

ALGORITHM = "xxh3_64"
METADATA_KEY = "checksums"
FORMAT_KEY = "format"
FORMAT = 2  # the store format written by this version (see the module doc)
CHUNK_BYTES = 16 * 2**20  # streamed verification reads at most this much at a time
_MEMO_FILES = 65536


class ChecksumError(CheckpointError):
    """A tensor's bytes do not match the checksum written with them (damaged after writing)."""


def _new_hash(dtype_name: str, shape: Iterable[int]) -> "xxhash.xxh3_64":
    digest = xxhash.xxh3_64()
    digest.update(f"{dtype_name}{list(shape)}".encode())
    return digest


def tensor_digest(tensor: torch.Tensor) -> str:
    """Hex XXH3-64 digest of one tensor's dtype, shape and (little-endian, row-major) bytes."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    digest = _new_hash(DTYPE_NAMES[tensor.dtype], tensor.shape)
    digest.update(flat.view(torch.uint8).numpy())
    return digest.hexdigest()


def digest_chunks(dtype_name: str, shape: Iterable[int], chunks: Iterable[memoryview]) -> str:
    """The digest ``tensor_digest`` gives, computed from a tensor's bytes read in chunks."""
    digest = _new_hash(dtype_name, shape)
    for chunk in chunks:
        digest.update(chunk)
    return digest.hexdigest()


def metadata_digest(metadata: Mapping[str, str]) -> str:
    """Hex XXH3-64 digest of every metadata entry but ``checksums`` itself (keys and values, sorted)."""
    covered = {k: v for k, v in metadata.items() if k != METADATA_KEY}
    return xxhash.xxh3_64(json.dumps(covered, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def checksummed_metadata(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> dict[str, str]:
    """``metadata`` (``str -> str``) with the store format and the ``checksums`` entry for
    ``tensors`` (the exact tensors being written) and for the metadata themselves."""
    out = {k: v for k, v in metadata.items() if k != METADATA_KEY}
    out[FORMAT_KEY] = str(FORMAT)
    out[METADATA_KEY] = json.dumps({
        "algorithm": ALGORITHM,
        "tensors": {k: tensor_digest(v) for k, v in sorted(tensors.items())},
        "metadata": metadata_digest(out),
    }, sort_keys=True)
    return out


def _one_byte_away(key: str, target: str) -> bool:
    """Whether ``key`` differs from ``target`` by one substituted, inserted or deleted character."""
    if key == target or abs(len(key) - len(target)) > 1:
        return False
    if len(key) == len(target):
        return sum(a != b for a, b in zip(key, target)) == 1
    short, long = sorted((key, target), key=len)
    return any(long[:i] + long[i + 1:] == short for i in range(len(long)))


def stored_checksums(metadata: Mapping[str, str], source: str) -> dict[str, str] | None:
    """Key -> digest from a file's metadata, after checking the metadata against their own digest;
    ``None`` for a file written before checksums (format 0, see the module doc).

    Raises ``ChecksumError`` naming ``source`` when the entry is malformed or uses another
    algorithm, when the metadata do not match their digest (an entry changed after writing), or
    when the file claims the current format and lacks what it requires.
    """
    raw, declared = metadata.get(METADATA_KEY), metadata.get(FORMAT_KEY)
    if raw is None:
        if declared is not None:
            raise ChecksumError(f"{source}: claims store format {declared} but has no '{METADATA_KEY}' metadata "
                                "(damaged header: a file of this format always carries them)")
        near = [k for k in metadata if _one_byte_away(k, METADATA_KEY) or _one_byte_away(k, FORMAT_KEY)]
        if near:
            raise ChecksumError(f"{source}: metadata key {near[0]!r} looks like a damaged '{METADATA_KEY}' or "
                                f"'{FORMAT_KEY}' key; the file cannot be told apart from one written before checksums")
        return None
    try:
        entry = json.loads(raw)
        algorithm, digests = entry["algorithm"], dict(entry["tensors"])
        covered = entry.get("metadata")
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise ChecksumError(f"{source}: malformed '{METADATA_KEY}' metadata ({err})") from err
    if algorithm != ALGORITHM:
        raise ChecksumError(f"{source}: checksums use {algorithm!r}; this version reads {ALGORITHM!r}")
    if covered is None:
        if declared is not None:
            raise ChecksumError(f"{source}: claims store format {declared} but its '{METADATA_KEY}' lack the "
                                "metadata digest (damaged header)")
        return digests  # format 1: tensors covered, metadata not
    computed = metadata_digest(metadata)
    if computed != covered:
        raise ChecksumError(f"{source}: metadata checksum mismatch (stored {ALGORITHM} {covered}, computed "
                            f"{computed}): a metadata entry changed or was damaged after the file was written")
    if declared != str(FORMAT):
        raise ChecksumError(f"{source}: store format {declared!r}; this version reads formats 0 to {FORMAT}")
    return digests


def file_format(metadata: Mapping[str, str]) -> int:
    """The store format of a file from its (checked) metadata: 0, 1 or ``FORMAT`` (module doc)."""
    if METADATA_KEY not in metadata:
        return 0
    return FORMAT if FORMAT_KEY in metadata else 1


def mismatch(source: str, key: str, stored: str | None, computed: str) -> ChecksumError:
    """The error for tensor ``key`` whose bytes hash to ``computed`` instead of ``stored``."""
    if stored is None:
        return ChecksumError(f"{source}: tensor {key!r} has no checksum although the file carries checksums")
    return ChecksumError(f"{source}: checksum mismatch in tensor {key!r} (stored {ALGORITHM} {stored}, "
                         f"computed {computed}): the file changed or was damaged after it was written")


def verify_tensors(
    path: str | os.PathLike, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str], identity: tuple | None = None
) -> None:
    """Check loaded ``tensors`` of file ``path`` against the checksums in its ``metadata``.

    ``identity``: the identity of the version of the file that was read (``file_identity`` taken
    before and found unchanged after the read); keys already verified for it are skipped and the
    ones verified now are remembered. ``None``: the version is unsure, nothing is remembered. A
    file without checksums passes (see the module doc). Raises ``ChecksumError`` naming the file
    and the tensor.
    """
    digests = stored_checksums(metadata, str(path))
    if digests is None:
        return
    done = _verified_keys(identity) if identity is not None else set()
    for key, tensor in tensors.items():
        if key in done:
            continue
        computed = tensor_digest(tensor)
        if digests.get(key) != computed:
            raise mismatch(str(path), key, digests.get(key), computed)
        if identity is not None:
            remember(identity, key)


def file_identity(path: str | os.PathLike) -> tuple:
    """What identifies one version of a file: (real path, device, inode, size, mtime in ns)."""
    return stat_identity(path, os.stat(path))


_VERIFIED: "OrderedDict[tuple, set[str]]" = OrderedDict()


def _verified_keys(identity: tuple) -> set[str]:
    keys = _VERIFIED.get(identity)
    if keys is None:
        return set()
    _VERIFIED.move_to_end(identity)
    return keys


def remember(identity: tuple, key: str) -> None:
    """Record that tensor ``key`` of the file version ``identity`` matched its checksum."""
    _VERIFIED.setdefault(identity, set()).add(key)
    _VERIFIED.move_to_end(identity)
    while len(_VERIFIED) > _MEMO_FILES:
        _VERIFIED.popitem(last=False)


def is_verified(identity: tuple, key: str) -> bool:
    """Whether tensor ``key`` of file version ``identity`` was verified by this process."""
    return key in _verified_keys(identity)


def forget_all() -> None:
    """Drop what this process remembers as verified (tests, benchmarks)."""
    _VERIFIED.clear()


SEAL_KEY = "checksum"


def _json_digest(payload: Mapping) -> str:
    return xxhash.xxh3_64(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def sealed_json(payload: Mapping) -> str:
    """JSON text of ``payload`` (a dict of JSON values) with the XXH3-64 digest of its canonical
    form under ``"checksum"``: what a small JSON cache (``eval/*.json``) is written as."""
    return json.dumps({**payload, SEAL_KEY: f"{ALGORITHM}:{_json_digest(payload)}"}, sort_keys=True)


def unsealed_json(text: str, source: str) -> dict:
    """The payload of ``sealed_json`` text; ``ChecksumError`` naming ``source`` when the text does
    not parse, lacks its checksum, or was changed after it was written (one digit is enough)."""
    try:
        data = json.loads(text)
        stored = data.pop(SEAL_KEY)
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise ChecksumError(f"{source}: damaged (unreadable JSON or no '{SEAL_KEY}': {err})") from err
    computed = f"{ALGORITHM}:{_json_digest(data)}"
    if stored != computed:
        raise ChecksumError(f"{source}: checksum mismatch (stored {stored}, computed {computed}): changed after writing")
    return data


def content_digest(metadata: Mapping[str, str]) -> str | None:
    """One digest naming a file's whole content (its tensors and metadata): XXH3-64 of its
    ``checksums`` entry, which holds their digests; ``None`` for a file without checksums. What a
    unit's predictions carry to name the sample set they were computed from."""
    raw = metadata.get(METADATA_KEY)
    return None if raw is None else f"{ALGORITHM}:{xxhash.xxh3_64(raw.encode()).hexdigest()}"
