"""The embedded digits dataset and its OOD patches, checked against independent numpy code."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits

from benchmark.core.data import as_tensors, dataset_info, get_dataset, get_ood_dataset, random_crop
from benchmark.core.data.digits import digits_split_arrays, ood_patch_arrays
from benchmark.core.data.info import DIGITS_MEAN, DIGITS_STD


def bilinear_upsample_numpy(images: np.ndarray, size: int = 28) -> np.ndarray:
    """Half-pixel-centre bilinear resize (PyTorch's align_corners=False), separable via np.interp."""
    n = images.shape[-1]
    source = np.clip((np.arange(size) + 0.5) * n / size - 0.5, 0, n - 1)
    # column j of weights interpolates the unit vector e_j: weights [size, n]
    weights = np.stack([np.interp(source, np.arange(n), unit) for unit in np.eye(n)], axis=1)
    return weights @ images @ weights.T


@pytest.fixture(scope="module")
def split():
    return digits_split_arrays()


def test_split_sizes_stratified_and_a_partition(split):
    x_train, x_test, y_train, y_test = split
    assert (len(x_train), len(x_test)) == (1437, 360)
    full = load_digits()
    per_class = np.bincount(full.target)
    # stratified: every class keeps its share of the test set to within one image
    assert np.all(np.abs(np.bincount(y_test, minlength=10) - 0.2 * per_class) <= 1)
    # the two splits together are exactly the dataset (rows compared as a multiset)
    rows = lambda x, y: sorted(map(tuple, np.column_stack([x.reshape(len(x), -1), y]).tolist()))
    both = rows(np.concatenate([x_train, x_test]), np.concatenate([y_train, y_test]))
    assert both == rows(full.images, full.target)


def test_processed_images_match_independent_pipeline(split):
    x_train, x_test, y_train, y_test = split
    for name_split, raw, labels in (("train", x_train, y_train), ("test", x_test, y_test)):
        images, got_labels = as_tensors(get_dataset("digits", name_split, data_dir="unused"))
        expected = (bilinear_upsample_numpy(raw / 16.0) - DIGITS_MEAN[0]) / DIGITS_STD[0]
        assert images.shape == (len(raw), 1, 28, 28) and images.dtype == torch.float32
        np.testing.assert_allclose(images[:, 0].numpy(), expected, atol=1e-5)
        assert torch.equal(got_labels, torch.as_tensor(labels, dtype=torch.int64))


def test_normalisation_constants_are_the_train_statistics(split):
    upsampled = bilinear_upsample_numpy(split[0] / 16.0)
    assert DIGITS_MEAN[0] == pytest.approx(upsampled.mean(), rel=1e-6)
    assert DIGITS_STD[0] == pytest.approx(upsampled.std(), rel=1e-6)
    info = dataset_info("digits")
    assert (info.num_classes, info.in_channels, info.image_size) == (10, 1, 28)


def test_callers_cannot_corrupt_the_cache():
    first = get_dataset("digits", "test", data_dir="unused")
    first.images.fill_(7.0)
    first.labels.fill_(3)
    images, labels = as_tensors(first)
    images.zero_()
    again = get_dataset("digits", "test", data_dir="unused")
    assert not torch.all(again.images == 7.0) and not torch.all(again.labels == 3)


def test_augment_crops_train_images_deterministically_and_leaves_test_alone():
    plain = get_dataset("digits", "train", data_dir="unused")
    augmented = get_dataset("digits", "train", data_dir="unused", augment=True)
    torch.manual_seed(0)
    first = torch.stack([augmented[i][0] for i in range(20)])
    torch.manual_seed(0)
    second = torch.stack([augmented[i][0] for i in range(20)])
    assert torch.equal(first, second)
    assert not torch.equal(first, plain.images[:20])
    # each augmented image is a crop of the original padded by 4 with the black-pixel value
    fill = -DIGITS_MEAN[0] / DIGITS_STD[0]
    for i in range(20):
        padded = torch.nn.functional.pad(plain.images[i], (4, 4, 4, 4), value=fill)
        crops = [padded[:, r : r + 28, c : c + 28] for r in range(9) for c in range(9)]
        assert any(torch.equal(first[i], crop) for crop in crops)
    test_augmented = get_dataset("digits", "test", data_dir="unused", augment=True)
    assert torch.equal(as_tensors(test_augmented)[0], as_tensors(get_dataset("digits", "test", "unused"))[0])


def test_random_crop_uses_every_offset_and_rejects_bad_input():
    image = torch.arange(16.0).reshape(1, 1, 4, 4).expand(400, 1, 4, 4)
    crops = random_crop(image, padding=1, fill=-1.0, generator=torch.Generator().manual_seed(0))
    assert crops.shape == image.shape
    distinct = {tuple(c.flatten().tolist()) for c in crops}
    assert len(distinct) == 9  # 3 x 3 offsets, all reached in 400 draws
    assert torch.equal(random_crop(image, padding=0), image)
    with pytest.raises(ValueError, match=r"\[B, C, H, W\]"):
        random_crop(torch.zeros(4, 4), padding=1)
    with pytest.raises(ValueError, match="padding"):
        random_crop(image, padding=-1)


def test_ood_patches_range_shape_and_determinism():
    patches, sources = ood_patch_arrays()
    again, _ = ood_patch_arrays()
    assert patches.shape == (360, 8, 8)
    np.testing.assert_array_equal(patches, again)
    assert np.bincount(sources).tolist() == [180, 180]
    assert patches.min() == 0.0 and patches.max() == 16.0
    np.testing.assert_allclose(patches.reshape(360, -1).max(axis=1), 16.0)  # each stretched to 0..16
    assert len({p.tobytes() for p in patches}) == 360
    ood = get_ood_dataset("digits_ood", "digits", data_dir="unused")
    images, labels = as_tensors(ood)
    expected = (bilinear_upsample_numpy(patches / 16.0) - DIGITS_MEAN[0]) / DIGITS_STD[0]
    np.testing.assert_allclose(images[:, 0].numpy(), expected, atol=1e-5)
    assert images.shape[1:] == as_tensors(get_dataset("digits", "test", "unused"))[0].shape[1:]
    assert torch.equal(labels, torch.from_numpy(sources))
