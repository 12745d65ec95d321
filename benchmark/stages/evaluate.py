"""Evaluate stage: for every method x mode in the store, raw and symmetry-free (NS) MMD against
the reference zoo plus the predictive metrics, into ``results/<experiment>/metrics.csv``; with
``evaluate.weight_matching`` also WM MMD (the NS steps with the permutations removed by weight
matching every network, zoo and samples, to one anchor: the lowest converged reference seed).

Each of the ``sample.repetitions`` repetitions of a unit is evaluated on its own and the row
holds their mean and 95% half-width (``metrics.uncertainty``); the first repetition also gets
MMDAgg's test per layer and the MMD of ``evaluate.reference_resamples`` halves of the
reference, whose spread is the standard error due to the finite zoo. A repetition that is
missing or stale (settings or code changed since it was drawn) stops the stage with the files
named and the command that redoes them: it is never mixed into the spread.

The reference (the converged checkpoints of ``seeds.reference``) is canonicalised once and
cached in ``store/<experiment>/reference/`` with its ensemble predictive; each repetition's
numbers are cached in ``store/<experiment>/eval/``, keyed by the files they were computed from
and by the code that computes them (``EVALUATE_CODE`` sources, library versions), so a second
run recomputes nothing and a fix in ``metrics/`` recomputes everything. Reference checkpoints
are validated whole before they are used; a damaged one stops the stage with one error naming
the files and the command that heals the zoo (``CorruptZooError``), never a table of failed
rows. Damaged caches are rebuilt.
"""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from tqdm.auto import tqdm

from benchmark.experiment import Experiment, code_fingerprint, stable_hash
from benchmark.core.models import predict_with_weights
from benchmark.results import MEASURED, MMD_COLUMNS, half_width, write_metrics
from benchmark.stages.sample import unit_problem
from benchmark.stages.zoo import corrupt_zoo_error
from benchmark.core.store import (
    CheckpointError,
    CheckpointFiles,
    SampleSetFile,
    StoreError,
    atomic_write_text,
    check_file,
    iter_checkpoint_batches,
    load_checkpoints_as_sample_set,
    load_sample_set,
    read_metadata,
    save_checkpoint,
    save_sample_set,
    seed_name,
    unstack,
    validate_tensors,
)
from methods import MODES, method_class, method_names
from metrics.mmd import PermutationTestConfig, ReferenceResampling, mmd
from metrics.predictive import predictive_metrics
from metrics.symmetries import align_to_anchor, canonicalize, spec_for_model
from metrics.uncertainty import interval

log = logging.getLogger(__name__)
EVALUATE_CODE = ("metrics", "benchmark/stages/evaluate.py", "benchmark/core/models", "benchmark/results.py")
SUMMARIES = ("median", "mean", "max")


class StaleSamplesError(StoreError):
    """A repetition of a unit is missing or was drawn with other settings or code."""


def reference_seeds(exp: Experiment) -> list[int]:
    """Converged zoo seeds of ``seeds.reference``."""
    return exp.store.converged_seeds(exp.reference.start, exp.reference.stop)


def available_rows(exp: Experiment) -> list[tuple[str, str]]:
    """(method, mode) pairs with at least one repetition's sample set and predictions in the
    store: registered methods in registry order, then external ones, sorted."""
    store = exp.store
    found = set()
    for path in store.samples_dir.glob("*_r*.safetensors") if store.samples_dir.is_dir() else ():
        stem, _, repetition = path.stem.rpartition("_r")
        method, _, mode = stem.rpartition("_")
        if mode in MODES and method and repetition.isdigit() and store.preds_path(method, mode, int(repetition)).is_file():
            found.add((method, mode))
    registered = list(method_names())
    order = registered + sorted({m for m, _ in found} - set(registered))
    return sorted(found, key=lambda row: (order.index(row[0]), MODES.index(row[1])))


