"""Every stage end to end on each device here (``device=cpu``, and ``device=cuda`` where there is a
GPU), on small versions of the three experiments: the embedded digits (every method and mode, then
HMC as a second reference), the MNIST format (IDX files; random crops, so the stacked zoo crops on
the device) and the CIFAR format with a width-8 ResNet-18 (BatchNorm, SWAG's recomputation, mixed
precision on a GPU). On the CPU the whole run is inside ``explicit_devices()``: a tensor made in the
project's code without naming its device fails the test, as it would crash on a GPU.

``make gpu-check`` runs this module on a GPU host; CI runs its CPU half (the CIFAR format on the CPU
is ``tests/benchmark/stages/test_resnet18.py``, also inside the guard)."""
from __future__ import annotations

import contextlib
import os

import numpy as np
import pandas as pd
import pytest
import torch
import torchvision.datasets.cifar
import torchvision.datasets.svhn

from benchmark.cli import run
from benchmark.experiment import Experiment
from tests.benchmark.core.data import formats
from tests.conftest import ALL_BASELINES, TINY_TRAIN, compose_config
from tests.devices import available_devices, explicit_devices

pytestmark = pytest.mark.slow

SMALL_METHODS = (  # every method's recipe cut to a few steps
    "sample.per_method=2", "sample.modes_multi=2", "sample.repetitions=1", "methods.bnn.train.epochs=1",
    "methods.bnn.train.milestones=[]", "methods.bnn.elbo_samples=1", "methods.swag.snapshots=2", "methods.swag.rank=2",
    "methods.sghmc.burn_in_epochs=1", "methods.sghmc.thinning_epochs=0.5", "methods.sghmc_sa.epochs=9",
    "methods.sghmc_sa.burn_in_epochs=1", "methods.sghmc_sa.thinning_epochs=1", "threads=1",
    "evaluate.reference_resamples=0", "evaluate.test_permutations=0",
)
SMALL_HMC = ("method=hmc", "mode=multi", "analysis=collapse", "methods.hmc.warmup=4",
             "methods.hmc.max_leapfrog_steps=3", "methods.hmc.trajectory_length=0.3", "methods.hmc.save_every=1",
             "methods.hmc.descent_steps=10", "methods.hmc.start_min_accuracy=null")


def guarded(device: str):
    """The device guard on the CPU (a GPU run meets real devices)."""
    return explicit_devices() if device == "cpu" else contextlib.nullcontext()


def run_stages(device: str, *overrides: str) -> Experiment:
    """``stage=all`` then ``stage=verify`` with ``overrides`` on ``device``; the experiment."""
    cfg = compose_config([f"device={device}", ALL_BASELINES, *overrides])  # the baselines' draws on the device too
    with guarded(device):
        run(cfg)
        run(compose_config([f"device={device}", ALL_BASELINES, *overrides, "stage=verify"]))
    return Experiment(cfg)


def check_results(exp: Experiment, units: set[str], metrics: str = "metrics.csv") -> None:
    """Every unit scored with finite MMDs and accuracies, Table 1 written."""
    df = pd.read_csv(exp.results_dir / metrics)
    scored = df[df.status == "ok"]
    assert {f"{m}/{mode}" for m, mode in zip(scored["method"], scored["mode"])} >= units, df[["method", "mode", "status"]]
    assert np.isfinite(scored["mmd_median"]).all() and np.isfinite(scored["acc"]).all()
    assert (exp.results_dir / "table1.md").is_file()


@pytest.mark.parametrize("device", available_devices())
def test_digits_every_method_then_hmc(tmp_path, device):
    where = [f"store={tmp_path / 'store'}", f"results={tmp_path / 'results'}", *TINY_TRAIN,
             "seeds.reference=[0,12]", "seeds.heldout=[100000,100024]", *SMALL_METHODS,
             "sample.per_method=8"]  # HMC's R-hat needs 4 draws of each of its 2 chains
    exp = run_stages(device, *where, "analysis=collapse")
    check_results(exp, {"dropout/one", "bnn/multi", "sghmc/one", "swag/multi", "laplace/one", "ensemble/multi"})
    hmc = run_stages(device, *where, *SMALL_HMC)
    check_results(hmc, {"hmc/multi"})


@pytest.mark.parametrize("device", available_devices())
def test_mnist_format_with_crops(tmp_path, device):
    rng = np.random.default_rng(0)
    for folder in ("MNIST", "FashionMNIST"):  # noise around a brightness that says the class
        formats.write_mnist_like(tmp_path / "data", folder, {
            split: ((rng.integers(0, 30, (n, 28, 28)) + 25 * (np.arange(n) % 10)[:, None, None]).astype(np.uint8),
                    np.arange(n) % 10) for split, n in (("train", 160), ("test", 20))})
    methods = "all" if device != "cpu" else "swag"  # the CPU lane: the crops and the stacked zoo; digits covers the methods
    exp = run_stages(device, "experiment=mnist_optunet", f"dataset.data_dir={tmp_path / 'data'}",
                     f"store={tmp_path / 'store'}", f"results={tmp_path / 'results'}", "train.epochs=3", "train.lr=0.5",
                     "train.milestones=[2]", "train.fail_rule.epoch=null", "train.fail_rule.final_min_accuracy=null", "seeds.reference=[0,6]",
                     "seeds.heldout=[100000,100006]", "zoo.crosscheck=0", f"method={methods}", "analysis=min_mass",
                     *SMALL_METHODS)
    assert exp.train_set.augment and exp.zoo_trainer.stacked
    check_results(exp, {"swag/one"})
    assert "| One Mode | SWAG | SWAG | 16.0 / " in (exp.results_dir / "paper.md").read_text()  # the paper ran MNIST


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the CPU run: tests/benchmark/stages/test_resnet18.py)")
def test_cifar_format_resnet18_on_cuda(tmp_path, monkeypatch):
    from tests.benchmark.stages.test_resnet18 import TINY_RESNET, write_resnet_data

    exists = lambda fpath, md5=None: os.path.isfile(fpath)  # noqa: E731 (tiny files cannot match the official md5)
    monkeypatch.setattr(torchvision.datasets.cifar, "check_integrity", exists)
    monkeypatch.setattr(torchvision.datasets.svhn, "check_integrity", exists)
    data = write_resnet_data(tmp_path / "data")
    exp = run_stages("cuda", "experiment=cifar100_resnet18", f"dataset.data_dir={data}", f"store={tmp_path / 'store'}",
                     f"results={tmp_path / 'results'}", *TINY_RESNET, "analysis=collapse")
    assert exp.acceleration.autocast is not None  # bf16 (or fp16) autocast and channels_last on the GPU
    check_results(exp, {"swag/multi", "laplace/one", "ensemble/multi", "bnn/one", "sghmc/one"})
