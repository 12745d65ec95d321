"""The zoo reference (``reference=zoo``, always evaluated: the paper's reference): the converged
checkpoints of ``seeds.reference``, its symmetry-free forms and its ensemble predictive, computed
once and cached in ``store/<experiment>/reference/``, and the numbers of one repetition of a method
scored against it (``ZooReference``, a ``benchmark.references.base.Reference``: the contract).
Shared by the evaluate stage and the analyses; another store's zoo (``other_zoo``) is this class
with another source.

Every cache is keyed by everything it is made from (ARCHITECTURE.md, "Caches"): the identity of
each file it was made from (its name in the store and its content digest: no absolute path, so a
moved store keeps its caches), the settings that shape it, the **whole computational source**
(``source_fingerprint``: any edit of ``metrics/``, ``methods/``, ``benchmark/core/`` or this
package recomputes every cache: they are cheap, and no module reached only through data, such as
the symmetry specs of ``metrics/symmetries/architectures.py``, can be left out of the key), the
library versions, the device type and the dtype. A cache whose key differs, or that fails
validation, is rebuilt.

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

from benchmark.core.models import fit_with_weights
from benchmark.core.store import (
    CheckpointError, CheckpointFiles, ExperimentStore, SampleSetFile, StoreError, check_file, clear_non_file,
    iter_checkpoint_batches, load_checkpoints_as_sample_set, load_sample_set, read_metadata, save_checkpoint,
    save_sample_set, unstack, validate_tensors,
)
from benchmark.core.training import squared_norm, training_potential
from benchmark.core.training.predict import predict_samples
from benchmark.experiment import Experiment
from benchmark.inventory import ReferenceRecipe, corrupt_zoo_error, reference_recipe, reference_seeds
from benchmark.references.base import Reference, files_key
from metrics.mmd import reference_bandwidths
from metrics.row import Forms, score_row

log = logging.getLogger(__name__)
ZOO_ROW = ("zoo", "multi")
"""The zoo's own row against another reference (one whose ``scores_zoo``): blocks of reference checkpoints scored as samples."""
FORM_FOLDERS = ("canonical", "aligned")
"""The forms a streamed zoo writes checkpoint by checkpoint, each in ``<form>-<key>/`` of its cache folder."""


