"""Sample stage: unit selection, written files, resume/validation, locks, failures and refusals."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import benchmark.stages.sample as sample_stage
from benchmark.cli import run
from benchmark.experiment import Experiment
from benchmark.stages.sample import SampleStageError, run_sample, selected_units
from benchmark.stages.zoo import run_zoo
from benchmark.store import load_checkpoint, load_sample_set, read_metadata, try_lock
from benchmark.training import NonFiniteError
from methods.base import MethodConfigError, predict_with_weights
from methods.modes import MissingBasesError
from tests.methods.conftest import HELDOUT, compose_config, one_thread


@pytest.fixture(scope="module")
def zoo_dir(tmp_path_factory) -> Path:
    """A trained tiny held-out zoo (digits/OptuNet, 2 epochs), copied into each test's store."""
    exp = Experiment(compose_config(tmp_path_factory.mktemp("sample_stage_zoo")))
    with one_thread(), exp.backends():
        run_zoo(exp, *HELDOUT)
    return exp.store.zoo_dir


@pytest.fixture
def make_exp(zoo_dir, tmp_path):
    """``make_exp(*overrides)``: an experiment whose store (this test's) holds the tiny zoo."""
    store = tmp_path / "store"
    shutil.copytree(zoo_dir, store / "digits_optunet" / "zoo")

    def build(*overrides: str) -> Experiment:
        return Experiment(compose_config(store, *overrides))

    with one_thread():
        yield build


def _written(exp: Experiment) -> list[str]:
    return sorted(p.name for d in (exp.store.samples_dir, exp.store.preds_dir) if d.is_dir() for p in d.iterdir())


def test_unit_selection() -> None:
    units = selected_units("all", "both")
    assert ("ensemble", "multi") in units and ("ensemble", "one") not in units
    assert ("sghmc", "one") in units and ("sghmc", "multi") not in units
    assert {("swag", "one"), ("swag", "multi"), ("laplace", "one"), ("dropout", "multi")} <= set(units)
    assert selected_units("all", "one") == [(m, "one") for m in ("dropout", "bnn", "sghmc", "swag", "laplace")]
    assert selected_units("ensemble", "one") == [("ensemble", "one")]  # kept so that check() refuses it
    with pytest.raises(ValueError, match="method='mcmc'.*all or one of dropout, bnn, sghmc, swag, laplace, ensemble"):
        selected_units("mcmc", "both")
    with pytest.raises(ValueError, match="mode='two'.*both, one, multi"):
        selected_units("swag", "two")


def test_ensemble_unit_is_written_validated_and_resumed(make_exp) -> None:
    exp = make_exp("stage=sample", "method=ensemble", "sample.per_method=3")
    run(exp.cfg)  # through the CLI's stage registry
    samples_path, preds_path = exp.store.samples_path("ensemble", "multi"), exp.store.preds_path("ensemble", "multi")
    meta = read_metadata(samples_path)
    seeds = json.loads(meta["base_seeds"])
    assert seeds == [s for s in exp.store.completed_seeds()][:3]
    assert (meta["method"], meta["mode"], meta["experiment"], meta["n_samples"]) == ("ensemble", "multi", "digits_optunet", "3")
    assert meta["config_hash"] == exp.config_hash and read_metadata(preds_path)["base_seeds"] == meta["base_seeds"]
    samples = load_sample_set(samples_path)
    first = load_checkpoint(exp.store.checkpoint_path(seeds[0]))[0]
    assert all(torch.equal(samples[k][0], first[k]) for k in first)
    preds = load_sample_set(preds_path)
    assert preds["id"].shape == (3, 360, 10) and preds["ood"].shape == (3, len(exp.ood_tensors[1]), 10)
    assert preds["id"].dtype == torch.float32
    torch.testing.assert_close(preds["ood"], predict_with_weights(exp.model(), samples, exp.ood_tensors[0]))
    torch.testing.assert_close(preds["id"].sum(-1), torch.ones(3, 360))

    mtime = preds_path.stat().st_mtime_ns
    assert run_sample(exp).skipped_done == ["ensemble/multi"]
    assert preds_path.stat().st_mtime_ns == mtime
    preds_path.write_bytes(preds_path.read_bytes()[:100])  # truncated: redone
    assert run_sample(exp).written == ["ensemble/multi"]
    changed = make_exp("method=ensemble", "sample.per_method=2")  # other settings: redone
    assert run_sample(changed).written == ["ensemble/multi"]
    assert load_sample_set(preds_path)["id"].shape[0] == 2


def test_dropout_one_mode_unit(make_exp) -> None:
    exp = make_exp("method=dropout", "mode=one", "sample.per_method=4")
    with exp.backends():
        assert run_sample(exp).written == ["dropout/one"]
    samples = load_sample_set(exp.store.samples_path("dropout", "one"))
    assert samples["fc2.weight"].shape == (4, 10, 3)
    seeds = json.loads(read_metadata(exp.store.preds_path("dropout", "one"))["base_seeds"])
    assert len(seeds) == 1 and seeds[0] in exp.store.completed_seeds()


def test_busy_unit_is_skipped(make_exp) -> None:
    exp = make_exp("method=ensemble", "sample.per_method=2")
    with try_lock(exp.store.lock_path("sample-ensemble-multi")) as locked:
        assert locked
        assert run_sample(exp).skipped_busy == ["ensemble/multi"]
    assert _written(exp) == []


def test_nan_in_a_named_method_fails_at_once_and_writes_nothing(make_exp) -> None:
    exp = make_exp("method=swag", "mode=one", "methods.swag.lr=1e30", "methods.swag.epochs_factor=1",
                   "methods.swag.snapshots=4", "methods.swag.rank=3")
    with pytest.raises(NonFiniteError, match="swag seed"):
        run_sample(exp)
    assert _written(exp) == []


def test_all_methods_go_on_past_failures_and_list_them(make_exp, monkeypatch) -> None:
    monkeypatch.setattr(sample_stage, "METHOD_NAMES", ("dropout", "swag", "ensemble"))
    exp = make_exp("sample.per_method=2", "sample.modes_multi=2", "methods.dropout.p=1.5", "methods.swag.lr=1e30",
                   "methods.swag.epochs_factor=1", "methods.swag.snapshots=4", "methods.swag.rank=3")
    with pytest.raises(SampleStageError) as err:
        run_sample(exp)
    message = str(err.value)
    assert message.startswith("4 method/mode unit(s) failed")
    assert "dropout/one: MethodConfigError: methods.dropout.p=1.5" in message and "dropout/multi" in message
    assert "swag/one: NonFiniteError" in message and "swag/multi: NonFiniteError" in message
    assert _written(exp) == ["ensemble_multi.safetensors", "ensemble_multi.safetensors"]


def test_refusals_and_missing_bases_come_before_any_training(make_exp) -> None:
    with pytest.raises(MethodConfigError, match="method=ensemble mode=one"):
        run_sample(make_exp("method=ensemble", "mode=one"))
    with pytest.raises(MissingBasesError, match=r"50 converged held-out base checkpoints needed.*stage=zoo"):
        run_sample(make_exp("method=ensemble", "sample.per_method=50"))
    exp = make_exp("method=dropout", "methods.dropout.p=0")
    with pytest.raises(MethodConfigError, match="methods.dropout.p=0"):
        run_sample(exp)
    assert _written(exp) == []
