"""``copies`` and ``copies_multi``: samples with no spread at all, the ceiling of the weight-space
columns. One mode: ``sample.per_method`` exact copies of repetition k's base network (the first
converged held-out seed of its block, the one-mode methods' base); multi mode: the first
``sample.modes_multi`` networks of that block (the multi-mode methods' bases), each copied
``per_method / modes_multi`` times. A one-mode method scores what these score when its samples do
not leave their base; the second zoo is the floor.

Why the MMD has a ceiling here: within the copies every kernel value is 1, and at MMDAgg's
smallest Gaussian bandwidth (half the smallest cross distance) every kernel value between the
zoo and the base is at most e^-4, so that kernel's MMD^2 is at least 1 - 2e^-4 whatever the zoo
(``tests/benchmark/baselines/test_copies.py`` checks it).
"""
from __future__ import annotations

import torch

from benchmark.baselines.base import Baseline, heldout_block
from benchmark.core.store import load_checkpoints_as_sample_set
from benchmark.experiment import Experiment
from benchmark.references.zoo import ZooReference


def base_seeds(exp: Experiment, repetition: int, bases: int) -> list[int]:
    """The first ``bases`` converged held-out seeds of repetition ``repetition``'s block (``heldout_block``)."""
    return heldout_block(exp, repetition, bases, "copies", "copies and copies_multi")


def copies_of(samples: dict[str, torch.Tensor], n: int) -> dict[str, torch.Tensor]:
    """``{key: [b x n, ...]}``: each of the ``b`` networks of ``samples`` (``{key: [b, ...]}``)
    repeated ``n`` times, the copies of one network together."""
    return {key: value.repeat_interleave(n, dim=0) for key, value in samples.items()}


class Copies(Baseline):
    """``copies``: ``sample.per_method`` copies of the repetition's one-mode base; ``CopiesMulti``
    (``multi``) copies its ``sample.modes_multi`` multi-mode bases instead (see the module docstring)."""

    name = "copies"
    label = "Copies of the base"
    about = ("the repetition's base network copied sample.per_method times: a one-mode sampler with no spread "
             "at all, the ceiling of the weight-space columns")
    order = 5
    held_out = True
    reach = "most"  # reads only the bases at the blocks' starts, which the methods with the most repetitions draw
    multi = False

    @classmethod
    def bases(cls, exp: Experiment) -> int:
        """How many bases a repetition copies: ``sample.modes_multi`` in multi mode, else 1."""
        return exp.design.modes_multi if cls.multi else 1

    @classmethod
    def networks(cls, exp: Experiment, repetition: int, n: int) -> list[int]:
        """The base seeds copied (``base_seeds``)."""
        return base_seeds(exp, repetition, cls.bases(exp))

    @classmethod
    def draw(cls, exp: Experiment, zoo: ZooReference, n: int, repetition: int
             ) -> tuple[dict[str, torch.Tensor], list[int] | None]:
        """``n`` samples: each base's checkpoint ``n / bases`` times (``ValueError`` when ``n`` does
        not split), and the base seeds."""
        bases = cls.bases(exp)
        if n % bases:
            raise ValueError(f"baseline {cls.name}: sample.per_method={n} does not split into {bases} bases "
                             "(sample.modes_multi)")
        seeds = base_seeds(exp, repetition, bases)
        return copies_of(load_checkpoints_as_sample_set(exp.store.checkpoint_paths(seeds)), n // bases), seeds


class CopiesMulti(Copies):
    """``copies_multi``: the repetition's ``sample.modes_multi`` multi-mode bases, each copied
    ``per_method / modes_multi`` times."""

    name = "copies_multi"
    label = "Copies of the bases"
    about = ("the repetition's sample.modes_multi multi-mode base networks, each copied per_method / modes_multi "
             "times: a multi-mode sampler with no spread around its modes")
    order = 6
    multi = True
