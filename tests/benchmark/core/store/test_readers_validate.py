"""Every reader validates content unless its caller says it already did, and the streamed readers
read all blocks of a file through the one handle that was verified."""
import json
import os

import pytest
import torch

from bench.corruptions import corrupt, nan_files
from benchmark.core.store import (
    CheckpointError, iter_checkpoint_batches, iter_column_chunks, iter_layer_column_chunks, load_checkpoint,
    load_layer, load_sample_set, save_checkpoint, save_sample_set,
)
from benchmark.core.store import sampleset
from benchmark.core.store.checksum import forget_all


@pytest.fixture(autouse=True)
def fresh_memo():
    forget_all()
    yield
    forget_all()




def test_a_nan_with_valid_checksums_is_refused_by_every_reader(tmp_path):
    samples, single = nan_files(tmp_path)
    readers = {
        "load_sample_set": lambda: load_sample_set(samples),
        "load_sample_set keys": lambda: load_sample_set(samples, ["w"]),
        "load_checkpoint without a model": lambda: load_checkpoint(single),
        "iter_column_chunks": lambda: list(iter_column_chunks(samples, "w", 4)),
        "iter_layer_column_chunks": lambda: list(iter_layer_column_chunks([single, single], "w", 4)),
        "load_layer": lambda: load_layer([single], "w"),
        "iter_checkpoint_batches": lambda: list(iter_checkpoint_batches([single], 1)),
    }
    for name, read in readers.items():
        forget_all()
        with pytest.raises(CheckpointError, match=r"tensor 'w' contains NaN or Inf"):
            read()
            pytest.fail(f"{name} read a NaN")


def test_a_caller_that_validated_the_file_skips_the_check(tmp_path):
    samples, single = nan_files(tmp_path)
    assert torch.isnan(load_sample_set(samples, validated=True)["w"]).any()
    assert torch.isnan(load_checkpoint(single, validated=True)[0]["w"]).any()
    assert torch.isnan(torch.cat(list(iter_column_chunks(samples, "w", 4, validated=True)), 1)).any()


def test_load_sample_set_checks_shapes_when_given(tmp_path):
    path = tmp_path / "s.safetensors"
    save_sample_set(path, {"w": torch.zeros(4, 6, 3), "b": torch.zeros(4, 6)}, {})
    load_sample_set(path, shapes={"w": (6, 3), "b": (6,)})
    with pytest.raises(CheckpointError, match=r"key 'w' has shape \(6, 3\), expected \(6, 2\)"):
        load_sample_set(path, shapes={"w": (6, 2), "b": (6,)})


def test_streamed_blocks_come_from_the_verified_file_through_one_handle(tmp_path, monkeypatch):
    torch.manual_seed(1)
    path, other = tmp_path / "s.safetensors", tmp_path / "t.safetensors"
    first, second = torch.randn(3, 12, 2), torch.randn(3, 12, 2)
    save_sample_set(path, {"w": first}, {})
    save_sample_set(other, {"w": second}, {})
    opened = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda p, *a, **k: (opened.append(str(p)), real_open(p, *a, **k))[1])
    blocks = iter_column_chunks(path, "w", 4)
    got = [next(blocks)]
    os.replace(other, path)  # a healed or republished file takes the name between two blocks
    got += list(blocks)
    assert torch.equal(torch.cat(got, 1), first.reshape(3, -1))  # every block from the version verified
    assert opened.count(str(path)) == 1  # header, checksum scan and 6 blocks through one handle


def test_a_zoo_file_reopened_past_the_handle_limit_must_be_the_same_version(tmp_path, monkeypatch):
    torch.manual_seed(2)
    paths = [tmp_path / f"seed_{i}.safetensors" for i in range(3)]
    for p in paths:
        save_checkpoint(p, {"w": torch.randn(8, 2)}, {})
    whole = torch.stack([load_checkpoint(p)[0]["w"].reshape(-1) for p in paths])
    assert torch.equal(torch.cat(list(iter_layer_column_chunks(paths, "w", 2)), 1), whole)
    monkeypatch.setattr(sampleset, "MAX_OPEN", 1)
    assert torch.equal(torch.cat(list(iter_layer_column_chunks(paths, "w", 2)), 1), whole)  # reopened, unchanged
    blocks = iter_layer_column_chunks(paths, "w", 2)
    next(blocks)
    save_checkpoint(paths[0], {"w": torch.randn(8, 2)}, {})  # rewritten between two blocks
    with pytest.raises(CheckpointError, match=r"seed_0.safetensors: the file changed while it was being read"):
        list(blocks)


def test_a_header_entry_whose_byte_range_does_not_fit_its_shape_is_refused(tmp_path):
    """A damaged shape in the header (bytes for 6x3 floats, shape claiming 6x2) is named as a corrupt
    header by the streamed readers, never read as another tensor's bytes."""
    import json
    import struct

    path = tmp_path / "s.safetensors"
    save_sample_set(path, {"w": torch.zeros(4, 6, 3)}, {})
    data = bytearray(path.read_bytes())
    (length,) = struct.unpack("<Q", data[:8])
    header = data[8 : 8 + length].decode()
    damaged = header.replace('"shape":[4,6,3]', '"shape":[4,6,2]')
    assert damaged != header and json.loads(damaged)
    data[8 : 8 + length] = damaged.encode()
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"key 'w' spans 288 bytes, its dtype and shape \[4, 6, 2\] need 192"):
        list(iter_column_chunks(path, "w", 4))


def _overwrite_tail(path, nbytes: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(-nbytes, 2)
        fh.write(b"\0" * nbytes)


def test_whole_file_readers_own_their_memory(tmp_path):
    # What was read must not change when the file changes afterwards (another node replacing or
    # damaging it): a memory-mapped read would see the new bytes, or die of SIGBUS on NFS.
    from benchmark.core.store import load_checkpoint, load_sample_set, save_checkpoint, save_sample_set
    from benchmark.core.store.sampleset import load_layer

    weights = torch.arange(1, 1001, dtype=torch.float32)
    save_checkpoint(tmp_path / "c.safetensors", {"w": weights}, {})
    save_sample_set(tmp_path / "s.safetensors", {"w": weights.reshape(10, 100)}, {})
    state, _ = load_checkpoint(tmp_path / "c.safetensors")
    samples = load_sample_set(tmp_path / "s.safetensors")
    layer = load_layer([tmp_path / "c.safetensors"], "w")
    for name in ("c.safetensors", "s.safetensors"):
        _overwrite_tail(tmp_path / name, 400)
    assert torch.equal(state["w"], weights)
    assert torch.equal(samples["w"].reshape(-1), weights)
    assert torch.equal(layer[0], weights)


@pytest.mark.parametrize("damage", ["hole", "short"])
def test_whole_file_readers_refuse_a_header_that_does_not_index_the_data(tmp_path, damage):
    import struct

    from benchmark.core.store import CheckpointError, load_checkpoint, save_checkpoint

    path = tmp_path / "c.safetensors"
    save_checkpoint(path, {"a": torch.ones(4), "b": torch.ones(4)}, {})
    raw = bytearray(path.read_bytes())
    if damage == "short":
        raw = raw[:-4]
    else:  # move b's span 4 bytes on and grow the file: a hole before b
        (length,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + length])
        header["b"]["data_offsets"] = [v + 4 for v in header["b"]["data_offsets"]]
        text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode().ljust(length)
        assert len(text) == length
        raw[8 : 8 + length] = text
        raw += b"\0" * 4
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="c.safetensors: corrupt"):
        load_checkpoint(path)
