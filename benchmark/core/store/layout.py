"""Where things live in the store, and which zoo seeds are done, failed or missing.

```
<root>/<experiment>/zoo/seed_000042.safetensors    trained checkpoint (validated on read)
<root>/<experiment>/zoo/failed/seed_000007.json   seed that did not converge, with its reason
<root>/<experiment>/zoo/quarantine/               checkpoints that failed validation, with why (quarantine.py)
<root>/<experiment>/samples/<method>_<mode>_r<k>.safetensors   weight sample set of a method (repetition k)
<root>/<experiment>/preds/<method>_<mode>_r<k>.safetensors     per-sample probabilities (ID, OOD)
<root>/<experiment>/{samples,preds}/quarantine/   sample sets and predictions that failed validation
<root>/<experiment>/.claims/                       one claim file per unit of work in progress (claims.py)
```
"""
from __future__ import annotations

import contextlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from benchmark.core.store.atomic import atomic_write_text
from benchmark.core.store.claims import Claim, reap_stale, try_claim
from benchmark.core.store.errors import StoreError

_SEED_FILE = re.compile(r"^seed_(\d{6})\.(safetensors|json)$")


def seed_of_file(name: str) -> int | None:
    """The seed of a zoo file name (``seed_000042.safetensors`` -> 42), ``None`` for other names."""
    m = _SEED_FILE.match(name)
    return int(m.group(1)) if m else None


def seed_name(seed: int) -> str:
    """File stem of a seed: ``seed_000042``."""
    if seed < 0 or seed > 999_999:
        raise ValueError(f"seed must be in [0, 999999], got {seed}")
    return f"seed_{seed:06d}"


@dataclass(frozen=True)
class ExperimentStore:
    """The store folder of one experiment under ``root`` (the config key ``store``).

    ``claim_timeout_s``, ``claim_heartbeat_s``: a claim whose heartbeat is older than the timeout
    is taken over; a held claim is refreshed every ``claim_heartbeat_s`` seconds (``claims.py``).
    """

    root: Path
    experiment: str
    claim_timeout_s: float = 300.0
    claim_heartbeat_s: float = 30.0

    @property
    def base(self) -> Path:
        return self.root / self.experiment

    @property
    def zoo_dir(self) -> Path:
        return self.base / "zoo"

    @property
    def failed_dir(self) -> Path:
        return self.zoo_dir / "failed"

    @property
    def samples_dir(self) -> Path:
        return self.base / "samples"

    @property
    def preds_dir(self) -> Path:
        return self.base / "preds"

    @property
    def claims_dir(self) -> Path:
        return self.base / ".claims"

    def checkpoint_path(self, seed: int) -> Path:
        return self.zoo_dir / f"{seed_name(seed)}.safetensors"

    def failed_path(self, seed: int) -> Path:
        return self.failed_dir / f"{seed_name(seed)}.json"

    def samples_path(self, method: str, mode: str, repetition: int = 0) -> Path:
        """The sample set of one repetition of a (method, mode) unit."""
        return self.samples_dir / f"{method}_{mode}_r{repetition}.safetensors"

    def preds_path(self, method: str, mode: str, repetition: int = 0) -> Path:
        """The per-sample predictions of one repetition of a (method, mode) unit."""
        return self.preds_dir / f"{method}_{mode}_r{repetition}.safetensors"

    def claim_path(self, name: str) -> Path:
        return self.claims_dir / f"{name}.claim"

    def claim(self, name: str) -> contextlib.AbstractContextManager[Claim | None]:
        """``with store.claim("zoo-seed_000007") as claim:`` the unit's ``Claim``, or ``None`` when
        a live process elsewhere holds it (see ``claims.try_claim``)."""
        return try_claim(self.claim_path(name), self.claim_timeout_s, self.claim_heartbeat_s)

    def reap_stale_claims(self) -> int:
        """Remove claims left by dead or timed-out processes (``claims.reap_stale``); how many."""
        return len(reap_stale(self.claims_dir, self.claim_timeout_s))

    def ensure_writable(self) -> None:
        """Create the experiment folders; raise ``StoreError`` naming the ``store`` option if not writable."""
        try:
            for d in (self.zoo_dir, self.failed_dir, self.samples_dir, self.preds_dir, self.claims_dir):
                d.mkdir(parents=True, exist_ok=True)
            probe = self.claims_dir / f".write-probe-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as err:
            raise StoreError(
                f"store={self.root}: cannot write to {self.base} ({err.strerror or err}); "
                "pass a writable folder with store=/path/to/store"
            ) from err

    def completed_seeds(self) -> list[int]:
        """Seeds with a checkpoint file in the zoo (sorted)."""
        return sorted(_seeds_in(self.zoo_dir, ".safetensors"))

    def converged_seeds(self, start: int, stop: int) -> list[int]:
        """Seeds of ``[start, stop)`` with a checkpoint and no failure record (sorted)."""
        failed = set(self.failed_seeds())
        return [s for s in self.completed_seeds() if start <= s < stop and s not in failed]

    def failed_seeds(self) -> dict[int, dict[str, Any]]:
        """Seed -> failure record (``reason``, ``epoch``, ``val_acc`` ...) of seeds that did not converge.

        A record that does not parse (damaged) is left out: its seed counts as not trained, and the
        zoo stage quarantines the record and trains the seed (``unreadable_failure_records``).
        """
        out = {}
        for seed in sorted(_seeds_in(self.failed_dir, ".json")):
            record = _read_record(self.failed_path(seed))
            if record is not None:
                out[seed] = record
        return out

    def unreadable_failure_records(self) -> dict[int, str]:
        """Seed -> why its failure record cannot be used (damaged JSON, no ``reason``)."""
        out = {}
        for seed in sorted(_seeds_in(self.failed_dir, ".json")):
            path = self.failed_path(seed)
            if _read_record(path) is None:
                out[seed] = f"{path}: damaged failure record (not a JSON object with a 'reason')"
        return out

    def record_failure(self, seed: int, record: dict[str, Any]) -> None:
        """Mark ``seed`` as failed (atomically), with ``record`` holding at least ``reason``."""
        if "reason" not in record:
            raise ValueError("record_failure: the record needs a 'reason'")
        atomic_write_text(self.failed_path(seed), json.dumps({"seed": seed, **record}, indent=2, sort_keys=True))

    def checkpoint_paths(self, seeds: Iterable[int]) -> list[Path]:
        """Checkpoint paths of ``seeds``; raises ``StoreError`` listing the missing ones."""
        seeds = list(seeds)
        missing = [s for s in seeds if not self.checkpoint_path(s).is_file()]
        if missing:
            raise StoreError(f"{self.zoo_dir}: no checkpoint for seeds {_compact(missing)}")
        return [self.checkpoint_path(s) for s in seeds]


def _read_record(path: Path) -> dict[str, Any] | None:
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and "reason" in record else None


def _seeds_in(folder: Path, suffix: str) -> set[int]:
    if not folder.is_dir():
        return set()
    seeds = set()
    for entry in folder.iterdir():
        m = _SEED_FILE.match(entry.name)
        if m and entry.name.endswith(suffix):
            seeds.add(int(m.group(1)))
    return seeds


def _compact(values: list[int]) -> str:
    """``[1, 2, 3, 7]`` -> ``'1-3, 7'`` for readable error messages."""
    if not values:
        return ""
    values = sorted(values)
    parts, start, prev = [], values[0], values[0]
    for v in values[1:] + [None]:
        if v is not None and v == prev + 1:
            prev = v
            continue
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
        if v is not None:
            start = prev = v
    return ", ".join(parts)
