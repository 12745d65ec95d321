"""Fenced publication (``atomic_path(..., exclusive=True)``): a late writer never replaces a
published file; "already exists" drops the late copy and leaves no temp file behind."""
import errno
import os

import pytest
import torch

from benchmark.core.store import AlreadyPublishedError, ExperimentStore, load_checkpoint, save_checkpoint, temp_files_of
from benchmark.core.store import atomic
from benchmark.core.store.sampleset import load_sample_set, save_sample_set


def test_a_late_writer_never_replaces_a_published_checkpoint(tmp_path):
    path = tmp_path / "seed_000001.safetensors"
    save_checkpoint(path, {"w": torch.ones(3)}, {"seed": 1}, exclusive=True)
    first = path.read_bytes()
    with pytest.raises(AlreadyPublishedError, match="seed_000001.safetensors: already published"):
        save_checkpoint(path, {"w": torch.zeros(3)}, {"seed": 1}, exclusive=True)
    assert path.read_bytes() == first and torch.equal(load_checkpoint(path)[0]["w"], torch.ones(3))
    assert temp_files_of(path) == [] and os.stat(path).st_nlink == 1
    save_checkpoint(path, {"w": torch.zeros(3)}, {"seed": 1})  # plain writes (caches) still replace
    assert torch.equal(load_checkpoint(path)[0]["w"], torch.zeros(3))


def test_sample_sets_and_failure_records_are_fenced_too(tmp_path):
    path = tmp_path / "swag_one_r0.safetensors"
    save_sample_set(path, {"w": torch.ones(2, 3)}, {}, exclusive=True)
    with pytest.raises(AlreadyPublishedError):
        save_sample_set(path, {"w": torch.zeros(2, 3)}, {}, exclusive=True)
    assert torch.equal(load_sample_set(path)["w"], torch.ones(2, 3))
    store = ExperimentStore(tmp_path, "e")
    store.record_failure(4, {"reason": "first"}, exclusive=True)
    with pytest.raises(AlreadyPublishedError):
        store.record_failure(4, {"reason": "late"}, exclusive=True)
    assert store.failed_seeds()[4]["reason"] == "first" and temp_files_of(store.failed_path(4)) == []


def test_without_hard_links_the_fallback_still_refuses_to_replace(tmp_path, monkeypatch, caplog):
    def no_links(src, dst, *args, **kwargs):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(atomic.os, "link", no_links)
    path = tmp_path / "a.txt"
    atomic.atomic_write_text(path, "first", exclusive=True)
    with pytest.raises(AlreadyPublishedError):
        atomic.atomic_write_text(path, "late", exclusive=True)
    assert path.read_text() == "first" and temp_files_of(path) == []
    assert "no hard links" in caplog.text
