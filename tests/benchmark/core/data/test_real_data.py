"""Real MNIST and FashionMNIST through the project's loaders and zoo trainer (issue 37, "Real data in CI").

Where the data comes from: the folder ``../shared/data`` next to the repository checkout (on the
workstation and in CI the repository is ``/work/main``, the data ``/work/shared/data``), or the folder
named by ``$POSTERIOR_BENCH_REAL_DATA``; both in torchvision's layout (``MNIST/raw/`` and
``FashionMNIST/raw/`` with the eight uncompressed IDX files; ``README.md`` there). The folder is read
only: the zoo's store goes in a temp folder. Without the files every test here is skipped, saying which
folder it looked in. Every other test reads tiny files in the real formats
(``tests/benchmark/core/data/conftest.py``).

What it checks, with the experiment ``mnist_optunet`` as configured (``conf/experiment/mnist_optunet.yaml``,
``conf/dataset/mnist.yaml``: OOD ``fashionmnist``, ``dataset.validation_fraction`` held out of the train
split):

1. the loaders read the real files: 60,000 train images (the training part plus the stratified
   validation part, per class ``round(fraction x class size)``), 10,000 test, 28x28, FashionMNIST's
   10,000 test images as OOD set; per-class label counts and the first labels of each set equal those
   of an independent IDX reader here (numpy on the big-endian header), which must also give the
   well-known values; the test and OOD images are the files' pixels normalised with MNIST's statistics;
2. four OptuNets trained on real MNIST by the zoo stage (the stacked trainer, on a temp store,
   ``seeds.reference=[0,4]``) for the 3 epochs at which the recipe judges its convergence rule
   (``fail_rule: {epoch: 3, min_accuracy: 0.15}``, left as the recipe has it) pass it: each stores a
   checkpoint and no failure record, with held-out (validation) and test accuracy above the threshold.
   Not one epoch with the rule moved to epoch 1: after one epoch seeds 1 and 2 still predict one class
   (validation accuracy 0.112, class 1's share) and would fail there; by epoch 3 every one of seeds 0-15
   passes (validation accuracy 0.23-0.58; OptuNet, 355 weights with a 3-unit bottleneck, learns slowly).

About 50 CPU-seconds in all (the training ~40), so ``slow``: ``make test`` runs it, ``make test-fast`` not.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmark.core.data import as_tensors, dataset_info, get_dataset
from benchmark.core.store import read_metadata
from benchmark.experiment import Experiment
from benchmark.stages import zoo
from tests.conftest import REPO, compose_config

pytestmark = pytest.mark.slow  # trains four OptuNets for three epochs on 55,000 images

ENV = "POSTERIOR_BENCH_REAL_DATA"
IDX = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")

# The well-known values of the official files.
MNIST_TRAIN_COUNTS = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
MNIST_TEST_COUNTS = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
FIRST_LABELS = {
    ("MNIST", "train"): [5, 0, 4, 1, 9, 2, 1, 3, 1, 4],
    ("MNIST", "t10k"): [7, 2, 1, 0, 4, 1, 4, 9, 5, 9],
    ("FashionMNIST", "t10k"): [9, 2, 1, 1, 6, 1, 4, 6, 5, 7],
}


def real_data_dir() -> tuple[Path, str]:
    """The folder to read and where its name came from."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV]).expanduser(), f"${ENV}"
    return REPO.parent / "shared" / "data", f"../shared/data next to the checkout {REPO}"


def missing_files(root: Path) -> list[str]:
    return [f"{folder}/raw/{name}" for folder in ("MNIST", "FashionMNIST") for name in IDX
            if not (root / folder / "raw" / name).is_file()]


@pytest.fixture(scope="module")
def root() -> Path:
    path, source = real_data_dir()
    missing = missing_files(path)
    if missing:
        pytest.skip(f"real MNIST/FashionMNIST not found in {path} ({source}): missing {', '.join(missing[:2])}"
                    f"{' ...' if len(missing) > 2 else ''}; set ${ENV} to a folder in torchvision's layout to run it")
    return path


