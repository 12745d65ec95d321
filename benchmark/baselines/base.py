"""The contract of a baseline: what the evaluate stage gives it and gets back.

``Baseline.draw(exp, zoo, n, repetition)``: given the experiment (its model, data, store and
recipe), the reference zoo (``ZooReference``: its weights or forms, for draws fitted to it), how
many networks a repetition holds (``sample.per_method``) and the repetition, it returns the weight
samples ``{key: [n, ...]}`` and the seeds of the store's networks they are (``None`` for draws),
a pure function of these inputs. ``networks(exp, repetition, n)`` names the store networks it will
read (they key its cached numbers); ``held_out``: whether it reads held-out networks (then at most
the design's repetitions, or its ``most`` for one whose ``reach`` is ``"most"``). The evaluate stage predicts and scores them like a method's samples.
"""
from __future__ import annotations

import hashlib
from typing import ClassVar

import torch

from benchmark.experiment import Experiment
from benchmark.inventory import converged
from benchmark.references.zoo import ZooReference


class Baseline:
    """A baseline row (see the module docstring): ``name`` (metrics.csv's ``method``), ``label``
    (the table's row name), ``about`` (what it is, for the captions), ``order`` (its place among
    the baselines in the tables)."""

    name: ClassVar[str]
    label: ClassVar[str]
    about: ClassVar[str]
    order: ClassVar[int] = 100
    held_out: ClassVar[bool] = False
    reach: ClassVar[str] = "repetitions"
    """For a ``held_out`` baseline: ``"repetitions"`` when it reads whole held-out blocks (at most the
    design's default count of repetitions), ``"most"`` when it reads only the bases at their starts
    (at most the largest count of any method: ``Design.baseline_repetitions``)."""

    @classmethod
    def networks(cls, exp: Experiment, repetition: int, n: int) -> list[int]:
        """The seeds of the store's networks repetition ``repetition``'s draws are (none by default)."""
        return []

    @classmethod
    def draw(cls, exp: Experiment, zoo: ZooReference, n: int, repetition: int
             ) -> tuple[dict[str, torch.Tensor], list[int] | None]:
        """Repetition ``repetition``'s ``n`` weight samples ``{key: [n, ...]}`` and the seeds of the
        networks they are (``None`` for draws)."""
        raise TypeError(f"{cls.__name__}.draw: every registered baseline defines its own draw (register refuses one without)")


def heldout_block(exp: Experiment, repetition: int, n: int, who: str, drop: str) -> list[int]:
    """The first ``n`` converged held-out seeds of repetition ``repetition``'s block (``Design.block``:
    from converged held-out seed ``repetition x Design.stride`` on, as the sample stage reads them);
    ``ValueError`` naming the baseline ``who``, the shortfall and what to drop (``drop``) otherwise."""
    design = exp.design
    seeds = list(design.block(converged(exp, exp.heldout), repetition, n))
    if len(seeds) < n:
        raise ValueError(f"baseline {who}: repetition {repetition} needs {n} converged held-out networks from "
                         f"converged seed {design.start(repetition)} of seeds.heldout={[exp.heldout.start, exp.heldout.stop]}, "
                         f"the store has {len(seeds)}; train them (stage=zoo zoo.range=heldout) or drop {drop!r} "
                         "from evaluate.baselines")
    return seeds


def generator(name: str, repetition: int) -> torch.Generator:
    """A CPU generator seeded by the baseline's name and the repetition alone."""
    seed = int.from_bytes(hashlib.sha256(f"baseline {name} repetition {repetition}".encode()).digest()[:8], "little")
    return torch.Generator(device="cpu").manual_seed(seed % 2**63)
