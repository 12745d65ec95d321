"""An image dataset held as tensors, with an optional cheap random-crop augmentation."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, Subset

NOT_IN_MEMORY_REASON = "not_in_memory"
"""Attribute that ``get_dataset`` sets on each dataset it serves image by image: why (``memory_problem``)."""

def crop_offsets(batch: int, padding: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Random crop offsets ``[2, batch]`` (rows, columns) in ``[0, 2 * padding]``, drawn from
    ``generator`` (the global CPU torch RNG if None) exactly as ``random_crop`` draws them, on the
    generator's device (the CPU for the global RNG), whatever device the images are on."""
    device = generator.device if generator is not None else torch.device("cpu")
    return torch.randint(0, 2 * padding + 1, (2, batch), generator=generator, device=device)


def epoch_crop_offsets(n: int, batch_size: int, padding: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """The crop offsets of one epoch's batches in one draw: ``[2, n]`` (rows, columns), where
    columns ``[start, start + b)`` are exactly what ``crop_offsets(b, padding, generator)`` would
    give for the batch of ``b`` items at ``start`` if called batch after batch (batches of
    ``batch_size``, the last one shorter). The generator advances as far as those calls would."""
    device = generator.device if generator is not None else torch.device("cpu")
    flat = torch.randint(0, 2 * padding + 1, (2 * n,), generator=generator, device=device)
    item = torch.arange(n, device=device)
    start = item // batch_size * batch_size
    size = torch.clamp(n - start, max=batch_size)
    row = 2 * start + (item - start)  # each batch draws its b rows, then its b columns
    return flat[torch.stack([row, row + size])]


def crop_at(images: torch.Tensor, padding: int, fill: float, offsets: torch.Tensor) -> torch.Tensor:
    """Crop each of ``images [B, C, H, W]`` at its ``offsets [2, B]`` after padding by ``padding``
    pixels of value ``fill`` -> ``[B, C, H, W]`` on the images' device (the offsets may be on
    another, e.g. drawn on the CPU for images on a GPU)."""
    b, c, h, w = images.shape
    device = images.device
    offsets = offsets.to(device)
    padded = F.pad(images, (padding, padding, padding, padding), value=fill)
    rows = (offsets[0, :, None] + torch.arange(h, device=device))[:, None, :, None]  # [B, 1, H, 1]
    cols = (offsets[1, :, None] + torch.arange(w, device=device))[:, None, None, :]  # [B, 1, 1, W]
    batch = torch.arange(b, device=device)[:, None, None, None]
    channels = torch.arange(c, device=device)[None, :, None, None]
    return padded[batch, channels, rows, cols]


def random_crop(
    images: torch.Tensor, padding: int, fill: float = 0.0, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Random crop of each image after padding it by ``padding`` pixels on every side.

    ``images`` ``[B, C, H, W]`` -> ``[B, C, H, W]``; every image gets its own offset, drawn
    from ``generator`` (the global torch RNG if None, so ``torch.manual_seed`` fixes it).
    Padded pixels take the value ``fill`` (in the units of ``images``), like
    ``torchvision.transforms.RandomCrop(H, padding)``.
    """
    if images.ndim != 4:
        raise ValueError(f"random_crop: expected images [B, C, H, W], got shape {tuple(images.shape)}")
    if padding < 0:
        raise ValueError(f"random_crop: padding must be >= 0, got {padding}")
    if padding == 0:
        return images.clone()
    return crop_at(images, padding, fill, crop_offsets(images.shape[0], padding, generator))


class InMemoryImageDataset(Dataset):
    """``(image [C, H, W] float32, label int)`` items served from two tensors.

    ``images`` ``[N, C, H, W]`` (already normalised), ``labels`` ``[N]`` int64. With
    ``augment_padding`` > 0 every item is randomly cropped after padding by that many pixels
    (``fill`` = the normalised value of a black pixel); ``augment_padding=0`` serves the
    images unchanged. Tensor-only work, no PIL: cheap enough for hundreds of tiny trainings.
    ``codes`` (optional, a set read from uint8 arrays): ``(codes [N, C, H, W] uint8, levels [C, 256])``
    with ``images[n, c] == levels[c, codes[n, c]]`` exactly; the vectorised trainer then gathers its
    batches from the codes (a quarter of the memory traffic).
    """

    def __init__(
        self, images: torch.Tensor, labels: torch.Tensor, augment_padding: int = 0, fill: float = 0.0,
        codes: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        if images.ndim != 4 or labels.shape != images.shape[:1]:
            raise ValueError(
                f"InMemoryImageDataset: expected images [N, C, H, W] and labels [N], "
                f"got {tuple(images.shape)} and {tuple(labels.shape)}"
            )
        if codes is not None and (codes[0].shape != images.shape or codes[0].dtype != torch.uint8
                                  or codes[1].shape[0] != images.shape[1]):
            raise ValueError(f"InMemoryImageDataset: codes must be uint8 {tuple(images.shape)} with levels [C, L], got "
                             f"{codes[0].dtype} {tuple(codes[0].shape)} and {tuple(codes[1].shape)}")
        self.images = images.to(torch.float32)
        self.labels = labels.to(torch.int64)
        self.augment_padding = augment_padding
        self.fill = fill
        self.codes = codes

    def subset(self, indices: torch.Tensor) -> "InMemoryImageDataset":
        """The items ``indices`` (copies), with the same augmentation."""
        codes = None if self.codes is None else (self.codes[0][indices], self.codes[1])
        return InMemoryImageDataset(self.images[indices], self.labels[indices], self.augment_padding, self.fill, codes)

    @property
    def augment(self) -> bool:
        """Whether items are randomly cropped."""
        return self.augment_padding > 0

    def __len__(self) -> int:
        return self.images.shape[0]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image = self.images[index]
        if self.augment:
            image = random_crop(image[None], self.augment_padding, self.fill)[0]
        return image, int(self.labels[index])


def as_in_memory(dataset: Dataset) -> InMemoryImageDataset | None:
    """``dataset`` as an ``InMemoryImageDataset``: itself, or the selected items of a ``Subset``
    of one (e.g. a training split with a validation part carved out), with the same
    augmentation; None for any other dataset."""
    if isinstance(dataset, InMemoryImageDataset):
        return dataset
    if isinstance(dataset, Subset):
        base = as_in_memory(dataset.dataset)
        if base is not None:
            return base.subset(torch.as_tensor(list(dataset.indices), dtype=torch.long))
    return None


def in_memory_problem(dataset: Dataset) -> str | None:
    """None when ``as_in_memory`` serves ``dataset`` from tensors; else why not: the reason its
    loader recorded (``benchmark.core.data.loading.memory_problem``), or its type for a dataset
    built elsewhere."""
    if as_in_memory(dataset) is not None:
        return None
    base = dataset
    while isinstance(base, Subset):
        base = base.dataset
    return getattr(base, NOT_IN_MEMORY_REASON, None) or (
        f"training set {type(dataset).__name__}: not an in-memory image dataset (InMemoryImageDataset, or a Subset of one)")
