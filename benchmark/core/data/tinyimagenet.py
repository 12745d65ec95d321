"""TinyImageNet-200 read from the official zip's folder layout (torchvision has no class for it).

Layout under ``root``::

    tiny-imagenet-200/wnids.txt                  one WordNet id per line (200 classes)
    tiny-imagenet-200/train/<wnid>/images/*.JPEG
    tiny-imagenet-200/val/images/*.JPEG
    tiny-imagenet-200/val/val_annotations.txt    filename<TAB>wnid<TAB>x0<TAB>y0<TAB>x1<TAB>y1

The official test images have no labels, so the ``"test"`` split is the official val set.

Class ``i`` is the wnid on line ``i`` of ``wnids.txt`` (the file is not sorted). That is how
torch-uncertainty's ``TinyImageNet`` numbers the classes (``self.ids.index(nid)`` over the lines of
``wnids.txt``, for the train and the val split alike), so the networks of its released zoo, and
every zoo trained here, read the labels they were trained with. Sorting the wnids instead would
permute the labels: imported networks would score near chance.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from torchvision.datasets import VisionDataset
from torchvision.datasets.folder import IMG_EXTENSIONS, default_loader, make_dataset
from torchvision.datasets.utils import download_and_extract_archive

from benchmark.core.data.errors import DatasetNotFoundError

URL = "http://cs231n.stanford.edu/tiny-imagenet-200.zip"
MD5 = "90528d7ca1a48142e341f4ef8d21d0de"
FOLDER = "tiny-imagenet-200"
LAYOUT = f"{FOLDER}/ with wnids.txt, train/<wnid>/images/*.JPEG, val/images/ and val/val_annotations.txt"


class TinyImageNet(VisionDataset):
    """TinyImageNet ``split`` (``"train"``: 100,000 images, ``"test"``: the 10,000 val images).

    Items: ``(transform(PIL RGB image), class index)``; the class index is the line of the
    image's wnid in ``wnids.txt`` (file order, as torch-uncertainty numbers them; ``classes``
    lists the wnids in that order). ``download=True`` fetches and extracts the
    official zip (md5-checked by torchvision) into ``root`` when the folder is missing. A
    missing folder or file raises ``DatasetNotFoundError``; a wnid listed twice in ``wnids.txt``
    or an annotation naming an unknown wnid raises ValueError with the file and line.
    """

    def __init__(
        self,
        root: str | Path,
        split: str = "train",
        transform: Callable | None = None,
        download: bool = False,
        loader: Callable[[str], Any] = default_loader,
    ) -> None:
        super().__init__(root, transform=transform)
        if split not in ("train", "test"):
            raise ValueError(f"TinyImageNet: split must be 'train' or 'test', got {split!r}")
        self.split = split
        self.folder = Path(self.root) / FOLDER
        if download and not self.folder.is_dir():
            download_and_extract_archive(URL, download_root=str(self.root), md5=MD5)
        wnids = self._read_wnids(self.folder / "wnids.txt")
        self.classes = wnids
        self.class_to_idx = {wnid: i for i, wnid in enumerate(wnids)}
        self.samples = self._train_samples() if split == "train" else self._val_samples()
        self.targets = [target for _, target in self.samples]
        self.loader = loader

    def _missing(self, path: Path, reason: str) -> DatasetNotFoundError:
        return DatasetNotFoundError("tinyimagenet", path, LAYOUT, reason)

    def _read_lines(self, path: Path) -> list[str]:
        if not path.is_file():
            raise self._missing(path, "file missing")
        return [line.strip() for line in path.read_text().splitlines() if line.strip()]

    def _read_wnids(self, path: Path) -> list[str]:
        """The wnids of ``path`` in line order (class i = line i); a repeated wnid is refused."""
        wnids = self._read_lines(path)
        first: dict[str, int] = {}
        for number, wnid in enumerate(wnids, start=1):
            if wnid in first:
                raise ValueError(f"{path}:{number}: wnid {wnid!r} is already listed on line {first[wnid]}; "
                                 "expected one wnid per class")
            first[wnid] = number
        return wnids

    def _train_samples(self) -> list[tuple[str, int]]:
        train = self.folder / "train"
        if not train.is_dir():
            raise self._missing(train, "folder missing")
        try:
            return make_dataset(str(train), self.class_to_idx, extensions=IMG_EXTENSIONS)
        except FileNotFoundError as error:  # a wnid of wnids.txt without images
            raise self._missing(train, str(error)) from error

    def _val_samples(self) -> list[tuple[str, int]]:
        annotations = self.folder / "val" / "val_annotations.txt"
        images = self.folder / "val" / "images"
        samples = []
        for number, line in enumerate(self._read_lines(annotations), start=1):
            fields = line.split("\t")
            if len(fields) < 2 or fields[1] not in self.class_to_idx:
                raise ValueError(
                    f"{annotations}:{number}: expected 'filename<TAB>wnid<TAB>bbox' with a wnid of "
                    f"wnids.txt, got {line!r}"
                )
            samples.append((str(images / fields[0]), self.class_to_idx[fields[1]]))
        return samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        path, target = self.samples[index]
        image = self.loader(path)
        if self.transform is not None:
            image = self.transform(image)
        return image, target

    def extra_repr(self) -> str:
        return f"Split: {self.split}"
