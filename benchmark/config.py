"""The schema of the Hydra config: typed dataclasses registered in Hydra's ConfigStore.

``conf/*.yaml`` hold values; these dataclasses hold the types, the allowed values (enums)
and the defaults, so Hydra refuses a bad override at composition with the key, the value
and what is allowed. Range checks live in each settings dataclass's ``__post_init__`` and run
when ``resolve_config`` turns the composed config into typed objects; their errors name the
full key.

The nodes that depend on the plug-ins come from ``build_schema(plugins)``, a pure function of
``Plugins`` (what ``benchmark.loader.load`` finds): one ``methods.<name>`` node per method, typed by
its ``Settings`` (with a ``conf/methods/<name>.yaml``), the choices of ``method=`` and ``analysis=``,
one ``analyze.<name>`` node per analysis, one ``reference=<name>`` node per reference, and the names
``sample.repetitions_per_method`` and ``evaluate.baselines`` may hold. ``compose`` stores a schema
in Hydra's ConfigStore and composes a config from it; ``benchmark.loader.compose_config`` is that
with every plug-in loaded.

``Config`` is the root: every key of ``python -m benchmark`` with its type. Only the runners
(``benchmark.cli``, ``benchmark.experiment``) read it; everything else gets typed objects.
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field, make_dataclass
from enum import Enum
from pathlib import Path
from types import MappingProxyType, ModuleType
from typing import Any, ClassVar, Dict, List, Mapping, Optional, Sequence, Union

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from benchmark.core.data import DATASET_NAMES
from benchmark.core.models import MODEL_NAMES
from benchmark.core.settings import SettingsError, require
from benchmark.core.store.claims import DEFAULT_HEARTBEAT_S, DEFAULT_TIMEOUT_S
from benchmark.core.store.importing import KeyMapping
from benchmark.core.training import Recipe
from metrics.symmetries import STEPS


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the key, the value and what is expected."""


# ``import`` is a Python keyword, so the enum is built by name (Stage["import"], Stage.zoo ...).
Stage = Enum("Stage", {name: name for name in ("zoo", "sample", "evaluate", "report", "analyze", "all", "finish", "verify", "import")},
             type=str)
Stage.__doc__ = ("What ``python -m benchmark`` runs (``all`` = zoo, sample, evaluate, report, analyze in order; "
                 "``finish`` = evaluate, report, analyze: the last job of ``make benchmark CLUSTER=slurm``; "
                 "``verify`` checks the store and is not part of ``all``; ``import`` = write a zoo made elsewhere "
                 "into the store instead of training it).")


class VerifyScope(str, Enum):
    """What ``stage=verify`` scans: every experiment folder under ``store``, or the current experiment's."""

    store = "store"
    experiment = "experiment"


class Repair(str, Enum):
    """What ``stage=verify`` moves to ``quarantine/``: nothing (``false``), what is corrupt
    (``true``), or what is corrupt and what is stale in the current experiment (``stale``)."""

    off = "false"
    corrupt = "true"
    stale = "stale"


class ModeChoice(str, Enum):
    """Which modes the sample stage runs: both, or one of them."""

    both = "both"
    one = "one"
    multi = "multi"


class Precision(str, Enum):
    """Arithmetic of the zoo's one-at-a-time training (evaluation stays float32)."""

    auto = "auto"
    """bf16 autocast on a CUDA GPU that supports it (else fp16) for networks with BatchNorm
    convolutions (ResNet-18); fp32 everywhere else (CPU, OptuNet)."""
    fp32 = "fp32"
    bf16 = "bf16"
    """``torch.autocast`` with bfloat16 (CPU too, slow without AMX/AVX512-BF16)."""
    fp16 = "fp16"
    """``torch.autocast`` with float16 and a ``GradScaler`` (CUDA only)."""


@dataclass(frozen=True)
class Plugins:
    """What the schema is built from (``build_schema``): every plug-in by name, each mapping in its
    order. ``benchmark.loader.load`` finds them; this module only reads their attributes.

    - ``methods``: ``PosteriorMethod`` subclasses (``Settings``, ``follows``), in table row order;
    - ``references``: ``Reference`` subclasses (``Settings``; ``own_row``, ``(method, mode)`` or
      ``None``: the method whose rows are the reference's own), the zoo first;
    - ``baselines``: ``Baseline`` subclasses, in table order (only their names are read);
    - ``analyses``: ``analysis=<name>`` -> its module, in drawing order; a module with ``Settings``
      (a dataclass) gets the node ``analyze.<name>``, a reference's hook (named after it) has none.
    """

    methods: Mapping[str, type]
    references: Mapping[str, type]
    baselines: Mapping[str, type]
    analyses: Mapping[str, ModuleType]


