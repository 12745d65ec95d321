"""Ways a checkpoint or sample-set file gets damaged, for the tests and ``bench/reliability.py``.

Each ``corrupt_<kind>(path)`` damages the safetensors file at ``path`` in place (as a failing
disk, a half-finished copy, a buggy tool or a mixed-up folder would) and returns the message
fragment the store's validation gives for it.
"""
from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open

from benchmark.core.store.blocks import read_header
from benchmark.core.store.checkpoint import write_safetensors
from benchmark.core.store.checksum import METADATA_KEY


def _tensors_and_metadata(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(path), framework="pt") as fh:  # raw read: no checksum verification
        return {k: fh.get_tensor(k).clone() for k in fh.keys()}, dict(fh.metadata() or {})


def _rewrite(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Write ``tensors`` with valid checksums, as another (buggy) writer would."""
    metadata = {k: v for k, v in metadata.items() if k != METADATA_KEY}
    write_safetensors(path, {k: v.contiguous() for k, v in tensors.items()}, metadata)


def _largest_float_key(tensors: dict[str, torch.Tensor]) -> str:
    return max((k for k, v in tensors.items() if v.is_floating_point()), key=lambda k: tensors[k].numel())


def corrupt_truncate(path: Path) -> str:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * 0.6)])
    return "truncated"


def corrupt_garbage(path: Path) -> str:
    size = path.stat().st_size
    path.write_bytes(random.Random(size).randbytes(size))
    return "corrupt or truncated safetensors"


def corrupt_bitflip(path: Path) -> str:
    header = read_header(path)
    key = max(header.entries, key=lambda k: header.entries[k]["data_offsets"][1] - header.entries[k]["data_offsets"][0])
    begin, end = header.entries[key]["data_offsets"]
    offset = header.data_start + (begin + end) // 2
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)[0]
        fh.seek(offset)
        fh.write(bytes([byte ^ 0x10]))
    return "checksum mismatch"


def corrupt_nan(path: Path) -> str:
    tensors, metadata = _tensors_and_metadata(path)
    key = _largest_float_key(tensors)
    tensors[key].view(-1)[0] = float("nan")
    _rewrite(path, tensors, metadata)
    return "contains NaN or Inf"


def corrupt_wrong_shape(path: Path) -> str:
    tensors, metadata = _tensors_and_metadata(path)
    key = _largest_float_key(tensors)
    tensors[key] = tensors[key][..., :-1].clone()
    _rewrite(path, tensors, metadata)
    return "has shape"


def corrupt_other_experiment(path: Path) -> str:
    tensors, metadata = _tensors_and_metadata(path)
    metadata["experiment"] = "mnist_optunet"
    _rewrite(path, tensors, metadata)
    return "mnist_optunet"


def _other_char(c: str) -> str:
    if c.isdigit():
        return str((int(c) + 1) % 10)
    return "b" if c.lower() == "a" else "a"


def damage_metadata(path: str | os.PathLike, key: str, part: str = "value") -> str:
    """Change one byte of metadata entry ``key`` of safetensors file ``path`` in place, as a failing
    disk would: ``part="value"`` changes one letter or digit in the middle of its value,
    ``part="key"`` the last letter of its name. The header keeps its length (the data stay where
    they are). Returns the expected message fragment."""
    path = Path(path)
    data = bytearray(path.read_bytes())
    length = int.from_bytes(data[:8], "little")
    header = bytes(data[8 : 8 + length])
    name = json.dumps(key).encode()
    at = header.find(name + b":")
    if at < 0:
        raise KeyError(f"{path}: no metadata key {key!r} in the header")
    if part == "key":
        pos = at + len(name) - 2  # last character of the name
    elif part == "value":
        start = at + len(name) + 2  # after the colon and the value's opening quote
        end = start
        while header[end : end + 1] != b'"' or header[end - 1 : end] == b"\\":
            end += 1
        pos = (start + end) // 2
        while not chr(header[pos]).isalnum():
            pos += 1
    else:
        raise ValueError(f"damage_metadata: part must be 'key' or 'value', got {part!r}")
    data[8 + pos] = ord(_other_char(chr(header[pos])))
    path.write_bytes(bytes(data))
    return "metadata"


def corrupt_metadata_digit(path: Path) -> str:
    """One character of a number in the metadata changed in place (``test_accuracy`` of a
    checkpoint, ``n_samples`` of a sample set, else the first entry covered by the checksum)."""
    metadata = read_header(path).metadata
    key = next((k for k in ("test_accuracy", "n_samples", "seed") if k in metadata),
               next(k for k in sorted(metadata) if k != METADATA_KEY))
    damage_metadata(path, key, "value")
    return "metadata checksum mismatch"


CORRUPTIONS: dict[str, Callable[[Path], str]] = {
    "truncate": corrupt_truncate,
    "garbage": corrupt_garbage,
    "bitflip": corrupt_bitflip,
    "nan": corrupt_nan,
    "wrong_shape": corrupt_wrong_shape,
    "other_experiment": corrupt_other_experiment,
    "metadata_digit": corrupt_metadata_digit,
}


def corrupt(path: str | os.PathLike, kind: str) -> str:
    """Damage ``path`` in way ``kind`` (a key of ``CORRUPTIONS``); return the expected message fragment."""
    return CORRUPTIONS[kind](Path(path))


def nan_files(folder: Path) -> tuple[Path, Path]:
    """``(sample set, checkpoint)`` written in ``folder`` by the store's own writers, each then
    given one NaN with valid checksums (a buggy writer): what every reader must refuse."""
    from benchmark.core.store import save_checkpoint, save_sample_set

    torch.manual_seed(0)
    samples, single = Path(folder) / "s.safetensors", Path(folder) / "c.safetensors"
    save_sample_set(samples, {"w": torch.randn(4, 6, 3), "b": torch.randn(4, 6)}, {})
    save_checkpoint(single, {"w": torch.randn(6, 3), "b": torch.randn(6)}, {})
    for path in (samples, single):
        corrupt(path, "nan")
    return samples, single