class ZooReference(Reference):
    """The reference zoo of ``exp`` with its cached forms (see the module docstring).

    ``source``: the experiment whose store holds the zoo (default ``exp`` itself; another store's
    zoo: ``benchmark.references.other_zoo``); ``exp``: the experiment whose samples are scored
    (its model, data and evaluate settings). ``folder``: where the forms are cached (default the
    source store's ``reference/``)."""

    name = "zoo"
    order = 0  # first: every run is evaluated against it
    needs = "the converged reference checkpoints of seeds.reference (stage=zoo zoo.range=reference)"
    own_row = ZOO_ROW

    def __init__(self, exp: Experiment, source: Experiment | None = None, folder: Path | None = None) -> None:
        settings = exp.config.evaluate
        source = exp if source is None else source
        self.source = source
        self.seeds = reference_seeds(source)
        if len(self.seeds) < 2:
            raise StoreError(
                f"{source.store.zoo_dir}: the reference needs at least 2 converged checkpoints in "
                f"seeds.reference={[source.reference.start, source.reference.stop]}, found {len(self.seeds)}; run "
                f"python -m benchmark stage=zoo experiment={source.name} store={source.config.store} zoo.range=reference"
            )
        super().__init__(exp, {"files": files_key(source.store.checkpoint_paths(self.seeds)), "seeds": self.seeds})
        self.folder = source.store.reference_dir if folder is None else folder
        self._checked: list[Path] | None = None
        self._description: dict[str, float] | None = None
        n_params = sum(math.prod(shape) for shape in exp.shapes().values())
        limit = float(settings.max_in_memory_gb)
        self.in_memory = len(self.seeds) * n_params * 4 <= limit * 2**30
        self.batch = max(1, int(limit * 2**30 // (8 * n_params * 4)))
        # WM MMD's anchor: the lowest converged reference seed (seed 002's code aligns to the first network).
        self.anchor_seed = self.seeds[0] if settings.weight_matching else None
        self.recipe: ReferenceRecipe | None = reference_recipe(source)

    @classmethod
    def cache_folder(cls, store: ExperimentStore) -> Path | None:
        """``store/<experiment>/reference/``."""
        return store.reference_dir

    def current_caches(self) -> set[str]:
        """The streamed forms' folders of the current keys (``canonical-<key>``, ``aligned-<key>``)."""
        return {f"{name}-{self.key(name)}" for name in FORM_FOLDERS}

    @property
    def size(self) -> int:
        """The number of networks in the reference (metrics.csv's ``n_reference``)."""
        return len(self.seeds)

    def checked_paths(self) -> list[Path]:
        """The reference checkpoints, each validated whole once (checksum, keys and shapes, finite
        values, experiment and seed); raises ``CorruptZooError`` naming every damaged one."""
        if self._checked is None:
            source = self.source
            paths, shapes, problems = source.store.checkpoint_paths(self.seeds), source.shapes(), {}
            for seed, path in tqdm(list(zip(self.seeds, paths)), desc=f"validate reference {source.name}",
                                   unit="file", dynamic_ncols=True, disable=len(paths) < 50):
                try:
                    check_file(path, shapes, expect={"experiment": source.name, "seed": str(seed)})
                except CheckpointError as err:
                    problems[path] = str(err)
            if problems:
                raise corrupt_zoo_error(source, problems, "reference checkpoint(s)")
            self._checked = paths
        return self._checked

    def _cached(self, name: str, build: Callable[[], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        path = self.folder / f"{name}.safetensors"
        key = self.key(name)
        _clear(path)
        try:
            if path.is_file() and read_metadata(path).get("key") == key:
                return load_sample_set(path)
        except CheckpointError as err:
            log.warning("%s; rebuilding this cache", err)
        value = build()
        inputs = {"config_hashes": list(self.recipe.config_hashes)} if self.recipe is not None else {}
        save_sample_set(path, value, {"key": key, "experiment": self.source.name, "seeds": self.seeds, **inputs})
        return value

    def weights(self) -> dict[str, torch.Tensor]:
        """Reference sample set ``{key: [R, ...]}`` (validated against the model)."""
        def build():
            zoo = load_checkpoints_as_sample_set(self.checked_paths(), validated=True)
            validate_tensors(zoo, self.exp.model(), source=str(self.source.store.zoo_dir), leading=1)
            return zoo
        return self._cached("zoo", build)

    def canonical(self) -> dict[str, torch.Tensor]:
        """Symmetry-free reference ``{key: [R, ...]}``, computed once."""
        return self._cached("canonical", lambda: self.canonicalize(self.weights()))

    def canonical_paths(self) -> list[Path]:
        """Streamed mode: one canonical checkpoint per reference seed, written once."""
        return self._form_paths("canonical", self.canonicalize)

    def _form_paths(self, name: str, transform: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]) -> list[Path]:
        """Streamed mode: ``transform`` of every reference checkpoint, one file per seed, written once."""
        folder = self.folder / f"{name}-{self.key(name)}"
        store = self.source.store
        stems = {s: store.seed_unit(s).stem for s in self.seeds}
        for seed in self.seeds:
            _clear(folder / f"{stems[seed]}.safetensors")
        todo = [s for s in self.seeds if not (folder / f"{stems[s]}.safetensors").is_file()]
        checked = dict(zip(self.seeds, self.checked_paths()))
        paths = [checked[s] for s in todo]
        for batch_seeds, batch in zip(_chunks(todo, self.batch), iter_checkpoint_batches(paths, self.batch, validated=True)):
            form = transform(batch)
            for i, seed in enumerate(batch_seeds):
                save_checkpoint(folder / f"{stems[seed]}.safetensors", unstack(form, i),
                                {"seed": seed, "source": files_key([checked[seed]])[0][1]})
        return [folder / f"{stems[s]}.safetensors" for s in self.seeds]

    def _healing(self, compute: Callable[[], Any]) -> Any:
        """``compute()`` (which reads the streamed forms), again after removing each form file it
        finds damaged (bit flip, truncation, NaN: ``CheckpointError.path`` in a form folder, one
        log line naming it), which ``_form_paths`` then rebuilds. A damaged reference checkpoint
        is not a cache: its error goes on."""
        for _ in range(len(self.seeds) + 1):
            try:
                return compute()
            except CheckpointError as err:
                path = Path(err.path) if err.path is not None else None
                if path is None or path.parent.parent != self.folder or not path.parent.name.startswith(("canonical-", "aligned-")):
                    raise
                log.warning("%s; removing this cache file and rebuilding it", err)
                path.unlink(missing_ok=True)
        return compute()

    def anchor(self) -> dict[str, torch.Tensor]:
        """The anchor checkpoint ``{key: [1, ...]}`` (``anchor_seed``: the lowest converged reference seed)."""
        return self._remember("anchor", lambda: load_checkpoints_as_sample_set(
            self.source.store.checkpoint_paths([self.anchor_seed])))

    def aligned(self) -> dict[str, torch.Tensor]:
        """The WM form of the reference ``{key: [R, ...]}``, computed once."""
        return self._cached("aligned", lambda: self.align(self.weights()))

    def predictive(self) -> torch.Tensor:
        """Zoo-ensemble predictive on the ID test set ``[N, C]``."""
        def build():
            images = self.exp.test_tensors[0]
            batches = [self.weights()] if self.in_memory else iter_checkpoint_batches(self.checked_paths(), self.batch, validated=True)
            total = sum(predict_samples(self.model, b, images).double().sum(0) for b in batches)
            return {"id": (total / len(self.seeds))[None]}
        return self._cached("predictive", build)["id"][0]

    def training_potential(self) -> dict[str, torch.Tensor]:
        """How far the reference is from a T = 1 posterior: for each of the first
        ``evaluate.potential_checkpoints`` converged reference checkpoints (0: all), its training
        potential ``U = sum_i CE(f_w(x_i), y_i) + (N weight_decay / 2) |w|^2`` over the parameters
        (nats, the un-augmented training split of N images: HMC's potential at T = 1) and its
        training accuracy (fraction); ``{"potential": [R'], "train_acc": [R']}`` (float64), cached.
        Under the posterior exp(-U) a spread of hundreds of nats would put nearly all the mass on
        one checkpoint: the zoo is an SGD ensemble, not draws from that posterior."""
        def build():
            count = self.exp.config.evaluate.potential_checkpoints
            paths = self.checked_paths()[: count or None]
            images, labels = self.exp.train_tensors
            parameters = [name for name, _ in self.exp.model().named_parameters()]
            potentials, accuracies = [], []
            batches = iter_checkpoint_batches(paths, self.batch, validated=True)
            for batch in tqdm(batches, desc=f"training potential of the {self.exp.name} zoo", unit="batch",
                              total=math.ceil(len(paths) / self.batch), dynamic_ncols=True, disable=len(paths) < 200):
                nll, correct = fit_with_weights(self.model, batch, images, labels)
                potentials.append(training_potential(nll, squared_norm(batch, parameters), len(labels),
                                                     self.exp.recipe.weight_decay))
                accuracies.append(correct.double() / len(labels))
            return {"potential": torch.cat(potentials)[None], "train_acc": torch.cat(accuracies)[None]}
        return {k: v[0] for k, v in self._cached("potential", build).items()}

    def description(self) -> dict[str, float]:
        """What the reference is, for metrics.csv's ``REFERENCE_COLUMNS``: the 5th/50th/95th
        percentiles of its checkpoints' training potential (nats; ``training_potential``), their
        median training accuracy (fraction) and how many checkpoints were measured; computed once."""
        if self._description is None:
            measured = self.training_potential()
            potential = measured["potential"].double()
            levels = torch.tensor([0.05, 0.5, 0.95], dtype=torch.float64, device="cpu")
            low, median, high = (float(q) for q in torch.quantile(potential, levels))
            self._description = {"reference_potential_p05": low, "reference_potential_median": median,
                                 "reference_potential_p95": high,
                                 "reference_train_acc": float(measured["train_acc"].double().median()),
                                 "reference_potential_n": float(len(potential))}
        return self._description

    def _bandwidth_grid(self, form: str) -> dict[str, dict[str, torch.Tensor]]:
        if self.in_memory:
            return super()._bandwidth_grid(form)
        return self._healing(lambda: reference_bandwidths(
            CheckpointFiles(self.checked_paths() if form == "mmd" else self.canonical_paths()), device=self.exp.device))

    def forms(self, weight_matching: bool = True) -> Forms:
        """As ``Reference.forms``; a streamed zoo gives its checkpoint files and its forms' files."""
        if self.in_memory:
            return super().forms(weight_matching)
        matching = self.anchor_seed is not None and weight_matching
        shared = {form: self.shared_bandwidths(form) for form in ("mmd", "ns_mmd")}
        return Forms(CheckpointFiles(self.checked_paths()), CheckpointFiles(self.canonical_paths()),
                     CheckpointFiles(self._form_paths("aligned", self.align)) if matching else None, self.predictive(),
                     shared)

    def score_samples(self, samples: dict[str, torch.Tensor], preds: dict[str, torch.Tensor], full: bool,
                      weight_matching: bool = True, path: Path | None = None) -> dict[str, Any]:
        """As ``Reference.score_samples``; a streamed zoo reads the samples' forms from files in column
        blocks (``path``, the file ``samples`` were read from, and private files of their NS and WM
        forms, removed after; ``path=None``: a private copy of the samples too)."""
        if self.in_memory:
            return super().score_samples(samples, preds, full, weight_matching, path)
        matching = self.anchor_seed is not None and weight_matching
        options, labels = self.options(full), self.exp.test_tensors[1]
        private = uuid.uuid4().hex[:12]  # two evaluate runs on one store never share these files
        folder = self.exp.store.eval_dir if path is None else path.parent
        stem = "scored" if path is None else path.stem
        own = [folder / f".{stem}.{form}-{private}.safetensors" for form in ("raw", "canonical", "aligned")]
        folder.mkdir(parents=True, exist_ok=True)
        try:
            if path is None:
                save_sample_set(own[0], samples, {"experiment": self.exp.name})
            save_sample_set(own[1], self.canonicalize(samples), {"experiment": self.exp.name})
            if matching:
                save_sample_set(own[2], self.align(samples), {"experiment": self.exp.name})
            forms = Forms(SampleSetFile(path or own[0]), SampleSetFile(own[1]), SampleSetFile(own[2]) if matching else None)
            return self._healing(lambda: score_row(self.forms(weight_matching), forms, options, preds, labels)).numbers(full)
        finally:
            for file in own:
                file.unlink(missing_ok=True)


def _clear(path: Path) -> None:
    """Remove a directory, dangling symlink or symlink loop standing in place of cache file
    ``path`` (``store.clear_non_file``), with one log line naming it: the cache is rebuilt."""
    removed = clear_non_file(path)
    if removed:
        log.warning("%s; rebuilding this cache", removed)


def _chunks(items: list[int], size: int) -> list[list[int]]:
    return [items[i : i + size] for i in range(0, len(items), size)]
