"""Sample stage: each method's weight samples in each mode, and its predictions with them.

``python -m benchmark stage=sample method=<all|name|external> mode=<both|one|multi>``

A unit is one (method, mode). It is skipped when its sample set and its predictions are in the
store and valid for the current settings; otherwise, under a per-unit lock, the method is fitted
around the mode's base networks (the converged checkpoints of ``seeds.heldout``, first seeds
first; ``methods.modes``), and the sample set ``{key: [S, ...]}`` and the predictions
``{"id": [S, N, C], "ood": [S, M, C]}`` (float32 probabilities on the ID test set and the OOD
set) are written atomically, predictions last: a unit counts as done only when both files
validate, so a killed run redoes at most the unit in flight. Units are claimed
(``store/claims.py``), so processes on several cluster nodes can share the work.

Self-healing: a stored unit whose sample set or predictions fail validation (unreadable,
truncated, checksum mismatch, NaN/Inf, wrong keys or shapes, another experiment's) has the
bad file moved to ``quarantine/`` beside it (one log line naming it) and is redrawn. A unit
whose metadata differ from the current settings is stale and redrawn in place.

Every unit is built and checked (``prepare_units``) before any training. With ``method=all`` a
unit that fails while fitting (NaN, no base converges) is logged, writes nothing, and the stage
goes on, raising ``SampleStageError`` listing the failures at the end; a named method fails at
once. ``method=external`` scores a sample set produced elsewhere (``external.path``).
"""
from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmark.config import ConfigError, ModeChoice
from benchmark.experiment import Experiment, code_fingerprint, library_versions, stable_hash
from benchmark.core.models import predict_with_weights
from benchmark.core.settings import SettingsError
from benchmark.stages.zoo import corrupt_zoo_error
from benchmark.core.store import (
    CheckpointError,
    SampleSet,
    StoreError,
    check_file,
    load_checkpoint,
    load_sample_set,
    quarantine,
    read_metadata,
    remove_temp_files_of,
    save_sample_set,
    validate_tensors,
)
from benchmark.core.training import NonFiniteError
from methods import MODES, MethodConfigError, MethodFitError, PosteriorMethod, method_class, method_names
from methods.modes import ModePlan, plan_counts, run_mode

log = logging.getLogger(__name__)
FIT_ERRORS = (NonFiniteError, MethodFitError)
NOT_WRITTEN = "not written yet"
ASSUMED_CONVERGENCE = 0.5  # for the suggested held-out range when no held-out seed was trained yet


class SampleStageError(RuntimeError):
    """Some (method, mode) units failed under ``method=all``; the others were written."""


class MissingBasesError(StoreError):
    """Too few converged held-out checkpoints for a mode; the message gives the zoo command."""


@dataclass
class SampleSummary:
    """What a sample-stage run did, per ``"method/mode"`` unit."""

    written: list[str] = field(default_factory=list)
    skipped_done: list[str] = field(default_factory=list)
    skipped_busy: list[str] = field(default_factory=list)
    unavailable: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    quarantined: dict[str, str] = field(default_factory=dict)  # unit -> what was wrong with its file(s)


@dataclass
class Unit:
    """One repetition of a (method, mode) to run: the built method and its plan (candidate bases,
    bases and samples per base)."""

    method: PosteriorMethod
    plan: ModePlan
    repetition: int = 0

    @property
    def key(self) -> str:
        return f"{self.method.name}/{self.plan.mode}/r{self.repetition}"


def selected_units(method: str, mode: str) -> list[tuple[str, str]]:
    """``(method, mode)`` pairs of ``method`` x ``mode`` (registered methods only).

    ``all``/``both`` expand to the modes each method supports; a named method with a named mode
    is kept even if unsupported, so that its ``check`` refuses it with the reason.
    """
    names = method_names() if method == "all" else (method,)
    units = []
    for name in names:
        supported = method_class(name).modes
        wanted = supported if mode == ModeChoice.both.value else (mode,)
        units += [(name, m) for m in wanted if m in supported or method != "all"]
    return units


SAMPLE_CODE = ("methods", "benchmark/core/training", "benchmark/core/models")  # what a sample set is computed by


