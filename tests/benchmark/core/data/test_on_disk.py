"""On-disk datasets read through the real code from tiny files in each real format."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

import benchmark.core.data.loading as loading
import benchmark.core.data.on_disk as on_disk
import benchmark.core.data.tinyimagenet as tinyimagenet
from benchmark.core.data import (
    DATASET_NAMES, DatasetNotFoundError, InMemoryImageDataset, as_tensors, crop_at, dataset_info, get_dataset,
    get_ood_dataset, get_train_split, in_memory_problem, memory_problem,
)
from benchmark.core.data.transforms import eval_transform
from tests.benchmark.core.data import formats
from tests.benchmark.core.data.conftest import BLUE, GREEN, GREY, RED, TIN_WNIDS

JPEG_TOLERANCE = 4 / 255  # constant-colour JPEGs decode to within a few levels


def normalised(images_hwc: np.ndarray, name: str) -> torch.Tensor:
    """Independent expectation: uint8 [N, H, W(, C)] -> [N, C, H, W] normalised with name's stats."""
    info = dataset_info(name)
    x = torch.as_tensor(images_hwc, dtype=torch.float64) / 255.0
    x = x.unsqueeze(1) if x.ndim == 3 else x.permute(0, 3, 1, 2)
    mean, std = torch.tensor(info.mean).view(1, -1, 1, 1), torch.tensor(info.std).view(1, -1, 1, 1)
    return ((x - mean) / std).float()


def colour_images(colours: list[tuple], name: str, size: int) -> torch.Tensor:
    return normalised(np.array(colours, dtype=np.uint8)[:, None, None, :].repeat(size, 1).repeat(size, 2), name)


def crop_kind(image: torch.Tensor, original: torch.Tensor, padding: int, fill: torch.Tensor) -> str | None:
    """"crop" or "flipped crop" when ``image`` is such a crop of ``original`` padded with ``fill``."""
    c, h, w = original.shape
    padded = fill.view(c, 1, 1).expand(c, h + 2 * padding, w + 2 * padding).clone()
    padded[:, padding : padding + h, padding : padding + w] = original
    for kind, candidate in (("crop", padded), ("flipped crop", padded.flip(-1))):
        for r in range(2 * padding + 1):
            for col in range(2 * padding + 1):
                if torch.allclose(image, candidate[:, r : r + h, col : col + w], atol=1e-6):
                    return kind
    return None


@pytest.mark.parametrize("name", ["mnist", "fashionmnist", "cifar100"])
@pytest.mark.parametrize("split", ["train", "test"])
def test_array_formats_load_exact_values(tiny_data, skip_md5, name, split):
    images, labels = tiny_data.arrays[name][split]
    got_images, got_labels = as_tensors(get_dataset(name, split, tiny_data.root))
    torch.testing.assert_close(got_images, normalised(images, name), rtol=0, atol=1e-5)
    assert got_labels.tolist() == labels.tolist()


def test_svhn_mat_loads_with_cifar_statistics_and_zero_label(tiny_data, skip_md5):
    images, labels = tiny_data.arrays["svhn"]["test"]
    got_images, got_labels = as_tensors(get_ood_dataset("svhn", "cifar100", tiny_data.root))
    torch.testing.assert_close(got_images, normalised(images, "cifar100"), rtol=0, atol=1e-5)
    assert got_labels.tolist() == labels.tolist()  # SVHN stores digit 0 as 10


def test_svhn_ood_is_a_fixed_subset(tiny_data, skip_md5, monkeypatch):
    monkeypatch.setitem(loading.OOD_MAX_ITEMS, "svhn", 3)
    first = as_tensors(get_ood_dataset("svhn", "cifar100", tiny_data.root))
    second = as_tensors(get_ood_dataset("svhn", "cifar100", tiny_data.root))
    full = as_tensors(get_dataset("svhn", "test", tiny_data.root))
    assert first[0].shape[0] == 3 and torch.equal(first[0], second[0])
    rows = [next(j for j in range(5) if torch.equal(full[0][j], image)) for image in first[0]]
    assert rows == sorted(set(rows))  # distinct images, kept in file order


