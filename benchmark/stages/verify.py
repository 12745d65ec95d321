"""Verify stage: check a whole store and report, per experiment, what is complete, missing,
quarantined, corrupt or stale; with ``verify.repair=true``, quarantine what is corrupt, with
``verify.repair=stale`` also what is stale in the current experiment, so that the next
``stage=zoo`` / ``stage=sample`` redoes it. Verify judges without destroying: good data are never
moved by ``repair=true``, and another experiment's files are never moved as stale.

``python -m benchmark stage=verify [experiment=<name>] [verify.scope=store|experiment] [verify.repair=false|true|stale]``

- scope ``store`` (default): every experiment folder under ``store``. The current experiment is
  checked against this command line's config; another one against its ``conf/experiment/<name>.yaml``;
  a folder with no experiment config only for integrity (readable, checksums, finite values,
  the experiment named in the metadata).
- corrupt: fails validation (unreadable, truncated, checksum mismatch, NaN/Inf, wrong keys or
  shapes, another experiment's or another seed's file, damaged failure record).
- stale: valid, but written with other settings (checkpoints: ``config_hash``; sample sets:
  ``settings_hash``) or before content checksums existed (unverified). A checkpoint without
  ``config_hash`` (imported, or written by another tool) is not stale. Another experiment's
  stale files are judged against its yaml defaults, not the overrides it was made with: they
  are reported as possibly stale and do not fail the stage.
- missing (not trained or drawn yet): in the current experiment, the store is incomplete: each
  missing zoo seed of its ranges, and each missing unit of what ``method=`` x ``mode=`` select
  (default: every method of the default run, both modes), is reported with the claim on it (live:
  in progress elsewhere; stale: its holder is dead, the next run takes it over) and the command that
  makes it, and the stage fails (``StoreIncompleteError``). Another experiment's missing files are
  only reported.
- failed to converge, quarantined: reported, not bad.
- temp files of writes killed mid-way: reported; ``repair`` removes them (under the unit's claim).
- old formats (``benchmark.inventory.migrations``: what older versions wrote): reported, never an
  error; ``repair`` migrates them first (a unit's files under its claim), before the checks read them.

Every file is read whole once (bounded memory); its identity (device, inode, size, mtime) is
recorded before it is read, and a repair moves it only while it is still that version (a file
healed by a concurrent run meanwhile is left alone). Exit status: non-zero
(``StoreIntegrityError``) when anything corrupt, or stale in the current experiment, was found,
also when ``repair`` moved it; non-zero (``StoreIncompleteError``) when the current experiment
is incomplete (see missing).
"""
from __future__ import annotations

import logging
import os
import shutil
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from benchmark.config import CONF_DIR, ConfigError, Repair, VerifyScope
from benchmark.loader import compose_config
from benchmark.core.store import (
    CheckpointError, ExperimentStore, StoreError, Unit, broken_link, check_file, claims_in, file_format, quarantined,
    read_metadata, remove_temp_files_of, stale_reason, stored_checksums, unsealed_json,
)
from benchmark.core.store.atomic import is_temp_file
from benchmark.core.store.claims import describe_holder, read_claim
from benchmark.experiment import Experiment
from benchmark.references import REFERENCES, Reference, evaluated
from benchmark.references.zoo import FORM_FOLDERS
from benchmark.inventory import (
    UnitState, checkpoint_staleness, expected_units, quarantined_seeds, seed_problem, unit_state,
)
from benchmark.core.store.work import quarantine_and_redo
from benchmark.inventory.migrations import Migration, results_migrations, unit_migrations
from methods import method_names, selected

log = logging.getLogger(__name__)
NAME = "verify"
FORM_PREFIXES = tuple(f"{name}-" for name in FORM_FOLDERS)


class StoreIntegrityError(StoreError):
    """``stage=verify`` found corrupt or stale files (listed in the log above the error)."""


class StoreIncompleteError(StoreError):
    """``stage=verify`` found the current experiment incomplete: zoo seeds or sample units missing
    (listed in the log above the error, with their claims and the commands that make them)."""


