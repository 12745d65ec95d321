"""Content checksums: written with every file, checked on every read (whole loads and streamed
blocks), independent of how they are computed here; files without them are still read."""
import json

import numpy as np
import pytest
import torch
import xxhash
from safetensors.torch import save_file

from benchmark.core.models import optunet
from benchmark.core.store import (
    CheckpointError, ChecksumError, check_file, iter_column_chunks, iter_layer_column_chunks, load_checkpoint,
    load_layer, load_sample_set, read_metadata, save_checkpoint, save_sample_set, stored_checksums,
)
from benchmark.core.store.checksum import forget_all
from bench.corruptions import corrupt


@pytest.fixture(autouse=True)
def fresh_memo():
    forget_all()
    yield
    forget_all()


@pytest.fixture
def state():
    torch.manual_seed(0)
    return optunet().state_dict()


def test_checksums_are_xxh3_of_dtype_shape_and_bytes(tmp_path, state):
    path = tmp_path / "c.safetensors"
    save_checkpoint(path, state, {"seed": 1})
    entry = json.loads(read_metadata(path)["checksums"])
    assert entry["algorithm"] == "xxh3_64" and sorted(entry["tensors"]) == sorted(state)
    for key, value in state.items():  # independent: numpy bytes of the tensor
        expected = xxhash.xxh3_64(f"F32{list(value.shape)}".encode() + np.ascontiguousarray(value.numpy()).tobytes())
        assert entry["tensors"][key] == expected.hexdigest(), key
    assert stored_checksums(read_metadata(path), str(path)) == entry["tensors"]


def _flipped(tmp_path, state):
    path = tmp_path / "c.safetensors"
    save_checkpoint(path, state, {"seed": 1})
    corrupt(path, "bitflip")
    return path


def test_a_bit_flip_is_caught_by_every_reader(tmp_path, state):
    path = _flipped(tmp_path, state)
    key = max(state, key=lambda k: state[k].numel())  # the flip is in the largest tensor
    readers = [
        lambda: load_checkpoint(path),
        lambda: load_sample_set(path),
        lambda: load_sample_set(path, [key]),
        lambda: check_file(path),
        lambda: load_layer([path], key),
        lambda: list(iter_layer_column_chunks([path], key, 7)),
    ]
    for read in readers:
        forget_all()
        with pytest.raises(ChecksumError, match=f"c.safetensors: checksum mismatch in tensor '{key}'"):
            read()
    load_sample_set(path, ["fc1.bias"])  # an undamaged tensor of the file still reads


def test_streamed_sample_set_blocks_are_verified(tmp_path):
    samples = {"a.weight": torch.randn(5, 40, 3), "a.bias": torch.randn(5, 40)}
    path = tmp_path / "s.safetensors"
    save_sample_set(path, samples, {})
    assert torch.equal(torch.cat(list(iter_column_chunks(path, "a.weight", 30)), 1), samples["a.weight"].reshape(5, -1))
    corrupt(path, "bitflip")
    forget_all()
    with pytest.raises(ChecksumError, match="checksum mismatch in tensor 'a.weight'"):
        list(iter_column_chunks(path, "a.weight", 30))


def test_verified_files_are_remembered_until_rewritten(tmp_path, state, monkeypatch):
    path = tmp_path / "c.safetensors"
    save_checkpoint(path, state, {})
    calls = []
    import benchmark.core.store.checksum as checksum

    real = checksum.tensor_digest
    monkeypatch.setattr(checksum, "tensor_digest", lambda t: calls.append(1) or real(t))
    load_checkpoint(path)
    first = len(calls)
    load_checkpoint(path)
    assert first == len(state) and len(calls) == first  # second read: nothing hashed again
    save_checkpoint(path, {k: v + 1 for k, v in state.items()}, {})
    load_checkpoint(path)
    assert len(calls) == 3 * first  # the write hashes once, the read of the new version once more


def test_files_written_before_checksums_are_still_read(tmp_path, state):
    path = tmp_path / "old.safetensors"
    save_file(state, str(path), metadata={"seed": "3"})
    loaded, meta = load_checkpoint(path, optunet())
    assert stored_checksums(meta, str(path)) is None and all(torch.equal(loaded[k], state[k]) for k in state)
    assert check_file(path) == {"seed": "3"}


@pytest.mark.parametrize("kind", ["truncate", "garbage", "bitflip", "nan", "wrong_shape", "other_experiment", "metadata_digit"])
def test_check_file_names_the_file_and_what_is_wrong(tmp_path, state, kind):
    path = tmp_path / "seed_000001.safetensors"
    save_checkpoint(path, state, {"seed": 1, "experiment": "digits_optunet"})
    check_file(path, optunet_shapes(), expect={"experiment": "digits_optunet"})
    message = corrupt(path, kind)
    with pytest.raises(CheckpointError, match=message) as err:
        check_file(path, optunet_shapes(), expect={"experiment": "digits_optunet"})
    assert str(path) in str(err.value)


def optunet_shapes():
    return {k: tuple(v.shape) for k, v in optunet().state_dict().items()}


def test_check_file_checks_sample_counts(tmp_path):
    path = tmp_path / "s.safetensors"
    save_sample_set(path, {"w": torch.zeros(4, 3), "b": torch.zeros(4)}, {})
    assert check_file(path, {"w": (3,), "b": ()}, leading=1, samples=4) is not None
    with pytest.raises(CheckpointError, match="4 samples, its metadata says 5"):
        check_file(path, {"w": (3,), "b": ()}, leading=1, samples=5)
    with path.open("ab") as fh:
        fh.write(b"junk")
    with pytest.raises(CheckpointError, match="4 unexpected bytes after the data"):
        check_file(path)


def test_another_experiments_file_is_refused_but_one_without_the_entry_passes(tmp_path, state):
    mine, theirs, plain = (tmp_path / f"{n}.safetensors" for n in ("mine", "theirs", "plain"))
    save_checkpoint(mine, state, {"experiment": "digits_optunet", "seed": 4})
    save_checkpoint(theirs, state, {"experiment": "mnist_optunet", "seed": 4})
    save_checkpoint(plain, state, {})  # written by another tool: nothing to tell it apart
    expect = {"experiment": "digits_optunet", "seed": "4"}
    assert check_file(mine, expect=expect)["experiment"] == "digits_optunet"
    check_file(plain, expect=expect)
    with pytest.raises(CheckpointError, match="theirs.safetensors: metadata experiment is 'mnist_optunet', expected"):
        load_checkpoint(theirs, expect=expect)
    with pytest.raises(CheckpointError, match="metadata seed is '4', expected '5'"):
        check_file(mine, expect={"seed": "5"})
