"""Shared test helpers: compose the real Hydra config with overrides.

``make test`` runs the suite in one pytest-xdist worker per core; each worker is pinned to its
own core (and its subprocesses with it), so that ``threads=auto`` gives one thread per worker and
no two busy processes share a core (that slows the tiny models tens of times)."""
from __future__ import annotations

import contextlib
import os

_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if _WORKER and hasattr(os, "sched_setaffinity"):
    _cores = sorted(os.sched_getaffinity(0))
    _workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if _workers <= len(_cores):
        _index = int(_WORKER.removeprefix("gw"))
        os.sched_setaffinity(0, set(_cores[_index :: _workers]))  # this worker's share of the cores
        os.environ["NUMBA_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"] = str(len(_cores[_index :: _workers]))

from pathlib import Path  # noqa: E402
from typing import Iterator  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from benchmark import loader  # noqa: E402

if _WORKER:
    torch.set_num_threads(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)

REPO = Path(__file__).resolve().parent.parent

# A recipe small enough for tests: 2 epochs of the digits recipe, convergence rule at epoch 1 (its end
# check at the early threshold: digits' final_min_accuracy is for the full recipe, not for 2 epochs).
TINY_TRAIN = ["train.epochs=2", "train.milestones=[1]", "train.fail_rule.epoch=1", "train.fail_rule.final_min_accuracy=null"]


def compose_config(overrides: list[str]) -> DictConfig:
    """The project's config with ``overrides`` applied (as on the command line), made lean for tests
    (``lean``): no baseline rows unless the overrides name ``evaluate.baselines``, and the methods'
    repetitions for the baselines unless they name ``evaluate.baseline_repetitions``."""
    if not any(o.startswith("evaluate.baseline_repetitions") for o in overrides):
        overrides = [*overrides, "evaluate.baseline_repetitions=null"]
    return loader.compose_config(lean(overrides))


ALL_BASELINES = "evaluate.baselines=[prior,init,gaussian,gaussian_ns,second_zoo,copies,copies_multi]"
"""The override that keeps every baseline row in a test (the project's default, which ``lean`` drops)."""


def lean(overrides: list[str]) -> list[str]:
    """``overrides`` for a test: ``uniform_repetitions``, and ``evaluate.baselines=[]`` unless they
    name ``evaluate.baselines``. The seven baseline rows are scored like seven more methods in every
    evaluate run (most of a tiny store's evaluate time); tests/benchmark/test_baselines.py and the
    end-to-end tests that pass ``ALL_BASELINES`` check them, tests of other things need not pay."""
    out = uniform_repetitions(overrides)
    if not any("evaluate.baselines" in o for o in out):
        out.append("evaluate.baselines=[]")
    return out


def uniform_repetitions(overrides: list[str]) -> list[str]:
    """``overrides`` plus ``sample.repetitions_per_method=null`` when they set ``sample.repetitions``
    and do not mention ``repetitions_per_method``: a test that asks for R repetitions gets R for every
    method, not the experiment's per-method counts (digits runs 8 for the rows that start from the
    base, whose extra held-out blocks a tiny test range does not hold)."""
    if any(o.startswith("sample.repetitions=") for o in overrides) and not any(
            "repetitions_per_method" in o for o in overrides):
        return [*overrides, "sample.repetitions_per_method=null"]
    return list(overrides)


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """One torch thread inside the block (bit-identical reruns; tiny models slow down many times
    when cores are oversubscribed), the previous count restored after."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


@pytest.fixture
def single_torch_thread() -> Iterator[None]:
    """One torch thread during the test (``one_thread`` as a fixture)."""
    with one_thread():
        yield


@pytest.fixture
def tiny_cfg(tmp_path) -> Iterator[DictConfig]:
    """digits/OptuNet config with a 2-epoch recipe and a store in a temp folder (with the
    model's CPU backend switches applied, as the CLI does)."""
    from benchmark.experiment import Experiment

    cfg = compose_config([f"store={tmp_path / 'store'}", f"results={tmp_path / 'results'}", *TINY_TRAIN])
    with Experiment(cfg).backends():
        yield cfg


@pytest.fixture
def cli(tmp_path, monkeypatch, caplog, capsys):
    """``cli(*args) -> (exit status, output)``: ``python -m benchmark *args`` run in this process
    (the subprocess costs seconds of imports and is not what these tests test): the command-line
    check, Hydra, the stages and the one-line error, with Hydra's logging left alone so that the
    log records reach the output."""
    import logging
    import sys

    from benchmark.cli import main

    def run(*args: str) -> tuple[int, str]:
        argv = [*lean(list(args)), f"hydra.run.dir={tmp_path / 'hydra'}", "hydra/job_logging=none",
                "hydra/hydra_logging=none"]
        monkeypatch.setattr(sys, "argv", ["benchmark", *argv])
        caplog.clear()
        with caplog.at_level(logging.INFO):
            try:
                main()
                code = 0
            except SystemExit as exit_:
                code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        captured = capsys.readouterr()
        return code, captured.out + captured.err + "\n".join(r.getMessage() for r in caplog.records)

    return run
