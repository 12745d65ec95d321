"""Sample stage: each method's weight samples in each mode, and its predictions with them.

``python -m benchmark stage=sample method=<all|name> mode=<both|one|multi>``

A unit is one (method, mode). It is skipped when its sample set and its predictions are in the
store and valid for the current settings; otherwise, under a per-unit lock, the method is fitted
around the mode's base networks (``methods.modes``), and the sample set ``{key: [S, ...]}`` and
the predictions ``{"id": [S, N, C], "ood": [S, M, C]}`` (float32 probabilities on the ID test set
and the OOD set) are written atomically, predictions last: a unit counts as done only when both
files validate, so a killed run redoes at most the unit in flight.

Every unit's ``check`` and bases are verified before any training. With ``method=all`` a
unit that fails (bad combination, missing bases, NaN) is logged, writes nothing, and the stage
goes on, raising ``SampleStageError`` listing the failures at the end; a named method fails at once.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

import torch
from omegaconf import OmegaConf

from benchmark.cli import register_stage
from benchmark.experiment import Experiment, library_versions, stable_hash
from benchmark.store import CheckpointError, SampleSet, read_metadata, sample_set_keys, save_sample_set, try_lock
from benchmark.training import NonFiniteError
from methods.base import MODES, MethodConfigError, MethodFitError, PosteriorMethod, predict_with_weights
from methods.modes import MissingBasesError, ModePlan, plan_mode, run_mode
from methods.registry import METHOD_NAMES, method_class

log = logging.getLogger(__name__)
MODE_CHOICES = ("both", *MODES)
UNIT_ERRORS = (MethodConfigError, MissingBasesError, NonFiniteError, MethodFitError)
NOT_WRITTEN = "not written yet"


class SampleStageError(RuntimeError):
    """Some (method, mode) units failed under ``method=all``; the others were written."""


@dataclass
class SampleSummary:
    """What a sample-stage run did, per ``"method/mode"`` unit."""

    written: list[str] = field(default_factory=list)
    skipped_done: list[str] = field(default_factory=list)
    skipped_busy: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)


def selected_units(method: str, mode: str) -> list[tuple[str, str]]:
    """``(method, mode)`` pairs of ``method`` x ``mode``.

    ``all``/``both`` expand to the modes each method supports; a named method with a named mode
    is kept even if unsupported, so that its ``check`` refuses it with the reason.
    """
    if method != "all" and method not in METHOD_NAMES:
        raise ValueError(f"method={method!r}: unknown method; expected all or one of {', '.join(METHOD_NAMES)}")
    if mode not in MODE_CHOICES:
        raise ValueError(f"mode={mode!r}: unknown mode; expected one of {', '.join(MODE_CHOICES)}")
    names = METHOD_NAMES if method == "all" else (method,)
    units = []
    for name in names:
        supported = method_class(name).modes
        wanted = supported if mode == "both" else (mode,)
        units += [(name, m) for m in wanted if m in supported or method != "all"]
    return units


def settings_hash(exp: Experiment, name: str) -> str:
    """Hash of what determines a unit's output besides the zoo config: method settings, sample
    counts, held-out range, and the model's method settings (``model.dropout_p``, ``model.laplace``)."""
    payload = {
        "zoo": exp.config_hash,
        "method": OmegaConf.to_container(exp.cfg.methods[name], resolve=True),
        "sample": {k: exp.cfg.sample[k] for k in ("per_method", "modes_multi")},
        "heldout": [int(exp.cfg.heldout.start), int(exp.cfg.heldout.stop)],
        "model": OmegaConf.to_container(exp.cfg.model, resolve=True),
    }
    return stable_hash(payload)


def unit_metadata(exp: Experiment, name: str, plan: ModePlan, seeds: tuple[int, ...]) -> dict[str, object]:
    """Metadata written with a unit's sample set and predictions (``seeds``: the base seeds used)."""
    return {
        "method": name, "mode": plan.mode, "experiment": exp.name, "base_seeds": list(seeds),
        "samples_per_base": plan.samples_per_base, "n_samples": plan.n_samples,
        "config_hash": exp.config_hash, "settings_hash": settings_hash(exp, name), "versions": library_versions(),
    }


def predictions(exp: Experiment, samples: SampleSet) -> dict[str, torch.Tensor]:
    """Per-sample probabilities ``{"id": [S, N, C], "ood": [S, M, C]}`` (float32) of the plain model."""
    model = exp.model().to(exp.device)
    return {
        "id": predict_with_weights(model, samples, exp.test_tensors[0]),
        "ood": predict_with_weights(model, samples, exp.ood_tensors[0]),
    }