@dataclass
class Problem:
    """A corrupt or stale file, the claim of its unit of work, and what redoes it."""

    kind: str  # "corrupt" | "stale"
    path: Path
    reason: str
    unit: Unit  # the unit the file belongs to (its claim guards the repair)
    redo: str  # the command that redoes the unit once the file is quarantined
    identity: tuple | None  # (device, inode, size, mtime) recorded before the file was read
    action: str = ""  # what this run did about it
    counts: bool = True  # whether it fails the stage (see ``judged``)
    judged: bool = False  # stale by comparison with the config (another experiment's then does not fail the stage)


@dataclass
class ExperimentHealth:
    """What ``stage=verify`` found in one experiment folder."""

    name: str
    checked_against: str
    zoo: dict[str, Counter] = field(default_factory=dict)  # range label -> counts
    samples: Counter = field(default_factory=Counter)
    problems: list[Problem] = field(default_factory=list)
    temp_files: list[Path] = field(default_factory=list)
    claims: Counter = field(default_factory=Counter)
    metadata_unverified: int = 0  # valid files of store format 1: tensors checksummed, metadata not
    caches: Counter = field(default_factory=Counter)  # "reference" / "numbers": cache files checked
    damaged_caches: dict[Path, str] = field(default_factory=dict)  # cache file -> what is wrong
    orphans: dict[Path, int] = field(default_factory=dict)  # cache folder of no current key -> its size in bytes
    cache_actions: dict[Path, str] = field(default_factory=dict)  # what this run did about each of the two above
    missing_seeds: dict[str, list[int]] = field(default_factory=dict)  # range label -> seeds with no file
    missing_units: list[Unit] = field(default_factory=list)  # expected sample units not (wholly) on disk
    incomplete: list[str] = field(default_factory=list)  # the current experiment's missing parts, in words
    migrations: list[tuple[Migration, str]] = field(default_factory=list)  # files of an older format, what this run did

    @property
    def bad(self) -> bool:
        return any(p.counts for p in self.problems) or bool(self.damaged_caches)

    def lines(self) -> list[str]:
        """The report: one summary line per part, then one line per problem."""
        def counts(counter: Counter, order: tuple[str, ...]) -> str:
            return ", ".join(f"{counter.get(k, 0)} {k}" for k in order)

        out = [f"{self.name} (checked against {self.checked_against}):"]
        for label, counter in self.zoo.items():
            out.append(f"  zoo {label}: " + counts(counter, ("complete", "missing", "failed to converge", "corrupt",
                                                              "stale", "quarantined")))
        out.append("  samples: " + counts(self.samples, ("complete", "missing", "corrupt", "stale", "quarantined"))
                   + " (method/mode units)")
        if self.metadata_unverified:
            out.append(f"  {self.metadata_unverified} file(s) of store format 1 (their tensors are checksummed, their "
                       "metadata not; usable, rewritten in the current format when their unit is redone)")
        out.append(f"  temp files of killed writes: {len(self.temp_files)}; claims: "
                   + counts(self.claims, ("live", "stale")))
        out.append(f"  caches: {self.caches.get('reference', 0)} reference file(s), {self.caches.get('numbers', 0)} "
                   f"number cache(s), {len(self.damaged_caches)} damaged; {len(self.orphans)} orphaned cache folder(s) "
                   f"({sum(self.orphans.values()) / 2**20:.1f} MiB)")
        for path, reason in self.damaged_caches.items():
            out.append(f"  CORRUPT CACHE: {reason} -> {self.cache_actions.get(path, '')}")
        for path, size in self.orphans.items():
            out.append(f"  ORPHANED CACHE: {path} ({size / 2**20:.1f} MiB; made for a key no current config uses: other "
                       f"code, settings or inputs) -> {self.cache_actions.get(path, '')}")
        for migration, action in self.migrations:
            out.append(f"  OLD FORMAT: {migration.what} -> {action}")
        for problem in self.problems:
            kind = problem.kind.upper() if problem.counts else f"POSSIBLY {problem.kind.upper()}"
            out.append(f"  {kind}: {problem.reason} -> {problem.action}")
        out += [f"  INCOMPLETE: {line}" for line in self.incomplete]
        return out