def test_fixed_subset_is_seeded_sorted_and_a_no_op_when_small():
    dataset = torch.utils.data.TensorDataset(torch.arange(50))
    subset = loading.fixed_subset(dataset, 20)
    again = loading.fixed_subset(dataset, 20)
    assert subset.indices == again.indices == sorted(set(subset.indices)) and len(subset) == 20
    assert loading.fixed_subset(dataset, 20, seed=1).indices != subset.indices
    assert loading.fixed_subset(dataset, 50) is dataset and loading.fixed_subset(dataset, None) is dataset


def test_production_keeps_torchvision_md5_checks(tiny_data):
    # no skip_md5 here: the tiny pickles do not match the official checksums
    with pytest.raises(DatasetNotFoundError, match="cifar-100-python"):
        get_dataset("cifar100", "test", tiny_data.root)
    with pytest.raises(DatasetNotFoundError, match="test_32x32.mat"):
        get_dataset("svhn", "test", tiny_data.root)


@pytest.mark.parametrize("name, kinds", [("mnist", {"crop"}), ("cifar100", {"crop", "flipped crop"}), ("tinyimagenet", {"crop", "flipped crop"})])
def test_augment_is_the_papers_crop_and_flip_on_train_only(tiny_data, skip_md5, tmp_path, name, kinds):
    root = tiny_data.root
    if name == "tinyimagenet":  # the session's constant-colour JPEGs cannot show a flip: use noise
        root = tmp_path
        formats.write_tinyimagenet(root, ["n1"], {"n1": [RED]}, [("n1", RED)])
        noise = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
        Image.fromarray(noise).save(root / "tiny-imagenet-200/train/n1/images/n1_0.JPEG")
    plain = as_tensors(get_dataset(name, "train", root))[0]
    augmented = get_dataset(name, "train", root, augment=True)
    info = dataset_info(name)
    black = -torch.tensor(info.mean) / torch.tensor(info.std)  # zero fill, normalised
    torch.manual_seed(3)
    draws = [torch.stack([augmented[i][0] for i in range(len(augmented))]) for _ in range(8)]
    assert any(not torch.allclose(d, plain) for d in draws)
    seen = {crop_kind(image, original, 4, black) for draw in draws for image, original in zip(draw, plain)}
    assert seen == kinds  # grey digits are never flipped; RGB sets are, about half the time
    test_plain = as_tensors(get_dataset(name, "test", root))[0]
    assert torch.equal(as_tensors(get_dataset(name, "test", root, augment=True))[0], test_plain)


def torch_uncertainty_labels(root, split):
    """Independent expectation, torch-uncertainty's rule (its ``TinyImageNet._make_paths``): the label
    of a wnid is its line in ``wnids.txt`` (``ids.index(nid)``), for the train folders and the val
    annotations alike. Returns {image file name: label}."""
    base = root / "tiny-imagenet-200"
    ids = [line.strip() for line in (base / "wnids.txt").read_text().splitlines()]
    if split == "train":
        return {image.name: ids.index(folder.name) for folder in (base / "train").iterdir()
                for image in (folder / "images").iterdir()}
    lines = (base / "val" / "val_annotations.txt").read_text().splitlines()
    return {line.split("\t")[0]: ids.index(line.split("\t")[1]) for line in lines}


def test_tinyimagenet_folder_layout(tiny_data):
    train = get_dataset("tinyimagenet", "train", tiny_data.root)
    test = get_dataset("tinyimagenet", "test", tiny_data.root)
    index = {wnid: i for i, wnid in enumerate(TIN_WNIDS)}  # line order of wnids.txt
    train_expected = [(index[w], c) for w, colours in tiny_data.arrays["tinyimagenet"]["train"].items() for c in colours]
    images, labels = as_tensors(train, batch_size=2)
    order = sorted(range(len(train_expected)), key=lambda i: TIN_WNIDS[train_expected[i][0]])  # folders walk in name order
    assert labels.tolist() == [train_expected[i][0] for i in order]
    torch.testing.assert_close(
        images, colour_images([train_expected[i][1] for i in order], "tinyimagenet", 64), rtol=0, atol=JPEG_TOLERANCE / 0.224
    )
    images, labels = as_tensors(test)
    val = tiny_data.arrays["tinyimagenet"]["test"]
    assert labels.tolist() == [index[w] for w, _ in val] and images.shape == (3, 3, 64, 64)
    torch.testing.assert_close(images, colour_images([c for _, c in val], "tinyimagenet", 64), rtol=0, atol=JPEG_TOLERANCE / 0.224)