def repetitions_of(exp: Experiment, method: str, mode: str) -> list[int]:
    """The repetitions a row averages: ``0 .. sample.repetitions - 1`` for a registered method,
    all checked done and current (``StaleSamplesError`` otherwise); ``[0]`` for an external one."""
    if method not in method_names():
        return [0]
    problems = []
    for r in range(exp.config.sample.repetitions):
        problem = unit_problem(exp, method, mode, r)
        if problem is not None:
            problems.append(f"repetition {r}: {problem}")
    if problems:
        raise StaleSamplesError(
            f"{method}/{mode}: {'; '.join(problems)}. Redo them with: python -m benchmark stage=sample "
            f"experiment={exp.name} method={method} mode={mode} (or lower sample.repetitions)"
        )
    return list(range(exp.config.sample.repetitions))


def describe_store(exp: Experiment) -> str:
    """One line per store folder, for error messages."""
    store = exp.store
    parts = [f"{len(store.completed_seeds())} zoo checkpoints"]
    for folder in (store.samples_dir, store.preds_dir):
        names = sorted(p.name for p in folder.glob("*.safetensors")) if folder.is_dir() else []
        parts.append(f"{folder}: {', '.join(names) if names else 'nothing'}")
    return "; ".join(parts)


def _fingerprint(paths: list[Path], extra: Any) -> str:
    """Hash of ``extra`` and the identity (path, size, mtime) of the files a result came from."""
    files = [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in paths]
    return stable_hash({"extra": extra, "files": files}, length=20)


