"""Where things live in the store, and which zoo seeds are done, failed or missing.

```
<root>/<experiment>/zoo/seed_000042.safetensors    trained checkpoint (validated on read)
<root>/<experiment>/zoo/failed/seed_000007.json   seed that did not converge, with its reason
<root>/<experiment>/zoo/quarantine/               checkpoints that failed validation, with why (quarantine.py)
<root>/<experiment>/samples/<method>_<mode>_r<k>.safetensors   weight sample set of a method (repetition k)
<root>/<experiment>/samples/<method>_<mode>_r<k>.nc           a chain method's draws as ArviZ InferenceData (inference_data.py)
<root>/<experiment>/preds/<method>_<mode>_r<k>.safetensors     per-sample probabilities (ID, OOD)
<root>/<experiment>/{samples,preds}/quarantine/   sample sets and predictions that failed validation
<root>/<experiment>/reference/                     the reference zoo's caches (benchmark/references/zoo.py)
<root>/<experiment>/eval/<method>_<mode>_r<k>.json the evaluate stage's numbers of one repetition
<root>/<experiment>/chains/<method>_<mode>_r<k>/seed_000042.safetensors   resumable state of one Markov chain (hmc; chain_files)
<root>/<experiment>/.claims/                       one claim (two names) per unit of work in progress (claims.py)
```

File names come from ``Unit`` (``units.py``): every path of a unit is asked of the store.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from benchmark.core.store.atomic import TEMP_MARK, atomic_write_text, broken_link, is_temp_file
from benchmark.core.store.chains import ChainFiles
from benchmark.core.store.claims import DEFAULT_HEARTBEAT_S, DEFAULT_TIMEOUT_S, Claim, fs_now, host_name, reap_stale, try_claim
from benchmark.core.store.claims import litter as claim_litter
from benchmark.core.store.errors import StoreError
from benchmark.core.store.units import Unit

log = logging.getLogger(__name__)
INFERENCE_DATA_SUFFIX = ".nc"


@dataclass(frozen=True)
class ExperimentStore:
    """The store folder of one experiment under ``root`` (the config key ``store``).

    ``claim_timeout_s``, ``claim_heartbeat_s``: a claim whose heartbeat is older than the timeout
    is taken over; a held claim is refreshed every ``claim_heartbeat_s`` seconds (``claims.py``).
    ``group_shared`` (``claims.group_shared``): folders setgid and group-writable, files group
    read/write (``ensure_writable``).
    """

    root: Path
    experiment: str
    claim_timeout_s: float = DEFAULT_TIMEOUT_S
    claim_heartbeat_s: float = DEFAULT_HEARTBEAT_S
    group_shared: bool = False

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

    @property
    def reference_dir(self) -> Path:
        """The reference zoo's caches (``benchmark/references/zoo.py``)."""
        return self.base / "reference"

    def other_reference_dir(self, name: str) -> Path:
        """The caches of the reference ``name`` built from another store's checkpoints
        (``benchmark/references/other_zoo.py``): kept in this store, never in the other one."""
        return self.base / f"reference-{name}"

    @property
    def eval_dir(self) -> Path:
        """The evaluate stage's per-repetition number caches."""
        return self.base / "eval"

    @property
    def chains_root(self) -> Path:
        """The resumable chain states of the units of chain methods (``chains_dir``)."""
        return self.base / "chains"

    def chains_dir(self, unit: Unit) -> Path:
        """The folder of the chain states of a sample unit (one file per base: ``chain_files(unit).path(seed)``)."""
        return self.chains_root / self._own(unit).stem

    def chain_files(self, unit: Unit, key: str = "") -> ChainFiles:
        """The chain states of a sample unit, to be run under ``key`` (``chains.ChainFiles``)."""
        return ChainFiles(self.chains_dir(unit), key, self._own(unit))

    def chain_claim(self, unit: Unit, seed: int) -> contextlib.AbstractContextManager[Claim | None]:
        """``with store.chain_claim(unit, seed) as claim:`` the claim on one chain of a sample unit
        (``None`` when a live process elsewhere runs it); as ``claim``."""
        path = self.claims_dir / f"{unit.chain_claim_name(seed)}.claim"
        return try_claim(path, self.claim_timeout_s, self.claim_heartbeat_s)

    def seed_unit(self, seed: int) -> Unit:
        """The unit of zoo seed ``seed``."""
        return Unit.zoo(self.experiment, seed)

    def sample_unit(self, method: str, mode: str, repetition: int = 0) -> Unit:
        """The unit of one repetition of ``method`` in ``mode``."""
        return Unit.samples(self.experiment, method, mode, repetition)

    def unit_of(self, path: str | os.PathLike) -> Unit | None:
        """The unit a file of this store (or a temp file of a write to it) belongs to, or ``None``;
        a unit's InferenceData (``inference_data_path``) belongs to it too."""
        name = Path(path).name
        final = name[1:].split(TEMP_MARK)[0] if is_temp_file(Path(name)) else name
        if final.endswith(INFERENCE_DATA_SUFFIX):
            name = final[: -len(INFERENCE_DATA_SUFFIX)] + ".safetensors"
        return Unit.parse(self.experiment, name)

    def checkpoint_path(self, seed: int) -> Path:
        return self.zoo_dir / f"{self.seed_unit(seed).stem}.safetensors"

    def failed_path(self, seed: int) -> Path:
        return self.failed_dir / f"{self.seed_unit(seed).stem}.json"

    def samples_path(self, unit: Unit) -> Path:
        """The sample set of a (method, mode, repetition) unit."""
        return self.samples_dir / f"{self._own(unit).stem}.safetensors"

    def preds_path(self, unit: Unit) -> Path:
        """The per-sample predictions of a (method, mode, repetition) unit."""
        return self.preds_dir / f"{self._own(unit).stem}.safetensors"

    def inference_data_path(self, unit: Unit) -> Path:
        """The draws of a chain method's unit as an ArviZ ``InferenceData`` (NetCDF, beside its
        sample set; ``inference_data.write_inference_data``): derived from the unit's files, not
        one of them (``unit_paths``)."""
        return self.samples_dir / f"{self._own(unit).stem}{INFERENCE_DATA_SUFFIX}"

    def unit_paths(self, unit: Unit) -> tuple[Path, ...]:
        """Every file a unit publishes: the checkpoint (or failure record) of a seed; the sample
        set and the predictions of a sample unit."""
        if unit.is_seed:
            return self.checkpoint_path(unit.seed), self.failed_path(unit.seed)
        return self.samples_path(unit), self.preds_path(unit)

    def eval_path(self, unit: Unit) -> Path:
        """The evaluate stage's number cache of a sample unit."""
        return self.eval_dir / f"{self._own(unit).cache_name}.json"

    def baseline_eval_path(self, baseline: str, repetition: int, against: str = "zoo") -> Path:
        """The evaluate stage's number cache of repetition ``repetition`` of baseline row ``baseline``
        (``benchmark.baselines``) scored against reference ``against``."""
        if not baseline.isidentifier() or int(repetition) < 0:
            raise ValueError(f"baseline_eval_path: expected an identifier and a repetition >= 0, got {baseline!r}, {repetition}")
        suffix = "" if against == "zoo" else f".{against}"
        return self.eval_dir / f"baseline_{baseline}_r{int(repetition)}{suffix}.json"

    def sample_units(self) -> list[Unit]:
        """Every sample unit with a sample set or a predictions file in the store (sorted)."""
        units = set()
        for folder in (self.samples_dir, self.preds_dir):
            for path in folder.glob("*.safetensors") if folder.is_dir() else ():
                unit = self.unit_of(path)
                if unit is not None and not unit.is_seed:
                    units.add(unit)
        return sorted(units)

    def _own(self, unit: Unit) -> Unit:
        if unit.experiment != self.experiment or unit.is_seed:
            raise ValueError(f"{unit.label} of {unit.experiment!r} is not a sample unit of the store of {self.experiment!r}")
        return unit

    def claim_path(self, unit: Unit) -> Path:
        return self.claims_dir / f"{unit.claim_name}.claim"

    def claim(self, unit: Unit) -> contextlib.AbstractContextManager[Claim | None]:
        """``with store.claim(unit) as claim:`` the unit's ``Claim``, or ``None`` when a live
        process elsewhere holds it (see ``claims.try_claim``)."""
        return try_claim(self.claim_path(unit), self.claim_timeout_s, self.claim_heartbeat_s)

    def reap_stale_claims(self) -> int:
        """Remove claims left by dead or timed-out processes (``claims.reap_stale``), then the
        litter of killed processes (``reap_litter``, one log line with the count); how many claims."""
        reaped = len(reap_stale(self.claims_dir, self.claim_timeout_s))
        litter = self.reap_litter()
        if litter:
            log.info("%s: removed %d file(s) of litter left by killed processes (claim tickets, probes, temp files "
                     "older than claims.timeout_s)", self.base, litter)
        return reaped

    def litter(self) -> list[Path]:
        """Files killed processes left behind, older than the claim timeout and owned by no
        claim: the claim protocol's (``claims.litter``: tickets, orphaned names, probes) and
        temp files of the store's own naming in the unit folders (whose unit is not claimed),
        ``reference/``, ``eval/`` and ``chains/*/``. Listed by ``stage=verify``; removed by ``reap_litter``."""
        out = claim_litter(self.claims_dir, self.claim_timeout_s)
        for folder in (self.zoo_dir, self.failed_dir, self.samples_dir, self.preds_dir):
            for tmp in old_temp_files(folder, self.claim_timeout_s):
                if not self.claim_path(self.unit_of(tmp)).exists():
                    out.append(tmp)
        chain_dirs = sorted(p for p in self.chains_root.iterdir() if p.is_dir()) if self.chains_root.is_dir() else []
        for folder in (self.reference_dir, self.eval_dir, *chain_dirs):
            out += old_temp_files(folder, self.claim_timeout_s)
        return out

    def results_litter(self, results_dir: Path) -> list[Path]:
        """Temp files of killed writers in ``results_dir`` (metrics, tables, figures), older than
        the claim timeout: results are written by atomic rename, so a live writer's temp file is
        younger than that. Listed by ``stage=verify``; removed by the stages that write results."""
        return [tmp for folder in (results_dir, results_dir / "figures")
                for tmp in old_temp_files(folder, self.claim_timeout_s)]

    def reap_litter(self) -> int:
        """Remove ``litter()``; how many files were removed."""
        removed = 0
        for path in self.litter():
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed += 1
        return removed

    def ensure_writable(self) -> None:
        """Create the experiment folders; raise ``StoreError`` naming the ``store`` option if not writable."""
        if self.group_shared:
            os.umask(os.umask(0) & ~0o070)  # umask 002 semantics: group bits never masked
        try:
            for d in (self.zoo_dir, self.failed_dir, self.samples_dir, self.preds_dir, self.claims_dir):
                d.mkdir(parents=True, exist_ok=True)
            if self.group_shared:
                _share_with_group(self.base)
            probe = self.claims_dir / f".write-probe-{host_name()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            probe.write_bytes(b"")  # a name of its own: pids repeat across nodes (pid 1 in containers)
            probe.unlink()
        except OSError as err:
            raise StoreError(
                f"store={self.root}: cannot write to {self.base} ({err.strerror or err}); "
                "pass a writable folder with store=/path/to/store"
            ) from err
        _warn_if_not_shared(self.root)

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

    def record_failure(self, seed: int, record: dict[str, Any], exclusive: bool = False) -> None:
        """Mark ``seed`` as failed (atomically), with ``record`` holding at least ``reason``
        (``exclusive``: fenced publication, ``AlreadyPublishedError`` if a record exists)."""
        if "reason" not in record:
            raise ValueError("record_failure: the record needs a 'reason'")
        atomic_write_text(self.failed_path(seed), json.dumps({"seed": seed, **record}, indent=2, sort_keys=True), exclusive)

    def attempts_path(self, seed: int) -> Path:
        """Where the runs in which ``seed`` diverged are counted (``zoo.max_attempts``)."""
        return self.failed_dir / f"{self.seed_unit(seed).stem}.attempts"

    def divergences(self, seed: int, config_hash: str) -> int:
        """How many runs saw ``seed`` diverge under ``config_hash`` (0 if none, or another config)."""
        record = _read_json(self.attempts_path(seed))
        return int(record.get("attempts", 0)) if record and record.get("config_hash") == config_hash else 0

    def record_divergence(self, seed: int, config_hash: str) -> int:
        """Count one more run in which ``seed`` diverged (call it under the seed's claim); the new count."""
        attempts = self.divergences(seed, config_hash) + 1
        atomic_write_text(self.attempts_path(seed), json.dumps({"seed": seed, "config_hash": config_hash,
                                                                "attempts": attempts}, sort_keys=True))
        return attempts

    def clear_divergences(self, seed: int) -> None:
        """Forget the divergences of ``seed`` (it converged or was recorded as failed)."""
        self.attempts_path(seed).unlink(missing_ok=True)

    def checkpoint_paths(self, seeds: Iterable[int]) -> list[Path]:
        """Checkpoint paths of ``seeds``; raises ``StoreError`` listing the missing ones."""
        seeds = list(seeds)
        missing = [s for s in seeds if not self.checkpoint_path(s).is_file()]
        if missing:
            broken = [line for s in missing if (line := broken_link(self.checkpoint_path(s)))]
            why = f" ({'; '.join(broken[:3])}; python -m benchmark stage=zoo experiment={self.experiment} quarantines " \
                  "and retrains them)" if broken else ""
            raise StoreError(f"{self.zoo_dir}: no checkpoint for seeds {_compact(missing)}{why}")
        return [self.checkpoint_path(s) for s in seeds]


