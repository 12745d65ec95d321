"""Checkpoints made elsewhere: find them in a folder or an archive, read them, and map their
keys to the experiment's model.

Readable files (by suffix): ``.safetensors`` (the released TorchUncertainty zoos, float16),
``.pt`` / ``.pth`` / ``.ckpt`` (``torch.save`` of a plain state dict, or a Lightning
checkpoint whose ``state_dict`` holds the weights under a key prefix such as ``model.``),
read with ``torch.load(weights_only=True)`` (no code runs from the file). Sources: a folder
(searched recursively), a ``.zip``, or a ``.tar`` / ``.tar.gz`` / ``.tgz``; members are read
one at a time, never extracted to disk. ``scan_source`` lists the checkpoint files in natural
order of their paths (``model_2`` before ``model_10``: the order seeds are given in) and says
which members it left out and why; ``iter_checkpoints`` then reads them in the archive's own
order, in one forward pass (a compressed stream is never seeked backwards: reading 1024
members in natural order from a ``.tgz`` would decompress it again for every member).

``KeyMapping`` turns a loaded object into a state dict keyed like the model: unwrap the
Lightning dict, strip leading prefixes, drop keys, apply ordered regex renames, cast floating
tensors; ``check_against`` then validates keys, shapes and finiteness. Errors name the file,
the key and the expected shape.
"""
from __future__ import annotations

import difflib
import functools
import hashlib
import io
import posixpath
import re
import stat
import tarfile
import zipfile
import zlib
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, List, Mapping, Optional

import torch
from safetensors.torch import load as load_safetensors

from benchmark.core.settings import require
from benchmark.core.store.checkpoint import check_finite, read_metadata
from benchmark.core.store.errors import CheckpointError

CHECKPOINT_SUFFIXES = (".safetensors", ".pt", ".pth", ".ckpt")
_TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz")
_ARCHIVE_ERRORS = (tarfile.TarError, zipfile.BadZipFile, zlib.error, EOFError, OSError)


@dataclass(frozen=True)
class ForeignCheckpoint:
    """One checkpoint file of a source: ``name`` is its path inside the folder or archive.

    ``problem`` says why its bytes could not be read (``data`` is then empty); a file whose
    bytes were read but do not parse is found by ``read_checkpoint``.
    """

    name: str
    archive: Optional[str]
    data: bytes
    problem: Optional[str] = None

    @property
    def where(self) -> str:
        """How error messages name the file."""
        return f"{self.archive}:{self.name}" if self.archive else self.name

    @property
    def sha256(self) -> Optional[str]:
        """SHA-256 of the file's bytes (None when they could not be read)."""
        return None if self.problem else hashlib.sha256(self.data).hexdigest()


@dataclass(frozen=True)
class SourceListing:
    """What a source holds: ``names``, its checkpoint files in natural order, and ``skipped``,
    the other entries as ``(name, why)`` (links, hidden and other files; directories are not
    listed), in the archive's order (a folder's: sorted)."""

    names: tuple[str, ...]
    skipped: tuple[tuple[str, str], ...] = ()

    def describe_skipped(self, limit: int = 8) -> str:
        """The skipped members as one line (the first ``limit``, then a count)."""
        shown = "; ".join(f"{name} ({why})" for name, why in self.skipped[:limit])
        more = len(self.skipped) - limit
        return shown + (f"; and {more} more" if more > 0 else "")


