"""Fixtures shared by the tests of ``benchmark``: the data readers' and the stages'."""
from __future__ import annotations

import os

import pytest
import torchvision.datasets.cifar
import torchvision.datasets.svhn


@pytest.fixture
def skip_md5(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiny CIFAR-100/SVHN files cannot match the official md5 sums, so only here torchvision's
    check_integrity is reduced to "the file exists"; production code keeps the md5 check."""

    def exists_only(fpath: str, md5: str | None = None) -> bool:
        return os.path.isfile(fpath)

    monkeypatch.setattr(torchvision.datasets.cifar, "check_integrity", exists_only)
    monkeypatch.setattr(torchvision.datasets.svhn, "check_integrity", exists_only)
