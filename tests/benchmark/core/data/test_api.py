"""Public API contract: names, splits, pairing rules, missing-data errors, Hydra configs."""
from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO
from benchmark.core.data import DATASET_NAMES, DatasetNotFoundError, dataset_info, get_dataset, get_ood_dataset

CONF = REPO / "conf" / "dataset"
ON_DISK = ["mnist", "fashionmnist", "cifar100", "svhn", "tinyimagenet", "dtd"]


def test_names_and_infos():
    assert set(DATASET_NAMES) == {"digits", "digits_ood", *ON_DISK}
    for name in DATASET_NAMES:
        info = dataset_info(name)
        assert info.name == name and len(info.mean) == len(info.std) == info.in_channels
        if info.default_ood is not None:
            ood = dataset_info(info.default_ood)
            assert ood.default_ood is None and (ood.mean, ood.std) == (info.mean, info.std)
    with pytest.raises(dataclasses.FrozenInstanceError):
        dataset_info("mnist").num_classes = 3


@pytest.mark.parametrize("call", [
    lambda: dataset_info("imagenet"),
    lambda: get_dataset("imagenet", "test", "data"),
    lambda: get_ood_dataset("imagenet", "mnist", "data"),
    lambda: get_ood_dataset("svhn", "imagenet", "data"),
])
def test_unknown_name_lists_the_valid_ones(call):
    with pytest.raises(ValueError, match=r"'imagenet'.*digits, digits_ood, mnist, fashionmnist, cifar100, svhn"):
        call()


@pytest.mark.parametrize("name, split, valid", [
    ("digits", "val", "train, test"),
    ("mnist", "training", "train, test"),
    ("dtd", "train", "test"),
    ("digits_ood", "train", "test"),
])
def test_bad_split_lists_the_valid_ones(name, split, valid):
    with pytest.raises(ValueError, match=f"split.*{split!r}.*{name!r}.*expected one of {valid}$"):
        get_dataset(name, split, "data")


@pytest.mark.parametrize("ood, id_name, message", [
    ("svhn", "mnist", "3 channel.*1"),
    ("fashionmnist", "cifar100", "1 channel.*3"),
    ("mnist", "digits", "embedded"),
    ("digits_ood", "mnist", "embedded"),
])
def test_unusable_ood_pairs_are_rejected(ood, id_name, message):
    with pytest.raises(ValueError, match=message):
        get_ood_dataset(ood, id_name, "data")


@pytest.mark.parametrize("name, looked_in", [
    ("mnist", "MNIST/raw"),
    ("fashionmnist", "FashionMNIST/raw"),
    ("cifar100", "cifar-100-python"),
    ("svhn", "test_32x32.mat"),
    ("tinyimagenet", "tiny-imagenet-200/wnids.txt"),
    ("dtd", "dtd/dtd"),
])
def test_missing_dataset_names_path_and_overrides(tmp_path, name, looked_in):
    with pytest.raises(DatasetNotFoundError) as caught:
        get_dataset(name, "test", tmp_path / "nowhere")
    error = caught.value
    assert isinstance(error, FileNotFoundError)
    assert error.path == tmp_path / "nowhere" / looked_in
    message = str(error)
    assert str(tmp_path / "nowhere" / looked_in) in message and repr(name) in message
    assert "dataset.data_dir=/path/to/data" in message and "dataset.download=true" in message


def test_missing_ood_dataset_is_reported_too(tmp_path):
    with pytest.raises(DatasetNotFoundError, match="FashionMNIST/raw.*dataset.data_dir="):
        get_ood_dataset("fashionmnist", "mnist", tmp_path)


def test_embedded_sets_ignore_data_dir(tmp_path):
    assert len(get_dataset("digits", "test", tmp_path / "nowhere", download=True)) == 360
    assert not (tmp_path / "nowhere").exists()


@pytest.mark.parametrize("name, augment", [("digits", False), ("mnist", True), ("cifar100", True), ("tinyimagenet", True)])
def test_hydra_dataset_configs(name, augment):
    config = yaml.safe_load((CONF / f"{name}.yaml").read_text())
    assert config == {
        "name": name,
        "data_dir": "data",
        "download": False,
        "ood": dataset_info(name).default_ood,
        "augment": augment,
    }


def test_missing_dataset_error_survives_pickling(tmp_path):
    with pytest.raises(DatasetNotFoundError) as caught:
        get_dataset("mnist", "train", tmp_path)
    copy = pickle.loads(pickle.dumps(caught.value))
    assert str(copy) == str(caught.value) and copy.path == caught.value.path and copy.filename == str(copy.path)