@dataclass
class ReferenceConfig:
    """What the evaluate stage scores against besides the zoo (always evaluated: Table 1), chosen
    with ``reference=<name>`` (the config group ``conf/reference/``: one yaml per registered
    reference of ``benchmark.references``). ``name``: the chosen reference (``zoo``: only the zoo;
    another: every row scored against it too, with what its report hooks add). The node of
    ``reference=<name>`` is ``reference_schema(name)``: this class with the reference's own
    settings (``Reference.Settings``, declared in its module) as further keys."""

    name: str = "zoo"
    known: ClassVar[tuple[str, ...]] = ()
    """The registered references' names (``build_schema`` sets them on the schema's subclasses)."""

    def __post_init__(self) -> None:
        require(self.name in self.known, "name", self.name,
                f"a registered reference, chosen with reference=<name>: one of {', '.join(sorted(self.known))} "
                "(benchmark/references/, conf/reference/<name>.yaml)")


def reference_schema(name: str, settings: type, base: type = ReferenceConfig) -> type:
    """The node of ``reference=<name>`` (Hydra's ``reference/base_<name>``, listed first in
    ``conf/reference/<name>.yaml``'s defaults): a subclass of ``base`` (a ``ReferenceConfig`` whose
    ``known`` names every reference) with ``name`` defaulting to ``name`` and one field per field of
    the reference's ``settings`` (a dataclass; same type and default); its ``__post_init__`` refuses
    another ``name`` and runs the settings' own checks."""
    if not dataclasses.is_dataclass(settings):
        raise TypeError(f"reference {name!r}: its Settings must be a dataclass, got {settings!r}")
    hints = typing.get_type_hints(settings)
    fields: list[tuple[str, Any, Any]] = [("name", str, field(default=name))]
    for f in dataclasses.fields(settings):
        default = field(default_factory=f.default_factory) if f.default_factory is not dataclasses.MISSING \
            else field(default=f.default if f.default is not dataclasses.MISSING else MISSING)
        fields.append((f.name, hints[f.name], default))
    own = [f.name for f in dataclasses.fields(settings)]

    def __post_init__(self) -> None:
        ReferenceConfig.__post_init__(self)
        require(self.name == name, "name", self.name,
                f"{name}, the reference chosen with reference={name} (another: reference=<name>, one of "
                f"{', '.join(sorted(self.known))})")
        settings(**{key: getattr(self, key) for key in own})

    title = "".join(part.title() for part in name.split("_"))
    return make_dataclass(f"{title}ReferenceConfig", fields, bases=(base,),
                          namespace={"__post_init__": __post_init__, "__module__": __name__,
                                     "__doc__": f"``reference={name}``: ``name`` and the reference's settings "
                                                f"(``{settings.__module__}.{settings.__qualname__}``)."})


class ZooRange(str, Enum):
    """Which seed ranges the zoo stage trains."""

    both = "both"
    reference = "reference"
    heldout = "heldout"


CanonicalStep = Enum("CanonicalStep", {name: name for name in STEPS}, type=str)
CanonicalStep.__doc__ = "A step of the symmetry-free (NS) form: scale, minmass, sort or softmax."
DatasetName = Enum("DatasetName", {name: name for name in DATASET_NAMES}, type=str)
DatasetName.__doc__ = "A dataset the suite can load."
ModelName = Enum("ModelName", {name: name for name in MODEL_NAMES}, type=str)
ModelName.__doc__ = "A model the suite can build."


@dataclass
class SeedsConfig:
    """Seed ranges ``[start, stop)``: the reference zoo, and the held-out seeds that give the
    methods' base networks and the Deep-Ensemble members. They must not overlap."""

    reference: List[int] = MISSING
    heldout: List[int] = MISSING
    # The share of seeds expected to pass the convergence rule: the sample stage's preflight counts
    # the held-out seeds not trained yet at this rate to refuse, before any training, a range that
    # cannot supply every repetition's bases and Deep-Ensemble members (inventory.heldout_shortfall).
    expected_convergence: float = 0.9

    def __post_init__(self) -> None:
        require(0 < self.expected_convergence <= 1, "expected_convergence", self.expected_convergence,
                "a fraction in (0, 1]")


@dataclass
class ZooConfig:
    """``range``: which ranges ``stage=zoo`` trains; this job trains the seeds with
    ``seed % num_shards == shard``. ``vectorize``: networks trained at once (K) by the
    vectorised trainer (``benchmark/core/training/vectorised.py``): ``auto`` = as many as fit in
    memory (on a CPU up to ``AUTO_NETWORKS``; on a GPU half its free memory's worth; one at a time
    where the architecture or the data cannot be stacked, e.g. ResNet-18's BatchNorm), an integer K (refused before any work if K networks
    do not fit in memory, with the K that does), or 1 = one at a time (``train_network``).
    ``crosscheck``: see below."""

    range: ZooRange = ZooRange.both
    shard: int = 0
    num_shards: int = 1
    vectorize: str = "auto"  # "auto" or an integer: OmegaConf has no union type; ``networks_at_once`` is the typed value
    # Runs in which a seed may diverge (NaN/Inf) before it is recorded as failed with reason
    # ``diverged`` (not in the paper; 3 chosen: a seed that diverges in three runs, maybe on other
    # nodes or GPUs, is not a transient fault; training on CPU is deterministic, so retrying
    # within one run would only repeat it). Counted per seed and config_hash in zoo/failed/.
    max_attempts: int = 3
    # The first ``crosscheck`` seeds of each range that are trained stacked are also trained one at a
    # time (train_network), and each one's checkpoint or failure record keeps that trainer's verdict, so
    # the zoo summary says on how many the two trainers' convergence verdicts differ (not in the paper;
    # 16: about 2% of make benchmark's time on digits, a minute or two per seed on MNIST, spread over the
    # shards). 0 = off.
    crosscheck: int = 16
    # A checkpoint or failure record of the range made under another model, data or recipe config
    # (its config_hash) is quarantined and the seed trained again, so that a recipe change retrains
    # the zoo; true keeps it (one warning; evaluate then refuses it unless evaluate.allow_other_recipe).
    keep_other_recipe: bool = False

    def __post_init__(self) -> None:
        require(self.num_shards >= 1, "num_shards", self.num_shards, "a positive integer")
        require(self.crosscheck >= 0, "crosscheck", self.crosscheck, "a number of seeds >= 0")
        require(0 <= self.shard < self.num_shards, "shard", self.shard, f"an integer in [0, num_shards={self.num_shards})")
        require(self.max_attempts >= 1, "max_attempts", self.max_attempts, "a positive integer (runs before a diverging seed is recorded as failed)")
        value = str(self.vectorize)
        require(value == "auto" or (value.isdigit() and int(value) >= 1), "vectorize", self.vectorize,
                "auto or a positive integer (1 = one network at a time)")

    @property
    def networks_at_once(self) -> Optional[int]:
        """``zoo.vectorize`` typed: K networks at once, ``None`` for ``auto``."""
        return None if str(self.vectorize) == "auto" else int(self.vectorize)


