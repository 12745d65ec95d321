"""The saved states of the Markov chains of one sample unit (``method=hmc``): where each lives
and the key it must have been run under.

A ``ChainFiles`` is asked of the store (``ExperimentStore.chain_files(unit, key)``) by the sample
stage, whose ``key`` is the unit's (the settings, code and inputs its samples are keyed by, with
the method's own fingerprint of its data): a saved state of another key is never resumed, and
``stale()`` lists what a stale unit leaves behind. ``ChainFiles(folder)`` (no unit, empty key) is a
plain folder for the batched API (``HMCMethod.run_chains``) outside a store.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from benchmark.core.store.checkpoint import read_metadata
from benchmark.core.store.errors import CheckpointError
from benchmark.core.store.units import Unit

KEY = "key"
"""The metadata entry of a chain state that holds the key it was run under."""


@dataclass(frozen=True)
class ChainFiles:
    """The chain states of one unit in ``directory`` (one file per base seed), run under ``key``."""

    directory: Path
    key: str = ""
    unit: Unit | None = None

    def path(self, seed: int) -> Path:
        """The state file of the chain of base ``seed``."""
        stem = self.unit.chain_stem(seed) if self.unit is not None else Unit.zoo("", seed).stem
        return Path(self.directory) / f"{stem}.safetensors"

    def saved(self) -> list[Path]:
        """Every chain state file in the folder (sorted; temp files and others left out)."""
        if not Path(self.directory).is_dir():
            return []
        return sorted(p for p in Path(self.directory).glob("seed_*.safetensors") if not p.name.startswith("."))

    def stale(self) -> dict[Path, str]:
        """State files of the folder not run under this ``key`` (another unit key: settings, code,
        data or zoo changed), or unreadable, each with why."""
        out = {}
        for path in self.saved():
            try:
                got = read_metadata(path).get(KEY)
            except CheckpointError as err:
                out[path] = str(err)
                continue
            except OSError as err:
                out[path] = f"{path}: unreadable ({err.strerror or err})"
                continue
            if got != self.key:
                out[path] = f"{path}: run under key {got}, the unit's is now {self.key}"
        return out
