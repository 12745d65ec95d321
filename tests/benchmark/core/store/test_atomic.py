"""Atomic writes: an error of the writer names the file being written."""
from __future__ import annotations

import pytest


def test_an_os_error_of_a_writer_that_names_no_file_names_the_one_being_written(tmp_path):
    """Issue #30, item 7: ``disk full`` named no path."""
    import errno

    from benchmark.core.store import atomic_path

    target = tmp_path / "x.safetensors"
    with pytest.raises(OSError, match=r"No space left on device \(writing .*x.safetensors\)") as raised:
        with atomic_path(target):
            raise OSError(errno.ENOSPC, "No space left on device")
    assert raised.value.errno == errno.ENOSPC and raised.value.filename == str(target) and not target.exists()
