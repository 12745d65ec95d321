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


Fill = "float | torch.Tensor"
"""The value of padded pixels: one number, or one per channel (``[C]``: the normalised black of an RGB set)."""


def pad_with(images: torch.Tensor, padding: int, fill: Fill) -> torch.Tensor:
    """``images [B, C, H, W]`` padded by ``padding`` pixels of ``fill`` (a number or ``[C]``) on every side."""
    if not isinstance(fill, torch.Tensor):
        return F.pad(images, (padding, padding, padding, padding), value=float(fill))
    b, c, h, w = images.shape
    padded = fill.to(images.device, images.dtype).view(1, c, 1, 1).repeat(b, 1, h + 2 * padding, w + 2 * padding)
    padded[:, :, padding : padding + h, padding : padding + w] = images
    return padded


def crop_at(images: torch.Tensor, padding: int, fill: Fill, offsets: torch.Tensor) -> torch.Tensor:
    """Crop each of ``images [B, C, H, W]`` at its ``offsets [2, B]`` after padding by ``padding``
    pixels of value ``fill`` (a number, or ``[C]`` one per channel) -> ``[B, C, H, W]`` on the
    images' device (the offsets may be on another, e.g. drawn on the CPU for images on a GPU)."""
    b, c, h, w = images.shape
    device = images.device
    offsets = offsets.to(device)
    padded = pad_with(images, padding, fill)
    rows = (offsets[0, :, None] + torch.arange(h, device=device))[:, None, :, None]  # [B, 1, H, 1]
    cols = (offsets[1, :, None] + torch.arange(w, device=device))[:, None, None, :]  # [B, 1, 1, W]
    batch = torch.arange(b, device=device)[:, None, None, None]
    channels = torch.arange(c, device=device)[None, :, None, None]
    return padded[batch, channels, rows, cols]


def decode(codes: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Images from uint8 ``codes [..., C, H, W]`` and per-channel ``levels [C, L]``:
    ``out[..., c, h, w] = levels[c, codes[..., c, h, w]]`` (the set's exact floats), on the codes' device."""
    channel = torch.arange(levels.shape[0], device=codes.device).view(levels.shape[0], 1, 1)
    return levels.to(codes.device)[channel, codes.long()]


def flip_draws(batch: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """``[batch]`` bool: which images a random horizontal flip mirrors (probability 1/2 each), drawn
    from ``generator`` (the global CPU torch RNG if None) on its device."""
    device = generator.device if generator is not None else torch.device("cpu")
    return torch.rand(batch, generator=generator, device=device) < 0.5


def flip_where(images: torch.Tensor, flips: torch.Tensor) -> torch.Tensor:
    """``images [B, C, H, W]`` with those where ``flips [B]`` is True mirrored left-right."""
    return torch.where(flips.to(images.device)[:, None, None, None], images.flip(-1), images)


def random_crop(
    images: torch.Tensor, padding: int, fill: Fill = 0.0, generator: torch.Generator | None = None
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
    with ``images[n, c] == levels[c, codes[n, c]]`` exactly; the trainers then gather their
    batches from the codes (a quarter of the memory traffic; on a GPU the set stays there as uint8).
    ``fill`` may be ``[C]`` (per-channel black of an RGB set); ``flip``: a random horizontal flip after
    the crop (RGB sets, as torchvision's ``RandomHorizontalFlip``).
    """

    def __init__(
        self, images: torch.Tensor, labels: torch.Tensor, augment_padding: int = 0, fill: Fill = 0.0,
        codes: tuple[torch.Tensor, torch.Tensor] | None = None, flip: bool = False,
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
        self.flip = flip
        self._resident: tuple[torch.device, torch.Tensor, torch.Tensor | None, torch.Tensor] | None = None

    def subset(self, indices: torch.Tensor) -> "InMemoryImageDataset":
        """The items ``indices`` (copies), with the same augmentation."""
        codes = None if self.codes is None else (self.codes[0][indices], self.codes[1])
        return InMemoryImageDataset(self.images[indices], self.labels[indices], self.augment_padding, self.fill, codes,
                                    self.flip)

    @property
    def augment(self) -> bool:
        """Whether items are randomly cropped (and flipped, with ``flip``)."""
        return self.augment_padding > 0

    def augmented(self, images: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """``images [B, C, H, W]`` (items of this set, on any device) with the set's augmentation: a crop
        at offsets drawn from ``generator``, then, with ``flip``, a mirror drawn from it (in that order)."""
        if not self.augment:
            return images
        out = random_crop(images, self.augment_padding, self.fill, generator)
        return flip_where(out, flip_draws(images.shape[0], generator)) if self.flip else out

    def batch(self, index: torch.Tensor, device: torch.device, generator: torch.Generator | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Items ``index [B]`` as ``(images [B, C, H, W], labels [B])`` on ``device``, augmented
        (``augmented``). The set is copied to ``device`` once and kept there (as its uint8 codes
        when it has them, decoded per batch to the same floats), so a GPU trainer reads no image
        from the host."""
        device = torch.device(device)
        if self._resident is None or self._resident[0] != device:
            codes = None if self.codes is None else (self.codes[0].to(device), self.codes[1].to(device))
            images = self.images.to(device) if codes is None else None
            self._resident = (device, images, codes, self.labels.to(device))
        _, images, codes, labels = self._resident
        index = index.to(device)
        x = images[index] if codes is None else decode(codes[0][index], codes[1])
        return self.augmented(x, generator), labels[index]

    def __len__(self) -> int:
        return self.images.shape[0]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.augmented(self.images[index][None])[0], int(self.labels[index])


def as_in_memory(dataset: Dataset) -> InMemoryImageDataset | None:
    """``dataset`` as an ``InMemoryImageDataset``: itself, or the selected items of a ``Subset``
    of one (e.g. a training split with a validation part carved out), with the same
    augmentation; None for any other dataset."""
    if isinstance(dataset, InMemoryImageDataset):
        return dataset
    if isinstance(dataset, Subset):
        kept = getattr(dataset, "_in_memory", None)  # made once per Subset (its copy may live on a GPU)
        if kept is not None:
            return kept
        base = as_in_memory(dataset.dataset)
        if base is not None:
            dataset._in_memory = base.subset(torch.as_tensor(list(dataset.indices), dtype=torch.long, device="cpu"))
            return dataset._in_memory
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
