"""The zoo reference (``reference=zoo``, always evaluated: the paper's reference): the converged
checkpoints of ``seeds.reference``, its symmetry-free forms and its ensemble predictive, computed
once and cached in ``store/<experiment>/reference/``, and the numbers of one repetition of a method
scored against it. Shared by the evaluate stage and the analyses; the other references
(``benchmark.references``: HMC's draws, another store's zoo) score with the same machinery.

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

from benchmark.core.fingerprint import source_fingerprint, stable_hash
from benchmark.core.models import fit_with_weights
from benchmark.core.training.predict import predict_samples
from benchmark.core.training import squared_norm, training_potential
from benchmark.core.store import (
    CheckpointError, CheckpointFiles, SampleSetFile, StoreError, Unit, check_file, clear_non_file,
    content_digest,
    iter_checkpoint_batches,
    load_checkpoints_as_sample_set, load_sample_set, read_metadata, save_checkpoint, save_sample_set, unstack,
    validate_tensors,
)
from benchmark.experiment import Experiment
from benchmark.inventory import (
    ReferenceRecipe, corrupt_zoo_error, describe_store, pairing_problem, reference_recipe, reference_seeds,
)
from metrics.mmd import MMDInputError, PermutationTestConfig, ReferenceResampling, reference_bandwidths
from metrics.row import Forms, ScoreOptions, score_row
from metrics.symmetries import align_to_anchor, canonicalize, spec_for_model

log = logging.getLogger(__name__)
DTYPE = torch.float32  # what the forms and the predictive are computed in
CACHES = ("zoo", "canonical", "aligned", "predictive")
"""The reference's caches that a row's numbers are computed from (``Reference.key``, ``numbers_key``);
each keyed by the whole source (``source_fingerprint``). ``potential`` (``training_potential``) is
keyed the same way but describes the reference, not a row."""
ZOO_ROW = ("zoo", "multi")
"""The zoo's own row against another reference (HMC): blocks of reference checkpoints scored as samples."""


def files_key(paths: list[Path]) -> list[tuple[str, str]]:
    """What identifies the versions of ``paths``, with no absolute path: each file's name in its
    folder (``zoo/seed_000042.safetensors``) and its content digest (``store.content_digest`` of its
    checksums), or its size and mtime for a file without checksums or with a damaged header (then
    refused by the validation that follows)."""
    out = []
    for path in paths:
        try:
            digest = content_digest(read_metadata(path))
        except CheckpointError:
            digest = None
        if digest is None:
            stat = path.stat()
            digest = f"size {stat.st_size} mtime {stat.st_mtime_ns}"
        out.append((f"{path.parent.name}/{path.name}", digest))
    return out