@pytest.mark.parametrize("split", ["train", "test"])
def test_tinyimagenet_labels_follow_the_line_order_of_wnids_txt_as_torch_uncertainty(tmp_path, split):
    """The released networks were trained with torch-uncertainty's numbering: class i = line i of
    the (unsorted) wnids.txt. Sorting would permute every label of this mock (no fixed point)."""
    wnids = ["n09256479", "n07753592", "n01443537", "n02124075"]
    colours = [RED, GREEN, BLUE, GREY]
    formats.write_tinyimagenet(tmp_path, wnids, {w: [c, c] for w, c in zip(wnids, colours)},
                               [(w, c) for w, c in zip(reversed(wnids), reversed(colours))])
    expected = torch_uncertainty_labels(tmp_path, split)
    reader = tinyimagenet.TinyImageNet(tmp_path, split)
    assert {path.rsplit("/", 1)[-1]: label for path, label in reader.samples} == expected and reader.classes == wnids
    sorted_index = {w: i for i, w in enumerate(sorted(wnids))}
    assert all(sorted_index[wnids[label]] != label for label in expected.values())  # the mock tells the orders apart
    images, labels = as_tensors(get_dataset("tinyimagenet", split, tmp_path))  # the public loader: colour -> wnid -> line
    palette = colour_images(colours, "tinyimagenet", 64)[:, :, 0, 0]
    nearest = torch.cdist(images[:, :, 0, 0], palette).argmin(1)
    assert labels.tolist() == nearest.tolist()  # colour k belongs to the wnid on line k


def test_tinyimagenet_wnid_listed_twice_is_refused(tmp_path):
    formats.write_tinyimagenet(tmp_path, ["n1", "n2"], {"n1": [RED], "n2": [BLUE]}, [("n1", RED)])
    (tmp_path / "tiny-imagenet-200/wnids.txt").write_text("n1\nn2\nn1\n")
    with pytest.raises(ValueError, match=r"wnids.txt:3: wnid 'n1' is already listed on line 1"):
        get_dataset("tinyimagenet", "test", tmp_path)


def test_tinyimagenet_grey_jpeg_becomes_rgb(tmp_path):
    formats.write_tinyimagenet(tmp_path, ["n1"], {"n1": [GREY]}, [("n1", GREY)])
    formats.write_image(tmp_path / "tiny-imagenet-200/val/images/val_0.JPEG", (90,), (64, 64), mode="L")
    image, label = get_dataset("tinyimagenet", "test", tmp_path)[0]
    assert image.shape == (3, 64, 64) and label == 0
    torch.testing.assert_close(image, colour_images([(90, 90, 90)], "tinyimagenet", 64)[0], rtol=0, atol=0.05)


def test_tinyimagenet_bad_layouts_name_the_file(tmp_path):
    formats.write_tinyimagenet(tmp_path, ["n1", "n2"], {"n1": [RED]}, [("n1", RED)])
    with pytest.raises(DatasetNotFoundError, match="tiny-imagenet-200/train"):  # n2 has no images
        get_dataset("tinyimagenet", "train", tmp_path)
    annotations = tmp_path / "tiny-imagenet-200/val/val_annotations.txt"
    annotations.write_text("val_0.JPEG\tn1\t0\t0\t1\t1\nval_1.JPEG\tn7\t0\t0\t1\t1\n")
    with pytest.raises(ValueError, match=r"val_annotations.txt:2: .*'val_1.JPEG\\tn7"):
        get_dataset("tinyimagenet", "test", tmp_path)
    annotations.unlink()
    with pytest.raises(DatasetNotFoundError, match="val_annotations.txt"):
        get_dataset("tinyimagenet", "test", tmp_path)