def _share_with_group(base: Path) -> None:
    """Make ``base`` and the folders under it that this user owns setgid and group-writable
    (new subfolders inherit the group and the setgid bit; the umask makes them group-writable)."""
    for folder in (base, *(p for p in base.rglob("*") if p.is_dir())):
        with contextlib.suppress(OSError):
            st = folder.stat()
            if st.st_uid == os.getuid():
                folder.chmod(st.st_mode & 0o7777 | 0o2070)


def old_temp_files(folder: Path, older_than_s: float) -> list[Path]:
    """``atomic_path``'s temp files directly in ``folder`` whose mtime is more than ``older_than_s``
    seconds old by the file server's clock (``fs_now``), sorted."""
    temps = sorted(p for p in folder.iterdir() if is_temp_file(p)) if folder.is_dir() else []
    if not temps:
        return []
    now, out = fs_now(folder), []
    for tmp in temps:
        try:
            if now - tmp.stat().st_mtime > older_than_s:
                out.append(tmp)
        except FileNotFoundError:
            continue
    return out


def _warn_if_not_shared(root: Path) -> None:
    """One line when the store folder is not group-writable but holds other users' files."""
    with contextlib.suppress(OSError):
        if root.stat().st_mode & 0o020:
            return
        others = {p.stat().st_uid for p in root.iterdir()} - {os.getuid()}
        if others:
            log.warning("store=%s is not group-writable but holds files of %d other user(s): pass "
                        "claims.group_shared=true (setgid, group-writable) so that they can work on it too", root,
                        len(others))


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


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
        if entry.name.endswith(suffix) and not entry.name.startswith("."):
            unit = Unit.parse("", entry.name)
            if unit is not None and unit.is_seed:
                seeds.add(unit.seed)
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