class Reference:
    """The reference zoo, its canonical form and its ensemble predictive, computed once and cached.

    A zoo that fits in ``evaluate.max_in_memory_gb`` is held as one sample set; a larger one
    (ResNet-18 zoos: ~45 MB per checkpoint) is streamed: MMD reads it layer by layer in column
    blocks, and the canonical zoo is written checkpoint by checkpoint.
    """

    def __init__(self, exp: Experiment, steps: list[str]) -> None:
        settings = exp.config.evaluate
        self.resampling = ReferenceResampling(count=settings.reference_resamples) if settings.reference_resamples else None
        self.test = PermutationTestConfig(b1=settings.test_permutations, b2=settings.test_permutations) \
            if settings.test_permutations else None
        self.exp = exp
        self.seeds = reference_seeds(exp)
        if len(self.seeds) < 2:
            raise StoreError(
                f"{exp.store.zoo_dir}: the reference needs at least 2 converged checkpoints in "
                f"seeds.reference={[exp.reference.start, exp.reference.stop]}, found {len(self.seeds)}; run "
                f"python -m benchmark stage=zoo experiment={exp.name} zoo.range=reference"
            )
        self.folder = exp.store.base / "reference"
        self.key = _fingerprint(exp.store.checkpoint_paths(self.seeds),
                                {"seeds": self.seeds, "steps": steps, "hash": exp.config_hash})
        self._checked: list[Path] | None = None
        self.steps = steps
        self.model = exp.model().to(exp.device)
        self.spec = spec_for_model(exp.model())
        n_params = sum(math.prod(shape) for shape in exp.shapes().values())
        limit = float(exp.config.evaluate.max_in_memory_gb)
        self.in_memory = len(self.seeds) * n_params * 4 <= limit * 2**30
        self.batch = max(1, int(limit * 2**30 // (8 * n_params * 4)))
        # WM MMD's anchor: the lowest converged reference seed (seed 002's code aligns to the first network).
        self.anchor_seed = self.seeds[0] if settings.weight_matching else None

    def checked_paths(self) -> list[Path]:
        """The reference checkpoints, each validated whole once (checksum, keys and shapes, finite
        values, experiment and seed); raises ``CorruptZooError`` naming every damaged one."""
        if self._checked is None:
            paths, shapes, problems = self.exp.store.checkpoint_paths(self.seeds), self.exp.shapes(), {}
            for seed, path in tqdm(list(zip(self.seeds, paths)), desc=f"validate reference {self.exp.name}",
                                   unit="file", dynamic_ncols=True, disable=len(paths) < 50):
                try:
                    check_file(path, shapes, expect={"experiment": self.exp.name, "seed": str(seed)})
                except CheckpointError as err:
                    problems[path] = str(err)
            if problems:
                raise corrupt_zoo_error(self.exp, problems, "reference checkpoint(s)")
            self._checked = paths
        return self._checked

    def _cached(self, name: str, build) -> dict[str, torch.Tensor]:
        path = self.folder / f"{name}.safetensors"
        try:
            if path.is_file() and read_metadata(path).get("key") == self.key:
                return load_sample_set(path)
        except CheckpointError as err:
            log.warning("%s; rebuilding this cache", err)
        value = build()
        save_sample_set(path, value, {"key": self.key, "experiment": self.exp.name, "seeds": self.seeds})
        return value

    def weights(self) -> dict[str, torch.Tensor]:
        """Reference sample set ``{key: [R, ...]}`` (validated against the model)."""
        def build():
            zoo = load_checkpoints_as_sample_set(self.checked_paths())
            validate_tensors(zoo, self.exp.model(), source=str(self.exp.store.zoo_dir), leading=1)
            return zoo
        return self._cached("zoo", build)

    def canonical(self) -> dict[str, torch.Tensor]:
        """Symmetry-free reference ``{key: [R, ...]}``, computed once."""
        return self._cached("canonical", lambda: canonicalize(self.weights(), self.spec, self.steps, device=self.exp.device)[0])

    @property
    def paths(self) -> list[Path]:
        return self.checked_paths()

    def canonical_paths(self) -> list[Path]:
        """Streamed mode: one canonical checkpoint per reference seed, written once."""
        return self._form_paths("canonical", lambda batch: canonicalize(batch, self.spec, self.steps, device=self.exp.device)[0])

    def _form_paths(self, name: str, transform) -> list[Path]:
        """Streamed mode: ``transform`` of every reference checkpoint, one file per seed, written once."""
        folder = self.folder / f"{name}-{self.key}"
        todo = [s for s in self.seeds if not (folder / f"{seed_name(s)}.safetensors").is_file()]
        checked = dict(zip(self.seeds, self.checked_paths()))
        paths = [checked[s] for s in todo]
        for batch_seeds, batch in zip(_chunks(todo, self.batch), iter_checkpoint_batches(paths, self.batch)):
            form = transform(batch)
            for i, seed in enumerate(batch_seeds):
                save_checkpoint(folder / f"{seed_name(seed)}.safetensors", unstack(form, i), {"seed": seed})
        return [folder / f"{seed_name(s)}.safetensors" for s in self.seeds]

    def align(self, samples: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The WM form of ``samples``: the NS steps with the permutation removed by weight matching
        to the anchor checkpoint instead of sorting (``metrics.symmetries.align_to_anchor``)."""
        anchor = load_checkpoints_as_sample_set(self.exp.store.checkpoint_paths([self.anchor_seed]))
        return align_to_anchor(samples, self.spec, anchor, self.steps)[0]

    def aligned(self) -> dict[str, torch.Tensor]:
        """The WM form of the reference ``{key: [R, ...]}``, computed once."""
        return self._cached("aligned", lambda: self.align(self.weights()))

    def predictive(self) -> torch.Tensor:
        """Zoo-ensemble predictive on the ID test set ``[N, C]``."""
        def build():
            images = self.exp.test_tensors[0]
            batches = [self.weights()] if self.in_memory else iter_checkpoint_batches(self.paths, self.batch)
            total = sum(predict_with_weights(self.model, b, images).double().sum(0) for b in batches)
            return {"id": (total / len(self.seeds))[None]}
        return self._cached("predictive", build)["id"][0]

    def mmd(self, samples_path: Path, samples: dict[str, torch.Tensor], full: bool) -> dict[str, float]:
        """Raw and NS MMD of a method's samples: ``{mmd_median, ..., ns_mmd_max}``; with ``full``
        also the standard errors due to the reference (``<column>_ref_sd``, from its halves) and
        the fraction of layers MMDAgg's test rejects (``mmd_reject``, ``ns_mmd_reject``)."""
        options = {"device": self.exp.device}
        if full:
            options |= {"resampling": self.resampling, "permutation_test": self.test}
        canonical = canonicalize(samples, self.spec, self.steps, device=self.exp.device)[0]
        wm_options = {k: v for k, v in options.items() if k != "permutation_test"}  # no test column for WM
        if self.in_memory:
            results = {"mmd": mmd(self.weights(), samples, **options),
                       "ns_mmd": mmd(self.canonical(), canonical, **options)}
            if self.anchor_seed is not None:
                results["wm_mmd"] = mmd(self.aligned(), self.align(samples), **wm_options)
        else:
            canonical_path = samples_path.with_name(f".{samples_path.stem}.canonical.safetensors")
            aligned_path = samples_path.with_name(f".{samples_path.stem}.aligned.safetensors")
            save_sample_set(canonical_path, canonical, {"experiment": self.exp.name})
            try:
                results = {"mmd": mmd(CheckpointFiles(self.paths), SampleSetFile(samples_path), **options),
                           "ns_mmd": mmd(CheckpointFiles(self.canonical_paths()), SampleSetFile(canonical_path), **options)}
                if self.anchor_seed is not None:
                    save_sample_set(aligned_path, self.align(samples), {"experiment": self.exp.name})
                    results["wm_mmd"] = mmd(CheckpointFiles(self._form_paths("aligned", self.align)),
                                            SampleSetFile(aligned_path), **wm_options)
            finally:
                canonical_path.unlink()
                aligned_path.unlink(missing_ok=True)
        out = {f"wm_mmd_{name}": math.nan for name in SUMMARIES}
        for prefix, result in results.items():
            for name in SUMMARIES:
                out[f"{prefix}_{name}"] = result.aggregate[name]
                if result.resampled:
                    out[f"{prefix}_{name}_ref_sd"] = float(result.resampled[name].std())
            if full and prefix != "wm_mmd":
                out[f"{prefix}_reject"] = result.reject_fraction
        return out


def _chunks(items: list[int], size: int) -> list[list[int]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def evaluate_repetition(exp: Experiment, ref: Reference, method: str, mode: str, r: int) -> dict[str, Any]:
    """The numbers of one repetition (the first with the reference's standard errors and the
    test); ``{"failed": reason}`` when its samples or predictions are unusable."""
    store = exp.store
    samples_path, preds_path = store.samples_path(method, mode, r), store.preds_path(method, mode, r)
    for path in (samples_path, preds_path):
        got = read_metadata(path).get("experiment")
        if got != exp.name:
            raise StoreError(f"{path}: holds samples of experiment {got!r}, expected {exp.name!r}; "
                             f"the store holds: {describe_store(exp)}")
    reference_id = ref.predictive()  # a damaged reference stops the stage (CorruptZooError), never a failed row
    try:
        samples = load_sample_set(samples_path)
        validate_tensors(samples, exp.model(), source=str(samples_path), leading=1)
        preds = load_sample_set(preds_path, ["id", "ood"])
        numbers: dict[str, Any] = {"n_samples": int(next(iter(samples.values())).shape[0])}
        numbers |= predictive_metrics(preds["id"], exp.test_tensors[1], preds["ood"], reference_id=reference_id)
    except (CheckpointError, ValueError) as err:
        log.error("%s/%s repetition %d marked failed: %s", method, mode, r, err)
        return {"failed": str(err)}
    numbers |= ref.mmd(samples_path, samples, full=r == 0)
    return numbers


def combine(row: dict[str, Any], repetitions: list[dict[str, Any]]) -> dict[str, Any]:
    """The metrics.csv row of ``row``'s unit from its repetitions' numbers: each measured value's
    mean and 95% half-width (the MMD ones widened by the reference's standard error)."""
    failed = [rep["failed"] for rep in repetitions if "failed" in rep]
    if failed:
        return {**row, "status": "failed", "reason": failed[0]}
    first = repetitions[0]
    row = {**row, "n_samples": first["n_samples"], "n_repetitions": len(repetitions),
           "mmd_reject": first.get("mmd_reject", math.nan), "ns_mmd_reject": first.get("ns_mmd_reject", math.nan)}
    for column in MEASURED:
        extra = first.get(f"{column}_ref_sd", math.nan) if column in MMD_COLUMNS else math.nan
        row[column], row[half_width(column)] = interval([rep[column] for rep in repetitions], extra)
    return row


def run(exp: Experiment) -> pd.DataFrame:
    """Evaluate every (method, mode) present in the store; write ``results/<exp>/metrics.csv``."""
    rows = available_rows(exp)
    if not rows:
        raise StoreError(f"nothing to evaluate for {exp.name}: no sample set with predictions; the store holds: {describe_store(exp)}")
    units, stale = {}, []
    for method, mode in rows:  # every missing or stale repetition is named before any work
        try:
            units[(method, mode)] = repetitions_of(exp, method, mode)
        except StaleSamplesError as err:
            stale.append(str(err))
    if stale:
        raise StaleSamplesError(" | ".join(stale))
    steps = [step.value for step in exp.config.evaluate.canonical_steps]
    ref = Reference(exp, steps)
    cache_dir = exp.store.base / "eval"
    code = code_fingerprint(EVALUATE_CODE)
    settings = {"resamples": exp.config.evaluate.reference_resamples, "test": exp.config.evaluate.test_permutations,
                "weight_matching": ref.anchor_seed}
    out = []
    bar = tqdm(total=sum(len(r) for r in units.values()), desc=f"evaluate {exp.name}", unit="repetition",
               dynamic_ncols=True)
    for (method, mode), repetitions in units.items():
        numbers = []
        for r in repetitions:
            paths = [exp.store.samples_path(method, mode, r), exp.store.preds_path(method, mode, r)]
            key = _fingerprint(paths, {"reference": ref.key, "code": code, "settings": settings})
            cached = cache_dir / f"{method}_{mode}_r{r}.json"
            hit = _cached_numbers(cached, key)
            if hit is not None:
                numbers.append(hit)
            else:
                numbers.append(evaluate_repetition(exp, ref, method, mode, r))
                atomic_write_text(cached, json.dumps({"key": key, "numbers": numbers[-1]}, default=_jsonable))
            bar.update()
        meta = read_metadata(exp.store.samples_path(method, mode, 0))
        label = meta.get("label") or (method_class(method).label if method in method_names() else method)
        row = {"experiment": exp.name, "experiment_label": exp.display_name, "method": method, "method_label": label,
               "mode": mode, "status": "ok", "reason": "", "ns_steps": "+".join(steps),
               "wm_anchor": "" if ref.anchor_seed is None else f"seed {ref.anchor_seed}"}
        out.append(combine(row, numbers))
    bar.close()
    path = exp.results_dir / "metrics.csv"
    frame = write_metrics(out, path)
    log.info("wrote %s (%d rows, reference of %d checkpoints)", path, len(frame), len(ref.seeds))
    return frame


def _cached_numbers(path: Path, key: str) -> dict[str, Any] | None:
    """The cached numbers at ``path`` if they were computed for ``key``; a damaged cache file counts as absent."""
    try:
        cached = json.loads(path.read_text())
        return _from_json(cached["numbers"]) if cached.get("key") == key else None
    except (OSError, ValueError, KeyError, AttributeError, TypeError):
        return None


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return None
    return float(value)


def _from_json(numbers: dict[str, Any]) -> dict[str, Any]:
    return {k: math.nan if v is None else v for k, v in numbers.items()}
