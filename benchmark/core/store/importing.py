"""Checkpoints made elsewhere: find them in a folder or an archive, read them, and map their
keys to the experiment's model.

Readable files (by suffix): ``.safetensors`` (the released TorchUncertainty zoos, float16),
``.pt`` / ``.pth`` / ``.ckpt`` (``torch.save`` of a plain state dict, or a Lightning
checkpoint whose ``state_dict`` holds the weights under a key prefix such as ``model.``),
read with ``torch.load(weights_only=True)`` (no code runs from the file). Sources: a folder
(searched recursively), a ``.zip``, or a ``.tar`` / ``.tar.gz`` / ``.tgz``; members are read
one at a time, never extracted to disk. Files are listed in natural order of their paths
(``model_2`` before ``model_10``).

``KeyMapping`` turns a loaded object into a state dict keyed like the model: unwrap the
Lightning dict, strip leading prefixes, drop keys, apply ordered regex renames, cast floating
tensors; ``check_against`` then validates keys, shapes and finiteness. Errors name the file,
the key and the expected shape.
"""
from __future__ import annotations

import difflib
import hashlib
import io
import re
import tarfile
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator, List, Mapping, Optional

import torch
from safetensors.torch import load as load_safetensors

from benchmark.core.settings import require
from benchmark.core.store.checkpoint import check_finite
from benchmark.core.store.errors import CheckpointError

CHECKPOINT_SUFFIXES = (".safetensors", ".pt", ".pth", ".ckpt")
_TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz")


@dataclass(frozen=True)
class ForeignCheckpoint:
    """One checkpoint file of a source: ``name`` is its path inside the folder or archive."""

    name: str
    archive: Optional[str]
    data: bytes

    @property
    def where(self) -> str:
        """How error messages name the file."""
        return f"{self.archive}:{self.name}" if self.archive else self.name

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()


