"""Open the on-disk datasets through torchvision (and our TinyImageNet reader).

torchvision's own integrity checks (md5 of the CIFAR-100 pickles and SVHN ``.mat`` files)
stay on; its "Dataset not found" RuntimeError becomes a ``DatasetNotFoundError`` that names
the path searched and the override that fixes it.

The sets whose files are arrays (MNIST and FashionMNIST's IDX files, the CIFAR-100 pickles, the
SVHN ``.mat``) are held by torchvision as one uint8 array once opened: ``open_arrays`` hands that
array over (``[N, C, H, W]``) instead of one PIL image per item. The sets of image files
(TinyImageNet's 110,000 JPEGs, DTD's images of every size) have no such array;
``why_not_in_memory`` says why for each.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch.utils.data import ConcatDataset, Dataset
from torchvision import datasets

from benchmark.core.data.errors import DatasetNotFoundError
from benchmark.core.data.tinyimagenet import LAYOUT as TINYIMAGENET_LAYOUT
from benchmark.core.data.tinyimagenet import TinyImageNet

_IDX_FILES = "train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte"
_DTD_SPLITS = ("train", "val", "test")


def _dtd(root: Path, split: str, transform: Callable, download: bool) -> Dataset:
    # Only the paper's OOD use exists: all three splits of partition 1 = every DTD image once.
    return ConcatDataset(
        [datasets.DTD(root, split=part, partition=1, transform=transform, download=download) for part in _DTD_SPLITS]
    )


def _mnist_arrays(dataset: Dataset) -> tuple[torch.Tensor, torch.Tensor]:
    return dataset.data.unsqueeze(1), dataset.targets.to(torch.int64)  # data [N, 28, 28]


def _cifar_arrays(dataset: Dataset) -> tuple[torch.Tensor, torch.Tensor]:
    # data [N, 32, 32, 3] (HWC, as PIL reads it)
    return torch.from_numpy(np.ascontiguousarray(dataset.data.transpose(0, 3, 1, 2))), torch.as_tensor(dataset.targets, dtype=torch.int64, device="cpu")


def _svhn_arrays(dataset: Dataset) -> tuple[torch.Tensor, torch.Tensor]:
    # data [N, 3, 32, 32]; labels already map the .mat's 10 to digit 0
    return torch.from_numpy(np.ascontiguousarray(dataset.data)), torch.as_tensor(dataset.labels, dtype=torch.int64, device="cpu")


@dataclass(frozen=True)
class _OnDisk:
    # open(root, split, transform, download) -> Dataset
    open: Callable[[Path, str, Callable, bool], Dataset]
    # where torchvision looks, relative to root, for this split
    looked_in: Callable[[str], str]
    expected: str
    # arrays(dataset opened without transform) -> (images [N, C, H, W] uint8, labels [N] int64); None: image files
    arrays: Callable[[Dataset], tuple[torch.Tensor, torch.Tensor]] | None = None
    # for a set of image files (no arrays): why it is read image by image rather than held as tensors
    image_files: str | None = None

    def __post_init__(self) -> None:
        if (self.arrays is None) == (self.image_files is None):
            raise ValueError(f"an on-disk set has either arrays or the reason it is read as image files ({self.expected})")


_ON_DISK: dict[str, _OnDisk] = {
    "mnist": _OnDisk(
        lambda root, split, transform, download: datasets.MNIST(
            root, train=split == "train", transform=transform, download=download
        ),
        lambda split: "MNIST/raw",
        f"MNIST/raw/ with the uncompressed IDX files {_IDX_FILES}",
        _mnist_arrays,
    ),
    "fashionmnist": _OnDisk(
        lambda root, split, transform, download: datasets.FashionMNIST(
            root, train=split == "train", transform=transform, download=download
        ),
        lambda split: "FashionMNIST/raw",
        f"FashionMNIST/raw/ with the uncompressed IDX files {_IDX_FILES}",
        _mnist_arrays,
    ),
    "cifar100": _OnDisk(
        lambda root, split, transform, download: datasets.CIFAR100(
            root, train=split == "train", transform=transform, download=download
        ),
        lambda split: "cifar-100-python",
        "cifar-100-python/ with the official train, test and meta pickles (md5-checked)",
        _cifar_arrays,
    ),
    "svhn": _OnDisk(
        lambda root, split, transform, download: datasets.SVHN(
            root, split=split, transform=transform, download=download
        ),
        lambda split: f"{split}_32x32.mat",
        "the official train_32x32.mat / test_32x32.mat directly in data_dir (md5-checked)",
        _svhn_arrays,
    ),
    "tinyimagenet": _OnDisk(
        lambda root, split, transform, download: TinyImageNet(
            root, split=split, transform=transform, download=download
        ),
        lambda split: "tiny-imagenet-200",
        TINYIMAGENET_LAYOUT,
        image_files="its 110,000 JPEG files are decoded image by image (as float32 tensors the train split alone "
                    "would take 4.9 GB)",
    ),
    "dtd": _OnDisk(
        _dtd, lambda split: "dtd/dtd", "dtd/dtd/ with images/<class>/*.jpg and labels/{train,val,test}1.txt",
        image_files="its JPEG files have every size and are resized image by image",
    ),
}


def has_arrays(name: str) -> bool:
    """Whether on-disk dataset ``name`` is stored as one array (``open_arrays`` reads it)."""
    return _ON_DISK[name].arrays is not None


def why_not_in_memory(name: str) -> str | None:
    """For an on-disk set of image files, why it is read image by image; None for a set of arrays."""
    return _ON_DISK[name].image_files


def open_arrays(name: str, split: str, data_dir: str | Path, download: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Split ``split`` of on-disk dataset ``name`` (one with ``has_arrays``) as it is on disk:
    ``(images [N, C, H, W] uint8, labels [N] int64)``, the pixels every item of ``open_on_disk``
    would turn into a PIL image, in the same order. Errors as ``open_on_disk``."""
    spec = _ON_DISK[name]
    if spec.arrays is None:
        raise ValueError(f"dataset {name!r}: {spec.image_files}; it has no array to read")
    return spec.arrays(open_on_disk(name, split, data_dir, download, None))


def open_on_disk(name: str, split: str, data_dir: str | Path, download: bool, transform: Callable | None) -> Dataset:
    """On-disk dataset ``name`` (mnist, fashionmnist, cifar100, svhn, tinyimagenet, dtd), split ``"train"``/``"test"``, from
    ``data_dir`` (downloaded there first when ``download``); items ``(transform(PIL image), label)``.

    Raises ``DatasetNotFoundError`` naming the searched path when the files are missing (or,
    for CIFAR-100/SVHN, fail torchvision's md5 check).
    """
    spec = _ON_DISK[name]
    root = Path(data_dir).expanduser()
    try:
        return spec.open(root, split, transform, download)
    except RuntimeError as error:
        if "not found" not in str(error):
            raise
        raise DatasetNotFoundError(name, root / spec.looked_in(split), spec.expected, f"torchvision: {error}") from error
