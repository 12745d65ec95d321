"""The store's sample sets on disk as MMD column sources: same numbers as in memory, named errors."""
import pandas as pd
import pytest
import torch

from benchmark.core.store import CheckpointError, CheckpointFiles, SampleSetFile, save_checkpoint, save_sample_set
from metrics.mmd import MMDInputError, mmd
from tests.metrics.mmd.test_table import _sample_sets


def test_store_streaming_equals_in_memory(tmp_path):
    x, y = _sample_sets()
    save_sample_set(tmp_path / "x.safetensors", x, {"method": "zoo"})
    save_sample_set(tmp_path / "y.safetensors", y, {"method": "test"})
    zoo = []
    for s in range(12):
        path = tmp_path / "zoo" / f"seed{s}.safetensors"
        save_checkpoint(path, {k: v[s] for k, v in x.items()}, {"seed": s})
        zoo.append(path)
    in_memory = mmd(x, y)
    from_files = mmd(SampleSetFile(tmp_path / "x.safetensors"), SampleSetFile(tmp_path / "y.safetensors"),
                     max_chunk_elements=25)
    from_zoo = mmd(CheckpointFiles(zoo), SampleSetFile(tmp_path / "y.safetensors"), max_chunk_elements=13)
    def by_layer(frame):  # safetensors headers list keys alphabetically
        return frame.sort_values("layer", kind="stable").reset_index(drop=True)

    for streamed in (from_files, from_zoo):
        pd.testing.assert_frame_equal(by_layer(streamed.per_kernel), by_layer(in_memory.per_kernel), rtol=1e-12)
        assert streamed.aggregate == pytest.approx(in_memory.aggregate, rel=1e-12)


def test_zoo_with_a_mismatched_checkpoint_is_named(tmp_path):
    good, bad = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_checkpoint(good, {"fc.weight": torch.zeros(3, 2)}, {})
    save_checkpoint(bad, {"fc.weight": torch.zeros(3, 3)}, {})
    with pytest.raises(CheckpointError, match="b.safetensors.*fc.weight"):
        CheckpointFiles([good, bad]).shapes()
    assert CheckpointFiles([good, good]).shapes() == {"fc.weight": (2, 3, 2)}
    with pytest.raises(CheckpointError, match="empty zoo"):
        CheckpointFiles([])


def test_store_sides_with_different_shapes_are_rejected(tmp_path):
    save_sample_set(tmp_path / "x.safetensors", {"fc.weight": torch.zeros(4, 3, 2)}, {})
    save_sample_set(tmp_path / "y.safetensors", {"fc.weight": torch.zeros(4, 3, 5)}, {})
    with pytest.raises(MMDInputError, match="layer 'fc'"):
        mmd(SampleSetFile(tmp_path / "x.safetensors"), SampleSetFile(tmp_path / "y.safetensors"))