class ImportRange(str, Enum):
    """Which seed range imported checkpoints fill."""

    reference = "reference"
    heldout = "heldout"


class SeedsFrom(str, Enum):
    """How an imported file gets its seed."""

    order = "order"
    """The i-th file (natural order of the paths) -> the range's start + i."""
    name = "name"
    """The last number in the file name (``model_0042.safetensors`` -> 42); must lie in the range."""


@dataclass
class ImportConfig:
    """``stage=import``: write checkpoints made elsewhere into the store as zoo checkpoints.

    ``source``: a folder, ``.zip`` or ``.tar``/``.tar.gz``/``.tgz`` of ``.safetensors``/``.pt``/
    ``.pth``/``.ckpt`` files; ``range``: the seed range they fill; ``seeds_from``: how each file
    gets its seed; ``skip`` / ``limit``: leave out the first ``skip`` files, then import at most
    ``limit`` (null = all the rest, which must fit in the range); ``evaluate``: compute each checkpoint's held-out accuracy and apply the
    recipe's convergence rule, as for a trained one, and judge the first ``chance_probe`` networks
    together: a median test accuracy within ``near_chance_margin`` of chance (or 3 standard errors
    of a chance accuracy on the test split, if more) refuses the import before anything is written
    (the zoo does not read this data set as it was trained: class order, normalisation, another
    data set; null = no check); ``mapping``: how the files' keys map to the model (``KeyMapping``;
    ready mappings in ``conf/zoo_import/``). A file that cannot be used is recorded as a failed
    seed with its reason and the import goes on, ending non-zero with the count.

    Chosen: ``near_chance_margin`` 0.05 (the released zoos score far above chance: MNIST OptuNet
    ~0.9, CIFAR-100 ResNet-18 ~0.75, TinyImageNet ResNet-18 ~0.56 against 0.1, 0.01, 0.005, while
    a network reading permuted labels scores ~1/classes); ``chance_probe`` 9 (the median stays
    above chance with up to four failed members among them; nine ResNet-18s take ~0.4 GB).
    """

    source: Optional[str] = None
    range: ImportRange = ImportRange.reference
    seeds_from: SeedsFrom = SeedsFrom.order
    skip: int = 0
    limit: Optional[int] = None
    evaluate: bool = True
    near_chance_margin: Optional[float] = 0.05
    chance_probe: int = 9
    mapping: KeyMapping = field(default_factory=KeyMapping)

    def __post_init__(self) -> None:
        require(self.limit is None or self.limit >= 1, "limit", self.limit, "a positive integer or null (all files)")
        require(self.skip >= 0, "skip", self.skip, "an integer >= 0")
        require(self.near_chance_margin is None or 0 <= self.near_chance_margin < 1, "near_chance_margin",
                self.near_chance_margin, "a fraction in [0, 1) or null (no check)")
        require(self.chance_probe >= 1, "chance_probe", self.chance_probe, "a positive integer")


