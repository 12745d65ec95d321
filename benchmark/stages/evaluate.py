"""Evaluate stage: for every method x mode in the store, raw and symmetry-free (NS) MMD against
the reference zoo plus the predictive metrics, into ``results/<experiment>/metrics.csv``.

The reference (the converged checkpoints of ``seeds.reference``) is canonicalised once and
cached in ``store/<experiment>/reference/`` with its ensemble predictive; each row is cached
in ``store/<experiment>/eval/`` keyed by the files it was computed from, so a second run
recomputes nothing.
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

from benchmark.experiment import Experiment, stable_hash
from benchmark.models import predict_with_weights
from benchmark.results import write_metrics
from benchmark.store import (
    CheckpointError,
    CheckpointFiles,
    SampleSetFile,
    StoreError,
    atomic_write_text,
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
from metrics.mmd import mmd
from metrics.predictive import predictive_metrics
from metrics.symmetries import canonicalize, spec_for_model

log = logging.getLogger(__name__)


def reference_seeds(exp: Experiment) -> list[int]:
    """Converged zoo seeds of ``seeds.reference``."""
    return exp.store.converged_seeds(exp.reference.start, exp.reference.stop)


def available_rows(exp: Experiment) -> list[tuple[str, str]]:
    """(method, mode) pairs whose sample set and predictions are both in the store: registered
    methods in registry order, then external ones, sorted."""
    store = exp.store
    found = set()
    for path in store.samples_dir.glob("*.safetensors") if store.samples_dir.is_dir() else ():
        method, _, mode = path.stem.rpartition("_")
        if mode in MODES and method and store.preds_path(method, mode).is_file():
            found.add((method, mode))
    registered = list(method_names())
    order = registered + sorted({m for m, _ in found} - set(registered))
    return sorted(found, key=lambda row: (order.index(row[0]), MODES.index(row[1])))


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
        self.exp = exp
        self.seeds = reference_seeds(exp)
        if len(self.seeds) < 2:
            raise StoreError(
                f"{exp.store.zoo_dir}: the reference needs at least 2 converged checkpoints in "
                f"seeds.reference={[exp.reference.start, exp.reference.stop]}, found {len(self.seeds)}; run "
                f"python -m benchmark stage=zoo experiment={exp.name} zoo.range=reference"
            )
        self.folder = exp.store.base / "reference"
        self.key = _fingerprint([], {"seeds": self.seeds, "steps": steps, "hash": exp.config_hash})
        self.steps = steps
        self.model = exp.model().to(exp.device)
        self.spec = spec_for_model(exp.model())
        n_params = sum(math.prod(shape) for shape in exp.shapes().values())
        limit = float(exp.config.evaluate.max_in_memory_gb)
        self.in_memory = len(self.seeds) * n_params * 4 <= limit * 2**30
        self.batch = max(1, int(limit * 2**30 // (8 * n_params * 4)))

    def _cached(self, name: str, build) -> dict[str, torch.Tensor]:
        path = self.folder / f"{name}.safetensors"
        if path.is_file() and read_metadata(path).get("key") == self.key:
            return load_sample_set(path)
        value = build()
        save_sample_set(path, value, {"key": self.key, "experiment": self.exp.name, "seeds": self.seeds})
        return value

    def weights(self) -> dict[str, torch.Tensor]:
        """Reference sample set ``{key: [R, ...]}`` (validated against the model)."""
        def build():
            paths = self.exp.store.checkpoint_paths(self.seeds)
            zoo = load_checkpoints_as_sample_set(paths)
            validate_tensors(zoo, self.exp.model(), source=str(self.exp.store.zoo_dir), leading=1)
            return zoo
        return self._cached("zoo", build)

    def canonical(self) -> dict[str, torch.Tensor]:
        """Symmetry-free reference ``{key: [R, ...]}``, computed once."""
        return self._cached("canonical", lambda: canonicalize(self.weights(), self.spec, self.steps, device=self.exp.device)[0])

    @property
    def paths(self) -> list[Path]:
        return self.exp.store.checkpoint_paths(self.seeds)

    def canonical_paths(self) -> list[Path]:
        """Streamed mode: one canonical checkpoint per reference seed, written once."""
        folder = self.folder / f"canonical-{self.key}"
        todo = [s for s in self.seeds if not (folder / f"{seed_name(s)}.safetensors").is_file()]
        paths = self.exp.store.checkpoint_paths(todo)
        for batch_seeds, batch in zip(_chunks(todo, self.batch), iter_checkpoint_batches(paths, self.batch)):
            canonical = canonicalize(batch, self.spec, self.steps, device=self.exp.device)[0]
            for i, seed in enumerate(batch_seeds):
                save_checkpoint(folder / f"{seed_name(seed)}.safetensors", unstack(canonical, i), {"seed": seed})
        return [folder / f"{seed_name(s)}.safetensors" for s in self.seeds]

    def predictive(self) -> torch.Tensor:
        """Zoo-ensemble predictive on the ID test set ``[N, C]``."""
        def build():
            images = self.exp.test_tensors[0]
            batches = [self.weights()] if self.in_memory else iter_checkpoint_batches(self.paths, self.batch)
            total = sum(predict_with_weights(self.model, b, images).double().sum(0) for b in batches)
            return {"id": (total / len(self.seeds))[None]}
        return self._cached("predictive", build)["id"][0]

    def mmd(self, samples_path: Path, samples: dict[str, torch.Tensor]) -> tuple[dict, dict]:
        """Aggregate raw and NS MMD (``{median, mean, max}`` each) of a method's samples."""
        device = self.exp.device
        canonical = canonicalize(samples, self.spec, self.steps, device=device)[0]
        if self.in_memory:
            return (mmd(self.weights(), samples, device=device).aggregate,
                    mmd(self.canonical(), canonical, device=device).aggregate)
        canonical_path = samples_path.with_name(f".{samples_path.stem}.canonical.safetensors")
        save_sample_set(canonical_path, canonical, {"experiment": self.exp.name})
        try:
            return (mmd(CheckpointFiles(self.paths), SampleSetFile(samples_path), device=device).aggregate,
                    mmd(CheckpointFiles(self.canonical_paths()), SampleSetFile(canonical_path), device=device).aggregate)
        finally:
            canonical_path.unlink()