def settings_hash(exp: Experiment, name: str) -> str:
    """Hash of what determines a unit's output besides the zoo config and the repetition: the
    method's settings, the sample counts, the held-out range, and the code that draws the samples
    (``SAMPLE_CODE`` sources and library versions). The number of repetitions is not in it: more
    repetitions keep the ones done."""
    payload = {
        "zoo": exp.config_hash,
        "method": exp.method_settings(name),
        "sample": {"per_method": exp.config.sample.per_method, "modes_multi": exp.config.sample.modes_multi},
        "heldout": [exp.heldout.start, exp.heldout.stop],
        "code": code_fingerprint(SAMPLE_CODE),
    }
    return stable_hash(payload)


def unit_metadata(exp: Experiment, unit: Unit, seeds: tuple[int, ...], diagnostics: dict[str, float]) -> dict[str, object]:
    """Metadata written with a unit's sample set and predictions (``seeds``: the base seeds used;
    ``diagnostics``: the method's, averaged over its bases)."""
    name, plan = unit.method.name, unit.plan
    return {
        "method": name, "label": method_class(name).label, "mode": plan.mode, "repetition": unit.repetition,
        "experiment": exp.name, "base_seeds": list(seeds), "samples_per_base": plan.samples_per_base,
        "n_samples": plan.n_samples, "config_hash": exp.config_hash, "settings_hash": settings_hash(exp, name),
        "diagnostics": diagnostics, "versions": library_versions(),
    }


def predictions(exp: Experiment, samples: SampleSet, method: PosteriorMethod | None = None) -> dict[str, torch.Tensor]:
    """Per-sample probabilities ``{"id": [S, N, C], "ood": [S, M, C]}`` (float32) of the plain model
    carrying each sample (``method.predict_weights``: the network the method's samples parameterise)."""
    if method is not None:
        return {"id": method.predict_weights(samples, exp.test_tensors[0]),
                "ood": method.predict_weights(samples, exp.ood_tensors[0])}
    model = exp.model().to(exp.device)
    return {
        "id": predict_with_weights(model, samples, exp.test_tensors[0]),
        "ood": predict_with_weights(model, samples, exp.ood_tensors[0]),
    }


@dataclass
class StoredUnit:
    """The state of a unit's two files in the store: ``missing`` (one or both not written),
    ``stale`` (metadata differ from the current settings: redrawn in place), ``corrupt``
    (file -> what is wrong: quarantined, then redrawn). ``problem`` is ``None`` when the unit is done."""

    missing: bool = False
    stale: str | None = None
    corrupt: dict[Path, str] = field(default_factory=dict)

    @property
    def problem(self) -> str | None:
        if self.corrupt:
            return "; ".join(self.corrupt.values())
        return NOT_WRITTEN if self.missing else self.stale


def inspect_unit(exp: Experiment, name: str, mode: str, expected: dict[str, object], repetition: int = 0) -> StoredUnit:
    """The ``StoredUnit`` of ``name``/``mode`` (``repetition``): done when both files are written, their metadata
    hold ``expected``, and they validate whole (``store.check_file``: checksums, finite values,
    the model's keys and shapes with the sample count of the metadata, predictions
    ``[S, N, classes]`` for the ID test set and the OOD set)."""
    store = exp.store
    paths = (store.samples_path(name, mode, repetition), store.preds_path(name, mode, repetition))
    state = StoredUnit(missing=not all(p.is_file() for p in paths))
    metas = {}
    for path in (p for p in paths if p.is_file()):
        try:
            metas[path] = read_metadata(path)
        except CheckpointError as err:
            state.corrupt[path] = str(err)
            continue
        if metas[path].get("experiment") != exp.name:
            state.corrupt[path] = (f"{path}: holds samples of experiment {metas[path].get('experiment')!r}, "
                                   f"expected {exp.name!r}")
        elif state.stale is None:
            stale = [k for k, v in expected.items() if metas[path].get(k) != v]
            if stale:
                state.stale = f"{path}: metadata {', '.join(stale)} differ from the current settings"
    if state.missing or state.stale or state.corrupt:
        return state
    try:
        n = int(json.loads(metas[paths[0]].get("n_samples", "0")))
    except (ValueError, TypeError):
        n = -1
    c, rows = exp.info.num_classes, _prediction_rows(exp)
    shapes = (exp.shapes(), None if rows is None else {"id": (rows[0], c), "ood": (rows[1], c)})
    for path, shape in zip(paths, shapes):
        try:
            check_file(path, shape, leading=1, samples=n, expect={"experiment": exp.name})
        except CheckpointError as err:
            state.corrupt[path] = str(err)
    return state