def natural_key(name: str) -> list:
    """Sort key that orders the digit runs of ``name`` by value (``a2`` < ``a10``)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def is_checkpoint(name: str) -> bool:
    return name.lower().endswith(CHECKPOINT_SUFFIXES) and not Path(name).name.startswith(".")


def _why_not_checkpoint(name: str) -> str:
    if Path(name).name.startswith("."):
        return "a hidden file"
    return f"not a checkpoint file ({', '.join(CHECKPOINT_SUFFIXES)})"


def _tar_entry(member: tarfile.TarInfo) -> Optional[str]:
    """Why tar ``member`` is left out (None: a checkpoint to read; "" : a directory, not reported)."""
    if member.isdir():
        return ""
    if member.issym():
        return f"a symbolic link to {member.linkname!r}, not followed; extract the archive to import its target"
    if member.islnk():
        return f"a hard link to {member.linkname!r}, not followed; extract the archive to import its target"
    if not member.isfile():
        return "not a regular file"
    return None if is_checkpoint(member.name) else _why_not_checkpoint(member.name)


def _zip_entry(info: zipfile.ZipInfo) -> Optional[str]:
    """Why zip member ``info`` is left out (None: a checkpoint to read; "": a directory)."""
    if info.is_dir():
        return ""
    if stat.S_ISLNK(info.external_attr >> 16):
        return "a symbolic link, not followed; extract the archive to import its target"
    return None if is_checkpoint(info.filename) else _why_not_checkpoint(info.filename)


def _refuse_duplicates(source: str | Path, names: Iterable[str]) -> None:
    """``CheckpointError`` if two members name the same path (a tar appended to, a zip written twice)."""
    counts = Counter(posixpath.normpath(name) for name in names)
    twice = sorted((name for name, n in counts.items() if n > 1), key=natural_key)
    if twice:
        listed = ", ".join(f"{name!r} ({counts[name]} times)" for name in twice[:3])
        raise CheckpointError(
            f"zoo_import.source={source}: {len(twice)} member name(s) appear more than once in the archive: {listed}"
            f"{' ...' if len(twice) > 3 else ''}; which copy is the checkpoint cannot be told, and each would be "
            "imported under its own seed: repack the archive with one member per name")


@functools.lru_cache(maxsize=8)
def _scan_archive(path: str, identity: tuple) -> SourceListing:
    """The listing of archive ``path`` (cached by ``identity``: the CLI's check and the stage
    list the same archive, and listing a .tgz decompresses all of it)."""
    entries: list[tuple[str, Optional[str]]] = []
    try:
        if path.lower().endswith(".zip"):
            with zipfile.ZipFile(path) as archive:
                entries = [(info.filename, _zip_entry(info)) for info in archive.infolist()]
        else:
            with tarfile.open(path) as archive:
                entries = [(member.name, _tar_entry(member)) for member in archive]
    except _ARCHIVE_ERRORS as err:
        raise CheckpointError(f"zoo_import.source={path}: not a readable archive ({type(err).__name__}: {err})") from err
    names = [name for name, why in entries if why is None]
    _refuse_duplicates(path, names)
    return SourceListing(tuple(sorted(names, key=natural_key)), tuple((n, why) for n, why in entries if why))


def scan_source(source: str | Path) -> SourceListing:
    """The checkpoint files of ``source`` (folder, zip or tar archive) in natural order, and the
    members left out (symbolic and hard links, hidden files, other files) with why.

    Raises ``CheckpointError`` naming ``source`` if it does not exist, is not a folder or a
    readable archive, holds no checkpoint file, or names one member twice.
    """
    path = Path(source).expanduser()
    if path.is_dir():
        names, skipped = [], []
        for entry in sorted(path.rglob("*")):
            relative = str(entry.relative_to(path))
            if entry.is_file():
                (names.append(relative) if is_checkpoint(entry.name) else skipped.append((relative, _why_not_checkpoint(relative))))
            elif not entry.is_dir():
                skipped.append((relative, "a broken link or not a regular file"))
        listing = SourceListing(tuple(sorted(names, key=natural_key)), tuple(skipped))
    elif path.is_file() and path.name.lower().endswith((".zip", *_TAR_SUFFIXES)):
        info = path.stat()
        listing = _scan_archive(str(path), (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns))
    elif not path.exists():
        raise CheckpointError(f"zoo_import.source={source}: no such file or folder")
    else:
        raise CheckpointError(f"zoo_import.source={source}: expected a folder, a .zip or a .tar/.tar.gz/.tgz archive")
    if not listing.names:
        raise CheckpointError(f"zoo_import.source={source}: no checkpoint file ({', '.join(CHECKPOINT_SUFFIXES)}) inside")
    return listing


def iter_checkpoints(source: str | Path, names: Iterable[str]) -> Iterator[ForeignCheckpoint]:
    """The files ``names`` of ``source`` with their bytes, each read once, in the source's own
    order: an archive's member order (one forward pass over it; a compressed stream is never
    seeked backwards), a folder's order of ``names``.

    A member whose bytes cannot be read (a zip member failing its CRC, a folder file that cannot
    be opened) comes with ``problem`` set; an archive that cannot be read on (a truncated or
    corrupt .tgz stream) or one of ``names`` not found (the archive
    changed since it was listed) raises ``CheckpointError`` naming the archive.
    """
    path = Path(source).expanduser()
    wanted = list(names)
    if path.is_dir():
        for name in wanted:
            try:
                yield ForeignCheckpoint(name, None, (path / name).read_bytes())
            except OSError as err:
                yield ForeignCheckpoint(name, None, b"", f"{path / name}: cannot be read ({err.strerror or err})")
        return
    archive_name, todo, last = str(path), set(wanted), None
    try:
        if path.name.lower().endswith(".zip"):
            with zipfile.ZipFile(path) as archive:
                for info in archive.infolist():
                    if info.filename not in todo:
                        continue
                    todo.discard(info.filename)
                    try:
                        data, problem = archive.read(info), None
                    # NotImplementedError: zipfile's answer to a compression method it cannot read
                    except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError) as err:
                        data, problem = b"", f"{archive_name}:{info.filename}: cannot be read ({type(err).__name__}: {err})"
                    last = info.filename
                    yield ForeignCheckpoint(info.filename, archive_name, data, problem)
                    if not todo:
                        break
        else:
            with tarfile.open(path) as archive:
                for member in archive:  # reads headers as it goes: one pass, forward only
                    if member.name not in todo or not member.isfile():
                        continue
                    todo.discard(member.name)
                    data = archive.extractfile(member).read()
                    last = member.name
                    yield ForeignCheckpoint(member.name, archive_name, data)
                    if not todo:
                        break  # the rest of the archive is not needed (zoo_import.skip / zoo_import.limit)
    except _ARCHIVE_ERRORS as err:
        after = f"after member {last!r}" if last else "before its first checkpoint"
        raise CheckpointError(f"{archive_name}: the archive cannot be read on {after} ({type(err).__name__}: {err})") from err
    if todo:
        missing = sorted(todo, key=natural_key)
        raise CheckpointError(f"{archive_name}: {len(missing)} member(s) listed before are no longer in it "
                              f"({', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}); was it replaced meanwhile?")


def read_checkpoint(file: ForeignCheckpoint) -> Any:
    """The object stored in ``file``: a dict of tensors (safetensors), or what ``torch.load``
    returns with ``weights_only=True``. ``CheckpointError`` naming the file if it cannot be read."""
    if file.problem:
        raise CheckpointError(file.problem)
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
    3. ``drop``: keys matching any of these regexes are discarded (e.g. BatchNorm's step counter
       ``num_batches_tracked``, which the released files store in float16: rounded, and Inf
       beyond 65,504 steps; a fitted temperature ``post_processing.*``);
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
    extra = sorted(k for k in tensors if k not in reference)  # sorted: the message names the same key every run
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


def imported_archives(paths: Iterable[Path]) -> dict[str, int]:
    """The sources (archive or folder) the checkpoint files ``paths`` were imported from, with how
    many of them each gave (``stage=import`` writes ``source: import`` and ``archive`` in the
    metadata); files trained here, or absent, count for none."""
    counts: Counter[str] = Counter()
    for path in paths:
        if path.is_file():
            meta = read_metadata(path)
            if meta.get("source") == "import":
                counts[str(meta.get("archive"))] += 1
    return dict(counts)


def seed_from_name(name: str) -> int:
    """The last integer in the file name of ``name`` (``model_0042.safetensors`` -> 42)."""
    numbers = re.findall(r"\d+", Path(name).name.split(".")[0])
    if not numbers:
        raise CheckpointError(f"{name}: no number in the file name to take the seed from (zoo_import.seeds_from=name)")
    return int(numbers[-1])
