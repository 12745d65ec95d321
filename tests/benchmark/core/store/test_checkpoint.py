import json
import math

import pytest
import torch

from benchmark.core.models import optunet
from benchmark.core.store import CheckpointError, load_checkpoint, read_metadata, save_checkpoint
from benchmark.core.store.atomic import atomic_path
from benchmark.core.store import CheckpointMetadata, SampleSetMetadata


@pytest.fixture
def model():
    torch.manual_seed(0)
    return optunet()


def test_round_trip_keeps_tensors_and_metadata(tmp_path, model):
    path = tmp_path / "c.safetensors"
    save_checkpoint(path, model.state_dict(), {"seed": 3, "experiment": "x", "test_accuracy": 0.75, "v": {"torch": "2"}})
    state, meta = load_checkpoint(path, model)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert meta["experiment"] == "x" and json.loads(meta["seed"]) == 3 and json.loads(meta["v"]) == {"torch": "2"}
    typed = CheckpointMetadata.decode(meta)
    assert typed.test_accuracy == 0.75 and typed.seed == 3 and math.isnan(typed.train_accuracy)
    assert typed.extra == {"v": '{"torch": "2"}'}
    assert read_metadata(path) == meta


def test_typed_metadata_round_trips_and_tolerates_absent_or_damaged_fields():
    meta = SampleSetMetadata(experiment="x", method="swag", label="SWAG", mode="one", repetition=2, n_samples=10,
                             base_seeds=[7, 8], diagnostics={"scale": 0.1}, settings_hash="abc")
    encoded = meta.encode()
    assert encoded["repetition"] == "2" and encoded["method"] == "swag" and "source" not in encoded
    assert SampleSetMetadata.decode(encoded) == meta
    damaged = SampleSetMetadata.decode({**encoded, "n_samples": "ten"})
    assert damaged.n_samples == -1 and damaged.base_seeds == [7, 8]
    assert CheckpointMetadata.decode({}).config_hash is None


def test_nan_weights_are_refused_and_nothing_is_written(tmp_path, model):
    state = model.state_dict()
    state["fc1.bias"] = state["fc1.bias"].clone()
    state["fc1.bias"][1] = float("inf")
    path = tmp_path / "c.safetensors"
    with pytest.raises(CheckpointError, match="'fc1.bias'.*NaN or Inf"):
        save_checkpoint(path, state, {})
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda s: s.pop("conv2.weight"), r"missing key 'conv2.weight' \(expected shape \(10, 1, 5, 5\)\)"),
        (lambda s: s.update(extra=torch.zeros(1)), "unexpected key 'extra'"),
        (lambda s: s.update({"fc2.weight": torch.zeros(10, 4)}), r"'fc2.weight' has shape \(10, 4\), expected \(10, 3\)"),
    ],
)
def test_mismatched_checkpoints_name_file_and_key(tmp_path, model, mutate, message):
    state = dict(model.state_dict())
    mutate(state)
    path = tmp_path / "bad.safetensors"
    save_checkpoint(path, state, {})
    with pytest.raises(CheckpointError, match=message) as err:
        load_checkpoint(path, model)
    assert str(path) in str(err.value)


def test_nan_in_a_stored_file_is_caught_on_read(tmp_path, model):
    from safetensors.torch import save_file

    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["conv1.weight"][0, 0, 0, 0] = float("nan")
    path = tmp_path / "nan.safetensors"
    save_file(state, str(path))
    with pytest.raises(CheckpointError, match="'conv1.weight' contains NaN"):
        load_checkpoint(path, model)


@pytest.mark.parametrize("keep", [5, 100, -40])
def test_truncated_or_garbage_files_name_the_file(tmp_path, model, keep):
    good = tmp_path / "good.safetensors"
    save_checkpoint(good, model.state_dict(), {})
    data = good.read_bytes()
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(data[:keep] if keep > 0 else data[:keep])
    with pytest.raises(CheckpointError, match="bad.safetensors: corrupt or truncated"):
        load_checkpoint(bad, model)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(CheckpointError, match="nope.safetensors: no such file"):
        load_checkpoint(tmp_path / "nope.safetensors")


def test_atomic_path_leaves_nothing_when_the_writer_fails(tmp_path):
    target = tmp_path / "out.bin"
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_bytes(b"partial")
            raise RuntimeError("killed mid-write")
    assert list(tmp_path.iterdir()) == []
    with atomic_path(target) as tmp:
        tmp.write_bytes(b"whole")
    assert target.read_bytes() == b"whole" and [p.name for p in tmp_path.iterdir()] == ["out.bin"]