def _prediction_rows(exp: Experiment) -> tuple[int, int] | None:
    """Rows of the ID test set and the OOD set, or ``None`` when the data are not on this machine
    (``stage=verify`` then checks predictions without their row counts)."""
    try:
        return len(exp.test_tensors[1]), len(exp.ood_tensors[1])
    except OSError:
        return None


def stored_problem(exp: Experiment, name: str, mode: str, expected: dict[str, object], repetition: int = 0) -> str | None:
    """Why the stored sample set and predictions of ``name``/``mode`` (``repetition``) are not
    usable (``None`` if both are written, valid, and their metadata holds ``expected``)."""
    return inspect_unit(exp, name, mode, expected, repetition).problem


def unit_expectations(exp: Experiment, name: str, mode: str, repetition: int = 0) -> dict[str, Any]:
    """The metadata a done repetition of a registered method's unit must hold under the current
    settings and code."""
    return {"method": name, "mode": mode, "experiment": exp.name, "repetition": str(repetition),
            "settings_hash": settings_hash(exp, name)}


def unit_problem(exp: Experiment, name: str, mode: str, repetition: int = 0) -> str | None:
    """Why the stored output of one repetition of a method's unit is not usable (``None`` if it
    is done and valid: its settings and code are the current ones)."""
    return stored_problem(exp, name, mode, unit_expectations(exp, name, mode, repetition), repetition)


def pool_size(method: PosteriorMethod, bases: int) -> int:
    """Candidate seeds reserved for one repetition: the bases, plus spares (a fifth, and one)
    for methods whose fit around a base can fail (retrained networks that do not converge)."""
    return bases + (math.ceil(0.2 * bases) + 1 if method.fits_can_fail else 0)


def repetition_candidates(seeds: list[int], pool: int, repetition: int) -> tuple[int, ...]:
    """The candidate bases of ``repetition``: its own block of ``pool`` seeds, so repetitions never
    share a base network, and a block does not depend on how many repetitions are asked."""
    return tuple(seeds[repetition * pool : (repetition + 1) * pool])


def quarantine_unit(exp: Experiment, key: str, state: StoredUnit, summary: SampleSummary) -> None:
    """Move the unit's corrupt files to ``quarantine/``, one log line each; count them in ``summary``."""
    for path, problem in state.corrupt.items():
        try:
            dest = quarantine(path, problem)
        except FileNotFoundError:
            continue
        log.error("%s; moved to %s, %s will be drawn again", problem, dest, key)
        summary.quarantined[key] = problem


def select_bases(exp: Experiment, count: int) -> list[int]:
    """All converged held-out seeds, checking there are at least ``count``.

    Raises ``MissingBasesError`` naming the missing count, the seed range and the zoo command
    that trains them (a larger ``seeds.heldout`` when the range is exhausted).
    """
    heldout = exp.heldout
    seeds = exp.store.converged_seeds(heldout.start, heldout.stop)
    if len(seeds) >= count:
        return seeds
    failed = sum(s in heldout for s in exp.store.failed_seeds())
    tried = len(seeds) + failed
    missing = count - len(seeds)
    message = (
        f"{exp.store.zoo_dir}: {count} converged held-out base checkpoints needed, {len(seeds)} found in "
        f"seeds.heldout={[heldout.start, heldout.stop]} ({failed} failed, {len(heldout) - tried} not trained yet); "
        f"{missing} missing."
    )
    if tried < len(heldout):
        command = f"python -m benchmark stage=zoo experiment={exp.name} zoo.range=heldout"
        extra = " (if that is still too few, widen seeds.heldout)"
    else:
        rate = len(seeds) / tried if seeds else ASSUMED_CONVERGENCE
        new_stop = heldout.stop + math.ceil(1.25 * missing / rate)
        override = f"'seeds.heldout=[{heldout.start},{new_stop}]'"
        command = f"python -m benchmark stage=zoo experiment={exp.name} zoo.range=heldout {override}"
        extra = f", then pass {override} to the sample stage too"
    raise MissingBasesError(f"{message} Train them with: {command}{extra}")


