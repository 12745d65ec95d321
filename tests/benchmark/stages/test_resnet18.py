"""ResNet-18 end to end: cifar100_resnet18 through zoo, every method and mode, evaluate and report,
and tinyimagenet_resnet18 through the stages it supports (no vBNN), on tiny copies of the real
on-disk formats (CIFAR-100 pickles, SVHN .mat, the TinyImageNet folders, DTD) with a 1-epoch
recipe: shapes, finite values, SWAG's BatchNorm recomputation, the symmetry engine keeping the
function of BatchNorm networks, and the tables."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pandas as pd
import pytest
import torch
import torchvision.datasets.cifar
import torchvision.datasets.svhn
from PIL import Image
from torch.optim.swa_utils import update_bn

from benchmark.cli import run
from benchmark.experiment import Experiment
from benchmark.core.models import predict_with_weights
from benchmark.core.store import load_checkpoints_as_sample_set, load_sample_set, read_metadata
from benchmark.core.training import iterate_batches
from metrics.symmetries import canonicalize, spec_for_model
from tests.benchmark.core.data import formats
from tests.conftest import ALL_BASELINES, compose_config
from tests.devices import explicit_devices

pytestmark = pytest.mark.slow
METHOD_UNITS = {"dropout/one", "dropout/multi", "bnn/one", "bnn/multi", "sghmc/one", "sghmc_sa/one", "swag/one", "swag/multi",
                "laplace/one", "laplace/multi", "ensemble/multi"}
TINY_RESNET = (  # ResNet-18 at width 8: the keys, BatchNorm and residual structure of the real one, 60x fewer weights
    "+model.kwargs.width=8", "train.epochs=1", "train.batch_size=4", "train.milestones=[]", "dataset.augment=false",
    "seeds.reference=[0,2]", "seeds.heldout=[100000,100002]", "sample.per_method=2", "sample.modes_multi=2",
    "methods.bnn.train.epochs=1", "methods.bnn.train.milestones=[]", "methods.bnn.elbo_samples=1",
    "methods.swag.snapshots=2", "methods.swag.rank=2", "methods.sghmc.burn_in_epochs=1",
    "methods.sghmc.thinning_epochs=0.5", "methods.sghmc.lr=0.01", "methods.sghmc_sa.epochs=3",
    "methods.sghmc_sa.burn_in_epochs=1", "methods.sghmc_sa.thinning_epochs=1", "threads=1", "sample.repetitions=1",
    "evaluate.reference_resamples=0", "evaluate.test_permutations=0",
    "analyze.toy.networks=64", "analyze.permutation_frequency.runs=1", "analyze.permutation_frequency.log_every=2",
)


@pytest.fixture(autouse=True)
def exists_only_checksums(skip_md5):
    """Tiny CIFAR-100/SVHN files cannot match the official md5 sums (``skip_md5``); the torch
    threads put back after each test."""
    saved = torch.get_num_threads()
    yield
    torch.set_num_threads(saved)


def write_resnet_data(root):
    """Tiny copies of the CIFAR-100 pickles, SVHN .mat, the TinyImageNet folders and DTD under ``root``."""
    rng = np.random.default_rng(7)

    def images(n, size):
        return rng.integers(0, 256, size=(n, size, size, 3), dtype=np.uint8)

    formats.write_cifar100(root, {"train": (images(8, 32), rng.integers(0, 100, 8)), "test": (images(4, 32), rng.integers(0, 100, 4))})
    formats.write_svhn(root, "test", images(4, 32), np.array([0, 3, 9, 1]))
    wnids = ["n01443537", "n02124075"]
    colours = [tuple(int(c) for c in rng.integers(0, 256, 3)) for _ in range(6)]
    formats.write_tinyimagenet(root, wnids, {wnids[0]: colours[:2], wnids[1]: colours[2:4]}, [(wnids[0], colours[4]), (wnids[1], colours[5])])
    for path in (root / "tiny-imagenet-200").rglob("*.JPEG"):  # noise instead of flat colours (BatchNorm needs variance)
        Image.fromarray(images(1, 64)[0]).save(path)
    formats.write_dtd(root, {"train": [("banded", (200, 30, 40), (80, 70))], "val": [("zigzagged", (20, 180, 60), (64, 64))],
                             "test": [("banded", (10, 40, 220), (50, 90))]})
    return root


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return write_resnet_data(tmp_path_factory.mktemp("resnet_data"))


def configure(tmp_path, data_dir, experiment, *extra):
    return compose_config([f"experiment={experiment}", f"dataset.data_dir={data_dir}", f"store={tmp_path / 'store'}",
                           f"results={tmp_path / 'results'}", ALL_BASELINES, *TINY_RESNET, *extra])


@pytest.fixture(scope="module")
def cifar(tmp_path_factory, data_dir):
    """cifar100_resnet18 run through zoo, sample (every method, both modes), evaluate and report."""
    tmp = tmp_path_factory.mktemp("cifar_resnet")
    mp = pytest.MonkeyPatch()
    mp.setattr(torchvision.datasets.cifar, "check_integrity", lambda fpath, md5=None: os.path.isfile(fpath))
    mp.setattr(torchvision.datasets.svhn, "check_integrity", lambda fpath, md5=None: os.path.isfile(fpath))
    # analysis=collapse: the analyses' own tests draw every figure; the TinyImageNet run draws marginals
    cfg = configure(tmp, data_dir, "cifar100_resnet18", "analysis=collapse")
    try:
        with explicit_devices():  # every tensor made in the project's code names its device (tests/devices.py)
            run(cfg)  # stage=all
    finally:
        mp.undo()
    return Experiment(cfg), tmp


def test_zoo_checkpoints(cifar):
    exp, _ = cifar
    store = exp.store
    assert store.completed_seeds() == [0, 1, 100000, 100001] and not store.failed_seeds()
    zoo = load_checkpoints_as_sample_set(store.checkpoint_paths(store.completed_seeds()))
    shapes = exp.shapes()
    assert {k: tuple(v.shape[1:]) for k, v in zoo.items()} == shapes and shapes["fc.weight"] == (100, 64)
    assert all(torch.isfinite(v.float()).all() for v in zoo.values())
    assert read_metadata(store.checkpoint_path(0))["trainer"] == "one at a time"  # BatchNorm: not stacked


def test_every_method_and_mode_wrote_finite_samples_and_predictions(cifar):
    exp, _ = cifar
    shapes = exp.shapes()
    units = set()
    for unit in exp.store.sample_units():
        method, mode = unit.row()
        path = exp.store.samples_path(unit)
        assert unit.repetition == 0
        units.add(f"{method}/{mode}")
        samples = load_sample_set(path)
        n = json.loads(read_metadata(path)["n_samples"])
        assert n == 2 and {k: tuple(v.shape) for k, v in samples.items()} == {k: (n, *s) for k, s in shapes.items()}
        assert all(torch.isfinite(v.float()).all() for v in samples.values()), path.name
        preds = load_sample_set(exp.store.preds_path(unit))
        assert preds["id"].shape == (2, 4, 100) and preds["ood"].shape == (2, 4, 100)
        for p in preds.values():
            assert torch.isfinite(p).all() and torch.allclose(p.sum(-1), torch.ones(()), atol=1e-4)
    assert units == METHOD_UNITS


def test_swag_draws_carry_batchnorm_statistics_recomputed_on_the_train_set(cifar):
    exp, _ = cifar
    path = exp.store.samples_path(exp.store.sample_unit("swag", "one"))
    samples = load_sample_set(path)
    (seed,) = json.loads(read_metadata(path)["base_seeds"])
    base = load_sample_set(exp.store.checkpoint_path(seed))
    for i in range(len(samples["fc.weight"])):
        model = exp.model()
        model.load_state_dict({k: v[i] for k, v in samples.items()})
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.reset_running_stats()
        update_bn(iterate_batches(exp.train_set, exp.recipe.batch_size, torch.Generator().manual_seed(seed), "cpu"), model)
        state = model.state_dict()
        for key in (k for k in samples if "running_" in k):
            torch.testing.assert_close(samples[key][i], state[key], rtol=1e-4, atol=1e-5, msg=key)
            assert not torch.equal(samples[key][i], base[key]), f"{key} kept the base's statistics"
        # bn1's mean, independently: the mean of conv1's output over the (un-augmented) train set.
        conv1 = torch.nn.functional.conv2d(exp.train_tensors[0], samples["conv1.weight"][i], padding=1)
        torch.testing.assert_close(samples["bn1.running_mean"][i], conv1.mean(dim=(0, 2, 3)), rtol=1e-4, atol=1e-5)


def test_canonicalising_batchnorm_networks_keeps_their_function(cifar):
    exp, _ = cifar
    store = exp.store
    zoo = load_checkpoints_as_sample_set(store.checkpoint_paths(store.completed_seeds()))
    canonical, _ = canonicalize(zoo, spec_for_model(exp.model()))
    assert any(not torch.equal(canonical[k], zoo[k]) for k in zoo if "running" not in k)
    images = exp.test_tensors[0]
    before, after = predict_with_weights(exp.model(), zoo, images), predict_with_weights(exp.model(), canonical, images)
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-5)


def test_metrics_and_tables(cifar):
    exp, tmp = cifar
    metrics = pd.read_csv(exp.results_dir / "metrics.csv")
    methods = metrics[metrics["mode"] != "baseline"]
    assert {f"{m}/{mode}" for m, mode in zip(methods.method, methods["mode"])} == METHOD_UNITS
    assert set(metrics.loc[metrics["mode"] == "baseline", "method"]) == {"prior", "init", "gaussian", "gaussian_ns",
                                                                         "second_zoo", "copies", "copies_multi"}
    # a width-8 ResNet under the prior of a 4-image training split (sd ~16) overflows float32: that baseline
    # says so in its row; every method's row is numbers
    overflow = metrics["reason"].fillna("").str.contains("overflow float32")
    assert (metrics.status.eq("ok") | (metrics["mode"].eq("baseline") & overflow)).all(), metrics[["method", "mode", "reason"]]
    ok = metrics[metrics.status == "ok"]
    numeric = ok[["mmd_median", "mmd_mean", "mmd_max", "ns_mmd_median", "energy", "ns_energy", "acc", "ece", "brier", "aupr",
                  "fpr95"]]
    assert np.isfinite(numeric.to_numpy()).all() and (ok.n_samples == 2).all()
    table1 = (exp.results_dir / "table1.md").read_text()
    assert "CIFAR100 - ResNet18" in table1 and "Deep Ensembles" in table1 and "SWAG" in table1
    for name in ("table1.csv", "table1.tex", "table2.md", "zoo.md"):
        assert (exp.results_dir / name).is_file()


def test_tinyimagenet_through_the_stages_it_supports(tmp_path, data_dir):
    # marginals: 41 layers and the longest display name, drawn at the column width (figure text checked)
    cfg = configure(tmp_path, data_dir, "tinyimagenet_resnet18", "train.batch_size=2", "analysis=marginals")
    run(cfg)
    exp = Experiment(cfg)
    metrics = pd.read_csv(exp.results_dir / "metrics.csv")
    methods = metrics[metrics["mode"] != "baseline"]
    units = {f"{m}/{mode}" for m, mode in zip(methods.method, methods["mode"])}
    assert units == METHOD_UNITS - {"bnn/one", "bnn/multi"}  # the paper could not train vBNNs on TinyImageNet
    overflow = metrics["reason"].fillna("").str.contains("overflow float32")
    assert (metrics.status.eq("ok") | (metrics["mode"].eq("baseline") & overflow)).all(), metrics[["method", "mode", "reason"]]
    ok = metrics[metrics.status == "ok"]
    assert np.isfinite(ok[["mmd_median", "acc"]].to_numpy()).all()
    preds = load_sample_set(exp.store.preds_path(exp.store.sample_unit("laplace", "one")))
    assert preds["id"].shape == (2, 2, 200) and preds["ood"].shape == (2, 3, 200)  # DTD: its three splits
    assert "TinyImageNet - ResNet18" in (exp.results_dir / "table1.md").read_text()
    assert (exp.results_dir / "figures" / "marginals.png").is_file()
    shutil.rmtree(exp.store.base)
