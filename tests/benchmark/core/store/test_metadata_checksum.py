"""The metadata are covered by a checksum, and a file of the current store format cannot lose its
checks by damage: each metadata entry's value or name changed by one byte is caught by every
reader; files of the two earlier formats are still read."""
import json
import shutil

import pytest
import torch
import xxhash
from safetensors.torch import save_file

from bench.corruptions import damage_metadata
from benchmark.core.models import optunet
from benchmark.core.store import (
    CheckpointError, CheckpointMetadata, ChecksumError, check_file, load_checkpoint, load_sample_set, read_metadata,
    save_checkpoint, stored_checksums,
)
from benchmark.core.store.checksum import FORMAT, file_format, forget_all, tensor_digest


@pytest.fixture(autouse=True)
def fresh_memo():
    forget_all()
    yield
    forget_all()


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    torch.manual_seed(0)
    state = optunet().state_dict()
    path = tmp_path_factory.mktemp("meta") / "seed_000003.safetensors"
    meta = CheckpointMetadata(experiment="digits_optunet", seed=3, role="reference", config_hash="0123abcd4567",
                              train_accuracy=0.97, validation_accuracy=0.95, test_accuracy=0.9437, epochs=12,
                              trainer="vectorised", versions={"torch": "2.14.1"})
    save_checkpoint(path, state, meta.encode())
    return path, state


def test_the_metadata_digest_is_xxh3_of_the_sorted_entries(written):
    path, _ = written
    meta = read_metadata(path)
    entry = json.loads(meta["checksums"])
    covered = {k: v for k, v in meta.items() if k != "checksums"}
    expected = xxhash.xxh3_64(json.dumps(covered, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    assert entry["metadata"] == expected and meta["format"] == str(FORMAT) == "2" and file_format(meta) == FORMAT


def _keys(path):
    return sorted(read_metadata(path))


@pytest.mark.parametrize("part", ["value", "key"])
def test_one_byte_of_any_metadata_entry_is_caught_by_every_reader(written, tmp_path, part):
    source, state = written
    keys = _keys(source)
    assert {"checksums", "format", "config_hash", "test_accuracy", "seed", "experiment"} <= set(keys)
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    for key in keys:
        path = tmp_path / f"{key}.safetensors"
        shutil.copy(source, path)
        damage_metadata(path, key, part)
        readers = {"check_file": lambda: check_file(path, shapes), "load_checkpoint": lambda: load_checkpoint(path),
                   "load_sample_set": lambda: load_sample_set(path)}
        if key != "checksums" or part == "key":  # a tensor digest changed is found when the tensor is read
            readers["read_metadata"] = lambda: read_metadata(path)
        for name, read in readers.items():
            forget_all()
            with pytest.raises(CheckpointError, match=str(path.name)):
                read()
                pytest.fail(f"{part} of {key!r} damaged passed {name}")


def test_a_damaged_digit_of_test_accuracy_is_named_as_a_metadata_mismatch(written, tmp_path):
    path = tmp_path / "c.safetensors"
    shutil.copy(written[0], path)
    damage_metadata(path, "test_accuracy")
    with pytest.raises(ChecksumError, match="metadata checksum mismatch"):
        read_metadata(path)


def test_a_renamed_checksums_key_does_not_turn_checks_off(written, tmp_path):
    path = tmp_path / "c.safetensors"
    shutil.copy(written[0], path)
    damage_metadata(path, "checksums", "key")
    with pytest.raises(ChecksumError, match="claims store format 2 but has no 'checksums'"):
        load_checkpoint(path)


def test_format_1_files_read_with_tensor_checksums_only(tmp_path, written):
    _, state = written
    path = tmp_path / "v1.safetensors"  # as the previous version wrote: tensor digests, no format key
    entry = json.dumps({"algorithm": "xxh3_64", "tensors": {k: tensor_digest(v) for k, v in state.items()}})
    save_file(state, str(path), metadata={"seed": "3", "checksums": entry})
    loaded, meta = load_checkpoint(path, optunet())
    assert file_format(meta) == 1 and stored_checksums(meta, str(path)) is not None
    assert check_file(path)["seed"] == "3"


def test_format_0_files_read_but_a_damaged_key_name_is_not_taken_for_one(tmp_path, written):
    _, state = written
    plain, damaged = tmp_path / "v0.safetensors", tmp_path / "bad.safetensors"
    save_file(state, str(plain), metadata={"seed": "3"})
    assert file_format(load_checkpoint(plain, optunet())[1]) == 0
    entry = json.dumps({"algorithm": "xxh3_64", "tensors": {k: tensor_digest(v) for k, v in state.items()}})
    save_file(state, str(damaged), metadata={"seed": "3", "checksumz": entry})
    with pytest.raises(ChecksumError, match="'checksumz' looks like a damaged 'checksums'"):
        check_file(damaged)