def prepare_units(exp: Experiment, summary: SampleSummary | None = None, check_bases: bool = True) -> list[Unit]:
    """Build and check every selected unit (each method x mode, ``sample.repetitions`` times)
    before any training. Repetition k takes its bases from the k-th block of converged held-out
    seeds (``repetition_candidates``).

    Raises ``MethodConfigError`` listing every refused unit (a bad method/model/mode
    combination), and ``MissingBasesError`` when ``check_bases`` and the store lacks bases.
    Under ``method=all``, methods the experiment marks ``unavailable`` are skipped (listed in
    ``summary.unavailable``).
    """
    method, mode = exp.config.method.value, exp.config.mode.value
    repetitions = exp.config.sample.repetitions
    units, refused = [], []
    for name, m in selected_units(method, mode):
        instance = exp.build_method(name)
        if method == "all" and instance.settings.unavailable:
            log.info("%s/%s skipped: %s", name, m, instance.settings.unavailable)
            if summary is not None:
                summary.unavailable.append(f"{name}/{m}")
            continue
        try:
            instance.check(m)
            bases, per_base = plan_counts(instance, m, exp.config.sample.per_method, exp.config.sample.modes_multi)
        except SettingsError as err:
            raise ConfigError(f"methods.{name}.{err}") from None
        except MethodConfigError as err:
            refused.append(f"{name}/{m}: {err}")
            continue
        units += [Unit(instance, ModePlan(m, (), bases, per_base), r) for r in range(repetitions)]
    if refused:
        raise MethodConfigError(f"{len(refused)} method/mode unit(s) refused before any work: {'; '.join(refused)}")
    if check_bases:
        for unit in units:
            pool = pool_size(unit.method, unit.plan.bases)
            seeds = select_bases(exp, (repetitions - 1) * pool + unit.plan.bases)
            candidates = repetition_candidates(seeds, pool, unit.repetition)
            unit.plan = ModePlan(unit.plan.mode, candidates, unit.plan.bases, unit.plan.samples_per_base)
    return units


def load_base(exp: Experiment, seed: int) -> dict[str, torch.Tensor]:
    """The validated plain state dict of held-out checkpoint ``seed``; a damaged one stops the
    stage with the file and the command that heals the zoo (``CorruptZooError``)."""
    path = exp.store.checkpoint_path(seed)
    try:
        state_dict, metadata = load_checkpoint(path, exp.model(), expect={"experiment": exp.name})
    except CheckpointError as err:
        raise corrupt_zoo_error(exp, {path: str(err)}, "held-out base checkpoint(s)") from err
    trained_with = metadata.get("config_hash")
    if trained_with is not None and trained_with != exp.config_hash:
        log.warning("%s was trained with config hash %s, this run's is %s (model/data/recipe changed since)",
                    path, trained_with, exp.config_hash)
    return state_dict


def write_unit(exp: Experiment, unit: Unit, claim=None) -> tuple[int, ...] | None:
    """Fit, sample, predict, and write the unit's two files (atomically, predictions last); return
    the base seeds, or ``None`` (nothing written) if ``claim`` was taken over meanwhile."""
    name, mode, r = unit.method.name, unit.plan.mode, unit.repetition
    samples, seeds, diagnostics = run_mode(unit.method, unit.plan, lambda seed: load_base(exp, seed),
                                           diagnostic_data=exp.test_tensors)
    preds = predictions(exp, samples, unit.method)
    if claim is not None and claim.lost:
        return None
    metadata = unit_metadata(exp, unit, seeds, diagnostics)
    save_sample_set(exp.store.samples_path(name, mode, r), samples, metadata)
    save_sample_set(exp.store.preds_path(name, mode, r), preds, metadata)
    return seeds


