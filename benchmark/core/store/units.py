"""Units of work of the store, and the names the store gives them.

A unit is what one process claims, computes and publishes as a whole: a zoo seed (its
checkpoint or its failure record), or one repetition of a (method, mode) (its sample set and
its predictions). ``Unit`` is the one type for both; it gives the unit's file stem, claim name,
cache name and log label, and ``Unit.parse`` is the one place that reads a unit back from a
file name. Nothing outside the store builds or parses these names.

```
zoo seed 42                     stem seed_000042        claim zoo-seed_000042      label seed 42
swag, one-mode, repetition 2    stem swag_one_r2        claim sample-swag-one-r2   label swag/one/r2
hmc multi r0, chain of base 7   stem seed_000007 (in chains/hmc_multi_r0/)   claim sample-hmc-multi-r0-chain-7
```

A sample unit of a method that runs resumable Markov chains (``hmc``) has one chain per base
network, each its own unit of work inside the unit: ``chain_stem`` names its state file,
``chain_claim_name`` its claim, so that a killed run resumes each chain and several jobs
share the chains of one unit.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

MAX_SEED = 999_999  # seeds are written with six digits
MODES = ("one", "multi")  # the two table groups of a method's samples

_SEED_STEM = re.compile(r"^seed_(\d{6})$")
_SAMPLE_STEM = re.compile(r"^(?P<method>[A-Za-z0-9_-]+?)_(?P<mode>one|multi)_r(?P<repetition>\d+)$")


@dataclass(frozen=True, order=True)
class Unit:
    """A zoo seed (``seed`` set) or one repetition of a method x mode (``method``, ``mode``,
    ``repetition`` set), of experiment ``experiment``. Build it with ``Unit.zoo`` or ``Unit.samples``."""

    experiment: str
    seed: int | None = None
    method: str | None = None
    mode: str | None = None
    repetition: int | None = None

    @classmethod
    def zoo(cls, experiment: str, seed: int) -> "Unit":
        """The zoo seed ``seed`` (0 <= seed <= ``MAX_SEED``)."""
        if not 0 <= int(seed) <= MAX_SEED:
            raise ValueError(f"seed must be in [0, {MAX_SEED}], got {seed}")
        return cls(experiment, seed=int(seed))

    @classmethod
    def samples(cls, experiment: str, method: str, mode: str, repetition: int = 0) -> "Unit":
        """Repetition ``repetition`` of ``method`` in ``mode`` (``one`` or ``multi``)."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if not method or "/" in method or method.endswith(("_one", "_multi")):
            raise ValueError(f"method name {method!r} cannot name a sample set")
        if int(repetition) < 0:
            raise ValueError(f"repetition must be >= 0, got {repetition}")
        return cls(experiment, method=method, mode=mode, repetition=int(repetition))

    @property
    def is_seed(self) -> bool:
        return self.seed is not None

    @property
    def stem(self) -> str:
        """File name without suffix: ``seed_000042`` or ``swag_one_r2``."""
        if self.is_seed:
            return f"seed_{self.seed:06d}"
        return f"{self.method}_{self.mode}_r{self.repetition}"

    @property
    def claim_name(self) -> str:
        """Name of the claim that guards the unit's files (``store.claim``)."""
        if self.is_seed:
            return f"zoo-{self.stem}"
        return f"sample-{self.method}-{self.mode}-r{self.repetition}"

    def chain_stem(self, seed: int) -> str:
        """File name (without suffix) of the state of the chain of base ``seed`` of a sample unit."""
        self.row()
        return self.zoo(self.experiment, seed).stem

    def chain_claim_name(self, seed: int) -> str:
        """Name of the claim that guards the chain of base ``seed`` of a sample unit."""
        self.row()
        return f"{self.claim_name}-chain-{int(seed)}"

    @property
    def cache_name(self) -> str:
        """Name of the evaluate stage's number cache of the unit (``eval/<cache_name>.json``)."""
        return self.stem

    @property
    def label(self) -> str:
        """How logs and errors name the unit: ``seed 42`` or ``swag/one/r2``."""
        return f"seed {self.seed}" if self.is_seed else f"{self.method}/{self.mode}/r{self.repetition}"

    def row(self) -> tuple[str, str]:
        """The table row ``(method, mode)`` of a sample unit."""
        if self.is_seed:
            raise ValueError(f"{self.label} is a zoo seed, not a row of the tables")
        return str(self.method), str(self.mode)

    @classmethod
    def parse(cls, experiment: str, name: str) -> "Unit | None":
        """The unit whose file (or temp file of a write in progress) is called ``name``, or ``None``.

        Accepts ``seed_000042.safetensors``, ``seed_000042.json``, ``swag_one_r2.safetensors``,
        ``swag_one_r2.json`` and the hidden temp names ``.<file>.tmp-<pid>-<id>`` of ``atomic.py``.
        """
        if name.startswith(".") and ".tmp-" in name:
            name = name[1:].split(".tmp-")[0]
        stem, dot, suffix = name.rpartition(".")
        if not dot or suffix not in ("safetensors", "json"):
            return None
        seed = _SEED_STEM.match(stem)
        if seed:
            return cls.zoo(experiment, int(seed.group(1)))
        sample = _SAMPLE_STEM.match(stem)
        if sample:
            return cls.samples(experiment, sample["method"], sample["mode"], int(sample["repetition"]))
        return None
