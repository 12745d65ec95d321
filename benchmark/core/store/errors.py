"""Errors raised by the checkpoint store."""
from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint or sample-set file is corrupt, truncated, or does not match the model.

    The message always names the file, and the key when one is at fault; ``path``, where set,
    is that file (so that a cache can remove exactly the damaged file and rebuild it).
    """

    def __init__(self, message: str, path: object = None) -> None:
        super().__init__(message)
        self.path = path


class StoreError(RuntimeError):
    """The store folder is unusable (not writable, wrong experiment, missing seeds)."""
