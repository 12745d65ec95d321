"""Writers of tiny datasets in the real on-disk formats torchvision (and our TinyImageNet) read."""
from __future__ import annotations

import pickle
import struct
from pathlib import Path

import numpy as np
import scipy.io
from PIL import Image


def write_idx(path: Path, array: np.ndarray) -> None:
    """IDX (LeCun) file of a uint8 array: magic 0x0000 08 <ndim>, big-endian int32 sizes, bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    header = struct.pack(">I", 0x0800 + array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    path.write_bytes(header + array.astype(np.uint8).tobytes())


def write_mnist_like(root: Path, folder: str, splits: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
    """``root/<folder>/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte`` (uncompressed), as
    torchvision's MNIST/FashionMNIST expect; ``splits`` maps "train"/"test" to (images [N,28,28], labels [N])."""
    raw = root / folder / "raw"
    for split, (images, labels) in splits.items():
        prefix = "train" if split == "train" else "t10k"
        write_idx(raw / f"{prefix}-images-idx3-ubyte", images)
        write_idx(raw / f"{prefix}-labels-idx1-ubyte", labels)


def write_cifar100(root: Path, splits: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
    """``root/cifar-100-python/{train,test,meta}`` pickles; images [N, 32, 32, 3] uint8 HWC."""
    folder = root / "cifar-100-python"
    folder.mkdir(parents=True, exist_ok=True)
    for split, (images, labels) in splits.items():
        entry = {
            "filenames": [f"img{i}.png" for i in range(len(labels))],
            "batch_label": f"{split} batch",
            "fine_labels": [int(v) for v in labels],
            "coarse_labels": [int(v) // 5 for v in labels],
            "data": images.transpose(0, 3, 1, 2).reshape(len(images), -1),  # rows of R, G, B planes
        }
        (folder / split).write_bytes(pickle.dumps(entry))
    meta = {"fine_label_names": [f"fine{i}" for i in range(100)], "coarse_label_names": [f"c{i}" for i in range(20)]}
    (folder / "meta").write_bytes(pickle.dumps(meta))


def write_svhn(root: Path, split: str, images: np.ndarray, labels: np.ndarray) -> None:
    """``root/<split>_32x32.mat`` with X [32, 32, 3, N] uint8 and y [N, 1] (digit 0 stored as 10)."""
    root.mkdir(parents=True, exist_ok=True)
    y = np.where(labels == 0, 10, labels).astype(np.uint8)[:, None]
    scipy.io.savemat(root / f"{split}_32x32.mat", {"X": images.transpose(1, 2, 3, 0), "y": y})


def write_image(path: Path, color: tuple[int, ...], size: tuple[int, int], mode: str = "RGB") -> None:
    """A constant-colour image file (format from the suffix); ``size`` is (width, height)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, size, color if mode == "RGB" else color[0]).save(path)


def write_tinyimagenet(root: Path, wnids: list[str], train: dict[str, list[tuple]], val: list[tuple]) -> None:
    """The official zip's layout under ``root/tiny-imagenet-200``; ``train`` maps wnid -> list of
    colours, ``val`` is a list of (wnid, colour). Images are 64x64 JPEGs."""
    base = root / "tiny-imagenet-200"
    base.mkdir(parents=True, exist_ok=True)
    (base / "wnids.txt").write_text("\n".join(wnids) + "\n")
    for wnid, colours in train.items():
        boxes = []
        for i, colour in enumerate(colours):
            write_image(base / "train" / wnid / "images" / f"{wnid}_{i}.JPEG", colour, (64, 64))
            boxes.append(f"{wnid}_{i}.JPEG\t0\t0\t63\t63")
        (base / "train" / wnid / f"{wnid}_boxes.txt").write_text("\n".join(boxes) + "\n")
    lines = []
    for i, (wnid, colour) in enumerate(val):
        write_image(base / "val" / "images" / f"val_{i}.JPEG", colour, (64, 64))
        lines.append(f"val_{i}.JPEG\t{wnid}\t0\t0\t63\t63")
    (base / "val" / "val_annotations.txt").write_text("\n".join(lines) + "\n")
    write_image(base / "test" / "images" / "test_0.JPEG", (0, 0, 0), (64, 64))


def write_dtd(root: Path, splits: dict[str, list[tuple[str, tuple, tuple[int, int]]]]) -> None:
    """``root/dtd/dtd/images/<class>/<name>.jpg`` and ``labels/<split>1.txt`` (lines
    "class/name.jpg") as torchvision's DTD expects; ``splits`` maps "train"/"val"/"test" to
    (class, colour, (width, height)) per image."""
    data = root / "dtd" / "dtd"
    for split, items in splits.items():
        lines = []
        for i, (cls, colour, size) in enumerate(items):
            name = f"{cls}_{split}_{i}.jpg"
            write_image(data / "images" / cls / name, colour, size)
            lines.append(f"{cls}/{name}")
        (data / "labels").mkdir(parents=True, exist_ok=True)
        (data / "labels" / f"{split}1.txt").write_text("\n".join(lines) + "\n")
