"""Shared fixtures of the method tests: a tiny digits/OptuNet experiment and a few trained bases.

``tiny_exp``    an ``Experiment`` on digits/OptuNet with ``train.epochs=2`` and a session tmp store;
                its held-out seed range ``[100000, 100008)`` is trained into the store (the zoo stage).
``build``       ``build(exp, name) -> method``: method ``name`` built from ``exp`` as the sample stage does.
``tiny_bases``  ``[(seed, state_dict), ...]`` of the converged held-out checkpoints of that store.
``compose_tiny`` ``compose_tiny(store, *overrides) -> DictConfig``: the same tiny config with more overrides.
``tiny_resnet``  ``tiny_resnet(*overrides) -> Experiment``: ResNet-18 on 8 random 1x8x8 images
                (batch 4, 1 epoch), for the ResNet-18 code paths of the methods.
Every test here runs with one torch thread; those using ``tiny_exp`` inside its ``backends()`` (autouse ``tiny_backends``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator

import pytest
import torch
from omegaconf import DictConfig

from benchmark import loader
from benchmark.core.data import InMemoryImageDataset
from benchmark.experiment import Experiment
from benchmark.stages.zoo import run_zoo
from benchmark.core.store import load_checkpoint
from tests.conftest import one_thread

HELDOUT = (100000, 100008)
# 2 epochs, the OptuMNIST non-convergence rule moved to epoch 2 so dead seeds are still recorded as failed.
TINY_OVERRIDES = (
    "experiment=digits_optunet",
    "device=cpu",
    "train.epochs=2",
    "train.fail_rule.epoch=2",
    "train.fail_rule.final_min_accuracy=null",  # digits' end threshold is for the full recipe
    f"seeds.heldout=[{HELDOUT[0]},{HELDOUT[1]}]",
    "seeds.reference=[0,0]",
    "sample.repetitions=1",
    "sample.repetitions_per_method=null",  # one repetition for every method (digits runs 8 for some)
)


def compose_config(store: Path, *overrides: str) -> DictConfig:
    """The tiny test config with the store at ``store`` and extra Hydra ``overrides``."""
    return loader.compose_config([*TINY_OVERRIDES, f"store={store}", f"results={Path(store).parent / 'results'}", *overrides])


@pytest.fixture(scope="session")
def compose_tiny() -> Callable[..., DictConfig]:
    """``compose_tiny(store, *overrides)``: build a tiny test config (see ``compose_config``)."""
    return compose_config


@pytest.fixture(scope="session")
def tiny_exp(tmp_path_factory: pytest.TempPathFactory) -> Experiment:
    """Tiny digits/OptuNet experiment whose store holds the trained held-out seeds (session-wide)."""
    exp = Experiment(compose_config(tmp_path_factory.mktemp("tiny_store") / "store"))
    with one_thread(), exp.backends():
        run_zoo(exp, exp.heldout)
    return exp



@pytest.fixture(autouse=True)
def tiny_backends(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test here runs with one torch thread; those using ``tiny_exp`` also under its
    backend switches (native CPU convolution for OptuNet)."""
    with one_thread():
        if "tiny_exp" not in request.fixturenames:
            yield
            return
        with request.getfixturevalue("tiny_exp").backends():
            yield


@pytest.fixture(scope="session")
def tiny_bases(tiny_exp: Experiment) -> list[tuple[int, dict[str, torch.Tensor]]]:
    """``(seed, state_dict)`` of every converged held-out checkpoint of ``tiny_exp`` (>= 3)."""
    store = tiny_exp.store
    seeds = store.converged_seeds(*HELDOUT)
    assert len(seeds) >= 3, f"tiny zoo: only {len(seeds)} of the held-out seeds {HELDOUT} converged"
    return [(s, load_checkpoint(store.checkpoint_path(s), tiny_exp.model())[0]) for s in seeds]


@pytest.fixture
def tiny_resnet(tmp_path: Path) -> Callable[..., Experiment]:
    """``tiny_resnet(*overrides)``: a narrow ResNet-18 experiment (width 8: the keys and structure of the
    real one, 60x fewer weights) whose data are 8 random 1x8x8 images
    (10 classes) for train, test and OOD; recipe of 1 epoch in batches of 4, no convergence rule."""

    def build(*overrides: str) -> Experiment:
        cfg = compose_config(tmp_path / "store", "model=resnet18", "+model.kwargs.width=8", "train.epochs=1", "train.batch_size=4",
                             "train.fail_rule.epoch=null", *overrides)
        exp = Experiment(cfg)
        generator = torch.Generator().manual_seed(0)
        images, labels = torch.randn(8, 1, 8, 8, generator=generator), torch.arange(8) % 10
        exp.__dict__.update(  # replace the cached datasets of the experiment (functools.cached_property)
            train_set=InMemoryImageDataset(images, labels), train_tensors=(images, labels),
            test_tensors=(images[:4], labels[:4]), ood_tensors=(images[4:] * 3, labels[4:]),
        )
        return exp

    return build


def build(exp: Experiment, name: str, **changes):
    """Method ``name`` built from ``exp`` as the sample stage builds it, its settings changed by
    ``changes`` (keyword -> value, validated by the settings dataclass)."""
    import dataclasses

    from methods import method_class

    settings = dataclasses.replace(exp.method_settings(name), **changes) if changes else exp.method_settings(name)
    return method_class(name)(exp.model, exp.training_data, settings, recipe=exp.recipe, device=exp.device)
