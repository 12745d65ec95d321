"""torchvision transform pipelines for the on-disk datasets (paper, appendix B.1)."""
from __future__ import annotations

import torch
from torchvision.transforms import v2

from benchmark.core.data.info import DatasetInfo

CROP_PADDING = 4


def _to_normalised_tensor(target: DatasetInfo) -> list:
    return [v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(target.mean, target.std)]


def eval_transform(target: DatasetInfo, resize: bool = False) -> v2.Compose:
    """PIL image -> ``[C, H, W]`` float32 normalised with ``target``'s statistics.

    With ``resize`` the image is first resized (aspect ratio not kept, antialiased) to
    ``target.image_size`` x ``target.image_size``, as the paper does for DTD.
    """
    size = [v2.Resize((target.image_size, target.image_size), antialias=True)] if resize else []
    return v2.Compose(size + _to_normalised_tensor(target))


def normalised_arrays(images: torch.Tensor, target: DatasetInfo) -> torch.Tensor:
    """uint8 images ``[N, C, H, W]`` -> ``[N, C, H, W]`` float32 normalised with ``target``'s
    statistics: ``eval_transform(target)`` applied to the whole array at once. Its steps are
    elementwise, so every image gets the bits it gets through PIL one at a time."""
    if images.dtype != torch.uint8 or images.ndim != 4:
        raise ValueError(f"normalised_arrays: expected uint8 images [N, C, H, W], got {images.dtype} {tuple(images.shape)}")
    return eval_transform(target)(images).as_subclass(torch.Tensor)


def levels(target: DatasetInfo) -> torch.Tensor:
    """``[C, 256]``: the normalised value of each uint8 intensity in each channel, computed by
    ``normalised_arrays`` (so ``levels[c, v]`` is bit for bit what an image's value v becomes)."""
    values = torch.arange(256, dtype=torch.uint8, device="cpu").view(1, 1, 256, 1).expand(1, target.in_channels, 256, 1).contiguous()
    return normalised_arrays(values, target)[0, :, :, 0].contiguous()


def black_fill(target: DatasetInfo) -> torch.Tensor:
    """The normalised value of intensity 0 per channel (``[C]`` float32, ``levels(target)[:, 0]``):
    the padding a random crop of the uint8 image adds, after normalisation."""
    return levels(target)[:, 0].clone()


def train_transform(info: DatasetInfo, augment: bool) -> v2.Compose:
    """Training pipeline of ``info``: with ``augment``, a random crop of the image's own size
    after padding by 4 (zero fill), plus a random horizontal flip for RGB sets
    (CIFAR-100, TinyImageNet); grey digit-like sets (MNIST) are not flipped."""
    if not augment:
        return eval_transform(info)
    steps = [v2.RandomCrop(info.image_size, padding=CROP_PADDING)]
    if info.in_channels == 3:
        steps.append(v2.RandomHorizontalFlip())
    return v2.Compose(steps + _to_normalised_tensor(info))
