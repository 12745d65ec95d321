"""The common interface of every posterior approximation.

A method is built like laplace-torch's ``Laplace(model, ...)``: from a **model factory**
(``factory(dropout=0.0) -> fresh plain nn.Module``, initialised from torch's global RNG),
the **data** (``TrainingData``), a typed **settings** dataclass (its ``Settings``, which is
also the schema of ``conf/methods/<name>.yaml``), and the experiment's training **recipe**.
It never sees the Hydra config.

It is then fitted around one trained base network (``fit(base, seed)``; one-mode) or, one
at a time, around each of K base networks (multi-mode; ``methods.modes.run_mode``), and
draws weight samples as a **sample set** keyed exactly like the plain model's state dict, so
MMD and the symmetry engine treat every method alike. Methods that change the architecture
(dropout masks, BLiTZ layers) still return plain-keyed weights.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, ClassVar, Optional, Sequence

import torch
from torch import nn

from benchmark.core.training.predict import predict_samples
from benchmark.core.store import MODES, ChainFiles, SampleSet, SampleSetMetadata
from benchmark.core.training import Recipe, TrainingData

ModelFactory = Callable[..., nn.Module]


class MethodConfigError(ValueError):
    """A method/model/mode combination that cannot work; raised before any training."""


class MethodFitError(RuntimeError):
    """A fit around one base network gave no usable approximation (e.g. a retrained network
    failed the recipe's convergence rule); NaN/Inf raises ``NonFiniteError`` instead."""


@dataclass
class MethodSettings:
    """Settings every method has. ``unavailable``: why this experiment does not run the method
    (e.g. the paper could not train it); ``null`` = it runs. Experiments set it in their config."""

    unavailable: Optional[str] = None


class ResumableChains(ABC):
    """A method whose samples of each base network come from one Markov chain that is saved as it
    runs and resumed bit for bit (``methods.hmc``). The sample stage runs such chains, before
    it publishes the unit, each under its own claim (``store.chain_claim``) with its state in
    the unit's ``ChainFiles`` (``store.chain_files``: the store names the files and gives the key
    the states must have been run under): a killed run resumes, and several jobs share the chains
    of one unit. ``fit``/``sample`` then read the finished chains from there (``use_chain_states``)."""

    @property
    @abstractmethod
    def chains_at_once(self) -> int:
        """How many chains one process runs together (claimed as a group)."""

    @abstractmethod
    def fingerprint(self) -> str:
        """What the method itself knows a saved chain depends on (its settings, data, code); the
        sample stage folds it into the unit's key (``ChainFiles.key``)."""

    @abstractmethod
    def chain_finished(self, files: ChainFiles, seed: int, draws: int) -> bool:
        """Whether the chain of base ``seed`` saved in ``files`` needs no more work for ``draws``
        kept draws under the current settings and key (done, or diverged for good)."""

    @abstractmethod
    def run_chains_in(self, files: ChainFiles, seeds: Sequence[int], load_base: Callable[[int], dict[str, torch.Tensor]],
                      draws: int, should_stop: Callable[[], bool]) -> bool:
        """Run (or resume) the chains of bases ``seeds`` to ``draws`` kept draws, saving their states in
        ``files`` as they go (a state of another key, or damaged, is started again). Stops
        early, returning False, once ``should_stop()`` (e.g. a claim lost); True when done."""

    @abstractmethod
    def use_chain_states(self, files: ChainFiles | None) -> None:
        """Let ``fit``/``sample`` resume the chains saved in ``files`` (None: keep nothing)."""


class PosteriorMethod(ABC):
    """Base class of the methods in ``methods/``.

    Subclasses set ``name``, ``label`` (the table's row name), ``Settings`` (a dataclass
    deriving from ``MethodSettings``) and ``modes`` (and ``samples_per_base`` if fixed), and
    implement ``fit``, ``sample`` and ``predict_own``; ``check`` refuses combinations that
    cannot work before any training.

    A method whose ``fit`` starts from the trained base network it is given (its weights are
    the approximation's starting point or centre: SWAG, Laplace, Deep Ensembles, SGHMC) sets the
    class attribute ``starts_from_base = True``; repetition k of two such rows then shares its
    base network and ``findings.md`` compares them paired. A method that keeps the default
    (``False``) trains its own network, at most under the base's seed (dropout, the vBNNs, the
    scale-adapted SGHMC), and is compared as an independent sample.
    """

    name: ClassVar[str]
    label: ClassVar[str]
    # Its place among the methods' rows in every table (the paper's row order: 10 ... 100), discovery's order;
    # a new method without one comes after them.
    order: ClassVar[int] = 1000
    Settings: ClassVar[type[MethodSettings]] = MethodSettings
    modes: ClassVar[tuple[str, ...]] = MODES
    # Fixed number of samples drawn around each base network (Deep Ensembles: 1, each member
    # is a sample); None = the mode's split (one: all samples, multi: per_method / modes_multi).
    samples_per_base: ClassVar[int | None] = None
    # Whether ``fit`` can fail on a base (MethodFitError: a retrained network that does not
    # converge), so that spare base networks are reserved for it.
    fits_can_fail: ClassVar[bool] = False
    # A variant of another method (its name): the settings the two share follow that method's
    # config node unless set for the variant itself (the config schema, benchmark/config.py).
    follows: ClassVar[str | None] = None
    # Whether ``method=all`` (and the Makefile's sweep) runs the method; False: only when named
    # (``method=hmc``: its cost is the experiment's choice).
    in_default_run: ClassVar[bool] = True
    # Whether ``fit`` starts from the trained base network it is given (SWAG, Laplace, Deep
    # Ensembles, SGHMC), so that two such rows pair on their repetitions (``report.findings``).
    starts_from_base: ClassVar[bool] = False
    # Whether its samples are Markov-chain states, stored chain after chain (``chain_layout``):
    # diagnostics.md's chain figures and the unit's ArviZ file (``.nc``) are written for it.
    markov_chain: ClassVar[bool] = False
    # How a reader takes its rows, for the table captions and findings.md (``{label}``: the row's
    # label); None: nothing beyond the method's name.
    table_note: ClassVar[str | None] = None
    # How to read the rows of every method that inherits it (the vBNN family), printed once before
    # the methods' own notes.
    family_note: ClassVar[str | None] = None
    # What its columns of diagnostics.md (``diagnostics()``) mean, the text of its section there;
    # None: no section.
    diagnostics_note: ClassVar[str | None] = None
    # The row of the paper's Tables 1 and 2 (Laurent et al., ICLR 2024) set beside this method's in
    # paper.md and named by findings.md's claims: "Dropout", "BNN", "SGHMC", "SWAG", "Laplace" or "DE";
    # None: not in the paper's tables.
    paper_label: ClassVar[str | None] = None
    # Whether it is the paper's own recipe for that row (listed first beside it); False: another
    # recipe set beside the same row (our BAOA SGHMC beside the paper's scale-adapted one).
    paper_recipe: ClassVar[bool] = True
    # findings.md's claims on a variant (``follows``) against the method it follows, one mode:
    # "underfitting" (seed 001: higher accuracy and lower NLL), "closer" (seeds 000 and 001: lower
    # NS MMD and MMD, the posterior nearer the reference once the symmetry is broken in training).
    variant_claims: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def chain_layout(cls, meta: SampleSetMetadata, n: int) -> tuple[int, int] | None:
        """``(chains, draws per chain)`` of a unit's ``n`` stored samples with metadata ``meta``, for a
        method whose samples are Markov-chain states (``markov_chain``); None when they are not, or
        when the metadata do not say (a unit written before they recorded it)."""
        return None

    def __init__(
        self,
        model: ModelFactory,
        data: TrainingData,
        settings: MethodSettings | None = None,
        *,
        recipe: Recipe,
        device: torch.device | str = "cpu",
    ) -> None:
        settings = self.Settings() if settings is None else settings
        if not isinstance(settings, self.Settings):
            raise TypeError(f"method={self.name}: settings must be a {self.Settings.__name__}, got {type(settings).__name__}")
        self.model_factory = model
        self.data = data
        self.settings = settings
        # train.until_plateau is the zoo's: a method's own training keeps the recipe's epochs
        self.recipe = recipe.without_plateau() if recipe is not None else None
        self.device = torch.device(device)

    def new_model(self, **kwargs) -> nn.Module:
        """A fresh plain model on the method's device (initialised from torch's global RNG)."""
        return self.model_factory(**kwargs).to(self.device)

    def check(self, mode: str) -> None:
        """Refuse a combination that cannot work, with the reason and the setting to use instead.

        Called before any training; the default checks the mode and ``settings.unavailable``.
        """
        if self.settings.unavailable:
            raise MethodConfigError(f"method={self.name}: {self.settings.unavailable}")
        if mode not in self.modes:
            raise MethodConfigError(
                f"method={self.name} mode={mode}: this method supports mode={' or mode='.join(self.modes)}"
            )

    @abstractmethod
    def fit(self, base: dict[str, torch.Tensor], seed: int) -> None:
        """Fit the approximation around ``base`` (a trained plain-model state dict).

        ``seed`` fixes every random choice of the fit (data order, initialisation of
        retrained networks). NaN/Inf during fitting raises ``benchmark.core.training.NonFiniteError``.
        """

    def prefit(self, seeds: Sequence[int], load_base: Callable[[int], dict[str, torch.Tensor]]) -> None:
        """Optionally fit around several bases at once before ``fit`` is called for each of them
        (``methods.modes.run_mode`` announces each round of candidate ``seeds``); ``fit(base, seed)``
        then returns (or raises) what was computed here. Default: nothing, every fit on its own."""

    @abstractmethod
    def sample(self, n: int, generator: torch.Generator) -> SampleSet:
        """``n`` weight samples ``{key: [n, ...]}`` keyed like the plain model's state dict."""

    def predict_weights(self, sample_set: SampleSet, images: torch.Tensor) -> torch.Tensor:
        """Probabilities ``[S, N, C]`` on ``images [N, ...]`` of the network each weight sample of
        ``sample_set`` parameterises: the plain model carrying it (what the sample stage stores).
        Only a method whose network computes another function of the same weights overrides it
        (``methods.bnn_skip``: fixed skip connections that are not weights)."""
        return predict_samples(self.new_model(), sample_set, images)

    def diagnostics(self, images: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        """Numbers that explain the fitted approximation (e.g. its variances; accuracies as
        fractions on ``images [N, ...]``/``labels [N]`` where useful), after ``fit`` and ``sample``;
        the report's diagnostics table shows their mean over bases. Default: none."""
        return {}

    @abstractmethod
    def predict_own(self, images: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
        """Probabilities ``[n, N, C]`` on ``images`` ``[N, ...]`` through the method's own machinery.

        Must consume ``generator`` exactly as ``sample`` does, so that with two generators
        seeded alike, prediction i corresponds to weight sample i (the consistency test).
        """