def natural_key(name: str) -> list:
    """Sort key that orders the digit runs of ``name`` by value (``a2`` < ``a10``)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def is_checkpoint(name: str) -> bool:
    return name.lower().endswith(CHECKPOINT_SUFFIXES) and not Path(name).name.startswith(".")


def list_checkpoints(source: str | Path) -> list[str]:
    """The checkpoint names of ``source`` (folder, zip or tar archive), in natural order.

    Raises ``CheckpointError`` naming ``source`` if it does not exist, is not a folder or an
    archive, or holds no checkpoint file.
    """
    path = Path(source).expanduser()
    if path.is_dir():
        names = [str(p.relative_to(path)) for p in path.rglob("*") if p.is_file() and is_checkpoint(p.name)]
    elif path.is_file() and path.name.lower().endswith(".zip"):
        with zipfile.ZipFile(path) as archive:
            names = [n for n in archive.namelist() if is_checkpoint(n)]
    elif path.is_file() and path.name.lower().endswith(_TAR_SUFFIXES):
        with tarfile.open(path) as archive:
            names = [m.name for m in archive.getmembers() if m.isfile() and is_checkpoint(m.name)]
    elif not path.exists():
        raise CheckpointError(f"zoo_import.source={source}: no such file or folder")
    else:
        raise CheckpointError(f"zoo_import.source={source}: expected a folder, a .zip or a .tar/.tar.gz/.tgz archive")
    if not names:
        raise CheckpointError(f"zoo_import.source={source}: no checkpoint file ({', '.join(CHECKPOINT_SUFFIXES)}) inside")
    return sorted(names, key=natural_key)


def iter_checkpoints(source: str | Path, names: list[str]) -> Iterator[ForeignCheckpoint]:
    """The files ``names`` of ``source`` with their bytes, one at a time, in the given order."""
    path = Path(source).expanduser()
    if path.is_dir():
        for name in names:
            yield ForeignCheckpoint(name, None, (path / name).read_bytes())
    elif path.name.lower().endswith(".zip"):
        with zipfile.ZipFile(path) as archive:
            for name in names:
                yield ForeignCheckpoint(name, str(path), archive.read(name))
    else:
        with tarfile.open(path) as archive:
            members = {m.name: m for m in archive.getmembers() if m.isfile()}
            for name in names:
                yield ForeignCheckpoint(name, str(path), archive.extractfile(members[name]).read())


def read_checkpoint(file: ForeignCheckpoint) -> Any:
    """The object stored in ``file``: a dict of tensors (safetensors), or what ``torch.load``
    returns with ``weights_only=True``."""
    try:
        if file.name.lower().endswith(".safetensors"):
            return load_safetensors(file.data)
        return torch.load(io.BytesIO(file.data), map_location="cpu", weights_only=True)
    except Exception as err:  # corrupt, truncated, or pickled code that weights_only refuses
        raise CheckpointError(f"{file.where}: cannot read the checkpoint ({type(err).__name__}: {err})") from err


@dataclass
class Rename:
    """``re.sub(pattern, replacement, key)`` applied to every key."""

    pattern: str
    replacement: str


@dataclass
class KeyMapping:
    """How a foreign checkpoint's keys become the model's state-dict keys, in this order:

    1. ``state_dict_key``: when the loaded object is a dict holding this key (a Lightning
       checkpoint), its value is the state dict; other entries (optimizer, epoch ...) are ignored;
    2. ``strip_prefixes``: leading prefixes removed, repeatedly (``model.`` of a Lightning module);
    3. ``drop``: keys matching any of these regexes are discarded (e.g. ``num_batches_tracked``,
       which the released float16 files store as Inf; a fitted temperature ``post_processing.*``);
    4. ``rename``: ordered regex substitutions (TorchUncertainty's ResNet-18 ``linear`` -> ``fc``,
       ``shortcut`` -> ``downsample``);
    5. floating tensors cast to ``dtype``.

    Model keys matching ``fill_missing`` that the file lacks take the fresh model's value
    (BatchNorm's ``num_batches_tracked`` counters, 0).
    """

    state_dict_key: Optional[str] = "state_dict"
    strip_prefixes: List[str] = field(default_factory=lambda: ["model.", "module.", "_orig_mod."])
    drop: List[str] = field(default_factory=lambda: [r"\.num_batches_tracked$", r"^post_processing\.", r"^loss\."])
    rename: List[Rename] = field(default_factory=list)
    fill_missing: List[str] = field(default_factory=lambda: [r"\.num_batches_tracked$"])
    dtype: str = "float32"

    def __post_init__(self) -> None:
        self.rename = [Rename(**r) if isinstance(r, Mapping) else r for r in self.rename]
        for what, pattern in [*(("drop", p) for p in self.drop), *(("fill_missing", p) for p in self.fill_missing),
                              *(("rename", r.pattern) for r in self.rename)]:
            require(_compiles(pattern), what, pattern, "a regular expression (Python re syntax)")
        dtype = getattr(torch, self.dtype, None)
        require(isinstance(dtype, torch.dtype) and dtype.is_floating_point, "dtype", self.dtype,
                "a floating torch dtype such as float32")

    def describe(self) -> dict[str, Any]:
        """The mapping as plain data (stored as provenance with every imported checkpoint)."""
        return asdict(self)

    def apply(self, loaded: Any, where: str) -> dict[str, torch.Tensor]:
        """The state dict of ``loaded`` with keys mapped (steps 1-5); ``where`` names the file in errors."""
        state = loaded
        if isinstance(loaded, Mapping) and self.state_dict_key and isinstance(loaded.get(self.state_dict_key), Mapping):
            state = loaded[self.state_dict_key]
        if not isinstance(state, Mapping):
            raise CheckpointError(f"{where}: holds a {type(state).__name__}, expected a state dict (key -> tensor)")
        dtype = getattr(torch, self.dtype)
        out: dict[str, torch.Tensor] = {}
        origin: dict[str, str] = {}
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                raise CheckpointError(f"{where}: entry {key!r} is a {type(value).__name__}, not a tensor; "
                                      f"set zoo_import.mapping.state_dict_key to the entry that holds the state dict")
            mapped = str(key)
            stripped = True
            while stripped:
                stripped = False
                for prefix in self.strip_prefixes:
                    if prefix and mapped.startswith(prefix):
                        mapped, stripped = mapped[len(prefix):], True
            if any(re.search(pattern, mapped) for pattern in self.drop):
                continue
            for rule in self.rename:
                mapped = re.sub(rule.pattern, rule.replacement, mapped)
            if mapped in out:
                raise CheckpointError(f"{where}: keys {origin[mapped]!r} and {key!r} both map to {mapped!r}")
            out[mapped], origin[mapped] = (value.to(dtype) if value.is_floating_point() else value), str(key)
        return out


def _compiles(pattern: str) -> bool:
    try:
        re.compile(pattern)
    except re.error:
        return False
    return True


def check_against(tensors: dict[str, torch.Tensor], reference: Mapping[str, torch.Tensor], mapping: KeyMapping,
                  where: str) -> dict[str, torch.Tensor]:
    """``tensors`` completed and checked against the fresh model state dict ``reference``:
    the same keys (``fill_missing`` ones may come from ``reference``), the same shapes, finite.
    Returned in ``reference``'s key order; ``CheckpointError`` naming the file, key and shape."""
    missing = [k for k in reference if k not in tensors and not any(re.search(p, k) for p in mapping.fill_missing)]
    extra = [k for k in tensors if k not in reference]
    if missing or extra:
        parts = []
        if missing:
            key = missing[0]
            parts.append(f"missing key {key!r} (expected shape {tuple(reference[key].shape)}); {len(missing)} missing in all")
        if extra:
            hint = difflib.get_close_matches(extra[0], [k for k in reference if k not in tensors], n=1)
            parts.append(f"unexpected key {extra[0]!r}" + (f" (did you mean {hint[0]!r}? add a rename to zoo_import.mapping)"
                                                            if hint else "") + f"; {len(extra)} unexpected in all")
        raise CheckpointError(f"{where}: " + "; ".join(parts))
    out = {}
    for key, want in reference.items():
        value = tensors.get(key, want)
        if tuple(value.shape) != tuple(want.shape):
            raise CheckpointError(f"{where}: key {key!r} has shape {tuple(value.shape)}, expected {tuple(want.shape)}")
        out[key] = value.to(want.dtype) if value.dtype != want.dtype and not want.is_floating_point() else value
    check_finite(out, where)
    return out


def seed_from_name(name: str) -> int:
    """The last integer in the file name of ``name`` (``model_0042.safetensors`` -> 42)."""
    numbers = re.findall(r"\d+", Path(name).name.split(".")[0])
    if not numbers:
        raise CheckpointError(f"{name}: no number in the file name to take the seed from (zoo_import.seeds_from=name)")
    return int(numbers[-1])