def _chunks(items: list[int], size: int) -> list[list[int]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def evaluate_row(exp: Experiment, ref: Reference, method: str, mode: str) -> dict[str, Any]:
    """One metrics.csv row; a method whose samples or predictions are unusable is marked failed."""
    store = exp.store
    samples_path, preds_path = store.samples_path(method, mode), store.preds_path(method, mode)
    metas = []
    for path in (samples_path, preds_path):
        meta = read_metadata(path)
        if meta.get("experiment") != exp.name:
            raise StoreError(f"{path}: holds samples of experiment {meta.get('experiment')!r}, expected {exp.name!r}; "
                             f"the store holds: {describe_store(exp)}")
        metas.append(meta)
    label = metas[0].get("label") or (method_class(method).label if method in method_names() else method)
    row: dict[str, Any] = {"experiment": exp.name, "experiment_label": exp.display_name, "method": method,
                           "method_label": label, "mode": mode, "status": "ok", "reason": ""}
    try:
        samples = load_sample_set(samples_path)
        validate_tensors(samples, exp.model(), source=str(samples_path), leading=1)
        preds = load_sample_set(preds_path, ["id", "ood"])
        row["n_samples"] = int(next(iter(samples.values())).shape[0])
        metrics = predictive_metrics(preds["id"], exp.test_tensors[1], preds["ood"], reference_id=ref.predictive())
    except (CheckpointError, ValueError) as err:
        log.error("%s/%s marked failed: %s", method, mode, err)
        return {**row, "status": "failed", "reason": str(err)}
    raw, ns = ref.mmd(samples_path, samples)
    row.update({f"mmd_{k}": raw[k] for k in ("median", "mean", "max")})
    row.update({f"ns_mmd_{k}": ns[k] for k in ("median", "mean", "max")})
    row.update(metrics)
    return row


def run(exp: Experiment) -> pd.DataFrame:
    """Evaluate every (method, mode) present in the store; write ``results/<exp>/metrics.csv``."""
    rows = available_rows(exp)
    if not rows:
        raise StoreError(f"nothing to evaluate for {exp.name}: no sample set with predictions; the store holds: {describe_store(exp)}")
    steps = [step.value for step in exp.config.evaluate.canonical_steps]
    ref = Reference(exp, steps)
    cache_dir = exp.store.base / "eval"
    out = []
    for method, mode in tqdm(rows, desc=f"evaluate {exp.name}", unit="row", dynamic_ncols=True):
        key = _fingerprint([exp.store.samples_path(method, mode), exp.store.preds_path(method, mode)],
                           {"reference": ref.key, "label": exp.display_name})
        cached = cache_dir / f"{method}_{mode}.json"
        if cached.is_file() and json.loads(cached.read_text()).get("key") == key:
            out.append(json.loads(cached.read_text())["row"])
            continue
        row = evaluate_row(exp, ref, method, mode)
        atomic_write_text(cached, json.dumps({"key": key, "row": row}, default=_jsonable))
        out.append(row)
    path = exp.results_dir / "metrics.csv"
    frame = write_metrics(out, path)
    log.info("wrote %s (%d rows, reference of %d checkpoints)", path, len(frame), len(ref.seeds))
    return frame


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return None
    return float(value)