@dataclass
class SampleConfig:
    """``per_method``: weight samples per method and mode (paper: 100); ``modes_multi``:
    multi-mode base networks (paper: 10), ``per_method / modes_multi`` samples each;
    ``repetitions``: independent repetitions of every method x mode (each on its own base
    networks, hence its own method seeds), whose spread gives the tables' error bars;
    ``repetitions_per_method``: registered method name -> its repetitions (both modes), in place of
    ``repetitions`` (cheap rows can run more: an exact paired sign-flip test on R repetitions cannot
    go below p = 2/2^R, 0.0625 at 5, 0.0078 at 8; repetition k of every row still starts from the
    same base, and more repetitions keep the ones done; the held-out range must hold the largest
    count's blocks; a method whose rows are a reference's own (``Reference.own_row``) cannot be named, and the zoo's blocks and the second zoo's cap keep ``repetitions``; null: none; ``'+sample.repetitions_per_method.<name>=N'``
    adds one on the command line, ``sample.repetitions_per_method=null`` drops an experiment's);
    both read only through the repetition design, ``benchmark.design.Design``;
    ``keep_stale``: a unit drawn under other settings or code is moved to ``quarantine/`` before
    it is drawn again (false: removed)."""

    per_method: int = 100
    modes_multi: int = 10
    repetitions: int = 3
    repetitions_per_method: Optional[Dict[str, int]] = None
    keep_stale: bool = True
    known_methods: ClassVar[tuple[str, ...]] = ()
    """The registered methods' names (``build_schema`` sets them on the schema's subclass)."""
    pooled_methods: ClassVar[Mapping[str, str]] = MappingProxyType({})
    """Method -> the reference whose rows its rows are (``Reference.own_row``): such a method's
    repetitions are the reference's, ``repetitions``, never ``repetitions_per_method``."""

    def __post_init__(self) -> None:
        require(self.per_method >= 1, "per_method", self.per_method, "a positive integer")
        require(self.modes_multi >= 1, "modes_multi", self.modes_multi, "a positive integer")
        require(self.repetitions >= 1, "repetitions", self.repetitions, "a positive integer")
        for name, count in (self.repetitions_per_method or {}).items():
            require(name in self.known_methods, f"repetitions_per_method.{name}", name,
                    f"a registered method: one of {', '.join(self.known_methods)}")
            require(isinstance(count, int) and count >= 1, f"repetitions_per_method.{name}", count,
                    "a positive integer")
            # a reference pools every repetition of its own method's rows, which the design lays out as sample.repetitions
            require(name not in self.pooled_methods, f"repetitions_per_method.{name}", count,
                    f"no entry: {name}'s rows are the {self.pooled_methods.get(name)} reference's own, with sample.repetitions "
                    "repetitions")


@dataclass
class EvaluateConfig:
    """``canonical_steps``: the symmetries removed for the NS MMD columns, in order (default
    scaling then permutation, as the paper's Table 1; ``softmax`` also removes the softmax
    additive symmetry, ``minmass`` scales by the min-mass problem instead of unit norms);
    ``weight_matching``: also the WM MMD columns (the same steps with the permutation removed by
    weight matching every network to one anchor, the lowest converged reference seed, instead of
    sorting; Table 3); off for ResNet-scale zoos, where matching every checkpoint is slow;
    ``max_in_memory_gb``: larger zoos are streamed from the store; ``reference_resamples``:
    random halves of the reference whose MMD spread gives its standard error (0 = none);
    ``test_permutations``: relabellings B1 = B2 of MMDAgg's aggregated test per layer (MMDAgg's
    own experiments use 500; 0 = no test); ``allow_partial``: evaluate against a reference range
    with seeds not trained yet (by default the stage refuses, naming how many and the command
    that trains them, so a table never silently rests on part of the zoo; metrics.csv's
    ``n_reference`` says how many checkpoints were used either way); ``allow_other_recipe``:
    evaluate against reference checkpoints trained under another model, data or recipe config
    than this run's (by default the stage refuses, naming the differing fields; with it, one
    warning, and metrics.csv's ``reference_recipe`` says so); ``baselines``: the baseline rows scored
    beside the methods (names registered in ``benchmark.baselines``: prior, untrained initialisations,
    Gaussians fitted to the raw and the symmetry-free zoo, a second zoo of the same recipe; null: every
    registered one, in table order; ``[]`` for none; an unregistered name is refused when the config
    is resolved, naming the registered ones: ``known_baselines``), over
    ``baseline_repetitions`` repetitions (null: ``sample.repetitions``; the second zoo's at most that);
    ``potential_checkpoints``: how many converged reference checkpoints (the first in seed order; 0 =
    all) the zoo's training potential is measured on (``ZooReference.training_potential``)."""

    canonical_steps: List[CanonicalStep] = field(default_factory=lambda: [CanonicalStep.scale, CanonicalStep.sort])
    weight_matching: bool = True
    max_in_memory_gb: float = 4.0
    reference_resamples: int = 20
    test_permutations: int = 500
    # Off by default: a partial zoo gives numbers that depend on which seeds happened to finish.
    allow_partial: bool = False
    # Off by default: numbers against a zoo of another recipe are not this config's numbers.
    allow_other_recipe: bool = False
    # Every baseline row by default (benchmark/baselines/): what a score means needs them.
    baselines: Optional[List[str]] = None
    # The zoo's training potential (its spread says how far the SGD ensemble is from a T = 1 posterior) is
    # measured on the first potential_checkpoints converged reference seeds: a full pass over the training split
    # per checkpoint, which for a 1,000-checkpoint ResNet-18 zoo would cost more than the rest of the stage.
    potential_checkpoints: int = 256
    # The baselines cost no training: more repetitions than the methods' let an exact test tell a method from a
    # baseline at 5 method repetitions (an unpaired 5 + 5 permutation test cannot go below p = 2/252). null: as
    # many as sample.repetitions; the second zoo never has more than sample.repetitions (its held-out blocks).
    baseline_repetitions: Optional[int] = None
    known_baselines: ClassVar[tuple[str, ...]] = ()
    """The registered baselines' names, in table order (``build_schema`` sets them on the schema's subclass)."""

    def __post_init__(self) -> None:
        require(self.max_in_memory_gb > 0, "max_in_memory_gb", self.max_in_memory_gb, "a positive number")
        require(self.reference_resamples == 0 or self.reference_resamples >= 2, "reference_resamples",
                self.reference_resamples, "0 or an integer >= 2")
        require(self.test_permutations == 0 or self.test_permutations >= 100, "test_permutations",
                self.test_permutations, "0 or an integer >= 100")
        names = [str(b) for b in self.baselines or ()]
        require(len(set(names)) == len(names), "baselines", names, "each baseline at most once")
        for name in names:
            require(name in self.known_baselines, "baselines", name,
                    f"registered baselines: some of {', '.join(self.known_baselines)} (benchmark/baselines/)")
        require(self.baseline_repetitions is None or self.baseline_repetitions >= 1, "baseline_repetitions",
                self.baseline_repetitions, "null (sample.repetitions) or a positive integer")
        require(self.potential_checkpoints >= 0, "potential_checkpoints", self.potential_checkpoints,
                "0 (every checkpoint) or a positive integer")


