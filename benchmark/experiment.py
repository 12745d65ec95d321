"""Everything a stage derives from the Hydra config: model, data, recipe, store, device, threads."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Iterator

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from benchmark.data import DatasetInfo, as_tensors, dataset_info, get_dataset, get_ood_dataset
from benchmark.models import build_model
from benchmark.store import ExperimentStore
from benchmark.training import Recipe


def stable_hash(payload: Any, length: int = 16) -> str:
    """Hex SHA-256 prefix of ``payload`` as key-sorted JSON: the same settings, the same hash."""
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:length]


def resolve_device(name: str) -> torch.device:
    """``auto`` -> CUDA when available else CPU; otherwise ``torch.device(name)``."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise ValueError(f"device={name!r}: not a torch device; use auto, cpu, cuda or cuda:N") from err
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r}: CUDA is not available on this machine; use device=cpu or device=auto")
    return device


def threads_per_job(setting: Any, parallel_jobs: int) -> int:
    """torch intra-op threads for one job: ``auto`` = cores // jobs sharing the machine (>= 1)."""
    if setting == "auto":
        return max(1, (os.cpu_count() or 1) // max(1, parallel_jobs))
    threads = int(setting)
    if threads < 1:
        raise ValueError(f"threads={setting!r}: expected auto or a positive integer")
    return threads


def library_versions() -> dict[str, str]:
    """Versions recorded in every checkpoint's metadata."""
    import safetensors
    import torchvision

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "safetensors": safetensors.__version__,
    }


@dataclass
class Experiment:
    """The resolved experiment of a config: ``cfg`` is the full Hydra config."""

    cfg: DictConfig

    @property
    def name(self) -> str:
        return str(self.cfg.experiment_name)

    @cached_property
    def info(self) -> DatasetInfo:
        return dataset_info(str(self.cfg.dataset.name))

    @cached_property
    def recipe(self) -> Recipe:
        return Recipe.from_config(self.cfg.train)

    @cached_property
    def device(self) -> torch.device:
        return resolve_device(str(self.cfg.device))

    @cached_property
    def store(self) -> ExperimentStore:
        return ExperimentStore(Path(str(self.cfg.store)), self.name)

    @cached_property
    def config_hash(self) -> str:
        """Hash of what determines a zoo checkpoint: model, dataset and training recipe."""
        payload = {
            "model": OmegaConf.to_container(self.cfg.model, resolve=True),
            "dataset": {k: self.cfg.dataset[k] for k in ("name", "augment")},
            "train": OmegaConf.to_container(self.cfg.train, resolve=True),
        }
        return stable_hash(payload)

    def model(self, dropout: float = 0.0) -> nn.Module:
        """A fresh model of the experiment (initialised from torch's global RNG)."""
        extra = self.cfg.model.get("kwargs")
        kwargs = dict(OmegaConf.to_container(extra, resolve=True)) if extra else {}
        return build_model(
            str(self.cfg.model.name), num_classes=self.info.num_classes, in_channels=self.info.in_channels,
            dropout=dropout, **kwargs,
        )

    @property
    def native_cpu_conv(self) -> bool:
        """``model.cpu_native_conv`` on a CPU run: PyTorch's native convolution instead of
        oneDNN/NNPACK (several times faster for OptuNet's tiny convolutions)."""
        return self.device.type == "cpu" and bool(self.cfg.model.get("cpu_native_conv", False))

    @contextlib.contextmanager
    def backends(self) -> Iterator[None]:
        """Apply the model config's backend switches inside the block, restore them after."""
        if not self.native_cpu_conv:
            yield
            return
        saved = torch.backends.mkldnn.enabled
        torch.backends.mkldnn.enabled = False
        try:
            with torch.backends.nnpack.flags(enabled=False):
                yield
        finally:
            torch.backends.mkldnn.enabled = saved

    def configure_backends(self) -> None:
        """Apply the model config's backend switches for the rest of the process."""
        if self.native_cpu_conv:
            torch.backends.mkldnn.enabled = False
            torch.backends.nnpack.set_flags(False)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Key -> shape of the plain model's state dict."""
        return {k: tuple(v.shape) for k, v in self.model().state_dict().items()}

    def _data(self, key: str) -> dict[str, Any]:
        ds = self.cfg.dataset
        return {"data_dir": str(ds.data_dir), "download": bool(ds.download), **({"augment": bool(ds.augment)} if key == "train" else {})}

    @cached_property
    def train_set(self):
        return get_dataset(self.info.name, "train", **self._data("train"))

    @cached_property
    def train_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Un-augmented train split in memory (for reported train accuracy and Laplace fits)."""
        data = self._data("test")
        return as_tensors(get_dataset(self.info.name, "train", data["data_dir"], data["download"], augment=False))

    @cached_property
    def test_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """ID test split in memory: ``(images [N, C, H, W], labels [N])``."""
        data = self._data("test")
        return as_tensors(get_dataset(self.info.name, "test", data["data_dir"], data["download"]))

    @cached_property
    def ood_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """OOD set in memory, processed like the ID test set."""
        data = self._data("test")
        return as_tensors(get_ood_dataset(str(self.cfg.dataset.ood), self.info.name, data["data_dir"], data["download"]))