def test_tinyimagenet_download_extracts_the_official_zip_only_when_missing(tmp_path, monkeypatch):
    calls = []

    def fake_download(url, download_root, md5):  # stands in for the network; writes the zip's content
        calls.append((url, md5))
        formats.write_tinyimagenet(tmp_path, ["n1"], {"n1": [BLUE]}, [("n1", BLUE)])

    monkeypatch.setattr(tinyimagenet, "download_and_extract_archive", fake_download)
    assert len(get_dataset("tinyimagenet", "test", tmp_path, download=True)) == 1
    assert calls == [(tinyimagenet.URL, tinyimagenet.MD5)]
    assert tinyimagenet.URL == "http://cs231n.stanford.edu/tiny-imagenet-200.zip"
    get_dataset("tinyimagenet", "train", tmp_path, download=True)
    assert len(calls) == 1


def test_dtd_is_all_splits_resized_to_64_with_tinyimagenet_statistics(tiny_data):
    dtd = get_ood_dataset("dtd", "tinyimagenet", tiny_data.root)
    images, _ = as_tensors(dtd)
    colours = [c for split in ("train", "val", "test") for _, c, _ in tiny_data.arrays["dtd"][split]]
    assert images.shape == (len(colours), 3, 64, 64)
    torch.testing.assert_close(images, colour_images(colours, "tinyimagenet", 64), rtol=0, atol=JPEG_TOLERANCE / 0.224)
    assert torch.equal(as_tensors(get_dataset("dtd", "test", tiny_data.root))[0], images)


@pytest.mark.parametrize("id_name", [n for n in DATASET_NAMES if dataset_info(n).default_ood])
def test_each_ood_set_matches_its_id_test_set(tiny_data, skip_md5, id_name):
    ood_name = dataset_info(id_name).default_ood
    id_image, _ = get_dataset(id_name, "test", tiny_data.root)[0]
    ood_image, ood_label = get_ood_dataset(ood_name, id_name, tiny_data.root)[0]
    info = dataset_info(id_name)
    assert id_image.shape == ood_image.shape == (info.in_channels, info.image_size, info.image_size)
    assert ood_image.dtype == id_image.dtype == torch.float32 and isinstance(ood_label, int)


def test_fashionmnist_ood_uses_mnist_statistics(tiny_data):
    images, _ = tiny_data.arrays["fashionmnist"]["test"]
    got, _ = as_tensors(get_ood_dataset("fashionmnist", "mnist", tiny_data.root))
    torch.testing.assert_close(got, normalised(images, "mnist"), rtol=0, atol=1e-5)


def test_ood_smaller_than_id_is_resized(tiny_data, skip_md5):
    got, _ = as_tensors(get_ood_dataset("svhn", "tinyimagenet", tiny_data.root))
    assert got.shape == (5, 3, 64, 64)


def test_as_tensors_batches_agree_and_bad_input(tiny_data):
    dataset = get_dataset("mnist", "train", tiny_data.root)
    small, large = as_tensors(dataset, batch_size=4), as_tensors(dataset)
    assert torch.equal(small[0], large[0]) and torch.equal(small[1], large[1]) and small[1].dtype == torch.int64
    with pytest.raises(ValueError, match="batch_size"):
        as_tensors(dataset, batch_size=0)
    with pytest.raises(ValueError, match="empty"):
        as_tensors(torch.utils.data.Subset(dataset, []))


def pil_path(name: str, split: str, root, target: str | None = None) -> torch.Tensor:
    """Independent of the in-memory reader: torchvision's dataset item by item, each image through
    PIL and the un-augmented transform (normalised with ``target``'s statistics)."""
    dataset = on_disk.open_on_disk(name, split, root, False, eval_transform(dataset_info(target or name)))
    return torch.stack([dataset[i][0] for i in range(len(dataset))])


@pytest.mark.parametrize("name, split", [("mnist", "train"), ("mnist", "test"), ("fashionmnist", "train"),
                                         ("fashionmnist", "test"), ("cifar100", "train"), ("cifar100", "test")])
def test_array_sets_are_read_into_memory_with_the_pil_paths_exact_values(tiny_data, skip_md5, name, split):
    dataset = get_dataset(name, split, tiny_data.root)
    assert isinstance(dataset, InMemoryImageDataset) and memory_problem(name) is None
    images, labels = as_tensors(dataset)
    assert torch.equal(images, pil_path(name, split, tiny_data.root))  # bit for bit
    assert labels.tolist() == tiny_data.arrays[name][split][1].tolist()
    codes, levels = dataset.codes  # the uint8 pixels and what each becomes, per channel
    channel = torch.arange(images.shape[1]).view(1, -1, 1, 1).expand_as(codes)
    assert codes.dtype == torch.uint8 and torch.equal(levels[channel, codes.long()], images)


