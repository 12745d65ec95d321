"""Self-healing: a checkpoint or sample set damaged in any of six ways is found, moved to
quarantine with its reason (one log line naming it), and redone bit for bit; evaluate and report
refuse a damaged reference with the file and the command that heals it, never "failed" rows."""
from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch

from benchmark.experiment import Experiment
from benchmark.stages.evaluate import run as run_evaluate
from benchmark.stages.report import write_zoo_summary
from benchmark.stages.sample import run as run_sample
from benchmark.inventory import CorruptZooError
from benchmark.stages.zoo import run_zoo
from benchmark.core.store import save_checkpoint
from benchmark.core.training import seeded
from tests.conftest import compose_config
from bench.corruptions import CORRUPTIONS, corrupt

TINY = ["train.epochs=1", "sample.repetitions=1", "evaluate.reference_resamples=0", "evaluate.test_permutations=0",
        "train.fail_rule.epoch=null", "seeds.reference=[0,2]", "seeds.heldout=[100000,100003]",
        "method=ensemble", "sample.per_method=3"]


pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("single_torch_thread")]  # bit-identical retraining


@pytest.fixture(scope="module")
def healthy(tmp_path_factory):
    """A store whose zoo (2 reference + 3 held-out seeds, 1 epoch) and ensemble unit are done."""
    root = tmp_path_factory.mktemp("healthy")
    exp = Experiment(compose_config([f"store={root / 'store'}", f"results={root / 'results'}", *TINY]))
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with exp.backends():
            run_zoo(exp, exp.reference)
            run_zoo(exp, exp.heldout)
            run_sample(exp)
    finally:
        torch.set_num_threads(saved)
    return root


@pytest.fixture
def exp(healthy, tmp_path):
    shutil.copytree(healthy / "store", tmp_path / "store")
    experiment = Experiment(compose_config([f"store={tmp_path / 'store'}", f"results={tmp_path / 'results'}", *TINY]))
    with experiment.backends():
        yield experiment


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_a_damaged_checkpoint_is_quarantined_and_retrained_bit_for_bit(exp, kind, caplog):
    path = exp.store.checkpoint_path(1)
    original = path.read_bytes()
    message = corrupt(path, kind)
    with caplog.at_level(logging.ERROR, logger="benchmark.stages.zoo"):
        summary = run_zoo(exp, exp.reference)
    assert list(summary.quarantined) == [1] and message in summary.quarantined[1]
    assert summary.trained == [1] and path.read_bytes() == original
    moved = exp.store.zoo_dir / "quarantine" / "seed_000001.safetensors"
    record = json.loads(moved.with_suffix(".json").read_text())
    assert message in record["reason"] and str(path) in record["reason"] and {"time", "host", "pid"} <= set(record)
    lines = [r.getMessage() for r in caplog.records if "moved to" in r.getMessage()]
    assert len(lines) == 1 and str(path) in lines[0] and str(moved) in lines[0] and "trained again" in lines[0]
    assert summary.state.quarantined == 1 and "1 quarantined" in summary.describe()
    assert not [p for p in exp.store.zoo_dir.iterdir() if p.name.startswith(".")]


def test_a_damaged_failure_record_is_quarantined_and_the_seed_retrained(exp):
    exp.store.checkpoint_path(0).unlink()
    exp.store.failed_path(0).write_text('{"reason": "did not conv')
    summary = run_zoo(exp, exp.reference)
    assert summary.trained == [0] and "damaged failure record" in summary.quarantined[0]
    assert (exp.store.failed_dir / "quarantine" / "seed_000001.json").exists() is False
    assert (exp.store.failed_dir / "quarantine" / "seed_000000.json").exists()


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_a_damaged_sample_set_is_quarantined_and_redrawn_bit_for_bit(exp, kind, caplog):
    path = exp.store.samples_path(exp.store.sample_unit("ensemble", "multi"))
    original = path.read_bytes()
    message = corrupt(path, kind)
    with caplog.at_level(logging.ERROR, logger="benchmark.stages.sample"):
        summary = run_sample(exp)
    assert summary.written == ["ensemble/multi/r0"] and message in summary.quarantined["ensemble/multi/r0"]
    assert path.read_bytes() == original
    assert (exp.store.samples_dir / "quarantine" / "ensemble_multi_r0.safetensors").exists()
    lines = [r.getMessage() for r in caplog.records if "moved to" in r.getMessage()]
    assert len(lines) == 1 and str(path) in lines[0] and "drawn again" in lines[0]