def needs(exp: Experiment) -> frozenset[str]:
    return frozenset()


def produces(exp: Experiment) -> frozenset[str]:
    return frozenset()


def check(exp: Experiment, made: frozenset[str] = frozenset()) -> None:
    """Verify reads whatever the store holds: nothing to refuse in advance."""


def experiment_folders(exp: Experiment) -> list[str]:
    """Names of the experiment folders ``stage=verify`` scans (the current one always included)."""
    if exp.config.verify.scope == VerifyScope.experiment:
        return [exp.name]
    root = exp.store.root
    found = {p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")} if root.is_dir() else set()
    return sorted(found | {exp.name})


def experiment_for(exp: Experiment, name: str) -> tuple[Experiment | None, str]:
    """The experiment to check folder ``name`` against, and what that is, in words."""
    if name == exp.name:
        return exp, "this command line's config"
    if (Path(CONF_DIR) / "experiment" / f"{name}.yaml").is_file():
        config = exp.config
        overrides = [f"experiment={name}", f"store={config.store}", f"results={config.results}",
                     f"claims.timeout_s={config.claims.timeout_s}", f"claims.heartbeat_s={config.claims.heartbeat_s}"]
        try:
            return Experiment(compose_config(overrides)), f"conf/experiment/{name}.yaml"
        except ConfigError as err:
            return None, f"integrity only: conf/experiment/{name}.yaml does not compose ({err})"
    return None, "no experiment config: integrity only"


def run(exp: Experiment) -> list[ExperimentHealth]:
    """Check every experiment folder of the scope; log the report; raise ``StoreIntegrityError``
    if anything is corrupt, or stale in the current experiment."""
    mode = exp.config.verify.repair_mode
    reports = []
    for name in experiment_folders(exp):
        target, against = experiment_for(exp, name)
        store = target.store if target else ExperimentStore(exp.store.root, name, exp.store.claim_timeout_s,
                                                              exp.store.claim_heartbeat_s)
        health = ExperimentHealth(name, against)
        migrate(target if name == exp.name else None, store, Path(exp.config.results) / name, health, mode)
        check_zoo(target, store, health)
        check_samples(target, store, health)
        check_leftovers(store, health, Path(exp.config.results) / name)
        check_caches(target, store, health)
        repair_caches(health, mode)
        current = name == exp.name
        if current:
            check_complete(exp, store, health)
        for problem in health.problems:
            problem.counts = problem.kind == "corrupt" or current or not problem.judged
            problem.action = _repair(store, problem, mode, current)
        if mode is not Repair.off:
            remove_temp_files(store, health)
            reaped = store.reap_stale_claims() if store.claims_dir.is_dir() else 0
            health.claims["stale"] -= min(reaped, health.claims["stale"])
        for line in health.lines():
            (log.error if (health.bad and line.lstrip().startswith(("CORRUPT", "STALE")))
             or line.lstrip().startswith("INCOMPLETE") else
             log.warning if line.lstrip().startswith(("POSSIBLY", "ORPHANED")) else log.info)("%s", line)
        reports.append(health)
    bad = [h for h in reports if h.bad]
    n = sum(p.counts for h in bad for p in h.problems) + sum(len(h.damaged_caches) for h in bad)
    incomplete = next((h for h in reports if h.incomplete), None)
    missing = (f"; and {exp.name} is incomplete: {'; '.join(incomplete.incomplete)}") if incomplete else ""
    if bad:
        done = {Repair.off: "run with verify.repair=true to quarantine what is corrupt (verify.repair=stale: "
                            "also what is stale in this experiment)",
                Repair.corrupt: "the corrupt ones were quarantined (the next run redoes them); verify.repair=stale "
                                "also quarantines what is stale in this experiment",
                Repair.stale: "quarantined (the next run redoes them)"}[mode]
        raise StoreIntegrityError(f"store {exp.store.root}: {n} corrupt or stale file(s) in "
                                  f"{', '.join(h.name for h in bad)} (listed above); {done}{missing}")
    if incomplete:
        raise StoreIncompleteError(f"store {exp.store.root}: nothing corrupt or stale, but {exp.name} is incomplete: "
                                   f"{'; '.join(incomplete.incomplete)}")
    log.info("store %s: %d experiment(s) checked, nothing corrupt or stale", exp.store.root, len(reports))
    return reports


def _repair(store: ExperimentStore, problem: Problem, mode: Repair, current: bool) -> str:
    """Quarantine ``problem``'s file if ``mode`` asks for it; say what was done or what would do it."""
    if problem.kind == "corrupt":
        return fix(store, problem) if mode is not Repair.off else \
            f"python -m benchmark stage=verify verify.repair=true quarantines it, then {problem.redo}"
    if not current:
        why = (f"judged against {store.experiment}'s yaml defaults, not the overrides it was made with; "
               if problem.judged else "")
        return (f"reported only: {why}stale files are repaired only for the current experiment: python -m benchmark "
                f"stage=verify experiment={store.experiment} <its overrides> verify.repair=stale")
    if mode is Repair.stale:
        return fix(store, problem)
    return f"python -m benchmark stage=verify verify.repair=stale quarantines it, then {problem.redo}"


def migrate(exp: Experiment | None, store: ExperimentStore, results_dir: Path, health: ExperimentHealth,
            mode: Repair) -> None:
    """Find what older versions wrote (``benchmark.inventory.migrations``): in ``results_dir``, and,
    for the current experiment (``exp``; ``None`` for another, whose overrides this command line does
    not know), in its sample units; apply each unless ``mode`` is off, a unit's under its claim.
    Recorded in ``health.migrations`` (reported, never an error): the checks that follow read the
    migrated files."""
    found = results_migrations(results_dir)
    if exp is not None:
        found += [m for unit in store.sample_units() if unit.row()[0] in method_names()
                  for m in unit_migrations(exp, unit)]
    for migration in found:
        if mode is Repair.off:
            action = "python -m benchmark stage=verify verify.repair=true migrates it"
        elif migration.unit is None:
            migration.apply()
            action = "migrated"
        else:
            with store.claim(migration.unit) as claim:
                if claim is None:
                    action = "left as is: its unit is being worked on by another process (run verify again later)"
                else:
                    migration.apply()
                    action = "migrated"
        health.migrations.append((migration, action))


def _progress(items: list, what: str):
    return tqdm(items, desc=f"verify {what}", unit="file", dynamic_ncols=True, disable=len(items) < 20)


def check_zoo(exp: Experiment | None, store: ExperimentStore, health: ExperimentHealth) -> None:
    """Validate every checkpoint and failure record of the zoo; count them per seed range."""
    ranges = [(f"{r.role} {r}", r) for r in (exp.reference, exp.heldout)] if exp else []
    seeds_on_disk = store.completed_seeds()
    counters = {label: Counter() for label, _ in ranges}
    counters["other seeds"] = Counter()

    def counter_of(seed: int) -> Counter:
        return next((counters[label] for label, r in ranges if seed in r), counters["other seeds"])

    shapes = exp.shapes() if exp else None
    zoo_command = f"python -m benchmark stage=zoo experiment={store.experiment}"
    for seed in _progress(seeds_on_disk, f"{store.experiment} zoo"):
        path = store.checkpoint_path(seed)
        identity = _identity(path)  # before anything is read: a repair moves only this version
        if exp is not None:
            problem = seed_problem(exp, seed, shapes)
        else:
            try:
                problem = broken_link(path)
                if problem is None:
                    check_file(path, expect={"experiment": store.experiment, "seed": str(seed)})
            except CheckpointError as err:
                problem = str(err)
            except OSError as err:
                problem = f"{path}: unreadable ({err.strerror or err})"
        unit = store.seed_unit(seed)
        redo = f"{zoo_command} retrains seed {seed}"
        if problem:
            counter_of(seed)["corrupt"] += 1
            health.problems.append(Problem("corrupt", path, problem, unit, redo, identity))
            continue
        unverified = _unverified(path, health)
        stale = unverified or (checkpoint_staleness(exp, path) if exp is not None else None)
        if stale:
            counter_of(seed)["stale"] += 1
            health.problems.append(Problem("stale", path, stale, unit, redo, identity, judged=not unverified))
        else:
            counter_of(seed)["complete"] += 1
    records = {p: _identity(p) for p in store.failed_dir.glob("*.json")} if store.failed_dir.is_dir() else {}
    for seed, problem in store.unreadable_failure_records().items():
        counter_of(seed)["corrupt"] += 1
        path = store.failed_path(seed)
        health.problems.append(Problem("corrupt", path, problem, store.seed_unit(seed),
                                       f"{zoo_command} retrains seed {seed}", records.get(path)))
    for seed in store.failed_seeds():
        counter_of(seed)["failed to converge"] += 1
    for seed in quarantined_seeds(store):
        counter_of(seed)["quarantined"] += 1
    on_disk = set(seeds_on_disk) | set(store.failed_seeds()) | set(store.unreadable_failure_records())
    for label, r in ranges:
        health.missing_seeds[label] = [s for s in r if s not in on_disk]
        counters[label]["missing"] = len(health.missing_seeds[label])
    health.zoo = {label: c for label, c in counters.items() if label != "other seeds" or sum(c.values())}


def check_complete(exp: Experiment, store: ExperimentStore, health: ExperimentHealth) -> None:
    """The current experiment's missing parts (``health.incomplete``), each with the claims on it and
    the command that makes it: the zoo seeds of its ranges, and the sample units of what ``method=``
    x ``mode=`` select (none for ``method=external``)."""
    def claims_on(units: list[Unit]) -> str:
        live, dead = [], []
        for unit in units:
            info = read_claim(store.claim_path(unit))
            if info is not None:
                (dead if stale_reason(info, store.claim_timeout_s) else live).append(
                    f"{unit.label} ({describe_holder(info, store.claim_timeout_s)})")
        parts = ([f"in progress elsewhere (live claims): {', '.join(live)}; wait for them"] if live else []) + \
            ([f"claimed by dead holders (stale claims): {', '.join(dead)}; the next run takes them over"] if dead else [])
        return f" [{'; '.join(parts)}]" if parts else ""

    def listed(units: list[Unit]) -> str:
        names = [u.label for u in units]
        return ", ".join(names[:8]) + (f", ... ({len(names) - 8} more)" if len(names) > 8 else "")

    for label, seeds in health.missing_seeds.items():
        if seeds:
            units = [store.seed_unit(s) for s in seeds]
            health.incomplete.append(
                f"zoo {label}: {len(seeds)} seed(s) missing ({listed(units)}){claims_on(units)} -> python -m benchmark "
                f"stage=zoo experiment={exp.name} <this command's overrides> trains them (a cluster: the same zoo "
                "command again)")
    method, mode = exp.config.method.value, exp.config.mode.value
    if method == "external":
        return
    wanted = set(selected(method, mode))
    units = sorted({u for u in health.missing_units if u.row() in wanted}, key=lambda u: u.label)
    if units:
        health.incomplete.append(
            f"samples: {len(units)} unit(s) of method={method} mode={mode} missing ({listed(units)}){claims_on(units)} "
            f"-> python -m benchmark stage=sample experiment={exp.name} method={method} mode={mode} <this command's "
            "overrides> draws them (stage=verify method=<name> checks only the methods you ran)")


def _unverified(path: Path, health: ExperimentHealth | None = None) -> str | None:
    """Why a valid file counts as stale for lack of content checksums (written before they existed);
    a file of store format 1 (metadata not covered) is counted in ``health``, not stale."""
    try:
        metadata = read_metadata(path)
        if stored_checksums(metadata, str(path)) is None:
            return f"{path}: written before content checksums (unverified: a silent bit flip could not be detected)"
    except CheckpointError as err:
        return str(err)
    if health is not None and file_format(metadata) == 1:
        health.metadata_unverified += 1
    return None


def check_samples(exp: Experiment | None, store: ExperimentStore, health: ExperimentHealth) -> None:
    """Validate every repetition's sample set and its predictions; count repetitions complete,
    missing (of the ``sample.repetitions`` the config asks for), corrupt, stale."""
    counter = health.samples
    on_disk = store.sample_units()
    if exp is not None:
        health.missing_units = [u for u in expected_units(exp) if u not in on_disk]
        counter["missing"] = len(health.missing_units)
    for unit in _progress(on_disk, f"{store.experiment} samples"):
        identities = {p: _identity(p) for p in store.unit_paths(unit)}  # before anything is read
        method, mode = unit.row()
        redo = (f"python -m benchmark stage=sample experiment={store.experiment} method={method} mode={mode} redraws it"
                if method in method_names() else f"stage=sample method=external mode={mode} scores it again")
        if exp is None:
            state = _integrity_only(store, unit)
        else:
            wanted = None if method in method_names() else {"experiment": exp.name, "method": method, "mode": mode}
            state = unit_state(exp, unit, wanted)
        for path, problem in state.corrupt.items():
            health.problems.append(Problem("corrupt", path, problem, unit, redo, identities.get(path)))
        if state.corrupt:
            counter["corrupt"] += 1
            continue
        if state.missing:
            counter["missing"] += 1
            health.missing_units.append(unit)
            continue
        stale = state.stale or next((r for p in store.unit_paths(unit) if (r := _unverified(p, health))), None)
        if stale:
            counter["stale"] += 1
            health.problems.append(Problem("stale", store.samples_path(unit), stale, unit, redo,
                                           identities.get(store.samples_path(unit)), judged=bool(state.stale)))
        else:
            counter["complete"] += 1
    counter["quarantined"] = len(quarantined(store.samples_dir)) + len(quarantined(store.preds_dir))


def check_caches(exp: Experiment | None, store: ExperimentStore, health: ExperimentHealth) -> None:
    """Validate every cache file of each registered reference's cache folder (``Reference.cache_folder``:
    ``reference/``, another store's zoo's ``reference-other_zoo/``; checksums, finite values, the
    streamed forms' folders too) and of ``eval/`` (sealed JSON), and list the form folders
    (``canonical-<key>``, ``aligned-<key>``) no current key uses, with their size (judged only with
    an experiment that evaluates against that reference and whose reference can be built)."""
    for reference in REFERENCES.values():
        folder = reference.cache_folder(store)
        if folder is not None:
            _check_reference_caches(folder, _current_caches(exp, reference), health)
    numbers = sorted(p for p in store.eval_dir.iterdir() if not p.name.startswith(".")) if store.eval_dir.is_dir() else []
    for path in numbers:
        health.caches["numbers"] += 1
        problem = _cache_problem(path, lambda p: unsealed_json(p.read_text(encoding="utf-8"), str(p)))
        if problem:
            health.damaged_caches[path] = problem


def _current_caches(exp: Experiment | None, reference: type[Reference]) -> set[str] | None:
    """The form folders the current keys of ``reference`` use, or ``None`` when they cannot be
    judged (no experiment, one not evaluated against it, or a reference that cannot be built)."""
    if exp is None or reference.name not in evaluated(exp):
        return None
    try:
        return reference.build(exp).current_caches()
    except (StoreError, CheckpointError, OSError):
        return None  # no reference to judge against: folders are not called orphaned


def _check_reference_caches(folder: Path, current: set[str] | None, health: ExperimentHealth) -> None:
    """Validate the cache files of ``folder`` (one reference's) and list its orphaned form folders."""
    entries = sorted(folder.iterdir()) if folder.is_dir() else []
    for entry in entries:
        if entry.name.startswith(".") or entry.name == "quarantine":
            continue
        if entry.is_dir() and not entry.is_symlink():
            if current is not None and entry.name.startswith(FORM_PREFIXES) and entry.name not in current:
                health.orphans[entry] = sum(p.lstat().st_size for p in entry.rglob("*"))
                continue
            files = sorted(p for p in entry.iterdir() if not p.name.startswith("."))
        else:
            files = [entry]
        for path in files:
            health.caches["reference"] += 1
            problem = _cache_problem(path, lambda p: check_file(p, expect={}))
            if problem:
                health.damaged_caches[path] = problem


def _cache_problem(path: Path, read) -> str | None:
    """What is wrong with cache file ``path`` (``read(path)`` raising, a directory or a symlink
    that leads nowhere in its place), or ``None``."""
    broken = broken_link(path)
    if broken:
        return broken
    if path.is_dir():
        return f"{path}: a directory in place of a cache file"
    try:
        read(path)
    except CheckpointError as err:
        return str(err)
    except (OSError, ValueError) as err:
        return f"{path}: unreadable ({getattr(err, 'strerror', None) or err})"
    return None


def repair_caches(health: ExperimentHealth, mode: Repair) -> None:
    """With ``verify.repair``, remove each damaged cache file and orphaned cache folder (a cache
    is rebuilt by the next evaluate run: nothing to keep); say what was or would be done."""
    for path in [*health.damaged_caches, *health.orphans]:
        if mode is Repair.off:
            health.cache_actions[path] = "python -m benchmark stage=verify verify.repair=true removes it"
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            Path(path).unlink(missing_ok=True)
        health.cache_actions[path] = "removed (the next evaluate run rebuilds what it needs)"


def _integrity_only(store: ExperimentStore, unit: Unit) -> UnitState:
    paths = store.unit_paths(unit)
    state = UnitState(missing=not all(p.is_file() for p in paths))
    for path in (p for p in paths if p.is_file()):
        try:
            check_file(path, expect={"experiment": store.experiment})
        except CheckpointError as err:
            state.corrupt[path] = str(err)
    return state


def check_leftovers(store: ExperimentStore, health: ExperimentHealth, results_dir: Path) -> None:
    """Temp files of writes killed mid-way, claims (live or stale), and the litter of killed
    processes in the store and in the experiment's ``results_dir`` (counted, not an error)."""
    for folder in (store.zoo_dir, store.failed_dir, store.samples_dir, store.preds_dir):
        if folder.is_dir():
            health.temp_files += sorted(p for p in folder.iterdir() if is_temp_file(p))
    for info in claims_in(store.claims_dir):
        health.claims["stale" if stale_reason(info, store.claim_timeout_s) else "live"] += 1
    # a count, not an error: the next zoo or sample run reaps it (unit temp files are counted above)
    if litter := [p for p in store.litter() if p not in health.temp_files]:
        log.info("%s: %d file(s) of litter left by killed processes (reaped by the next run)", store.experiment, len(litter))
    if litter := store.results_litter(results_dir):  # reaped by the next evaluate, report or analyze run
        log.info("%s: %d temp file(s) of killed writers in %s (reaped by the next run that writes results)",
                 store.experiment, len(litter), results_dir)


def fix(store: ExperimentStore, problem: Problem) -> str:
    """Quarantine ``problem``'s file under its unit's claim (re-checked there); say what was done."""
    with store.claim(problem.unit) as claim:
        if claim is None:
            return "left as is: its unit is being worked on by another process (run verify again later)"
        if not os.path.lexists(problem.path):
            return "already gone (another process moved or replaced it)"
        if _identity(problem.path) != problem.identity:
            return "left as is: the file was replaced since it was checked (run verify again)"
        moved = quarantine_and_redo({problem.path: f"{problem.kind}: {problem.reason}"}, problem.redo)
    if not moved:
        return "already gone (another process moved or replaced it)"
    return f"moved to {moved[problem.path]}; {problem.redo}"


def _identity(path: Path) -> tuple | None:
    """(device, inode, size, mtime in ns) of ``path`` (of the link itself for a symlink that leads
    nowhere); ``None`` when it is absent."""
    try:
        st = path.stat()
    except OSError:
        try:
            st = path.lstat()
        except FileNotFoundError:
            return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def remove_temp_files(store: ExperimentStore, health: ExperimentHealth) -> None:
    """Remove temp files of killed writes whose unit nobody is working on (its claim is free)."""
    removed = 0
    for tmp in health.temp_files:
        unit = store.unit_of(tmp)
        if unit is None:
            continue
        final = tmp.with_name(tmp.name[1:].split(".tmp-")[0])
        with store.claim(unit) as claim:
            if claim is not None:
                removed += len(remove_temp_files_of(final))
    if health.temp_files:
        log.info("%s: removed %d of %d temp file(s) of killed writes", store.experiment, removed, len(health.temp_files))
    health.temp_files = [t for t in health.temp_files if t.exists()]
