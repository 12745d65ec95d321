"""The reference posterior of an experiment (the converged checkpoints of ``seeds.reference``),
its symmetry-free forms and its ensemble predictive, computed once and cached in
``store/<experiment>/reference/``, and the numbers of one repetition of a method scored
against it. Shared by the evaluate stage and the analyses.

Every cache is keyed by exactly what it depends on (ARCHITECTURE.md, "Caches"): the checkpoint
files it was made from (path, size, mtime), the settings that shape it, the code that computes
it (``code_fingerprint`` of the modules named in ``CODE``: a fix in ``metrics/symmetries``
rebuilds the canonical and aligned forms, not the predictive), the library versions, the device
type and the dtype. A cache whose key differs, or that fails validation, is rebuilt.

A zoo that fits in ``evaluate.max_in_memory_gb`` is held as one sample set; a larger one
(ResNet-18 zoos: ~45 MB per checkpoint) is streamed: MMD reads it layer by layer in column
blocks, and the canonical zoo is written checkpoint by checkpoint.
"""
from __future__ import annotations

import logging
import math
import uuid
from pathlib import Path
from typing import Any, Callable

import torch
from tqdm.auto import tqdm

from benchmark.core.fingerprint import code_fingerprint, stable_hash
from benchmark.core.models import predict_with_weights
from benchmark.core.store import (
    CheckpointError, CheckpointFiles, SampleSetFile, StoreError, Unit, check_file, iter_checkpoint_batches,
    load_checkpoints_as_sample_set, load_sample_set, read_metadata, save_checkpoint, save_sample_set, unstack,
    validate_tensors,
)
from benchmark.experiment import Experiment
from benchmark.inventory import corrupt_zoo_error, describe_store, pairing_problem, reference_seeds
from metrics.mmd import PermutationTestConfig, ReferenceResampling, mmd, reference_bandwidths
from metrics.predictive import predictive_metrics
from metrics.symmetries import align_to_anchor, canonicalize, spec_for_model

log = logging.getLogger(__name__)
SUMMARIES = ("median", "mean", "max")
DTYPE = torch.float32  # what the forms and the predictive are computed in
CODE = {
    "zoo": (),  # a copy of the checkpoints: the files and the library versions only
    "canonical": ("metrics.symmetries.canonical",),
    "aligned": ("metrics.symmetries.rebasin", "metrics.symmetries.canonical"),
    "predictive": ("benchmark.core.models.predict", "benchmark.core.models.registry"),
    "numbers": ("benchmark.reference", "metrics.mmd", "metrics.predictive"),
}
"""The modules whose code (and what it imports) computes each cache."""


def files_key(paths: list[Path]) -> list[tuple[str, int, int]]:
    """What identifies the versions of ``paths``: (path, size, mtime in ns) of each."""
    return [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in paths]