def read_idx(path: Path) -> np.ndarray:
    """An IDX file read independently of torchvision: magic ``00 00 08 ndim`` (unsigned bytes), then
    ``ndim`` big-endian uint32 sizes, then the data."""
    raw = path.read_bytes()
    assert raw[:3] == b"\x00\x00\x08", f"{path}: not an unsigned-byte IDX file (magic {raw[:4].hex()})"
    ndim = raw[3]
    shape = tuple(int(n) for n in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    assert data.size == int(np.prod(shape)), f"{path}: {data.size} bytes of data for shape {shape}"
    return data.reshape(shape)


@pytest.fixture(scope="module")
def files(root) -> dict[tuple[str, str], tuple[np.ndarray, np.ndarray]]:
    """``(set, "train"/"t10k") -> (images [N, 28, 28] uint8, labels [N])`` read by ``read_idx``."""
    return {(folder, split): (read_idx(root / folder / "raw" / f"{split}-images-idx3-ubyte"),
                              read_idx(root / folder / "raw" / f"{split}-labels-idx1-ubyte"))
            for folder in ("MNIST", "FashionMNIST") for split in ("train", "t10k")}


@pytest.fixture(scope="module")
def exp(root, tmp_path_factory) -> Experiment:
    store = tmp_path_factory.mktemp("real_store")
    return Experiment(compose_config([
        "experiment=mnist_optunet", f"dataset.data_dir={root}", f"store={store / 'store'}",
        f"results={store / 'results'}", "seeds.reference=[0,4]", "zoo.range=reference", "zoo.crosscheck=0",
        "train.epochs=3"]))


def counts(labels) -> list[int]:
    return np.bincount(np.asarray(labels), minlength=10).tolist()


def normalised(images: np.ndarray, name: str) -> torch.Tensor:
    """uint8 ``[N, 28, 28]`` -> ``[N, 1, 28, 28]`` normalised with ``name``'s mean and std."""
    info = dataset_info(name)
    return ((torch.from_numpy(images.astype(np.float64)) / 255.0 - info.mean[0]) / info.std[0]).unsqueeze(1).float()


def test_the_independent_reader_gives_the_well_known_values(files):
    for (folder, split), (images, labels) in files.items():
        n = 60_000 if split == "train" else 10_000
        assert images.shape == (n, 28, 28) and labels.shape == (n,), (folder, split)
        assert set(np.unique(labels).tolist()) == set(range(10)), (folder, split)
    assert counts(files["MNIST", "train"][1]) == MNIST_TRAIN_COUNTS
    assert counts(files["MNIST", "t10k"][1]) == MNIST_TEST_COUNTS
    for key, first in FIRST_LABELS.items():
        assert files[key][1][:10].tolist() == first, key


def test_the_experiment_reads_the_real_train_split_with_its_validation_part(exp, files, root):
    fraction = exp.config.dataset.validation_fraction
    assert exp.info.name == "mnist" and exp.config.dataset.ood.value == "fashionmnist" and 0 < fraction < 1
    file_images, file_labels = files["MNIST", "train"]
    train_images, train_labels = exp.train_tensors
    val_images, val_labels = exp.validation_tensors
    per_class = counts(file_labels)
    held_out = [round(fraction * n) for n in per_class]
    assert len(train_labels) + len(val_labels) == 60_000
    assert counts(val_labels) == held_out and sum(held_out) == 5_001  # 0.08333 of 60,000, rounded class by class
    assert [t + v for t, v in zip(counts(train_labels), counts(val_labels))] == per_class
    assert tuple(train_images.shape) == (54_999, 1, 28, 28) and tuple(val_images.shape) == (5_001, 1, 28, 28)
    # The whole train split as the loader reads it, in the files' order.
    whole_images, whole_labels = as_tensors(get_dataset("mnist", "train", root))
    assert whole_labels.tolist()[:10] == FIRST_LABELS["MNIST", "train"]
    assert torch.equal(whole_labels, torch.from_numpy(file_labels.astype(np.int64)))
    torch.testing.assert_close(whole_images, normalised(file_images, "mnist"), rtol=0, atol=1e-5)
    # Together the two parts are the split's images, each once (compared by each image's pixel sum).
    sums = torch.cat([train_images, val_images]).flatten(1).sum(1).sort().values
    torch.testing.assert_close(sums, whole_images.flatten(1).sum(1).sort().values, rtol=0, atol=1e-3)


def test_the_experiment_reads_the_real_test_and_ood_sets(exp, files):
    for (images, labels), key, name in ((exp.test_tensors, ("MNIST", "t10k"), "mnist"),
                                         (exp.ood_tensors, ("FashionMNIST", "t10k"), "fashionmnist")):
        file_images, file_labels = files[key]
        assert tuple(images.shape) == (10_000, 1, 28, 28), name
        assert labels.tolist()[:10] == FIRST_LABELS[key], name
        assert counts(labels) == counts(file_labels), name
        assert torch.equal(labels, torch.from_numpy(file_labels.astype(np.int64))), name
        # Both processed like MNIST's test set: MNIST's mean and std, whatever set they come from.
        torch.testing.assert_close(images, normalised(file_images, "mnist"), rtol=0, atol=1e-5, msg=name)
    assert counts(exp.test_tensors[1]) == MNIST_TEST_COUNTS


def test_four_optunets_trained_on_real_mnist_pass_the_recipes_convergence_rule(exp, single_torch_thread):
    rule = exp.recipe.fail_rule
    assert (exp.recipe.epochs, rule.epoch, rule.min_accuracy) == (3, 3, 0.15)  # the recipe's own rule, judged at the end
    with exp.backends():
        summaries = zoo.run(exp)
    assert exp.zoo_trainer.stacked, exp.zoo_trainer
    (summary,) = summaries
    assert sorted(summary.trained) == [0, 1, 2, 3] and summary.failed == [] and summary.diverged == {}
    assert exp.store.failed_seeds() == {} and exp.store.completed_seeds() == [0, 1, 2, 3]
    for seed in range(4):
        meta = read_metadata(exp.store.checkpoint_path(seed))
        assert float(meta["epochs"]) == 3, meta
        assert float(meta["validation_accuracy"]) > rule.min_accuracy, (seed, meta)
        assert float(meta["test_accuracy"]) > rule.min_accuracy, (seed, meta)
