"""Materialise an evaluation dataset as two in-memory tensors."""
from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Dataset

from benchmark.core.data.in_memory import as_in_memory


def as_tensors(dataset: Dataset, batch_size: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """All items of ``dataset`` in order: ``(images [N, C, H, W] float32, labels [N] int64)``.

    An un-augmented ``InMemoryImageDataset`` (or a Subset of one) is copied directly; anything else is read
    through a single-process ``DataLoader`` in batches of ``batch_size``. Meant for test/OOD
    sets: an augmenting dataset would be materialised with one random draw.
    """
    if batch_size < 1:
        raise ValueError(f"as_tensors: batch_size must be >= 1, got {batch_size}")
    memory = as_in_memory(dataset)
    if memory is not None and not memory.augment:
        if len(memory) == 0:
            raise ValueError("as_tensors: the dataset is empty")
        return memory.images.clone(), memory.labels.clone()
    images, labels = [], []
    for batch_images, batch_labels in DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=0):
        images.append(batch_images.to(torch.float32))
        labels.append(torch.as_tensor(batch_labels, dtype=torch.int64))
    if not images:
        raise ValueError("as_tensors: the dataset is empty")
    return torch.cat(images), torch.cat(labels)