def test_damaged_predictions_are_quarantined_and_redrawn(exp):
    path = exp.store.preds_path(exp.store.sample_unit("ensemble", "multi"))
    original = path.read_bytes()
    corrupt(path, "nan")
    summary = run_sample(exp)
    assert "contains NaN" in summary.quarantined["ensemble/multi/r0"] and path.read_bytes() == original
    assert (exp.store.preds_dir / "quarantine" / "ensemble_multi_r0.safetensors").exists()


@pytest.mark.parametrize("samples_kind", ["other_experiment", "garbage"])
def test_both_damaged_files_of_a_unit_are_named_and_quarantined(exp, samples_kind, caplog):
    # A sample set whose metadata are already wrong must not hide its damaged predictions:
    # both are named in a log line and kept as evidence, not deleted when the unit is redrawn.
    unit = exp.store.sample_unit("ensemble", "multi")
    paths = [exp.store.samples_path(unit), exp.store.preds_path(unit)]
    originals = [p.read_bytes() for p in paths]
    corrupt(paths[0], samples_kind)
    corrupt(paths[1], "bitflip")
    with caplog.at_level(logging.ERROR):
        summary = run_sample(exp)
    assert summary.written == ["ensemble/multi/r0"] and [p.read_bytes() for p in paths] == originals
    lines = [r.getMessage() for r in caplog.records if "moved to" in r.getMessage()]
    assert len(lines) == 2 and all(any(str(p) in line for line in lines) for p in paths)
    for folder in (exp.store.samples_dir, exp.store.preds_dir):
        assert (folder / "quarantine" / "ensemble_multi_r0.safetensors").exists()


@pytest.mark.parametrize("kind", ["truncate", "nan", "wrong_shape", "other_experiment", "bitflip"])
def test_evaluate_refuses_a_damaged_reference_with_the_healing_command(exp, kind):
    path = exp.store.checkpoint_path(1)
    message = corrupt(path, kind)
    with pytest.raises(CorruptZooError) as err:
        run_evaluate(exp)
    text = str(err.value)
    assert str(path) in text and message in text and "reference checkpoint(s)" in text
    assert "python -m benchmark stage=zoo experiment=digits_optunet" in text and "verify.repair=true" in text
    assert not (exp.results_dir / "metrics.csv").exists() and not (exp.store.base / "eval").exists()
    run_zoo(exp, exp.reference)  # heals it
    frame = run_evaluate(exp)
    assert list(frame.status) == ["ok"] * len(frame) and list(frame["mode"]).count("baseline") == len(frame) - 1


def test_a_damaged_base_checkpoint_stops_the_sample_stage_with_the_healing_command(exp):
    exp.store.samples_path(exp.store.sample_unit("ensemble", "multi")).unlink()
    corrupt(exp.store.checkpoint_path(100001), "bitflip")
    with pytest.raises(CorruptZooError, match=r"held-out base checkpoint.*seed_100001.*checksum mismatch.*stage=zoo"):
        run_sample(exp)


def test_report_refuses_an_unreadable_zoo_checkpoint(exp):
    corrupt(exp.store.checkpoint_path(0), "garbage")
    with pytest.raises(CorruptZooError, match=r"seed_000000.safetensors: corrupt.*stage=zoo experiment=digits_optunet"):
        write_zoo_summary(exp, exp.results_dir / "zoo.md")


def test_a_checkpoint_of_another_model_is_named(exp):
    """The issue's case: another shape in the zoo gave 'stack expects each tensor to be equal size'."""
    with seeded(0):
        other = torch.nn.Linear(3, 2).state_dict()
    save_checkpoint(exp.store.checkpoint_path(0), other, {"seed": 0, "experiment": exp.name})
    with pytest.raises(CorruptZooError, match=r"seed_000000.safetensors: missing key 'conv1.weight'"):
        run_evaluate(exp)


def test_temp_files_of_a_write_killed_mid_way_are_removed_when_the_seed_is_redone(exp):
    path = exp.store.checkpoint_path(1)
    original = path.read_bytes()
    path.unlink()  # killed mid-write: the checkpoint never got its final name, a temp file stayed
    leftover = path.with_name(f".{path.name}.tmp-4242-0badcafe")
    leftover.write_bytes(original[:100])
    summary = run_zoo(exp, exp.reference)
    assert summary.trained == [1] and path.read_bytes() == original and not leftover.exists()
