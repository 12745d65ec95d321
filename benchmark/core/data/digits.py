"""The embedded ``digits`` experiment data: scikit-learn's 8x8 digits and grey OOD patches.

Both go through one pipeline: intensities 0..16 -> [0, 1], bilinear upsampling 8x8 -> 28x28
(``torch.nn.functional.interpolate``, ``align_corners=False``), normalisation with the train
split's mean/std (``DIGITS_MEAN``/``DIGITS_STD``). Results are cached per process; callers get
clones, so nothing they do can corrupt the cache.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits, load_sample_images
from sklearn.model_selection import train_test_split

from benchmark.core.data.info import DIGITS_MEAN, DIGITS_STD

DIGITS_SIZE = 28
DIGITS_MAX = 16.0  # scikit-learn's digits count 0..16 set pixels per 4x4 block
SPLIT_SEED = 0
TEST_FRACTION = 0.2
OOD_SEED = 0
OOD_COUNT = 360  # the digits test-set size
# Patch sides in pixels of the 427x640 sample images; multiples of 8 so that the 8x8
# downsampling is an exact block average.
OOD_PATCH_SIDES = (32, 48, 64, 96, 128)
# ITU-R 601-2 luma, the weights of PIL's convert("L").
_LUMA = np.array([0.299, 0.587, 0.114])


def upsample_and_normalise(images: np.ndarray) -> torch.Tensor:
    """The digits pipeline: ``[N, 8, 8]`` intensities in 0..16 -> ``[N, 1, 28, 28]`` float32,
    normalised with ``DIGITS_MEAN``/``DIGITS_STD``."""
    if images.ndim != 3 or images.shape[1:] != (8, 8):
        raise ValueError(f"digits pipeline: expected images [N, 8, 8], got shape {images.shape}")
    x = torch.as_tensor(images, dtype=torch.float32, device="cpu").div(DIGITS_MAX).unsqueeze(1)
    x = F.interpolate(x, size=(DIGITS_SIZE, DIGITS_SIZE), mode="bilinear", align_corners=False)
    return (x - DIGITS_MEAN[0]) / DIGITS_STD[0]


def digits_split_arrays() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The fixed stratified split of scikit-learn's digits, raw: ``(x_train [1437, 8, 8],
    x_test [360, 8, 8], y_train [1437], y_test [360])``, intensities 0..16."""
    digits = load_digits()
    return train_test_split(
        digits.images, digits.target, test_size=TEST_FRACTION, stratify=digits.target, random_state=SPLIT_SEED
    )


def ood_patch_arrays() -> tuple[np.ndarray, np.ndarray]:
    """``OOD_COUNT`` grey 8x8 patches cut from scikit-learn's sample images, raw.

    Returns ``(patches [360, 8, 8] float64 in 0..16, source [360] int64)`` where ``source`` is
    0 for china.jpg and 1 for flower.jpg (half the patches each). Positions and sides come
    from a fixed seed; each patch is block-averaged to 8x8 and its intensities stretched to
    the full 0..16 range (a flat patch becomes all zeros).
    """
    rng = np.random.default_rng(OOD_SEED)
    images = load_sample_images().images
    per_image = OOD_COUNT // len(images)
    patches, sources = [], []
    for source, rgb in enumerate(images):
        grey = rgb.astype(np.float64) @ _LUMA
        for _ in range(per_image):
            side = int(rng.choice(OOD_PATCH_SIDES))
            top = int(rng.integers(0, grey.shape[0] - side + 1))
            left = int(rng.integers(0, grey.shape[1] - side + 1))
            block = side // 8
            patch = grey[top : top + side, left : left + side].reshape(8, block, 8, block).mean(axis=(1, 3))
            low, high = patch.min(), patch.max()
            patches.append((patch - low) / (high - low) * DIGITS_MAX if high > low else np.zeros_like(patch))
            sources.append(source)
    return np.stack(patches), np.asarray(sources, dtype=np.int64)


@lru_cache(maxsize=None)
def _processed(split: str) -> tuple[torch.Tensor, torch.Tensor]:
    if split == "ood":
        patches, sources = ood_patch_arrays()
        return upsample_and_normalise(patches), torch.from_numpy(sources)
    x_train, x_test, y_train, y_test = digits_split_arrays()
    images, labels = (x_train, y_train) if split == "train" else (x_test, y_test)
    return upsample_and_normalise(images), torch.as_tensor(labels, dtype=torch.int64, device="cpu")


def digits_tensors(split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Processed digits as fresh tensors: ``(images [N, 1, 28, 28] float32, labels [N] int64)``.

    ``split``: ``"train"`` (N = 1437), ``"test"`` (N = 360) or ``"ood"`` (the 360 patches,
    labels = source image). Computed once per process, cloned on every call.
    """
    if split not in ("train", "test", "ood"):
        raise ValueError(f"digits split: expected 'train', 'test' or 'ood', got {split!r}")
    images, labels = _processed(split)
    return images.clone(), labels.clone()


def black_pixel_value() -> float:
    """The normalised value of intensity 0: the fill of the digits' padded random crop."""
    return -DIGITS_MEAN[0] / DIGITS_STD[0]