def run(exp: Experiment) -> SampleSummary:
    """Run the units of ``method`` x ``mode`` that the store lacks (see module doc)."""
    if exp.config.method.value == "external":
        return run_external(exp)
    single = exp.config.method.value != "all"
    store = exp.store
    store.ensure_writable()
    store.reap_stale_claims()  # claims of runs killed after they wrote their unit
    summary = SampleSummary()
    todo = []
    for unit in prepare_units(exp, summary):
        name, mode, r = unit.method.name, unit.plan.mode, unit.repetition
        state = inspect_unit(exp, name, mode, unit_expectations(exp, name, mode, r), r)
        if state.problem is None:
            summary.skipped_done.append(unit.key)
            continue
        if state.stale and not state.corrupt:
            log.warning("%s: redoing (%s)", unit.key, state.stale)
        todo.append(unit)
    for unit in todo:
        name, mode, r = unit.method.name, unit.plan.mode, unit.repetition
        with store.claim(f"sample-{name}-{mode}-r{r}") as claim:
            if claim is None:
                log.info("%s: in progress elsewhere, skipped", unit.key)
                summary.skipped_busy.append(unit.key)
                continue
            for path in (store.samples_path(name, mode, r), store.preds_path(name, mode, r)):
                remove_temp_files_of(path)  # left by a writer killed mid-write
            state = inspect_unit(exp, name, mode, unit_expectations(exp, name, mode, r), r)  # again, under the claim
            if state.problem is None:
                summary.skipped_done.append(unit.key)
                continue
            quarantine_unit(exp, unit.key, state, summary)
            try:
                seeds = write_unit(exp, unit, claim)
            except FIT_ERRORS as err:
                if single:
                    raise
                log.error("%s stopped: %s (nothing written)", unit.key, err)
                summary.failed[unit.key] = f"{type(err).__name__}: {err}"
                continue
            if seeds is None:
                log.warning("%s: the claim was taken over while drawing; nothing written", unit.key)
                summary.skipped_busy.append(unit.key)
                continue
            log.info("%s: %d samples from base seeds %s written", unit.key, unit.plan.n_samples, list(seeds))
            summary.written.append(unit.key)
    log.info("sample stage: wrote %s; quarantined and redrew %s; already done %s; busy elsewhere %s",
             summary.written or "nothing", list(summary.quarantined) or "none", summary.skipped_done or "none",
             summary.skipped_busy or "none")
    if summary.failed:
        details = "; ".join(f"{u}: {msg}" for u, msg in summary.failed.items())
        raise SampleStageError(f"{len(summary.failed)} method/mode unit(s) failed and wrote nothing: {details}")
    return summary


def external_mode(exp: Experiment) -> str:
    """The mode an external sample set is reported under (``mode=one`` or ``mode=multi``)."""
    mode = exp.config.mode.value
    if mode not in MODES:
        raise ConfigError(f"mode={mode}: method=external needs mode=one or mode=multi (the table group of its row)")
    return mode


def load_external(exp: Experiment) -> SampleSet:
    """The validated sample set of ``external.path``: the model's keys, each ``[S, *shape]`` with
    one S >= 2, finite floats; errors name the key and the expected shape."""
    path = exp.config.external.path
    if not path:
        raise ConfigError("external.path: missing; method=external needs external.path=/path/to/samples.safetensors")
    if not Path(path).is_file():
        raise ConfigError(f"external.path={path}: no such file")
    samples = load_sample_set(path)
    shapes = exp.shapes()
    validate_tensors(samples, shapes, source=str(path), leading=1)
    counts = {k: int(v.shape[0]) for k, v in samples.items()}
    if len(set(counts.values())) != 1 or min(counts.values()) < 2:
        raise CheckpointError(f"{path}: every key needs the same number S >= 2 of samples [S, ...], got {counts}")
    model_state = exp.model().state_dict()
    for key, value in samples.items():
        if value.dtype != model_state[key].dtype:
            samples[key] = value.to(model_state[key].dtype)
    return samples


def run_external(exp: Experiment) -> SampleSummary:
    """Score a sample set produced elsewhere: validate it against the model, predict with every
    sample, and store it as method ``external.name`` so evaluate and report add its row."""
    external = exp.config.external
    mode = external_mode(exp)
    samples = load_external(exp)
    exp.store.ensure_writable()
    n = int(next(iter(samples.values())).shape[0])
    source = str(Path(external.path).resolve())
    metadata = {
        "method": external.name, "label": external.label or external.name, "mode": mode, "repetition": 0,
        "experiment": exp.name, "n_samples": n, "source": source, "source_size": Path(source).stat().st_size,
        "config_hash": exp.config_hash, "versions": library_versions(),
    }
    expected = {k: str(metadata[k]) if isinstance(metadata[k], str) else json.dumps(metadata[k])
                for k in ("method", "label", "mode", "experiment", "source", "source_size")}
    summary = SampleSummary()
    key = f"{external.name}/{mode}/r0"
    state = inspect_unit(exp, external.name, mode, expected)
    if state.problem is None:
        summary.skipped_done.append(key)
        return summary
    quarantine_unit(exp, key, state, summary)
    preds = predictions(exp, samples)
    save_sample_set(exp.store.samples_path(external.name, mode), samples, metadata)
    save_sample_set(exp.store.preds_path(external.name, mode), preds, metadata)
    log.info("%s: %d external samples from %s written", key, n, source)
    summary.written.append(key)
    return summary
