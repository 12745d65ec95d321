import pytest
import torch

from benchmark.core.store import (
    CheckpointError,
    iter_checkpoint_batches,
    iter_column_chunks,
    iter_layer_column_chunks,
    load_checkpoints_as_sample_set,
    load_layer,
    load_sample_set,
    sample_count,
    sample_set_keys,
    save_checkpoint,
    save_sample_set,
    stack_state_dicts,
    unstack,
)


@pytest.fixture
def sample_set():
    g = torch.Generator().manual_seed(0)
    return {"a.weight": torch.randn(6, 5, 4, 3, generator=g), "a.bias": torch.randn(6, 5, generator=g), "n": torch.arange(6)}


def test_sample_set_round_trip_and_key_shapes(tmp_path, sample_set):
    path = tmp_path / "s.safetensors"
    save_sample_set(path, sample_set, {"method": "swag"})
    assert sample_set_keys(path) == {"a.weight": (6, 5, 4, 3), "a.bias": (6, 5), "n": (6,)}
    loaded = load_sample_set(path)
    assert all(torch.equal(loaded[k], v) for k, v in sample_set.items())
    assert list(load_sample_set(path, ["a.bias"])) == ["a.bias"]
    with pytest.raises(CheckpointError, match="no key 'zz'"):
        load_sample_set(path, ["zz"])


@pytest.mark.parametrize("max_columns", [1, 5, 9, 10, 10_000])
def test_column_chunks_reassemble_the_flattened_tensor_within_the_bound(tmp_path, sample_set, max_columns):
    path = tmp_path / "s.safetensors"
    save_sample_set(path, sample_set, {})
    for key, full in sample_set.items():
        chunks = list(iter_column_chunks(path, key, max_columns))
        assert torch.equal(torch.cat(chunks, dim=1), full.reshape(6, -1))
        row = full[0, 0].numel() if full.dim() > 1 else 1
        assert all(c.shape[1] <= max(max_columns, row) for c in chunks)


def test_zoo_layer_reads_match_whole_checkpoints(tmp_path):
    states = [{"w": torch.randn(7, 3), "b": torch.randn(7)} for _ in range(4)]
    paths = []
    for i, s in enumerate(states):
        paths.append(tmp_path / f"c{i}.safetensors")
        save_checkpoint(paths[-1], s, {})
    stacked = stack_state_dicts(states)
    assert torch.equal(load_layer(paths, "w"), stacked["w"])
    assert torch.equal(torch.cat(list(iter_layer_column_chunks(paths, "w", 6)), 1), stacked["w"].reshape(4, -1))
    assert [c.shape for c in iter_layer_column_chunks(paths, "w", 6)] == [(4, 6)] * 3 + [(4, 3)]
    batches = list(iter_checkpoint_batches(paths, 3))
    assert [sample_count(b) for b in batches] == [3, 1]
    assert torch.equal(load_checkpoints_as_sample_set(paths)["b"], stacked["b"])
    assert all(torch.equal(unstack(stacked, 2)[k], states[2][k]) for k in states[2])
    with pytest.raises(CheckpointError, match="c0.safetensors: no key 'q'"):
        load_layer(paths, "q")


def test_inconsistent_sample_sets_are_refused(tmp_path):
    with pytest.raises(CheckpointError, match="disagree on the sample count"):
        save_sample_set(tmp_path / "x.safetensors", {"a": torch.zeros(3, 2), "b": torch.zeros(4)}, {})
    with pytest.raises(CheckpointError, match="'a' contains NaN"):
        save_sample_set(tmp_path / "x.safetensors", {"a": torch.full((3, 2), float("nan"))}, {})
    with pytest.raises(CheckpointError, match="differ from state dict 0"):
        stack_state_dicts([{"a": torch.zeros(1)}, {"b": torch.zeros(1)}])
    assert not (tmp_path / "x.safetensors").exists()


def test_block_reads_refuse_truncated_files_and_mismatched_zoos(tmp_path, sample_set):
    path = tmp_path / "s.safetensors"
    save_sample_set(path, sample_set, {})
    data = path.read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[:-50])
    with pytest.raises(CheckpointError, match="cut.safetensors: truncated"):
        list(iter_column_chunks(cut, "a.weight", 30))
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_checkpoint(a, {"w": torch.zeros(3, 2)}, {})
    save_checkpoint(b, {"w": torch.zeros(4, 2)}, {})
    with pytest.raises(CheckpointError, match=r"b.safetensors: key 'w' has shape \(4, 2\), expected \(3, 2\)"):
        list(iter_layer_column_chunks([a, b], "w"))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.int64])
def test_block_reads_keep_dtype(tmp_path, dtype):
    full = (torch.arange(5 * 4 * 3).reshape(5, 4, 3) - 7).to(dtype)
    path = tmp_path / "d.safetensors"
    save_sample_set(path, {"x": full}, {})
    chunks = list(iter_column_chunks(path, "x", 3))
    assert all(c.dtype == dtype for c in chunks) and torch.equal(torch.cat(chunks, 1), full.reshape(5, -1))