@dataclass
class VerifyConfig:
    """``stage=verify``. ``scope``: ``store`` checks every experiment folder under ``store`` (the
    current experiment against this command line's config, the others against their
    ``conf/experiment/<name>.yaml``), ``experiment`` only the current one. ``repair``: ``false``
    reports only; ``true`` moves what is corrupt to ``quarantine/`` (and removes temp files of
    killed writes) so that the next ``stage=zoo`` / ``stage=sample`` redoes it; ``stale`` also
    moves what is stale (valid, but made with other settings or code), in the current experiment
    only: another experiment's stale files are reported, never moved (they may have been made
    with overrides this command line does not know). Read it as ``repair_mode`` (a ``Repair``;
    a Hydra override ``verify.repair=true`` arrives as a bool, hence the union, normalised to
    the value's string)."""

    scope: VerifyScope = VerifyScope.store
    repair: Union[bool, str] = False

    def __post_init__(self) -> None:
        names = {False: Repair.off, True: Repair.corrupt, **{r.value: r for r in Repair}, **{r: r for r in Repair}}
        value = self.repair.lower() if isinstance(self.repair, str) and not isinstance(self.repair, Repair) else self.repair
        require(value in names, "repair", self.repair, "false, true or stale")
        self.repair = names[value].value

    @property
    def repair_mode(self) -> Repair:
        """``repair`` as a ``Repair``."""
        return Repair(self.repair)


@dataclass
class ClaimConfig:
    """Claims on units of work shared by processes and cluster nodes (``benchmark/core/store/claims.py``):
    a held claim is refreshed every ``heartbeat_s`` seconds; one not refreshed for ``timeout_s``
    seconds is taken over (a claimant on the same host whose process is gone, at once). A stage that
    found units it was asked for claimed by live processes elsewhere waits for them, polling every
    ``min(heartbeat_s, 10)`` seconds, until each is published or its claim goes stale (then it takes
    the unit over), for at most ``wait_s`` seconds; then it fails, naming the units and their holders
    (0: fail at once). Keep ``wait_s`` above ``timeout_s``, so that a dead holder's units are taken over
    within the wait, and above the time one unit takes, so that a live holder can finish it."""

    timeout_s: float = DEFAULT_TIMEOUT_S
    heartbeat_s: float = DEFAULT_HEARTBEAT_S
    wait_s: float = 3600.0
    # A store shared by the users of one group: new folders setgid and group-writable, files
    # group-readable and -writable (umask 002 semantics for this process). Here and not under
    # ``store`` because ``store`` is the store's path. Off by default: a personal store stays private.
    group_shared: bool = False

    def __post_init__(self) -> None:
        require(self.heartbeat_s > 0, "heartbeat_s", self.heartbeat_s, "a positive number of seconds")
        require(self.timeout_s >= 2 * self.heartbeat_s, "timeout_s", self.timeout_s,
                f"at least twice heartbeat_s={self.heartbeat_s:g} (several missed heartbeats before a takeover)")
        require(self.wait_s >= 0, "wait_s", self.wait_s, "a number of seconds >= 0")

    @property
    def poll_s(self) -> float:
        """How often a waiting stage reads the claims it waits for."""
        return min(self.heartbeat_s, 10.0)


@dataclass
class ExternalConfig:
    """``method=external``: score a sample set produced elsewhere. ``path``: a safetensors file
    ``{state-dict key: [S, ...]}``; ``name``: its row's method id; ``label``: its row name in the
    tables (null = ``name``)."""

    path: Optional[str] = None
    name: str = "external"
    label: Optional[str] = None
    known_methods: ClassVar[tuple[str, ...]] = ()
    """The registered methods' names, which ``name`` may not take (``build_schema`` sets them)."""

    def __post_init__(self) -> None:
        ok = self.name.replace("-", "_").isidentifier() and self.name not in self.known_methods and self.name != "all"
        require(ok, "name", self.name, f"a name of letters, digits, - and _ other than all, {', '.join(self.known_methods)}")


