"""Datasets of the suite: the embedded digits experiment and the paper's torchvision-backed sets.

``get_dataset(name, split, data_dir, download, augment)`` and
``get_ood_dataset(ood_name, id_name, data_dir, download)`` return datasets of
``(image [C, H, W] float32 normalised, label int)``; ``as_tensors`` materialises one;
``memory_problem`` decides which are served from in-memory tensors (and says why not);
``dataset_info`` gives classes, channels, size and normalisation of each name.
"""
from benchmark.core.data.errors import DatasetNotFoundError
from benchmark.core.data.in_memory import (
    InMemoryImageDataset, as_in_memory, crop_at, crop_offsets, decode, epoch_crop_offsets, flip_draws, flip_where,
    in_memory_problem, random_crop,
)
from benchmark.core.data.info import DATASET_NAMES, DatasetInfo, dataset_info
from benchmark.core.data.loading import (
    TrainSplit, check_ood_pairing, get_dataset, get_ood_dataset, get_train_split, memory_problem, stratified_split,
)
from benchmark.core.data.materialise import as_tensors

__all__ = [
    "DATASET_NAMES",
    "DatasetInfo",
    "DatasetNotFoundError",
    "InMemoryImageDataset",
    "as_in_memory",
    "in_memory_problem",
    "memory_problem",
    "as_tensors",
    "check_ood_pairing",
    "get_train_split",
    "stratified_split",
    "TrainSplit",
    "crop_at",
    "crop_offsets",
    "decode",
    "epoch_crop_offsets",
    "flip_draws",
    "flip_where",
    "dataset_info",
    "get_dataset",
    "get_ood_dataset",
    "random_crop",
]
