"""The contract of a reference: what the suite gives a reference plug-in and what it gets back.

A reference, a concrete subclass of the abstract ``Reference`` (e.g. ``ZooReference(exp)``), is,
like laplace-torch's ``Laplace(model, ...)``, built from what it needs and then answers every
scoring question about itself:

What you give: ``exp``, the experiment whose samples are scored (its model, its data, its
``evaluate`` settings: the NS steps, the reference's random halves, MMDAgg's test, the device)
and, in ``exp.config.reference``, the reference's own typed settings (``Settings``). A subclass
reads what it needs from the store (``needs``; ``problem`` says why a store cannot give it, with
the command that makes it).

What you get: an object whose

- ``forms()`` are its networks in the coordinates the rows compare (``metrics.row.Forms``: raw,
  symmetry-free, weight-matched where it has an anchor), with its ensemble ``predictive()`` on the
  ID test split ``[N, C]`` and the bandwidth grids shared by every row (``shared_bandwidths``);
- ``score(unit, full)`` and ``score_samples(samples, preds, full)`` give a repetition's row
  (``metrics.row.score_row``, the suite's one scoring function), ``{"failed": reason}`` for a
  unit whose files are unusable;
- ``numbers_key`` / ``files_numbers_key`` key the cached numbers of a row against it;
- ``size``, ``recipe``, ``steps``, ``anchor_seed`` and ``description()`` fill metrics.csv's
  columns that say what it is; ``health()`` one log line on how far to trust it;
- ``against(unit)`` is what a unit is scored against (a reference pooled from a method's draws
  leaves a unit's own draws out).

And, as a plug-in (class attributes and class methods, read without building it):

- ``name`` (metrics.csv's ``reference`` column, ``reference=<name>``), ``Settings`` (its typed
  settings, ``conf/reference/<name>.yaml``, read by the schema, ``benchmark.loader``), ``needs``, ``scores_zoo`` (whether the zoo gets a
  row against it), ``own_row`` (its own networks' row, never ranked), ``drawn_by(exp)`` (whether
  ``exp``'s sample stage makes its inputs);
- ``cache_folder(store)`` and ``current_caches()``: where it caches forms on disk, which
  ``stage=verify`` checks (and which folders there the current keys use);
- ``hooks``: the modules of its report hooks (``ReportHooks``: the extra table and findings
  section of the report stage, the extra analysis of the analyze stage), found by name so that
  the report and the analyses, above this layer, import them and not the other way round.

A new reference implements at least ``name``, ``needs``, ``__init__(exp)`` (calling
``Reference.__init__(exp, inputs)`` with what identifies its inputs), ``weights()`` and
``predictive()``; the rest has defaults. The zoo (``benchmark.references.zoo``) implements it, and
so does every other module of this package (``conf/reference/`` lists them).
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar

import torch

from benchmark.core.fingerprint import source_fingerprint, stable_hash
from benchmark.core.store import (
    CheckpointError, ExperimentStore, StoreError, Unit, content_digest, load_sample_set, read_metadata, validate_tensors,
)
from benchmark.experiment import Experiment
from benchmark.inventory import ReferenceRecipe, describe_store, pairing_problem
from metrics.mmd import PermutationTestConfig, ReferenceResampling, reference_bandwidths
from metrics.row import Forms, ScoreOptions, score_row
from metrics.symmetries import align_to_anchor, canonicalize, spec_for_model

log = logging.getLogger(__name__)
DTYPE = torch.float32  # what the forms and the predictive are computed in
CACHES = ("zoo", "canonical", "aligned", "predictive")
"""The reference's forms that a row's numbers are computed from (``Reference.key``, ``numbers_key``)."""


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


@dataclass(frozen=True)
class NoSettings:
    """A reference without settings of its own (``conf/reference/<name>.yaml`` holds only ``name``)."""


@dataclass(frozen=True)
class ReportHooks:
    """What a reference adds to the report and the figures, as module names (imported by the
    report and analyze stages). ``report``: a module with ``write(exp, metrics, repetitions, out_dir)
    -> list[Path]`` (its extra tables, from metrics.csv's and repetitions.csv's frames, every
    reference's rows) and ``findings(metrics, repetitions) -> FindingsSection`` (its section of
    findings.md); ``analysis``: the module of an extra analysis, drawn as ``analysis=<the reference's name>``
    (its ``NAME``; the analyses' protocol, ``benchmark/analyses/__init__.py``). ``None``: none."""

    report: str | None = None
    analysis: str | None = None


class Reference(ABC):
    """A reference the samples are scored against (see the module docstring for the contract).

    This base class holds what every reference scores with (the evaluate settings, the model and
    its symmetries) and scores in memory from ``weights()`` and ``predictive()``, which a
    subclass provides; the zoo adds its disk caches and streaming."""

    name: ClassVar[str]
    """Which reference this is (metrics.csv's ``reference`` column; ``benchmark.references.REFERENCES``)."""
    order: ClassVar[int] = 100
    """Its place among the references (``benchmark.core.plugins.discover``; ties by module name): the zoo first."""
    Settings: ClassVar[type] = NoSettings
    """Its typed settings: the fields of ``conf/reference/<name>.yaml`` besides ``name``."""
    needs: ClassVar[str]
    """What the reference reads from the store (named in ``problem``'s message)."""
    scores_zoo: ClassVar[bool] = False
    """Whether the zoo itself gets a row against this reference (``ZOO_ROW``: blocks of zoo checkpoints)."""
    hooks: ClassVar[ReportHooks] = ReportHooks()
    """Its report and analysis hooks (``ReportHooks``)."""
    own_row: ClassVar[tuple[str, str] | None] = None
    """The ``(method, mode)`` row of metrics.csv that is this reference's own networks scored as samples
    (never ranked among the methods); ``None``: none."""

    recipe: ReferenceRecipe | None = None
    """The recipes its networks were trained under (metrics.csv's ``reference_config_hash``; None: not a zoo)."""
    anchor_seed: int | None = None
    """The network the WM form aligns to (None: no WM columns)."""

    def __init__(self, exp: Experiment, inputs: dict[str, Any]) -> None:
        """``exp``: the experiment whose samples are scored; ``inputs``: what identifies the
        reference's own inputs (file names and content digests, never absolute paths) in its keys."""
        settings = exp.config.evaluate
        self.exp = exp
        self.steps = [step.value for step in settings.canonical_steps]
        self.resampling = ReferenceResampling(count=settings.reference_resamples) if settings.reference_resamples else None
        self.test = PermutationTestConfig(b1=settings.test_permutations, b2=settings.test_permutations) \
            if settings.test_permutations else None
        self.model = exp.model().to(exp.device)
        self.spec = spec_for_model(exp.model())
        self._inputs = inputs
        self._bandwidths: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
        self._forms: dict[bool, Forms] = {}
        self._memory: dict[str, Any] = {}

    # --- as a plug-in ---------------------------------------------------------------------------------

    @classmethod
    def settings(cls, exp: Experiment) -> Any:
        """This reference's typed settings (``Settings``) from ``exp.config.reference``."""
        node = exp.config.reference
        names = [f for f in getattr(cls.Settings, "__dataclass_fields__", {})]
        return cls.Settings(**{name: getattr(node, name) for name in names})

    @classmethod
    def problem(cls, exp: Experiment) -> str | None:
        """Why the store cannot give this reference, with the command that makes what is missing;
        ``None`` when it can."""
        return None

    @classmethod
    def drawn_by(cls, exp: Experiment) -> bool:
        """Whether ``exp``'s sample stage draws what this reference reads (then an evaluate stage of
        the same run does not refuse it before the sample stage ran)."""
        return False

    @classmethod
    def build(cls, exp: Experiment) -> "Reference":
        """The scoring object of ``exp`` against this reference."""
        return cls(exp)

    @classmethod
    def cache_folder(cls, store: ExperimentStore) -> Path | None:
        """The folder of ``store`` where this reference caches its forms (checked by ``stage=verify``);
        ``None``: it caches nothing on disk."""
        return None

    def current_caches(self) -> set[str]:
        """The names of the form folders under ``cache_folder`` that this reference's current keys use
        (``stage=verify`` calls the others orphaned)."""
        return set()

    # --- what it is -----------------------------------------------------------------------------------

    @property
    def size(self) -> int:
        """The number of networks in the reference (metrics.csv's ``n_reference``)."""
        return int(next(iter(self.weights().values())).shape[0])

    def against(self, unit: Unit) -> "Reference":
        """What ``unit``'s samples are scored against: this reference."""
        return self

    def health(self) -> str | None:
        """One log line on how trustworthy the reference itself is, or ``None``."""
        return None

    def description(self) -> dict[str, float]:
        """metrics.csv's ``REFERENCE_COLUMNS`` that describe the reference (none by default)."""
        return {}

    # --- its forms ------------------------------------------------------------------------------------

    @abstractmethod
    def weights(self) -> dict[str, torch.Tensor]:
        """The reference's networks ``{key: [R, ...]}``."""
        ...

    @abstractmethod
    def predictive(self) -> torch.Tensor:
        """The reference's ensemble predictive on the ID test split ``[N, C]``."""
        ...

    def _remember(self, name: str, build: Callable[[], Any]) -> Any:
        """``build()``, computed once per object."""
        if name not in self._memory:
            self._memory[name] = build()
        return self._memory[name]

    def canonicalize(self, samples: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The NS form of a sample set: the ``evaluate.canonical_steps`` removed."""
        return canonicalize(samples, self.spec, self.steps, device=self.exp.device)[0]

    def canonical(self) -> dict[str, torch.Tensor]:
        """The symmetry-free reference ``{key: [R, ...]}``."""
        return self._remember("canonical", lambda: self.canonicalize(self.weights()))

    def anchor(self) -> dict[str, torch.Tensor]:
        """The network ``{key: [1, ...]}`` the WM form aligns to (``anchor_seed``)."""
        raise ValueError(f"reference {self.name!r} ({type(self).__name__}) has no anchor network (anchor_seed is None): "
                         "its weight-matched form is not computed")

    def align(self, samples: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The WM form of ``samples``: the NS steps with the permutation removed by weight matching
        to the anchor network instead of sorting (``metrics.symmetries.align_to_anchor``)."""
        return align_to_anchor(samples, self.spec, self.anchor(), self.steps)[0]

    def aligned(self) -> dict[str, torch.Tensor]:
        """The WM form of the reference ``{key: [R, ...]}``."""
        return self._remember("aligned", lambda: self.align(self.weights()))

    def shared_bandwidths(self, form: str) -> dict[str, dict[str, torch.Tensor]]:
        """The bandwidth grid per layer shared by every row (``metrics.mmd.reference_bandwidths``)
        of the raw reference (``form="mmd"``) or the symmetry-free one (``"ns_mmd"``), computed once
        per object: ``{layer: {"laplace": [10], "gaussian": [10]}}``."""
        if form not in ("mmd", "ns_mmd"):
            raise ValueError(f"shared_bandwidths: form must be 'mmd' or 'ns_mmd', got {form!r}")
        if form not in self._bandwidths:
            self._bandwidths[form] = self._bandwidth_grid(form)
        return self._bandwidths[form]

    def _bandwidth_grid(self, form: str) -> dict[str, dict[str, torch.Tensor]]:
        return reference_bandwidths(self.weights() if form == "mmd" else self.canonical(), device=self.exp.device)

    def forms(self, weight_matching: bool = True) -> Forms:
        """The reference's forms for ``metrics.row.score_row``: raw, symmetry-free and (with an anchor
        and ``weight_matching``) weight-matched networks, its predictive and the shared bandwidth
        grids; read once per object."""
        matching = self.anchor_seed is not None and weight_matching
        if matching not in self._forms:
            shared = {form: self.shared_bandwidths(form) for form in ("mmd", "ns_mmd")}
            self._forms[matching] = Forms(self.weights(), self.canonical(), self.aligned() if matching else None,
                                          self.predictive(), shared)
        return self._forms[matching]

    # --- keys -----------------------------------------------------------------------------------------

    def key(self, cache: str) -> str:
        """The key of form ``cache`` (one of ``CACHES``, or ``potential``): the reference's inputs,
        the settings that shape it, the whole computational source and the library versions
        (``source_fingerprint``), device and dtype."""
        shaping = {"zoo": {}, "canonical": {"steps": self.steps},
                   "aligned": {"steps": self.steps, "anchor": self.anchor_seed},
                   "predictive": {"config": self.exp.config_hash},
                   "potential": {"config": self.exp.config_hash,
                                 "checkpoints": self.exp.config.evaluate.potential_checkpoints}}
        return stable_hash({"inputs": self._inputs, "cache": cache, "settings": shaping.get(cache, {}),
                            "code": source_fingerprint(), "device": self.exp.device.type,
                            "dtype": str(DTYPE)}, length=20)

    def numbers_key(self, unit: Unit) -> str:
        """The key of the cached numbers of ``unit`` against this reference: its two files, the
        reference's form keys, the evaluate settings, the scoring code."""
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

    # --- scoring --------------------------------------------------------------------------------------

    def options(self, full: bool) -> ScoreOptions:
        """How a row's MMD is measured (``metrics.row.ScoreOptions``): on the experiment's device; with
        ``full``, the reference's random halves (``evaluate.reference_resamples``) and MMDAgg's test
        (``evaluate.test_permutations``)."""
        return ScoreOptions(device=self.exp.device, resampling=self.resampling if full else None,
                            permutation_test=self.test if full else None)

    def score(self, unit: Unit, full: bool) -> dict[str, Any]:
        """The numbers of one repetition of a method (``full``: with the reference's standard
        errors and MMDAgg's test): ``score_samples`` of its stored samples and predictions;
        ``{"failed": reason}`` when they are unusable (unpaired, unreadable, of another model). A
        damaged reference stops with its error (``CorruptZooError``), and so does any error of the
        scoring itself (a reference that cannot be compared, e.g. too small to halve:
        ``MMDInputError``; a streamed read of the reference), never as a failed row."""
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
        try:  # only the unit's own files make a failed row; an error of the scoring itself stops the run
            mixed = pairing_problem(metas[samples_path], metas[preds_path], preds_path)
            if mixed is not None:
                raise CheckpointError(mixed)
            samples = load_sample_set(samples_path)
            validate_tensors(samples, self.exp.model(), source=str(samples_path), leading=1)
            preds = load_sample_set(preds_path, ["id", "ood"])
        except (CheckpointError, ValueError) as err:
            log.error("%s marked failed: %s", unit.label, err)
            return {"failed": str(err)}
        return self.score_samples(samples, preds, full=full, path=samples_path)

    def score_samples(self, samples: dict[str, torch.Tensor], preds: dict[str, torch.Tensor], full: bool,
                      weight_matching: bool = True, path: Path | None = None) -> dict[str, Any]:
        """The numbers of a sample set ``{key: [S, ...]}`` and its predictions (``{"id": [S, N, C],
        "ood": [S, M, C]}``) against this reference (``metrics.row.score_row``: the predictive metrics
        against its predictive, raw, NS and WM MMD, and with ``full`` the ``*_ref_sd`` and ``*_reject``
        columns and the per-layer records, ``metrics.row.Scored.numbers``). ``weight_matching=False`` leaves the WM columns NaN even where the reference has an
        anchor (the baselines: matching their draws to the anchor costs more than the rest of their
        numbers, and they are not ranked by it). ``path``: the file ``samples`` were read from (a
        streamed reference reads it in column blocks)."""
        matching = self.anchor_seed is not None and weight_matching
        forms = Forms(samples, self.canonicalize(samples), self.align(samples) if matching else None)
        return score_row(self.forms(weight_matching), forms, self.options(full), preds, self.exp.test_tensors[1]).numbers(full)
