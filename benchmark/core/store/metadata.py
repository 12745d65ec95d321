"""The typed metadata of the store's files.

safetensors keeps metadata as ``str -> str``; the store writes strings as they are and every other
value as JSON (``encode``). ``CheckpointMetadata`` (a zoo checkpoint: trained here or imported)
and ``SampleSetMetadata`` (a method's sample set and its predictions) are what readers get back
(``decode``), so nobody parses a metadata string by hand. A field absent from a file (written by
an older version or another tool) decodes to its default; unknown keys are kept in ``extra``.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, TypeVar

T = TypeVar("T", bound="_Metadata")
WRITER_KEYS = ("checksums", "format")  # written by the store's writer itself, not part of a file's metadata


def encode_metadata(metadata: Mapping[str, Any]) -> dict[str, str]:
    """safetensors metadata must be ``str -> str``: strings stay, other values become JSON."""
    return {str(k): v if isinstance(v, str) else json.dumps(v, sort_keys=True) for k, v in metadata.items()}


def _decoded(raw: str, kind: Any) -> Any:
    """A metadata string as the field type ``kind`` (a string field stays as it is)."""
    if kind in (str, "str", Optional[str], "Optional[str]", "str | None"):
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return None


@dataclass(frozen=True)
class _Metadata:
    extra: dict = field(default_factory=dict)

    def encode(self) -> dict[str, str]:
        """The ``str -> str`` metadata written into the file (``None`` fields are left out)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        return encode_metadata({**self.extra, **{k: v for k, v in values.items() if v is not None}})

    @classmethod
    def decode(cls: type[T], metadata: Mapping[str, str]) -> T:
        """The typed metadata of a file's ``str -> str`` metadata; a field that is absent or does not
        parse gets its default (and a malformed number its ``None``/NaN default)."""
        fields = {f.name: f for f in dataclasses.fields(cls) if f.name != "extra"}
        values, extra = {}, {}
        for key, raw in metadata.items():
            if key in fields:
                value = _decoded(raw, fields[key].type)
                if value is not None:
                    values[key] = value
            elif key not in WRITER_KEYS:
                extra[key] = raw
        return cls(extra=extra, **values)


@dataclass(frozen=True)
class CheckpointMetadata(_Metadata):
    """A zoo checkpoint's metadata. Accuracies are fractions (NaN: not measured). ``config_hash``:
    the model, data and recipe config it was trained with (``None``: imported or written by
    another tool, never stale for that), and ``config`` that config itself (``Experiment.recipe_config``:
    what names the fields of a zoo trained under another recipe); ``trainer``: how it was trained; ``crosscheck``: for a seed
    the zoo also trained with the other trainer (``zoo.crosscheck``), that trainer and its outcome
    (``trainer``, ``verdict``: converged / failed / diverged, ``validation_accuracy``,
    ``max_weight_difference``); ``plateaued``: under ``train.until_plateau``, whether training
    stopped because it plateaued (False: at ``max_epochs``; absent when the option is off); ``history``:
    one record per epoch trained (``TrainResult.history``: ``epoch``, ``loss``, and the ``check_accuracy``
    and ``train_subset_accuracy`` fractions of the zoo's training curves); ``source`` ... ``mapping``: the
    provenance of an imported checkpoint."""

    experiment: Optional[str] = None
    seed: Optional[int] = None
    role: Optional[str] = None
    config_hash: Optional[str] = None
    config: Optional[dict] = None
    train_accuracy: float = math.nan
    validation_accuracy: float = math.nan
    test_accuracy: float = math.nan
    epochs: Optional[int] = None
    plateaued: Optional[bool] = None
    trainer: Optional[str] = None
    crosscheck: Optional[dict] = None
    history: Optional[list] = None
    versions: Optional[dict] = None
    source: Optional[str] = None
    source_file: Optional[str] = None
    archive: Optional[str] = None
    source_sha256: Optional[str] = None
    mapping: Optional[dict] = None


@dataclass(frozen=True)
class SampleSetMetadata(_Metadata):
    """The metadata of a unit's sample set and predictions (both files carry the same, and the
    predictions ``samples_digest``: the ``content_digest`` of the sample set they were computed
    from, checked on read so a pair from two writers is never taken for one).
    ``settings_hash``: what a registered method's samples were drawn with (``None`` for an
    external sample set); ``diagnostics``: the method's own numbers, averaged over its bases;
    ``source`` / ``source_size``: the file an external sample set came from; ``base_digests``: base
    seed -> a digest of the tensors of the checkpoint it was drawn around (``inventory.base_digests``):
    a base retrained since makes the unit stale; ``layout``: the unit's place in the repetition
    design (``benchmark.design.Design.unit_layout``: its candidate block among the converged
    held-out seeds), so that a design change that moves the block makes the unit stale;
    ``read_seeds``: the held-out seeds it read, in order (its candidate block up to its last base,
    ``inventory.read_seeds``), so that a change of the held-out range that puts other seeds at
    those positions makes the unit stale and one that does not (a range grown at its end) keeps it."""

    experiment: Optional[str] = None
    method: Optional[str] = None
    label: Optional[str] = None
    mode: Optional[str] = None
    repetition: Optional[int] = None
    layout: Optional[str] = None
    n_samples: int = -1
    base_seeds: Optional[list] = None
    samples_per_base: Optional[int] = None
    config_hash: Optional[str] = None
    settings_hash: Optional[str] = None
    diagnostics: Optional[dict] = None
    versions: Optional[dict] = None
    source: Optional[str] = None
    source_size: Optional[int] = None
    samples_digest: Optional[str] = None
    base_digests: Optional[dict] = None
    read_seeds: Optional[list] = None