@dataclass
class DatasetConfig:
    """ID dataset, its OOD set, where they live on disk, and whether training augments.
    ``validation_fraction``: the part of the train split held out (stratified, fixed seed) to
    judge the recipe's convergence rule on; 0 = train on all of it (needs no rule)."""

    name: DatasetName = MISSING
    data_dir: str = "data"
    download: bool = False
    ood: DatasetName = MISSING
    augment: bool = False
    validation_fraction: float = 0.0

    def __post_init__(self) -> None:
        require(0.0 <= self.validation_fraction < 0.5, "validation_fraction", self.validation_fraction,
                "a fraction in [0, 0.5)")


@dataclass
class ModelConfig:
    """The architecture: ``name``, the factory's ``kwargs``, and ``cpu_native_conv`` (PyTorch's
    native CPU convolution instead of oneDNN/NNPACK: several times faster for OptuNet's tiny
    convolutions). The method settings that depend on the model (appendix B) live in the methods'
    own nodes, set by ``conf/model/<name>.yaml``."""

    name: ModelName = MISSING
    kwargs: Dict[str, Any] = field(default_factory=dict)
    cpu_native_conv: bool = False


@dataclass
class ClusterConfig:
    """``parallel_jobs``: jobs of a multirun sweep (``-m``) sharing one machine (sets torch threads
    per sweep job with ``threads=auto``; a single run takes every core)."""

    name: str = "local"
    parallel_jobs: int = 1

    def __post_init__(self) -> None:
        require(self.parallel_jobs >= 1, "parallel_jobs", self.parallel_jobs, "a positive integer")


def _is_interpolation(value: Any) -> bool:
    return isinstance(value, str) and value.startswith("${")


def _following(cls: type, path: str, keys: set[str]) -> type:
    """A subclass of dataclass ``cls`` whose fields ``keys`` default to ``${<path>.<key>}``, recursively
    into nested (non-optional) dataclass fields, so that an override of a nested key lands on the
    subclass's own copy; ``__post_init__`` validates once no interpolation is left."""
    hints = typing.get_type_hints(cls)
    fields = []
    for f in dataclasses.fields(cls):
        if f.name not in keys:
            continue
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            nested = _following(kind, f"{path}.{f.name}", {g.name for g in dataclasses.fields(kind)})
            fields.append((f.name, nested, field(default_factory=nested)))
        else:
            fields.append((f.name, kind, field(default=f"${{{path}.{f.name}}}")))
    validate = getattr(cls, "__post_init__", None)

    def __post_init__(self) -> None:
        if validate is not None and not any(_is_interpolation(getattr(self, f.name)) for f in dataclasses.fields(self)):
            validate(self)

    return make_dataclass(cls.__name__, fields, bases=(cls,),
                          namespace={"__post_init__": __post_init__, "__module__": cls.__module__, "__doc__": cls.__doc__})


def settings_schema(methods: Mapping[str, type], name: str) -> type:
    """The schema of ``methods.<name>`` (``methods``: every method by name): the method's
    ``Settings``; for a variant of another method (``PosteriorMethod.follows``), a subclass in which
    every setting the two share defaults to the interpolation ``${methods.<followed>.<key>}`` (leaf by
    leaf inside nested nodes). An experiment file or a command line that changes the followed
    method then changes the variant too, and ``methods.<name>.<key>=...`` changes the variant alone."""
    cls = methods[name]
    if not cls.follows:
        return cls.Settings
    shared = {f.name for f in dataclasses.fields(methods[cls.follows].Settings)} - {"unavailable"}
    return _following(cls.Settings, f"methods.{cls.follows}", shared)