def unit_problem(exp: Experiment, name: str, mode: str) -> str | None:
    """Why the stored output of a unit is not usable (``None`` if it is done and valid)."""
    store = exp.store
    paths = (store.samples_path(name, mode), store.preds_path(name, mode))
    if not all(p.is_file() for p in paths):
        return NOT_WRITTEN
    try:
        metas = [read_metadata(p) for p in paths]
        shapes = sample_set_keys(paths[0])
        preds = sample_set_keys(paths[1])
    except CheckpointError as err:
        return str(err)
    expected = {"method": name, "mode": mode, "experiment": exp.name, "settings_hash": settings_hash(exp, name)}
    for path, meta in zip(paths, metas):
        stale = [k for k, v in expected.items() if meta.get(k) != v]
        if stale:
            return f"{path}: metadata {', '.join(stale)} differ from the current settings"
    n = json.loads(metas[0].get("n_samples", "0"))
    model_shapes = exp.shapes()
    if set(shapes) != set(model_shapes) or any(shapes[k] != (n, *s) for k, s in model_shapes.items()):
        return f"{paths[0]}: keys or shapes differ from the model's with {n} samples"
    c = exp.info.num_classes
    wanted = {"id": (n, len(exp.test_tensors[1]), c), "ood": (n, len(exp.ood_tensors[1]), c)}
    if preds != wanted:
        return f"{paths[1]}: shapes {preds}, expected {wanted}"
    return None


def prepare(exp: Experiment, name: str, mode: str) -> tuple[PosteriorMethod, ModePlan]:
    """Build the method, refuse a bad combination, and find its bases (no training)."""
    method = method_class(name)(exp, exp.cfg.methods[name])
    method.check(mode)
    return method, plan_mode(exp, method, mode)


def write_unit(exp: Experiment, name: str, method: PosteriorMethod, plan: ModePlan) -> tuple[int, ...]:
    """Fit, sample, predict, and write the unit's two files (atomically, predictions last); return the base seeds."""
    samples, seeds = run_mode(method, plan)
    preds = predictions(exp, samples)
    metadata = unit_metadata(exp, name, plan, seeds)
    save_sample_set(exp.store.samples_path(name, plan.mode), samples, metadata)
    save_sample_set(exp.store.preds_path(name, plan.mode), preds, metadata)
    return seeds


def run_sample(exp: Experiment) -> SampleSummary:
    """Run the units of ``cfg.method`` x ``cfg.mode`` that the store lacks (see module doc)."""
    method, mode = str(exp.cfg.method), str(exp.cfg.mode)
    units = selected_units(method, mode)
    single = method != "all"
    store = exp.store
    store.ensure_writable()
    summary = SampleSummary()
    todo = []
    for name, m in units:
        unit = f"{name}/{m}"
        problem = unit_problem(exp, name, m)
        if problem is None:
            summary.skipped_done.append(unit)
            continue
        if problem != NOT_WRITTEN:
            log.warning("%s: redoing (%s)", unit, problem)
        try:
            todo.append((name, *prepare(exp, name, m)))
        except UNIT_ERRORS as err:
            if single:
                raise
            log.error("%s refused: %s (nothing written)", unit, err)
            summary.failed[unit] = f"{type(err).__name__}: {err}"
    for name, instance, plan in todo:
        unit = f"{name}/{plan.mode}"
        with try_lock(store.lock_path(f"sample-{name}-{plan.mode}")) as locked:
            if not locked:
                log.info("%s: in progress elsewhere, skipped", unit)
                summary.skipped_busy.append(unit)
                continue
            if unit_problem(exp, name, plan.mode) is None:
                summary.skipped_done.append(unit)
                continue
            try:
                seeds = write_unit(exp, name, instance, plan)
            except UNIT_ERRORS as err:
                if single:
                    raise
                log.error("%s stopped: %s (nothing written)", unit, err)
                summary.failed[unit] = f"{type(err).__name__}: {err}"
                continue
            log.info("%s: %d samples from base seeds %s written", unit, plan.n_samples, list(seeds))
            summary.written.append(unit)
    log.info("sample stage: wrote %s; already done %s; busy elsewhere %s",
             summary.written or "nothing", summary.skipped_done or "none", summary.skipped_busy or "none")
    if summary.failed:
        details = "; ".join(f"{u}: {msg}" for u, msg in summary.failed.items())
        raise SampleStageError(f"{len(summary.failed)} method/mode unit(s) failed and wrote nothing: {details}")
    return summary


register_stage("sample", run_sample)
