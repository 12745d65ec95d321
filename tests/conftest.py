"""Shared test helpers: compose the real Hydra config with overrides."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest
from omegaconf import DictConfig

from benchmark import config

REPO = Path(__file__).resolve().parent.parent

# A recipe small enough for tests: 2 epochs of the digits recipe, convergence rule at epoch 1.
TINY_TRAIN = ["train.epochs=2", "train.milestones=[1]", "train.fail_rule.epoch=1"]


def compose_config(overrides: list[str]) -> DictConfig:
    """The project's config with ``overrides`` applied (as on the command line)."""
    return config.compose_config(overrides)


@pytest.fixture
def tiny_cfg(tmp_path) -> Iterator[DictConfig]:
    """digits/OptuNet config with a 2-epoch recipe and a store in a temp folder (with the
    model's CPU backend switches applied, as the CLI does)."""
    from benchmark.experiment import Experiment

    cfg = compose_config([f"store={tmp_path / 'store'}", f"results={tmp_path / 'results'}", *TINY_TRAIN])
    with Experiment(cfg).backends():
        yield cfg
