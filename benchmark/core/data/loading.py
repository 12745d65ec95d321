"""``get_dataset`` / ``get_ood_dataset``: every dataset of the suite, processed as the paper does."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import Dataset, Subset

from benchmark.core.data.digits import black_pixel_value, digits_tensors
from benchmark.core.data.in_memory import NOT_IN_MEMORY_REASON, InMemoryImageDataset
from benchmark.core.data.info import check_split, dataset_info
from benchmark.core.data.on_disk import has_arrays, open_arrays, open_on_disk, why_not_in_memory
from benchmark.core.data.transforms import CROP_PADDING, black_fill, eval_transform, levels, normalised_arrays, train_transform

_EMBEDDED = ("digits", "digits_ood")
# On-disk sets whose images vary in size: always resized to the target size.
_VARIABLE_SIZE = frozenset({"dtd"})
# The paper keeps "a fixed set of 10,000" SVHN test images as OOD set (appendix B.3.2).
OOD_MAX_ITEMS = {"svhn": 10_000}
OOD_SUBSET_SEED = 0
VALIDATION_SEED = 0


def memory_problem(name: str) -> str | None:
    """Why dataset ``name`` (augmented or not) is not served from in-memory tensors, or None when it is. The one place that decides: ``get_dataset`` follows it,
    and whoever needs tensors (the vectorised zoo trainer) reports its reason (``in_memory_problem``).

    In memory: the embedded digits, and every on-disk set stored as one array (MNIST,
    FashionMNIST, CIFAR-100, SVHN: read once, normalised as a whole with the PIL path's exact
    steps); the random crop (with the per-channel black padding, and the horizontal flip of RGB
    sets) then runs on the tensors, on the trainer's device. Not: the sets of image files
    (TinyImageNet, DTD).
    """
    if name in _EMBEDDED:
        return None
    if not has_arrays(name):
        return f"dataset {name}: {why_not_in_memory(name)}"
    return None


def get_dataset(
    name: str, split: str, data_dir: str | Path, download: bool = False, augment: bool = False
) -> Dataset:
    """Dataset ``name`` (see ``DATASET_NAMES``), ``split`` ``"train"`` or ``"test"``.

    Items: ``(image [C, H, W] float32 normalised with dataset_info(name).mean/std, label int)``.
    ``augment`` applies the paper's training augmentation to the train split only (random
    crop with padding 4, plus a horizontal flip for RGB sets); test splits are normalised
    only. Where ``memory_problem`` allows, the split is read once into an ``InMemoryImageDataset``
    (the same values as the PIL path; the crop is drawn from torch's RNG or the trainer's
    generator instead of torchvision's); otherwise items are read through torchvision one at a
    time, and the dataset carries the reason (``in_memory_problem``). ``data_dir``/``download``
    locate on-disk sets and are ignored by the embedded ``digits``/``digits_ood``.
    ``dtd``'s only split, ``"test"``, is all three DTD splits concatenated, resized to 64x64.
    Raises ValueError for unknown names/splits, ``DatasetNotFoundError`` for missing files.
    """
    info = dataset_info(name)
    check_split(info, split)
    augment = augment and split == "train"
    if name in _EMBEDDED:
        images, labels = digits_tensors("ood" if name == "digits_ood" else split)
        return InMemoryImageDataset(images, labels, CROP_PADDING if augment else 0, black_pixel_value())
    problem = memory_problem(name)
    if problem is None:
        images, labels = open_arrays(name, split, data_dir, download)
        black = black_fill(info)  # the crop's zero padding of the uint8 image, normalised (per channel)
        fill = (float(black[0]) if info.in_channels == 1 else black) if augment else 0.0
        return InMemoryImageDataset(normalised_arrays(images, info), labels, CROP_PADDING if augment else 0, fill,
                                    codes=(images, levels(info)), flip=augment and info.in_channels == 3)
    if split == "train":
        transform = train_transform(info, augment)
    else:
        transform = eval_transform(info, resize=name in _VARIABLE_SIZE)
    dataset = open_on_disk(name, split, data_dir, download, transform)
    setattr(dataset, NOT_IN_MEMORY_REASON, problem)
    return dataset


@dataclass(frozen=True)
class TrainSplit:
    """The official train split of a dataset, less a held-out validation part: ``train`` (augmented
    as asked), ``train_plain`` (the same images un-augmented) and ``validation`` (un-augmented;
    None when no validation part is carved)."""

    train: Dataset
    train_plain: Dataset
    validation: Dataset | None


def get_train_split(
    name: str, data_dir: str | Path, download: bool = False, augment: bool = False, validation_fraction: float = 0.0,
) -> TrainSplit:
    """Dataset ``name``'s train split with a stratified ``validation_fraction`` of it held out
    (per class, ``round(fraction * class size)`` images drawn with a fixed seed), so that a
    convergence rule is never judged on the test set nor on training images."""
    if not 0.0 <= validation_fraction < 1.0:
        raise ValueError(f"dataset.validation_fraction={validation_fraction}: expected a fraction in [0, 1)")
    train = get_dataset(name, "train", data_dir, download, augment=augment)
    if not augment:
        plain = train
    elif isinstance(train, InMemoryImageDataset):  # the same tensors, served un-augmented
        plain = InMemoryImageDataset(train.images, train.labels, codes=train.codes)
    else:
        plain = get_dataset(name, "train", data_dir, download, augment=False)
    if validation_fraction == 0.0:
        return TrainSplit(train, plain, None)
    train_idx, val_idx = stratified_split(dataset_labels(plain), validation_fraction)
    return TrainSplit(subset(train, train_idx), subset(plain, train_idx), subset(plain, val_idx))


def dataset_labels(dataset: Dataset) -> torch.Tensor:
    """Labels ``[N]`` of a dataset without loading its images (in-memory or torchvision ``targets``)."""
    if isinstance(dataset, InMemoryImageDataset):
        return dataset.labels
    targets = getattr(dataset, "targets", None)
    if targets is None:
        raise ValueError(f"{type(dataset).__name__}: no labels to stratify a validation split on (no .targets)")
    return torch.as_tensor(targets, dtype=torch.int64)


def stratified_split(labels: torch.Tensor, fraction: float, seed: int = VALIDATION_SEED) -> tuple[torch.Tensor, torch.Tensor]:
    """``(kept indices, held-out indices)``, both sorted: per class, ``round(fraction * count)``
    indices drawn at random with ``seed`` are held out."""
    generator = torch.Generator().manual_seed(seed)
    held = []
    for label in torch.unique(labels).tolist():
        members = torch.nonzero(labels == label).flatten()
        chosen = members[torch.randperm(len(members), generator=generator)[: round(fraction * len(members))]]
        held.append(chosen)
    held_out = torch.cat(held).sort().values
    mask = torch.ones(len(labels), dtype=torch.bool, device=labels.device)
    mask[held_out] = False
    return torch.nonzero(mask).flatten(), held_out


def subset(dataset: Dataset, indices: torch.Tensor) -> Dataset:
    """The items ``indices`` of ``dataset``; an in-memory dataset stays in memory (fast batches)."""
    if isinstance(dataset, InMemoryImageDataset):
        return dataset.subset(indices)
    return Subset(dataset, indices.tolist())


def get_ood_dataset(ood_name: str, id_name: str, data_dir: str | Path, download: bool = False) -> Dataset:
    """OOD set ``ood_name``'s test split processed like ``id_name``'s test split.

    Items: ``(image [C, H, W] float32, label int)`` with ``id_name``'s channels, size
    (resized when they differ, and always for DTD) and normalisation; labels are the OOD
    set's own and carry no meaning for the ID task. SVHN is cut to a fixed, seeded subset of
    ``OOD_MAX_ITEMS["svhn"]`` images as in the paper. The embedded ``digits_ood`` pairs only
    with ``digits``. Raises ValueError for unknown names or a channel mismatch.
    """
    check_ood_pairing(ood_name, id_name)
    ood, target = dataset_info(ood_name), dataset_info(id_name)
    if ood_name in _EMBEDDED:
        return get_dataset(ood_name, "test", data_dir, download)
    resize = ood_name in _VARIABLE_SIZE or ood.image_size != target.image_size
    problem = memory_problem(ood_name)
    if not resize and problem is None:
        images, labels = open_arrays(ood_name, "test", data_dir, download)
        dataset = InMemoryImageDataset(normalised_arrays(images, target), labels)
    else:
        dataset = open_on_disk(ood_name, "test", data_dir, download, eval_transform(target, resize=resize))
        setattr(dataset, NOT_IN_MEMORY_REASON, problem or f"dataset {ood_name}: resized image by image")
    return fixed_subset(dataset, OOD_MAX_ITEMS.get(ood_name))


def check_ood_pairing(ood_name: str, id_name: str) -> None:
    """Raise ValueError (naming ``dataset.ood``) unless ``ood_name`` can serve as OOD set of ``id_name``:
    the same number of channels, and the embedded sets only with each other."""
    ood, target = dataset_info(ood_name), dataset_info(id_name)
    if (ood_name in _EMBEDDED) != (id_name in _EMBEDDED):
        raise ValueError(
            f"dataset.ood={ood_name}: cannot serve as OOD set of {id_name!r}: the embedded sets "
            f"({', '.join(_EMBEDDED)}) pair only with each other"
        )
    if ood.in_channels != target.in_channels:
        raise ValueError(
            f"dataset.ood={ood_name}: has {ood.in_channels} channel(s) but {id_name!r} has "
            f"{target.in_channels}; pick an OOD set with the same channels"
        )


def fixed_subset(dataset: Dataset, max_items: int | None, seed: int = OOD_SUBSET_SEED) -> Dataset:
    """``dataset`` itself when it has at most ``max_items`` items (or ``max_items`` is None),
    else a ``Subset`` of ``max_items`` indices drawn without replacement with ``seed``, in
    increasing order, so the same files always give the same subset."""
    size = len(dataset)
    if max_items is None or size <= max_items:
        return dataset
    generator = torch.Generator().manual_seed(seed)
    indices = torch.randperm(size, generator=generator)[:max_items].sort().values
    return subset(dataset, indices)