@pytest.mark.parametrize("ood, id_name", [("fashionmnist", "mnist"), ("svhn", "cifar100")])
def test_ood_array_sets_are_read_into_memory_with_the_pil_paths_exact_values(tiny_data, skip_md5, ood, id_name):
    dataset = get_ood_dataset(ood, id_name, tiny_data.root)
    assert isinstance(dataset, InMemoryImageDataset)
    assert torch.equal(as_tensors(dataset)[0], pil_path(ood, "test", tiny_data.root, target=id_name))


def test_the_in_memory_crop_is_the_pil_crop_at_the_same_offsets(tiny_data):
    """MNIST's augmented stream crops the normalised tensors; at the offsets drawn, each crop is
    bit for bit torchvision's pad-by-4 (black) and crop of the PIL image, then normalised."""
    from torchvision.transforms.v2 import functional as TF

    train = get_dataset("mnist", "train", tiny_data.root, augment=True)
    assert isinstance(train, InMemoryImageDataset) and train.augment_padding == 4
    offsets = torch.tensor([[0, 8, 3, 5, 1, 7], [8, 0, 4, 2, 6, 1]])
    ours = crop_at(train.images, 4, train.fill, offsets)
    raw = on_disk.open_on_disk("mnist", "train", tiny_data.root, False, None)
    transform = eval_transform(dataset_info("mnist"))
    for i in range(len(raw)):
        image = TF.crop(TF.pad(raw[i][0], [4], fill=0), int(offsets[0, i]), int(offsets[1, i]), 28, 28)
        assert torch.equal(ours[i], transform(image))


def test_the_in_memory_rgb_crop_and_flip_are_the_pil_ones_at_the_same_draws(tiny_data, skip_md5):
    """CIFAR-100's augmented stream in memory: at the offsets and flips drawn from a generator, each
    image is bit for bit torchvision's pad-by-4 (black in every channel), crop and horizontal flip of
    the PIL image, then normalised; on the trainer's device, from the uint8 codes."""
    from torchvision.transforms.v2 import functional as TF

    from benchmark.core.data import crop_offsets, flip_draws

    train = get_dataset("cifar100", "train", tiny_data.root, augment=True)
    assert isinstance(train, InMemoryImageDataset) and train.flip and train.fill.shape == (3,)
    index = torch.arange(len(train))
    ours, labels = train.batch(index, torch.device("cpu"), torch.Generator().manual_seed(5))
    draws = torch.Generator().manual_seed(5)
    offsets, flips = crop_offsets(len(train), 4, draws), flip_draws(len(train), draws)
    assert 0 < int(flips.sum()) < len(train) or len(train) < 4
    raw = on_disk.open_on_disk("cifar100", "train", tiny_data.root, False, None)
    transform = eval_transform(dataset_info("cifar100"))
    for i in range(len(raw)):
        image = TF.crop(TF.pad(raw[i][0], [4], fill=0), int(offsets[0, i]), int(offsets[1, i]), 32, 32)
        image = TF.horizontal_flip(image) if flips[i] else image
        assert torch.equal(ours[i], transform(image)) and int(labels[i]) == raw[i][1]


def test_one_place_says_which_sets_are_not_in_memory_and_why(tiny_data, skip_md5):
    assert memory_problem("mnist") is None and memory_problem("digits") is None and memory_problem("cifar100") is None
    assert "JPEG files" in memory_problem("tinyimagenet") and "every size" in memory_problem("dtd")
    assert isinstance(get_dataset("cifar100", "train", tiny_data.root, augment=True), InMemoryImageDataset)
    for dataset, words in ((get_dataset("tinyimagenet", "train", tiny_data.root), "JPEG files"),
                           (get_train_split("tinyimagenet", tiny_data.root, validation_fraction=0.3).train, "JPEG files")):
        assert not isinstance(dataset, InMemoryImageDataset) and words in in_memory_problem(dataset)
    assert in_memory_problem(get_train_split("mnist", tiny_data.root, augment=True, validation_fraction=0.3).train) is None
