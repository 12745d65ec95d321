"""Static facts about every dataset the suite knows: classes, channels, size, normalisation."""
from __future__ import annotations

from dataclasses import dataclass

# Mean/std of the digits train split (1437 images) after scaling to [0, 1] and the bilinear
# 8x8 -> 28x28 upsampling; tests/benchmark/core/data recomputes them from scikit-learn's data.
DIGITS_MEAN = (0.30538338,)
DIGITS_STD = (0.32470462,)
# The statistics of the paper authors' library (torch-uncertainty datamodules); for
# TinyImageNet it uses the ImageNet statistics.
MNIST_MEAN, MNIST_STD = (0.1307,), (0.3081,)
CIFAR100_MEAN, CIFAR100_STD = (0.5071, 0.4867, 0.4408), (0.2675, 0.2565, 0.2761)
TINYIMAGENET_MEAN, TINYIMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)

SPLITS = ("train", "test")


@dataclass(frozen=True)
class DatasetInfo:
    """What a model and the evaluation need to know about dataset ``name``.

    ``image_size`` is H = W in pixels of the tensors the loaders return, ``in_channels`` their
    C. ``mean``/``std`` (one value per channel, on the [0, 1] intensity scale) are the
    normalisation ``get_dataset`` applies. OOD-only sets (``default_ood`` is None) carry the
    statistics of the in-distribution set they are paired with in the paper, because they are
    only ever used processed like that set's test split. ``splits`` lists the valid
    ``split`` values (OOD-only sets built from a test split offer only ``"test"``). ``labels``:
    how the readers number the classes where that changed between versions of the suite (part of
    the experiment's config hash, so checkpoints trained on another numbering are stale).
    """

    name: str
    num_classes: int
    in_channels: int
    image_size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    default_ood: str | None
    splits: tuple[str, ...] = SPLITS
    labels: str = ""


_INFOS: dict[str, DatasetInfo] = {
    info.name: info
    for info in (
        DatasetInfo("digits", 10, 1, 28, DIGITS_MEAN, DIGITS_STD, "digits_ood"),
        # Labels of the patches say which scikit-learn sample image they were cut from.
        DatasetInfo("digits_ood", 2, 1, 28, DIGITS_MEAN, DIGITS_STD, None, ("test",)),
        DatasetInfo("mnist", 10, 1, 28, MNIST_MEAN, MNIST_STD, "fashionmnist"),
        DatasetInfo("fashionmnist", 10, 1, 28, MNIST_MEAN, MNIST_STD, None),
        DatasetInfo("cifar100", 100, 3, 32, CIFAR100_MEAN, CIFAR100_STD, "svhn"),
        DatasetInfo("svhn", 10, 3, 32, CIFAR100_MEAN, CIFAR100_STD, None),
        DatasetInfo("tinyimagenet", 200, 3, 64, TINYIMAGENET_MEAN, TINYIMAGENET_STD, "dtd",
                    labels="class i = line i of wnids.txt"),
        # Textures: the three DTD splits concatenated, resized to 64x64 (paper, appendix B.3.2).
        DatasetInfo("dtd", 47, 3, 64, TINYIMAGENET_MEAN, TINYIMAGENET_STD, None, ("test",)),
    )
}
DATASET_NAMES: tuple[str, ...] = tuple(_INFOS)


def dataset_info(name: str) -> DatasetInfo:
    """The ``DatasetInfo`` of ``name`` (one of ``DATASET_NAMES``); ValueError otherwise."""
    if name not in _INFOS:
        raise ValueError(f"dataset.name: unknown dataset {name!r}; expected one of {', '.join(DATASET_NAMES)}")
    return _INFOS[name]


def check_split(info: DatasetInfo, split: str) -> None:
    """Raise ValueError unless ``split`` is one of ``info.splits``."""
    if split not in info.splits:
        raise ValueError(
            f"split: unknown split {split!r} for dataset {info.name!r}; expected one of {', '.join(info.splits)}"
        )