@dataclass
class Config:
    """The root of the config: every key of ``python -m benchmark``.

    ``experiment_name``; ``display_name`` (the experiment's name in the tables); ``stage``;
    ``store`` (checkpoint store root: store/<experiment>/...); ``results`` (tables and figures:
    results/<experiment>/...); ``device`` (auto | cpu | cuda | cuda:N | per_job: in a sweep, job j on
    cuda:(j mod the visible GPUs), ``cluster=gpu_node``); ``precision`` and
    ``channels_last`` (mixed precision and NHWC memory format of the zoo's one-at-a-time training:
    ``Precision``; channels_last null = on where precision auto would use autocast); ``tf32``
    (TensorFloat-32 in CUDA matmuls and convolutions: off by default, so that a GPU trains the
    float32 networks a CPU trains, to rounding; PyTorch's own default turns it on for cuDNN
    convolutions); ``threads``
    (torch threads per process: auto = every available core for a single run, cores //
    cluster.parallel_jobs for each job of a multirun sweep, ``-m``); ``debug`` (tracebacks instead
    of one-line errors); ``method`` and ``mode`` (what the sample stage runs); ``analysis`` (what
    the analyze stage draws); ``reference`` (``reference_schema(<name>)``, a ``ReferenceConfig``:
    what evaluate and report score against besides the zoo and its settings, ``conf/reference/``); then the nodes typed above: ``seeds``, ``zoo``, ``sample``,
    ``evaluate``, ``analyze``, ``external``, ``verify``, ``claims`` (cross-node claims on units of
    work), ``dataset``, ``model``, ``train`` (the ``Recipe``), ``cluster``, ``methods`` (one node
    per registered method) and ``zoo_import`` (``stage=import``).

    The fields that depend on the plug-ins (``defaults``, ``method``, ``analysis``, ``reference``,
    ``sample``, ``evaluate``, ``analyze``, ``external``, ``methods``) are typed here by what every schema shares;
    ``build_schema`` types them by the plug-ins in a subclass, the root that is composed.
    """

    defaults: List[Any] = field(default_factory=list)
    experiment_name: str = MISSING
    display_name: str = MISSING
    stage: Stage = Stage.all
    store: str = "store"
    results: str = "results"
    device: str = "auto"
    precision: Precision = Precision.auto
    channels_last: Optional[bool] = None
    tf32: bool = False
    threads: str = "auto"
    debug: bool = False
    method: str = "all"
    mode: ModeChoice = ModeChoice.both
    analysis: str = "all"
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    seeds: SeedsConfig = field(default_factory=SeedsConfig)
    zoo: ZooConfig = field(default_factory=ZooConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    analyze: Any = None
    external: ExternalConfig = field(default_factory=ExternalConfig)
    verify: VerifyConfig = field(default_factory=VerifyConfig)
    claims: ClaimConfig = field(default_factory=ClaimConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: Recipe = MISSING
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    methods: Any = None
    zoo_import: ImportConfig = field(default_factory=ImportConfig)

    def __post_init__(self) -> None:
        for key in ("store", "results"):  # an empty path would silently mean the current directory
            value = getattr(self, key)
            require(value is not None and str(value).strip() != "", key, value,
                    f"a folder path (empty is refused: pass {key}=. for the current directory)")


@dataclass(frozen=True)
class Schema:
    """A config schema (``build_schema``): ``root``, the ``Config`` subclass that is composed
    (Hydra's ``base_config``); ``methods``, the node of each ``methods.<name>`` (``methods/base_<name>``,
    listed first by ``conf/methods/<name>.yaml``); ``references``, the node of each ``reference=<name>``
    (``reference/base_<name>``, listed first by ``conf/reference/<name>.yaml``)."""

    root: type
    methods: Mapping[str, type]
    references: Mapping[str, type]


def build_schema(plugins: Plugins) -> Schema:
    """The schema of a config over ``plugins``; a pure function of them (``TypeError`` naming an
    analysis or a reference whose ``Settings`` is not a dataclass).

    The root types ``method=`` by an enum of the methods (with ``all`` and ``external``),
    ``analysis=`` by one of the analyses (with ``all``), ``methods`` by one node per method
    (``settings_schema``), ``analyze`` by one node per analysis with settings, ``reference`` by the
    references' names, and ``sample.repetitions_per_method`` and ``evaluate.baselines`` by the
    names they may hold (``external.name`` may hold none of the methods')."""
    method_names = tuple(plugins.methods)
    method_choice = Enum("MethodChoice", {name: name for name in ("all", *method_names, "external")}, type=str)
    method_choice.__doc__ = "What the sample stage runs: all methods, one of them, or an external sample set."
    analysis_choice = Enum("Analysis", {name: name for name in (*plugins.analyses, "all")}, type=str)
    analysis_choice.__doc__ = "What ``stage=analyze`` draws (``analysis=...``): one of the analyses, or ``all``."
    node_schemas = {name: settings_schema(plugins.methods, name) for name in method_names}
    methods_node = make_dataclass("MethodsConfig", [(name, node, field(default_factory=node))
                                                    for name, node in node_schemas.items()])
    settings = {name: module.Settings for name, module in plugins.analyses.items() if hasattr(module, "Settings")}
    for name, kind in settings.items():
        if not dataclasses.is_dataclass(kind):
            raise TypeError(f"analysis {name!r}: its Settings must be a dataclass, got {kind!r}")
    analyze_node = make_dataclass("AnalyzeConfig", [(name, kind, field(default_factory=kind)) for name, kind in settings.items()])
    reference_node = _with(ReferenceConfig, known=tuple(plugins.references))
    references = {name: reference_schema(name, reference.Settings, reference_node)
                  for name, reference in plugins.references.items()}
    sample_node = _with(SampleConfig, known_methods=method_names, pooled_methods=MappingProxyType(
        {r.own_row[0]: name for name, r in plugins.references.items() if r.own_row is not None}))
    evaluate_node = _with(EvaluateConfig, known_baselines=tuple(plugins.baselines))
    external_node = _with(ExternalConfig, known_methods=method_names)
    defaults = ["_self_"] + [{f"methods@methods.{name}": name} for name in method_names]
    root = make_dataclass("Config", [
        ("defaults", List[Any], field(default_factory=lambda: list(defaults))),
        ("method", method_choice, field(default=method_choice["all"])),
        ("analysis", analysis_choice, field(default=analysis_choice["all"])),
        ("reference", reference_node, field(default_factory=reference_node)),
        ("sample", sample_node, field(default_factory=sample_node)),
        ("evaluate", evaluate_node, field(default_factory=evaluate_node)),
        ("analyze", analyze_node, field(default_factory=analyze_node)),
        ("external", external_node, field(default_factory=external_node)),
        ("methods", methods_node, field(default_factory=methods_node))], bases=(Config,))
    return Schema(root=root, methods=MappingProxyType(node_schemas), references=MappingProxyType(references))


def _with(cls: type, **known: Any) -> type:
    """A subclass of dataclass ``cls`` (same name, no new field) whose class attributes ``known`` hold
    the plug-ins' names its checks accept."""
    return make_dataclass(cls.__name__, [], bases=(cls,), namespace={"__module__": cls.__module__, "__doc__": cls.__doc__,
                                                                       **known})


def visible_gpus() -> int:
    """The number of CUDA devices this process sees (at least 1): ``${visible_gpus:}`` in
    ``conf/cluster/gpu_node.yaml`` sizes the sweep's pool to one job per GPU."""
    import torch

    return max(1, torch.cuda.device_count())


def register_configs(schema: Schema) -> None:
    """Store ``schema`` in Hydra's ConfigStore: the root ``base_config``, ``methods/base_<name>`` for
    every method and ``reference/base_<name>`` for every reference."""
    OmegaConf.register_new_resolver("visible_gpus", visible_gpus, replace=True)
    store = ConfigStore.instance()
    store.store(name="base_config", node=schema.root)
    for name, node in schema.methods.items():
        store.store(group="methods", name=f"base_{name}", node=node)
    for name, node in schema.references.items():
        store.store(group="reference", name=f"base_{name}", node=node)


def resolve_config(cfg: DictConfig) -> Any:
    """The composed config as typed objects (``Config`` with ``Recipe``, method settings ...).

    Every dataclass node is converted innermost first, so a range violation (``SettingsError``)
    or a missing value is reported as ``ConfigError`` with its full key.
    """
    for path, node in _dataclass_nodes(cfg, ""):
        known = {f.name for f in dataclasses.fields(OmegaConf.get_type(node))}
        unknown = [key for key in node.keys() if key not in known]
        if unknown:  # a '+key=value' override opens the schema; refuse what it added
            raise ConfigError(f"{path}.{unknown[0]}: not a key of {OmegaConf.get_type(node).__name__}; "
                              f"expected one of {', '.join(sorted(known))}")
        try:
            OmegaConf.to_object(node)
        except SettingsError as err:
            raise ConfigError(f"{path}.{err}") from None
        except OmegaConfBaseException as err:
            raise ConfigError(one_line(err)) from None
    try:
        return OmegaConf.to_object(cfg)
    except SettingsError as err:  # the root's own checks (store, results)
        raise ConfigError(str(err)) from None


def _dataclass_nodes(node: Any, path: str) -> list[tuple[str, DictConfig]]:
    """``(dotted path, node)`` of every nested structured (dataclass) node, children before parents."""
    out: list[tuple[str, DictConfig]] = []
    if not isinstance(node, DictConfig):
        return out
    for key in node.keys():
        if OmegaConf.is_missing(node, key) or OmegaConf.is_interpolation(node, key):
            continue
        out += _dataclass_nodes(node._get_node(key), f"{path}.{key}" if path else str(key))
    if path and dataclasses.is_dataclass(OmegaConf.get_type(node)):
        out.append((path, node))
    return out


def one_line(err: BaseException) -> str:
    """An OmegaConf/Hydra error as one line: ``full.key: message`` (their messages span lines
    and append the key, the types and Hydra's search path)."""
    cause = err
    while cause.__cause__ is not None and isinstance(cause.__cause__, OmegaConfBaseException):
        cause = cause.__cause__
    text = str(getattr(cause, "msg", None) or cause)
    text = text.split("\n    full_key:")[0].split("\nConfig search path:")[0]
    text = text.replace("Available options in", "available options in")
    message = " ".join(text.replace("\t", " ").split())
    key = getattr(cause, "full_key", None)
    return f"{key}: {message}" if key and not message.startswith(str(key)) else message


def _conf_dir() -> str:
    """The Hydra config folder: ``benchmark/conf`` inside an installed wheel (pyproject.toml ships
    the repository's ``conf/`` there as package data), else ``conf/`` at the root of the checkout
    this package is imported from (a checkout, an editable install)."""
    package = Path(__file__).resolve().parent
    installed = package / "conf"
    return str(installed if (installed / "config.yaml").is_file() else package.parent / "conf")


CONF_DIR = _conf_dir()


def compose(schema: Schema, overrides: Sequence[str] = (), config_dir: str = CONF_DIR) -> DictConfig:
    """The config of ``schema`` with command-line style ``overrides`` applied (Hydra's compose API),
    as ``python -m benchmark`` would compose it (without the ``hydra`` node). Inside a running
    ``python -m benchmark`` (Hydra already initialised, e.g. ``stage=verify`` composing another
    experiment's config) it composes with that app's config search path."""
    register_configs(schema)
    if GlobalHydra.instance().is_initialized():
        return hydra_compose(config_name="config", overrides=list(overrides))
    with initialize_config_dir(config_dir=config_dir, version_base="1.3"):
        return hydra_compose(config_name="config", overrides=list(overrides))
