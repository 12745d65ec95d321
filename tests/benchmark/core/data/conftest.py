"""Tiny copies of every on-disk dataset, written once per session in the real formats."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from tests.benchmark.core.data import formats

TIN_WNIDS = ["n09999999", "n01443537", "n02124075"]  # unsorted on purpose: class i is line i of wnids.txt
RED, GREEN, BLUE, GREY = (200, 30, 40), (20, 180, 60), (10, 40, 220), (128, 128, 128)


@dataclass
class TinyData:
    root: Path
    arrays: dict = field(default_factory=dict)


def _uint8(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.integers(0, 256, size=shape, dtype=np.uint8)


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> TinyData:
    rng = np.random.default_rng(1234)
    data = TinyData(tmp_path_factory.mktemp("datasets"))
    for folder, key in (("MNIST", "mnist"), ("FashionMNIST", "fashionmnist")):
        splits = {split: (_uint8(rng, n, 28, 28), rng.integers(0, 10, n)) for split, n in (("train", 6), ("test", 4))}
        formats.write_mnist_like(data.root, folder, splits)
        data.arrays[key] = splits
    cifar = {split: (_uint8(rng, n, 32, 32, 3), rng.integers(0, 100, n)) for split, n in (("train", 5), ("test", 3))}
    formats.write_cifar100(data.root, cifar)
    data.arrays["cifar100"] = cifar
    svhn_labels = np.array([0, 1, 9, 5, 0])
    svhn_images = _uint8(rng, 5, 32, 32, 3)
    formats.write_svhn(data.root, "test", svhn_images, svhn_labels)
    data.arrays["svhn"] = {"test": (svhn_images, svhn_labels)}
    tin_train = {TIN_WNIDS[0]: [RED, GREEN], TIN_WNIDS[1]: [BLUE], TIN_WNIDS[2]: [GREY]}
    tin_val = [(TIN_WNIDS[2], RED), (TIN_WNIDS[0], BLUE), (TIN_WNIDS[1], GREEN)]
    formats.write_tinyimagenet(data.root, TIN_WNIDS, tin_train, tin_val)
    data.arrays["tinyimagenet"] = {"train": tin_train, "test": tin_val}
    dtd = {
        "train": [("banded", RED, (80, 120)), ("zigzagged", GREEN, (64, 64))],
        "val": [("banded", BLUE, (300, 200))],
        "test": [("zigzagged", GREY, (50, 50))],
    }
    formats.write_dtd(data.root, dtd)
    data.arrays["dtd"] = dtd
    return data