class Reference:
    """The reference zoo of ``exp`` with its cached forms (see the module docstring)."""

    def __init__(self, exp: Experiment) -> None:
        settings = exp.config.evaluate
        self.exp = exp
        self.steps = [step.value for step in settings.canonical_steps]
        self.resampling = ReferenceResampling(count=settings.reference_resamples) if settings.reference_resamples else None
        self.test = PermutationTestConfig(b1=settings.test_permutations, b2=settings.test_permutations) \
            if settings.test_permutations else None
        self.seeds = reference_seeds(exp)
        if len(self.seeds) < 2:
            raise StoreError(
                f"{exp.store.zoo_dir}: the reference needs at least 2 converged checkpoints in "
                f"seeds.reference={[exp.reference.start, exp.reference.stop]}, found {len(self.seeds)}; run "
                f"python -m benchmark stage=zoo experiment={exp.name} zoo.range=reference"
            )
        self.folder = exp.store.reference_dir
        self._checked: list[Path] | None = None
        self._bandwidths: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
        self.model = exp.model().to(exp.device)
        self.spec = spec_for_model(exp.model())
        n_params = sum(math.prod(shape) for shape in exp.shapes().values())
        limit = float(settings.max_in_memory_gb)
        self.in_memory = len(self.seeds) * n_params * 4 <= limit * 2**30
        self.batch = max(1, int(limit * 2**30 // (8 * n_params * 4)))
        # WM MMD's anchor: the lowest converged reference seed (seed 002's code aligns to the first network).
        self.anchor_seed = self.seeds[0] if settings.weight_matching else None
        self._inputs = {"files": files_key(exp.store.checkpoint_paths(self.seeds)), "seeds": self.seeds}

    def key(self, cache: str) -> str:
        """The key of cache ``cache`` (a name of ``CODE``): the input files, the settings that shape
        it, the code that computes it, the library versions (in the fingerprint), device and dtype."""
        shaping = {"zoo": {}, "canonical": {"steps": self.steps},
                   "aligned": {"steps": self.steps, "anchor": self.anchor_seed},
                   "predictive": {"config": self.exp.config_hash}}
        return stable_hash({"inputs": self._inputs, "cache": cache, "settings": shaping.get(cache, {}),
                            "code": code_fingerprint(CODE[cache]), "device": self.exp.device.type,
                            "dtype": str(DTYPE)}, length=20)

    def numbers_key(self, unit: Unit) -> str:
        """The key of the cached numbers of ``unit``: its two files, the reference's canonical and
        aligned keys, the evaluate settings, the scoring code."""
        settings = self.exp.config.evaluate
        store = self.exp.store
        return stable_hash({
            "files": files_key([store.samples_path(unit), store.preds_path(unit)]),
            "reference": [self.key(c) for c in ("zoo", "canonical", "aligned", "predictive")],
            "settings": {"resamples": settings.reference_resamples, "test": settings.test_permutations,
                         "weight_matching": self.anchor_seed, "steps": self.steps},
            "code": code_fingerprint(CODE["numbers"]), "device": self.exp.device.type,
        }, length=20)

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

    def _cached(self, name: str, build: Callable[[], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        path = self.folder / f"{name}.safetensors"
        key = self.key(name)
        try:
            if path.is_file() and read_metadata(path).get("key") == key:
                return load_sample_set(path)
        except CheckpointError as err:
            log.warning("%s; rebuilding this cache", err)
        value = build()
        save_sample_set(path, value, {"key": key, "experiment": self.exp.name, "seeds": self.seeds})
        return value

    def weights(self) -> dict[str, torch.Tensor]:
        """Reference sample set ``{key: [R, ...]}`` (validated against the model)."""
        def build():
            zoo = load_checkpoints_as_sample_set(self.checked_paths(), validated=True)
            validate_tensors(zoo, self.exp.model(), source=str(self.exp.store.zoo_dir), leading=1)
            return zoo
        return self._cached("zoo", build)

    def canonical(self) -> dict[str, torch.Tensor]:
        """Symmetry-free reference ``{key: [R, ...]}``, computed once."""
        return self._cached("canonical", lambda: self.canonicalize(self.weights()))

    def canonicalize(self, samples: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The NS form of a sample set: the ``evaluate.canonical_steps`` removed."""
        return canonicalize(samples, self.spec, self.steps, device=self.exp.device)[0]

    def canonical_paths(self) -> list[Path]:
        """Streamed mode: one canonical checkpoint per reference seed, written once."""
        return self._form_paths("canonical", self.canonicalize)

    def _form_paths(self, name: str, transform: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]) -> list[Path]:
        """Streamed mode: ``transform`` of every reference checkpoint, one file per seed, written once."""
        folder = self.folder / f"{name}-{self.key(name)}"
        store = self.exp.store
        stems = {s: store.seed_unit(s).stem for s in self.seeds}
        todo = [s for s in self.seeds if not (folder / f"{stems[s]}.safetensors").is_file()]
        checked = dict(zip(self.seeds, self.checked_paths()))
        paths = [checked[s] for s in todo]
        for batch_seeds, batch in zip(_chunks(todo, self.batch), iter_checkpoint_batches(paths, self.batch, validated=True)):
            form = transform(batch)
            for i, seed in enumerate(batch_seeds):
                save_checkpoint(folder / f"{stems[seed]}.safetensors", unstack(form, i), {"seed": seed})
        return [folder / f"{stems[s]}.safetensors" for s in self.seeds]

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
            batches = [self.weights()] if self.in_memory else iter_checkpoint_batches(self.checked_paths(), self.batch, validated=True)
            total = sum(predict_with_weights(self.model, b, images).double().sum(0) for b in batches)
            return {"id": (total / len(self.seeds))[None]}
        return self._cached("predictive", build)["id"][0]

    def shared_bandwidths(self, form: str) -> dict[str, dict[str, torch.Tensor]]:
        """The bandwidth grid per layer shared by every row (``metrics.mmd.reference_bandwidths``)
        of the raw zoo (``form="mmd"``) or the symmetry-free one (``"ns_mmd"``), computed once per
        ``Reference``: ``{layer: {"laplace": [10], "gaussian": [10]}}``."""
        if form not in self._bandwidths:
            if form not in ("mmd", "ns_mmd"):
                raise ValueError(f"shared_bandwidths: form must be 'mmd' or 'ns_mmd', got {form!r}")
            if self.in_memory:
                zoo = self.weights() if form == "mmd" else self.canonical()
            else:
                zoo = CheckpointFiles(self.checked_paths() if form == "mmd" else self.canonical_paths())
            self._bandwidths[form] = reference_bandwidths(zoo, device=self.exp.device)
        return self._bandwidths[form]

    def mmd(self, samples_path: Path, samples: dict[str, torch.Tensor], full: bool) -> dict[str, float]:
        """Raw and NS MMD of a method's samples: ``{mmd_median, ..., ns_mmd_max}``, and their
        medians with the bandwidths shared by every row (``mmd_shared_median``,
        ``ns_mmd_shared_median``; ``shared_bandwidths``); with ``full`` also the standard errors
        due to the reference (``<column>_ref_sd``, from its halves) and the fraction of layers
        MMDAgg's test rejects (``mmd_reject``, ``ns_mmd_reject``)."""
        options: dict[str, Any] = {"device": self.exp.device}
        if full:
            options |= {"resampling": self.resampling, "permutation_test": self.test}
        canonical = self.canonicalize(samples)
        wm_options = {k: v for k, v in options.items() if k != "permutation_test"}  # no test column for WM
        shared = {form: {"shared_bandwidths": self.shared_bandwidths(form)} for form in ("mmd", "ns_mmd")}
        if self.in_memory:
            results = {"mmd": mmd(self.weights(), samples, **options, **shared["mmd"]),
                       "ns_mmd": mmd(self.canonical(), canonical, **options, **shared["ns_mmd"])}
            if self.anchor_seed is not None:
                results["wm_mmd"] = mmd(self.aligned(), self.align(samples), **wm_options)
        else:
            private = uuid.uuid4().hex[:12]  # two evaluate runs on one store never share these files
            canonical_path = samples_path.with_name(f".{samples_path.stem}.canonical-{private}.safetensors")
            aligned_path = samples_path.with_name(f".{samples_path.stem}.aligned-{private}.safetensors")
            save_sample_set(canonical_path, canonical, {"experiment": self.exp.name})
            try:
                results = {"mmd": mmd(CheckpointFiles(self.checked_paths()), SampleSetFile(samples_path), **options,
                                      **shared["mmd"]),
                           "ns_mmd": mmd(CheckpointFiles(self.canonical_paths()), SampleSetFile(canonical_path), **options,
                                         **shared["ns_mmd"])}
                if self.anchor_seed is not None:
                    save_sample_set(aligned_path, self.align(samples), {"experiment": self.exp.name})
                    results["wm_mmd"] = mmd(CheckpointFiles(self._form_paths("aligned", self.align)),
                                            SampleSetFile(aligned_path), **wm_options)
            finally:
                canonical_path.unlink(missing_ok=True)
                aligned_path.unlink(missing_ok=True)
        out = {f"wm_mmd_{name}": math.nan for name in SUMMARIES}
        for prefix, result in results.items():
            for name in SUMMARIES:
                out[f"{prefix}_{name}"] = result.aggregate[name]
                if result.resampled:
                    out[f"{prefix}_{name}_ref_sd"] = float(result.resampled[name].std())
            if full and prefix != "wm_mmd":
                out[f"{prefix}_reject"] = result.reject_fraction
            if result.shared is not None:
                out[f"{prefix}_shared_median"] = result.shared.aggregate["median"]
                if result.shared.resampled:
                    out[f"{prefix}_shared_median_ref_sd"] = float(result.shared.resampled["median"].std())
        return out

    def score(self, unit: Unit, full: bool) -> dict[str, Any]:
        """The numbers of one repetition of a method (``full``: with the reference's standard
        errors and MMDAgg's test): predictive metrics against the zoo ensemble, raw, NS and WM MMD;
        ``{"failed": reason}`` when its samples or predictions are unusable. A damaged reference
        stops with ``CorruptZooError``, never a failed row."""
        store = self.exp.store
        samples_path, preds_path = store.samples_path(unit), store.preds_path(unit)
        metas = {}
        for path in (samples_path, preds_path):
            metas[path] = read_metadata(path)
            got = metas[path].get("experiment")
            if got != self.exp.name:
                raise StoreError(f"{path}: holds samples of experiment {got!r}, expected {self.exp.name!r}; "
                                 f"the store holds: {describe_store(self.exp)}")
        reference_id = self.predictive()
        try:
            mixed = pairing_problem(metas[samples_path], metas[preds_path], preds_path)
            if mixed is not None:
                raise CheckpointError(mixed)
            samples = load_sample_set(samples_path)
            validate_tensors(samples, self.exp.model(), source=str(samples_path), leading=1)
            preds = load_sample_set(preds_path, ["id", "ood"])
            numbers: dict[str, Any] = {"n_samples": int(next(iter(samples.values())).shape[0])}
            numbers |= predictive_metrics(preds["id"], self.exp.test_tensors[1], preds["ood"], reference_id=reference_id)
        except (CheckpointError, ValueError) as err:
            log.error("%s marked failed: %s", unit.label, err)
            return {"failed": str(err)}
        return numbers | self.mmd(samples_path, samples, full=full)


def _chunks(items: list[int], size: int) -> list[list[int]]:
    return [items[i : i + size] for i in range(0, len(items), size)]
