"""Errors raised by the dataset loaders."""
from __future__ import annotations

from pathlib import Path


class DatasetNotFoundError(FileNotFoundError):
    """A dataset's files are not where the config says they are.

    The message names the dataset, the path that was searched, what was expected inside
    ``data_dir`` and the two Hydra overrides that fix it (``dataset.data_dir=...`` or
    ``dataset.download=true``). ``dataset`` and ``path`` are kept as attributes.
    """

    def __init__(self, dataset: str, path: str | Path, expected: str, reason: str = "") -> None:
        self.dataset, self.path, self.expected, self.reason = dataset, Path(path), expected, reason
        because = f" ({reason})" if reason else ""
        super().__init__(
            f"dataset {dataset!r} not found: looked in {self.path}{because}. Expected inside "
            f"data_dir: {expected}. Fix: set dataset.data_dir=/path/to/data (the folder holding "
            f"that layout), or dataset.download=true to download it into data_dir."
        )
        self.filename = str(self.path)

    def __str__(self) -> str:
        # OSError would print "[Errno None] None: '<filename>'" once filename is set.
        return str(self.args[0])

    def __reduce__(self):
        # Rebuild from the constructor's arguments, so the error survives pickling between
        # processes (joblib / submitit workers).
        return type(self), (self.dataset, self.path, self.expected, self.reason)