class Reference:
    """The reference zoo of ``exp`` with its cached forms (see the module docstring).

    ``source``: the experiment whose store holds the zoo (default ``exp`` itself; another store's
    zoo: ``benchmark.references.other_zoo``); ``exp``: the experiment whose samples are scored
    (its model, data and evaluate settings). ``folder``: where the forms are cached (default the
    source store's ``reference/``)."""

    name = "zoo"
    """Which reference this is (metrics.csv's ``reference`` column; ``benchmark.references.REFERENCES``)."""

    def __init__(self, exp: Experiment, source: Experiment | None = None, folder: Path | None = None) -> None:
        settings = exp.config.evaluate
        self._scoring(exp)
        source = exp if source is None else source
        self.source = source
        self.seeds = reference_seeds(source)
        if len(self.seeds) < 2:
            raise StoreError(
                f"{source.store.zoo_dir}: the reference needs at least 2 converged checkpoints in "
                f"seeds.reference={[source.reference.start, source.reference.stop]}, found {len(self.seeds)}; run "
                f"python -m benchmark stage=zoo experiment={source.name} store={source.config.store} zoo.range=reference"
            )
        self.folder = source.store.reference_dir if folder is None else folder
        self._checked: list[Path] | None = None
        n_params = sum(math.prod(shape) for shape in exp.shapes().values())
        limit = float(settings.max_in_memory_gb)
        self.in_memory = len(self.seeds) * n_params * 4 <= limit * 2**30
        self.batch = max(1, int(limit * 2**30 // (8 * n_params * 4)))
        # WM MMD's anchor: the lowest converged reference seed (seed 002's code aligns to the first network).
        self.anchor_seed = self.seeds[0] if settings.weight_matching else None
        self._inputs = {"files": files_key(source.store.checkpoint_paths(self.seeds)), "seeds": self.seeds}
        self.recipe: ReferenceRecipe | None = reference_recipe(source)
        """The recipes the checkpoints were trained under (metrics.csv's ``reference_config_hash``)."""

    needs = "the converged reference checkpoints of seeds.reference (stage=zoo zoo.range=reference)"
    """What the reference reads from the store (named in ``problem``'s message)."""
    scores_zoo = False
    """Whether the zoo itself gets a row against this reference (``ZOO_ROW``: blocks of zoo checkpoints)."""

    @classmethod
    def problem(cls, exp: Experiment) -> str | None:
        """Why the store cannot give this reference, with the command that makes what is missing;
        ``None`` when it can. The zoo's completeness is checked by the evaluate stage (its
        ``evaluate.allow_partial`` and recipe rules), so ``None`` here."""
        return None

    @classmethod
    def build(cls, exp: Experiment) -> "Reference":
        """The scoring object of ``exp`` against this reference (its settings: ``exp.config.reference``)."""
        return cls(exp)

    def against(self, unit: Unit) -> "Reference":
        """What ``unit``'s samples are scored against: this reference (HMC leaves an HMC unit's own draws out)."""
        return self

    def health(self) -> str | None:
        """One log line on how trustworthy the reference itself is (HMC: how well its chains mixed),
        or ``None`` when there is nothing to say (a zoo)."""
        return None

    def _scoring(self, exp: Experiment) -> None:
        """What every reference scores with: the evaluate settings, the model and its symmetries."""
        settings = exp.config.evaluate
        self.exp = exp
        self.steps = [step.value for step in settings.canonical_steps]
        self.resampling = ReferenceResampling(count=settings.reference_resamples) if settings.reference_resamples else None
        self.test = PermutationTestConfig(b1=settings.test_permutations, b2=settings.test_permutations) \
            if settings.test_permutations else None
        self._bandwidths: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
        self._description: dict[str, float] | None = None
        self._forms: dict[bool, Forms] = {}
        self.model = exp.model().to(exp.device)
        self.spec = spec_for_model(exp.model())

    @property
    def size(self) -> int:
        """The number of networks in the reference (metrics.csv's ``n_reference``)."""
        return len(self.seeds)

    def key(self, cache: str) -> str:
        """The key of cache ``cache`` (one of ``CACHES``): the input files, the settings that shape
        it, the whole computational source and the library versions (``source_fingerprint``), device
        and dtype."""
        shaping = {"zoo": {}, "canonical": {"steps": self.steps},
                   "aligned": {"steps": self.steps, "anchor": self.anchor_seed},
                   "predictive": {"config": self.exp.config_hash},
                   "potential": {"config": self.exp.config_hash,
                                 "checkpoints": self.exp.config.evaluate.potential_checkpoints}}
        return stable_hash({"inputs": self._inputs, "cache": cache, "settings": shaping.get(cache, {}),
                            "code": source_fingerprint(), "device": self.exp.device.type,
                            "dtype": str(DTYPE)}, length=20)

    def numbers_key(self, unit: Unit) -> str:
        """The key of the cached numbers of ``unit``: its two files, the reference's canonical and
        aligned keys, the evaluate settings, the scoring code."""
        store = self.exp.store
        return self.files_numbers_key([store.samples_path(unit), store.preds_path(unit)])

    def files_numbers_key(self, paths: list[Path]) -> str:
        """The key of the cached numbers of samples read from ``paths`` (see ``numbers_key``)."""
        settings = self.exp.config.evaluate
        return stable_hash({
            "files": files_key(paths), "against": self.name,
            "reference": [self.key(c) for c in CACHES],
            "settings": {"resamples": settings.reference_resamples, "test": settings.test_permutations,
                         "weight_matching": self.anchor_seed, "steps": self.steps},
            "code": source_fingerprint(), "device": self.exp.device.type,
        }, length=20)

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

    def canonicalize(self, samples: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The NS form of a sample set: the ``evaluate.canonical_steps`` removed."""
        return canonicalize(samples, self.spec, self.steps, device=self.exp.device)[0]

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

    def align(self, samples: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The WM form of ``samples``: the NS steps with the permutation removed by weight matching
        to the anchor checkpoint instead of sorting (``metrics.symmetries.align_to_anchor``)."""
        anchor = load_checkpoints_as_sample_set(self.source.store.checkpoint_paths([self.anchor_seed]))
        return align_to_anchor(samples, self.spec, anchor, self.steps)[0]

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

    def shared_bandwidths(self, form: str) -> dict[str, dict[str, torch.Tensor]]:
        """The bandwidth grid per layer shared by every row (``metrics.mmd.reference_bandwidths``)
        of the raw zoo (``form="mmd"``) or the symmetry-free one (``"ns_mmd"``), computed once per
        ``Reference``: ``{layer: {"laplace": [10], "gaussian": [10]}}``."""
        if form not in self._bandwidths:
            if form not in ("mmd", "ns_mmd"):
                raise ValueError(f"shared_bandwidths: form must be 'mmd' or 'ns_mmd', got {form!r}")
            if self.in_memory:
                zoo = self.weights() if form == "mmd" else self.canonical()
                self._bandwidths[form] = reference_bandwidths(zoo, device=self.exp.device)
            else:
                self._bandwidths[form] = self._healing(lambda: reference_bandwidths(
                    CheckpointFiles(self.checked_paths() if form == "mmd" else self.canonical_paths()),
                    device=self.exp.device))
        return self._bandwidths[form]

    def options(self, full: bool) -> ScoreOptions:
        """How a row's MMD is measured (``metrics.row.ScoreOptions``): on the experiment's device; with
        ``full``, the reference's random halves (``evaluate.reference_resamples``) and MMDAgg's test
        (``evaluate.test_permutations``)."""
        return ScoreOptions(device=self.exp.device, resampling=self.resampling if full else None,
                            permutation_test=self.test if full else None)

    def forms(self, weight_matching: bool = True) -> Forms:
        """The reference's forms for ``metrics.row.score_row``: its raw, symmetry-free and (with an
        anchor and ``weight_matching``) weight-matched networks, in memory or as the streamed
        checkpoint files, its predictive and the shared bandwidth grids."""
        shared = {form: self.shared_bandwidths(form) for form in ("mmd", "ns_mmd")}
        matching = self.anchor_seed is not None and weight_matching
        if self.in_memory:
            if matching not in self._forms:  # read from the caches once per scoring object
                self._forms[matching] = Forms(self.weights(), self.canonical(), self.aligned() if matching else None,
                                              self.predictive(), shared)
            return self._forms[matching]
        return Forms(CheckpointFiles(self.checked_paths()), CheckpointFiles(self.canonical_paths()),
                     CheckpointFiles(self._form_paths("aligned", self.align)) if matching else None, self.predictive(),
                     shared)

    def score(self, unit: Unit, full: bool) -> dict[str, Any]:
        """The numbers of one repetition of a method (``full``: with the reference's standard
        errors and MMDAgg's test): ``score_samples`` of its stored samples and predictions;
        ``{"failed": reason}`` when they are unusable. A damaged reference stops with
        ``CorruptZooError``, never a failed row."""
        store = self.exp.store
        samples_path, preds_path = store.samples_path(unit), store.preds_path(unit)
        metas = {}
        for path in (samples_path, preds_path):
            metas[path] = read_metadata(path)
            got = metas[path].get("experiment")
            if got != self.exp.name:
                raise StoreError(f"{path}: holds samples of experiment {got!r}, expected {self.exp.name!r}; "
                                 f"the store holds: {describe_store(self.exp)}")
        self.forms()  # a damaged reference stops here, not as a failed row
        try:
            mixed = pairing_problem(metas[samples_path], metas[preds_path], preds_path)
            if mixed is not None:
                raise CheckpointError(mixed)
            samples = load_sample_set(samples_path)
            validate_tensors(samples, self.exp.model(), source=str(samples_path), leading=1)
            preds = load_sample_set(preds_path, ["id", "ood"])
            return self.score_samples(samples, preds, full=full, path=samples_path)
        except MMDInputError:  # the reference cannot be compared at all (e.g. too small to halve): every row would fail
            raise
        except (CheckpointError, ValueError) as err:
            log.error("%s marked failed: %s", unit.label, err)
            return {"failed": str(err)}

    def score_samples(self, samples: dict[str, torch.Tensor], preds: dict[str, torch.Tensor], full: bool,
                      weight_matching: bool = True, path: Path | None = None) -> dict[str, Any]:
        """The numbers of a sample set ``{key: [S, ...]}`` and its predictions (``{"id": [S, N, C],
        "ood": [S, M, C]}``) against this reference (``metrics.row.score_row``: the predictive metrics
        against its predictive, raw, NS and WM MMD, and with ``full`` the ``*_ref_sd`` and ``*_reject``
        columns). ``weight_matching=False`` leaves the WM columns NaN even where the reference has an
        anchor (the baselines: matching their draws to the anchor costs more than the rest of their
        numbers, and they are not ranked by it). ``path``: the file ``samples`` were read from, which
        a streamed reference reads in column blocks (``None``: a private copy, removed after)."""
        matching = self.anchor_seed is not None and weight_matching
        options, labels = self.options(full), self.exp.test_tensors[1]
        canonical = self.canonicalize(samples)
        if self.in_memory:
            forms = Forms(samples, canonical, self.align(samples) if matching else None)
            return score_row(self.forms(weight_matching), forms, options, preds, labels).row
        private = uuid.uuid4().hex[:12]  # two evaluate runs on one store never share these files
        folder = self.exp.store.eval_dir if path is None else path.parent
        stem = "scored" if path is None else path.stem
        own = [folder / f".{stem}.{form}-{private}.safetensors" for form in ("raw", "canonical", "aligned")]
        folder.mkdir(parents=True, exist_ok=True)
        try:
            if path is None:
                save_sample_set(own[0], samples, {"experiment": self.exp.name})
            save_sample_set(own[1], canonical, {"experiment": self.exp.name})
            if matching:
                save_sample_set(own[2], self.align(samples), {"experiment": self.exp.name})
            forms = Forms(SampleSetFile(path or own[0]), SampleSetFile(own[1]), SampleSetFile(own[2]) if matching else None)
            return self._healing(lambda: score_row(self.forms(weight_matching), forms, options, preds, labels)).row
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
