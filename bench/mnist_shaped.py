"""MNIST-shaped data for the zoo bench: MNIST's format, sizes and recipe without MNIST itself.

This machine cannot download MNIST, so ``write_mnist_shaped`` writes 60,000 + 10,000 images in
MNIST's IDX files (``<root>/MNIST/raw/``, read by the suite's real loader): scikit-learn's 8x8
digits upsampled to 20x20 (MNIST's digit box), placed in a 28x28 frame at a random offset of up
to 3 pixels from the centre, with a little noise, as uint8. Learnable like MNIST (OptuNets pass
the convergence rule), so the bench's seeds leave the stack as they would on MNIST.
"""
from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits

FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
         "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}


def _write_idx(path: Path, array: np.ndarray) -> None:
    """An uncompressed IDX file of a uint8 array (magic 0x0000 08 <ndim>, big-endian sizes, bytes)."""
    header = struct.pack(">I", 0x0800 + array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    temp = path.with_suffix(".tmp")
    temp.write_bytes(header + array.astype(np.uint8).tobytes())
    temp.replace(path)


def mnist_shaped_images(count: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``(images [count, 28, 28] uint8, labels [count] uint8)`` drawn from scikit-learn's digits."""
    digits = load_digits()
    rng = np.random.default_rng(seed)
    pick = rng.integers(0, len(digits.target), count)
    small = torch.as_tensor(digits.images[pick] / 16.0, dtype=torch.float32).unsqueeze(1)
    box = F.interpolate(small, size=(20, 20), mode="bilinear", align_corners=False).squeeze(1).numpy()
    frame = np.zeros((count, 28, 28), dtype=np.float32)
    shifts = rng.integers(-3, 4, (count, 2))
    for i, (dy, dx) in enumerate(shifts):
        frame[i, 4 + dy : 24 + dy, 4 + dx : 24 + dx] = box[i]
    frame += rng.normal(0.0, 0.05, frame.shape).astype(np.float32)
    return np.clip(frame * 255.0, 0, 255).astype(np.uint8), digits.target[pick].astype(np.uint8)


def write_mnist_shaped(root: Path, train: int = 60_000, test: int = 10_000, seed: int = 0) -> Path:
    """``root`` holding ``MNIST/raw/`` with ``train`` + ``test`` MNIST-shaped images (kept when
    already written with these sizes)."""
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for split, count, split_seed in (("train", train, seed), ("test", test, seed + 1)):
        images_file, labels_file = (raw / name for name in FILES[split])
        if images_file.is_file() and images_file.stat().st_size == 16 + count * 784 and labels_file.is_file():
            continue
        images, labels = mnist_shaped_images(count, split_seed)
        _write_idx(images_file, images)
        _write_idx(labels_file, labels)
    return root
