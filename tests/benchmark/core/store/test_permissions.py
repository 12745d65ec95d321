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
