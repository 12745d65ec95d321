"""Everything a stage derives from the config: store, device, data, model factory, seed ranges,
the zoo trainer, and the methods built from their typed settings. Only runners use it.

Settings are read from ``exp.config`` (the typed root ``Config``); ``Experiment`` adds only what
is derived from them (objects, resolved choices, checks)."""
from __future__ import annotations

import contextlib
import json
import logging
import os
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Iterator

import torch
from omegaconf import DictConfig
from torch import nn

from benchmark.design import Design
from benchmark.config import Config, ConfigError, Precision, resolve_config
from benchmark.core.data import (
    DatasetInfo, TrainSplit, as_tensors, check_ood_pairing, dataset_info, get_dataset, get_ood_dataset, get_train_split,
)
from benchmark.core.fingerprint import stable_hash
from benchmark.core.models import build_model
from benchmark.core.store import MAX_SEED, ExperimentStore
from benchmark.core.training import Acceleration, Recipe, TrainingData
from benchmark.core.training.stacked import NotStackableError, stacked_networks
from benchmark.core.training.vectorised import AUTO_NETWORKS, check_stackable, networks_that_fit
from benchmark.core.settings import SettingsError
from methods import MethodConfigError, PosteriorMethod, method_class, selected
from methods.modes import ModePlan

log = logging.getLogger(__name__)


def job_number() -> int:
    """This job's number in a Hydra sweep (``hydra.job.num``); 0 outside a sweep."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return 0
    return int(HydraConfig.get().job.get("num", 0) or 0)


def resolve_device(name: str, job: int | None = None) -> torch.device:
    """``auto`` -> CUDA when available else CPU; ``per_job`` -> ``cuda:(job mod the visible GPUs)``
    (``job``: the sweep's job number, ``job_number()`` if None: one worker per GPU of a node,
    ``cluster=gpu_node``); otherwise ``torch.device(name)``."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "per_job":
        if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
            raise ConfigError("device=per_job: one worker per GPU, but this machine has no CUDA device; "
                              "use device=cpu (or cluster=local)")
        return torch.device("cuda", (job_number() if job is None else job) % torch.cuda.device_count())
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise ConfigError(f"device={name!r}: not a torch device; use auto, cpu, cuda, cuda:N or per_job") from err
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={name!r}: CUDA is not available on this machine; use device=cpu or device=auto")
    return device


