"""Files are created with the permissions the umask gives, as any other tool writing the folder
would (safetensors alone creates 0600 files)."""
import os
import stat

import pytest
import torch

from benchmark.core.store import atomic_write_text, quarantine, save_checkpoint, save_sample_set


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o002, 0o077])
def test_checkpoints_sample_sets_and_json_follow_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        save_checkpoint(tmp_path / "c.safetensors", {"w": torch.ones(3)}, {"seed": 1})
        save_sample_set(tmp_path / "s.safetensors", {"w": torch.ones(2, 3)}, {})
        atomic_write_text(tmp_path / "r.json", "{}")
        moved = quarantine(tmp_path / "s.safetensors", "test")
    finally:
        os.umask(old)
    expected = 0o666 & ~umask
    for path in (tmp_path / "c.safetensors", tmp_path / "r.json", moved, moved.with_suffix(".json")):
        assert stat.S_IMODE(path.stat().st_mode) == expected, (path, oct(path.stat().st_mode))


def test_a_group_shared_store_makes_setgid_group_writable_folders_and_files(tmp_path):
    from benchmark.core.store import ExperimentStore

    old = os.umask(0o022)
    try:
        store = ExperimentStore(tmp_path / "store", "exp", group_shared=True)
        store.ensure_writable()
        (store.zoo_dir / "quarantine").mkdir()  # made later by another stage
        save_checkpoint(store.checkpoint_path(1), {"w": torch.ones(3)}, {"seed": 1}, exclusive=True)
        private = ExperimentStore(tmp_path / "private", "exp")
        os.umask(0o022)
        private.ensure_writable()
    finally:
        os.umask(old)
    for folder in (store.base, store.zoo_dir, store.claims_dir, store.zoo_dir / "quarantine"):
        mode = folder.stat().st_mode
        assert mode & stat.S_ISGID and mode & 0o070 == 0o070, (folder, oct(mode))
    assert stat.S_IMODE(store.checkpoint_path(1).stat().st_mode) == 0o664
    assert not private.zoo_dir.stat().st_mode & (stat.S_ISGID | 0o020)  # off by default


@pytest.mark.skipif(os.getuid() != 0, reason="needs to give a file to another user")
def test_a_store_with_other_users_files_that_is_not_group_writable_warns_once(tmp_path, caplog):
    from benchmark.core.store import ExperimentStore

    root = tmp_path / "store"
    (root / "colleague").mkdir(parents=True)
    os.chown(root / "colleague", 12345, -1)
    root.chmod(0o755)
    ExperimentStore(root, "exp").ensure_writable()
    lines = [r for r in caplog.records if "not group-writable" in r.getMessage()]
    assert len(lines) == 1 and "claims.group_shared=true" in lines[0].getMessage()
    caplog.clear()
    root.chmod(0o775)
    ExperimentStore(root, "exp").ensure_writable()
    assert "not group-writable" not in caplog.text
