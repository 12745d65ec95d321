"""Open the on-disk datasets through torchvision (and our TinyImageNet reader).

torchvision's own integrity checks (md5 of the CIFAR-100 pickles and SVHN ``.mat`` files)
stay on; its "Dataset not found" RuntimeError becomes a ``DatasetNotFoundError`` that names
the path searched and the override that fixes it.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

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


@dataclass(frozen=True)
class _OnDisk:
    # open(root, split, transform, download) -> Dataset
    open: Callable[[Path, str, Callable, bool], Dataset]
    # where torchvision looks, relative to root, for this split
    looked_in: Callable[[str], str]
    expected: str


_ON_DISK: dict[str, _OnDisk] = {
    "mnist": _OnDisk(
        lambda root, split, transform, download: datasets.MNIST(
            root, train=split == "train", transform=transform, download=download
        ),
        lambda split: "MNIST/raw",
        f"MNIST/raw/ with the uncompressed IDX files {_IDX_FILES}",
    ),
    "fashionmnist": _OnDisk(
        lambda root, split, transform, download: datasets.FashionMNIST(
            root, train=split == "train", transform=transform, download=download
        ),
        lambda split: "FashionMNIST/raw",
        f"FashionMNIST/raw/ with the uncompressed IDX files {_IDX_FILES}",
    ),
    "cifar100": _OnDisk(
        lambda root, split, transform, download: datasets.CIFAR100(
            root, train=split == "train", transform=transform, download=download
        ),
        lambda split: "cifar-100-python",
        "cifar-100-python/ with the official train, test and meta pickles (md5-checked)",
    ),
    "svhn": _OnDisk(
        lambda root, split, transform, download: datasets.SVHN(
            root, split=split, transform=transform, download=download
        ),
        lambda split: f"{split}_32x32.mat",
        "the official train_32x32.mat / test_32x32.mat directly in data_dir (md5-checked)",
    ),
    "tinyimagenet": _OnDisk(
        lambda root, split, transform, download: TinyImageNet(
            root, split=split, transform=transform, download=download
        ),
        lambda split: "tiny-imagenet-200",
        TINYIMAGENET_LAYOUT,
    ),
    "dtd": _OnDisk(
        _dtd, lambda split: "dtd/dtd", "dtd/dtd/ with images/<class>/*.jpg and labels/{train,val,test}1.txt"
    ),
}

def open_on_disk(name: str, split: str, data_dir: str | Path, download: bool, transform: Callable) -> Dataset:
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