def available_cores() -> int:
    """CPU cores this process may run on: its affinity mask (what a SLURM allocation or a
    container grants), else the machine's count."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def threads_per_job(setting: str, parallel_jobs: int, sweep_job: bool) -> int:
    """torch intra-op threads for one process: ``auto`` = every available core when the process
    is not a job of a multirun sweep (``sweep_job`` false: a plain ``python -m benchmark ...``
    runs alone), available cores // ``cluster.parallel_jobs`` (the jobs sharing them, >= 1) when it
    is; an integer as given."""
    if str(setting) == "auto":
        return max(1, available_cores() // (max(1, parallel_jobs) if sweep_job else 1))
    try:
        threads = int(setting)
    except ValueError:
        threads = 0
    if threads < 1:
        raise ConfigError(f"threads={setting!r}: expected auto or a positive integer")
    return threads


@dataclass(frozen=True)
class SeedRange:
    """Seeds ``[start, stop)`` of one role (``reference`` or ``heldout``)."""

    role: str
    start: int
    stop: int

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.stop))

    def __len__(self) -> int:
        return self.stop - self.start

    def __contains__(self, seed: object) -> bool:
        return isinstance(seed, int) and self.start <= seed < self.stop

    def __str__(self) -> str:
        return f"[{self.start}, {self.stop})"


def seed_ranges(seeds: Any) -> tuple[SeedRange, SeedRange]:
    """``(reference, heldout)`` from ``seeds``; refuses malformed or overlapping ranges."""
    ranges = []
    for role in ("reference", "heldout"):
        value = list(getattr(seeds, role))
        if len(value) != 2 or not 0 <= value[0] <= value[1] <= MAX_SEED + 1:
            raise ConfigError(f"seeds.{role}={value}: expected [start, stop) with 0 <= start <= stop <= {MAX_SEED + 1}")
        ranges.append(SeedRange(role, int(value[0]), int(value[1])))
    reference, heldout = ranges
    if reference.start < heldout.stop and heldout.start < reference.stop and len(reference) and len(heldout):
        raise ConfigError(
            f"seeds.reference={[reference.start, reference.stop]} and seeds.heldout={[heldout.start, heldout.stop]} "
            "overlap: the methods' base networks and Deep-Ensemble members must not be reference checkpoints"
        )
    return reference, heldout


@dataclass(frozen=True)
class ZooTrainer:
    """How the zoo stage trains, decided once per run (``Experiment.zoo_trainer``): ``stacked``
    (the vectorised trainer, at most ``networks`` per stack) or one at a time; ``reason``: why not
    stacked; ``stacks``: stacks one process trains at once (on a CPU one per torch thread, each
    stack's packed kernels on a core of their own; one on a GPU and one at a time), sized together
    with ``networks`` so that all of them fit in memory."""

    stacked: bool
    networks: int
    reason: str | None = None
    stacks: int = 1

    @property
    def name(self) -> str:
        """The ``trainer`` metadata of the checkpoints it trains (not K: a stacked network's result
        does not depend on how many train beside it)."""
        return "vectorised" if self.stacked else "one at a time"


class Experiment:
    """The resolved experiment of a config. ``config`` is the typed root ``Config``; ``reference``
    and ``heldout`` are the zoo's two seed ranges (``SeedRange``: ``seeds.reference``, the reference
    range, whose converged checkpoints are the reference zoo; ``seeds.heldout``, the base networks
    and Deep-Ensemble members), not the reference plug-in a run scores against (``config.reference``)."""

    config: Config

    def __init__(self, cfg: DictConfig | Config) -> None:
        self.config = resolve_config(cfg) if isinstance(cfg, DictConfig) else cfg
        self.reference, self.heldout = seed_ranges(self.config.seeds)
        if self.config.train.fail_rule.active and self.config.dataset.validation_fraction == 0:
            raise ConfigError(
                f"train.fail_rule={{epoch: {self.config.train.fail_rule.epoch}, min_accuracy: "
                f"{self.config.train.fail_rule.min_accuracy}}} needs held-out data to be judged on: set "
                "dataset.validation_fraction > 0 (never the test set)"
            )

    @property
    def name(self) -> str:
        return str(self.config.experiment_name)

    @property
    def display_name(self) -> str:
        return str(self.config.display_name)

    @cached_property
    def info(self) -> DatasetInfo:
        return dataset_info(self.config.dataset.name.value)

    @property
    def recipe(self) -> Recipe:
        return self.config.train

    @cached_property
    def device(self) -> torch.device:
        return resolve_device(str(self.config.device))

    @cached_property
    def acceleration(self) -> Acceleration:
        """Mixed precision and memory format of the zoo's one-at-a-time training (``precision``,
        ``channels_last``). ``auto`` turns both on for CUDA training of networks with BatchNorm
        convolutions (ResNet-18: tensor cores, NHWC cuDNN kernels) and off elsewhere: on a CPU and
        for OptuNet's one- and two-channel convolutions they do not pay."""
        precision, channels_last, device = self.config.precision, self.config.channels_last, self.device
        heavy = device.type == "cuda" and any(isinstance(m, nn.BatchNorm2d) for m in self.model().modules())
        if precision == Precision.fp16 and device.type != "cuda":
            raise ConfigError(f"precision=fp16: float16 training with loss scaling needs CUDA (device {device}); "
                              "use precision=bf16 or precision=fp32")
        if precision == Precision.auto:
            precision = (Precision.bf16 if torch.cuda.is_bf16_supported() else Precision.fp16) if heavy else Precision.fp32
        dtype = {Precision.fp32: None, Precision.bf16: torch.bfloat16, Precision.fp16: torch.float16}[precision]
        return Acceleration(dtype, heavy if channels_last is None else bool(channels_last))

    @cached_property
    def store(self) -> ExperimentStore:
        claims = self.config.claims
        return ExperimentStore(Path(self.config.store), self.name, claims.timeout_s, claims.heartbeat_s,
                               claims.group_shared)

    @property
    def results_dir(self) -> Path:
        """``results/<experiment>/``."""
        return Path(self.config.results) / self.name

    @cached_property
    def recipe_config(self) -> dict[str, Any]:
        """What determines a zoo checkpoint, as plain JSON values: model, dataset (with its class
        numbering where that changed between versions: ``DatasetInfo.labels``) and training recipe.
        Recorded in every checkpoint (``config``), so that a zoo of another recipe is named field by field."""
        dataset = self.config.dataset
        data = {"name": dataset.name.value, "augment": dataset.augment}
        if self.info.labels:
            data["labels"] = self.info.labels
        payload = {"model": asdict(self.config.model), "dataset": data, "train": self.recipe.identity()}
        return json.loads(json.dumps(payload, sort_keys=True, default=lambda v: getattr(v, "value", str(v))))

    @cached_property
    def config_hash(self) -> str:
        """Hash of ``recipe_config``: what determines a zoo checkpoint."""
        return stable_hash(self.recipe_config)

    def model(self, dropout: float = 0.0) -> nn.Module:
        """A fresh model of the experiment (initialised from torch's global RNG): the model
        factory the methods are built with."""
        model = self.config.model
        return build_model(
            model.name.value, num_classes=self.info.num_classes, in_channels=self.info.in_channels,
            dropout=dropout, **dict(model.kwargs),
        )

    @contextlib.contextmanager
    def backends(self) -> Iterator[None]:
        """Inside the block, PyTorch's native CPU convolution instead of oneDNN/NNPACK when
        ``model.cpu_native_conv`` is set on a CPU run (several times faster for OptuNet's tiny
        convolutions), and on CUDA TensorFloat-32 as ``tf32`` says (matmuls and cuDNN convolutions);
        the switches are restored after."""
        if self.device.type == "cuda":
            saved_tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = bool(self.config.tf32)
            try:
                yield
            finally:
                torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved_tf32
            return
        if not (self.device.type == "cpu" and self.config.model.cpu_native_conv):
            yield
            return
        saved = torch.backends.mkldnn.enabled
        torch.backends.mkldnn.enabled = False
        try:
            with torch.backends.nnpack.flags(enabled=False):
                yield
        finally:
            torch.backends.mkldnn.enabled = saved

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Key -> shape of the plain model's state dict."""
        return {k: tuple(v.shape) for k, v in self.model().state_dict().items()}

    def _location(self) -> tuple[str, bool]:
        dataset = self.config.dataset
        return str(dataset.data_dir), bool(dataset.download)

    @cached_property
    def train_split(self) -> TrainSplit:
        """The official train split less ``dataset.validation_fraction`` of it held out."""
        dataset = self.config.dataset
        return get_train_split(self.info.name, *self._location(), augment=bool(dataset.augment),
                               validation_fraction=float(dataset.validation_fraction))

    @property
    def train_set(self):
        """The training stream (augmented as ``dataset.augment`` says), without the validation part."""
        return self.train_split.train

    @cached_property
    def train_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The training images un-augmented, in memory (reported train accuracy, Laplace and SGHMC)."""
        return as_tensors(self.train_split.train_plain)

    @cached_property
    def validation_tensors(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The held-out validation part of the train split in memory (None when there is none)."""
        validation = self.train_split.validation
        return None if validation is None else as_tensors(validation)

    @cached_property
    def test_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """ID test split in memory: ``(images [N, C, H, W], labels [N])``."""
        return as_tensors(get_dataset(self.info.name, "test", *self._location()))

    @cached_property
    def ood_dataset(self):
        """The OOD set, processed like the ID test set (not yet in memory)."""
        return get_ood_dataset(self.config.dataset.ood.value, self.info.name, *self._location())

    @cached_property
    def ood_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """OOD set in memory, processed like the ID test set."""
        return as_tensors(self.ood_dataset)

    @property
    def training_data(self) -> TrainingData:
        """What the zoo and the methods train on; the convergence rule is judged on the validation part."""
        return TrainingData(train=self.train_set, train_tensors=self.train_tensors, check=self.validation_tensors)

    def check_data(self) -> None:
        """Refuse, before any work, an OOD set that does not pair with the ID set, or data that is
        not on disk (``DatasetNotFoundError`` naming the folder and the download option)."""
        dataset = self.config.dataset
        check_ood_pairing(dataset.ood.value, self.info.name)
        get_dataset(self.info.name, "train", *self._location())
        get_dataset(self.info.name, "test", *self._location())
        _ = self.ood_dataset

    @cached_property
    def zoo_trainer(self) -> ZooTrainer:
        """How the zoo trains (``zoo.vectorize``), decided once: ``auto`` stacks as many networks as
        fit in memory (on a CPU at most ``AUTO_NETWORKS``, where a larger stack is no faster; on a GPU
        as many as half its free memory holds), or trains one at a time where the architecture or
        the data cannot be stacked (the reason is logged); an explicit K that cannot be stacked or
        does not fit raises ``ConfigError`` naming the value to use; 1 = one at a time."""
        wanted = self.config.zoo.networks_at_once
        if wanted == 1:
            return ZooTrainer(False, 1, "zoo.vectorize=1")
        try:
            check_stackable(self.train_set)
            template = stacked_networks(self.model().to(self.device), self.device)
        except NotStackableError as err:
            if wanted is not None:
                raise ConfigError(f"zoo.vectorize={wanted}: {self.name} cannot be trained stacked ({err}); "
                                  "use zoo.vectorize=1 or zoo.vectorize=auto") from None
            log.info("zoo: one network at a time (%s)", err)
            return ZooTrainer(False, 1, str(err))
        del template
        shape = (self.info.in_channels, self.info.image_size, self.info.image_size)
        stacks = max(1, torch.get_num_threads()) if self.device.type == "cpu" else 1
        fit, per_network, available = networks_that_fit(self.model().to(self.device), shape,
                                                        self.config.train.batch_size, self.device, stacks=stacks)
        if wanted is None:
            return ZooTrainer(True, max(1, min(AUTO_NETWORKS, fit) if self.device.type == "cpu" else fit), stacks=stacks)
        if wanted > fit:
            at_once = f" in each of the {stacks} stacks trained at once (one per torch thread)" if stacks > 1 else ""
            raise ConfigError(
                f"zoo.vectorize={wanted}: {wanted} networks{at_once} need about {wanted * stacks * per_network / 2**30:.2f} "
                f"GiB on {self.device}, more than half of the {available / 2**30:.2f} GiB available; use "
                f"zoo.vectorize={max(1, fit)} (or zoo.vectorize=auto{', or fewer threads' if stacks > 1 else ''})")
        return ZooTrainer(True, wanted, stacks=stacks)

    def method_settings(self, name: str) -> Any:
        """The typed settings of method ``name`` (``methods.<name>``)."""
        return getattr(self.config.methods, name)

    def build_method(self, name: str) -> PosteriorMethod:
        """Method ``name`` built from the model factory, the data, its settings and the recipe."""
        cls = method_class(name)
        return cls(self.model, self.training_data, self.method_settings(name), recipe=self.recipe, device=self.device)

    @cached_property
    def design(self) -> Design:
        """The repetition design of the config's ``sample`` node (``benchmark.design``)."""
        return Design.of(self.config.sample)

    def planned_methods(self) -> tuple[list[tuple[PosteriorMethod, ModePlan]], list[str]]:
        """Every method x mode that ``method=`` and ``mode=`` select, built and checked before any
        training: ``([(method, plan without candidate bases)], [skipped "name/mode: why"])``, each
        plan with one repetition's ``(bases, samples per base)`` from the design
        (``Design.plan_counts``). Under ``method=all`` a method the experiment marks ``unavailable`` is
        skipped. Raises ``MethodConfigError`` listing every refused combination (bad
        method/model/mode, sample counts that do not split) and ``ConfigError`` for a setting out
        of range."""
        method, mode = self.config.method.value, self.config.mode.value
        planned, skipped, refused = [], [], []
        for name, m in selected(method, mode):
            instance = self.build_method(name)
            if method == "all" and instance.settings.unavailable:
                skipped.append(f"{name}/{m}: {instance.settings.unavailable}")
                continue
            try:
                instance.check(m)
                bases, per_base = self.design.plan_counts(instance, m)
            except SettingsError as err:
                raise ConfigError(f"methods.{name}.{err}") from None
            except MethodConfigError as err:
                refused.append(f"{name}/{m}: {err}")
                continue
            planned.append((instance, ModePlan(m, (), bases, per_base)))
        if refused:
            raise MethodConfigError(f"{len(refused)} method/mode unit(s) refused before any work: {'; '.join(refused)}")
        return planned, skipped
