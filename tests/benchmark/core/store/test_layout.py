import pytest

from benchmark.core.store import ExperimentStore, StoreError
from benchmark.core.store.layout import _compact


def test_paths_seeds_and_failures(tmp_path):
    store = ExperimentStore(tmp_path, "exp")
    store.ensure_writable()
    assert store.checkpoint_path(42).name == "seed_000042.safetensors"
    store.checkpoint_path(3).write_bytes(b"x")
    store.record_failure(5, {"reason": "dead units"})
    assert store.completed_seeds() == [3]
    assert store.failed_seeds() == {5: {"seed": 5, "reason": "dead units"}}
    with pytest.raises(StoreError, match=r"no checkpoint for seeds 4-6, 9"):
        store.checkpoint_paths([3, 4, 5, 6, 9])
    with pytest.raises(ValueError, match="reason"):
        store.record_failure(1, {})


def test_unwritable_store_names_the_option(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(StoreError, match=r"store=.*file/sub: cannot write.*Not a directory.*store=/path/to/store"):
        ExperimentStore(blocker / "sub", "exp").ensure_writable()


def test_damaged_failure_records_are_left_out_and_listed(tmp_path):
    store = ExperimentStore(tmp_path, "exp")
    store.ensure_writable()
    store.record_failure(5, {"reason": "dead units"})
    store.failed_path(6).write_text('{"reason": "dead')
    store.failed_path(7).write_text("[1, 2]")
    assert store.failed_seeds() == {5: {"seed": 5, "reason": "dead units"}}
    assert sorted(store.unreadable_failure_records()) == [6, 7]
    assert "seed_000006.json: damaged failure record" in store.unreadable_failure_records()[6]


def test_compact_ranges():
    assert _compact([7, 1, 2, 3, 5]) == "1-3, 5, 7"
