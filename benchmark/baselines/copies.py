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

from benchmark.baselines.base import Baseline
from benchmark.core.store import load_checkpoints_as_sample_set
from benchmark.design import Design
from benchmark.experiment import Experiment
from benchmark.inventory import converged
from benchmark.references.zoo import ZooReference


def base_seeds(exp: Experiment, repetition: int, bases: int) -> list[int]:
    """The first ``bases`` converged held-out seeds of repetition ``repetition``'s block
    (``Design.block``, as the sample stage lays them out); ``ValueError`` naming the shortfall."""
    design = Design.of(exp)
    seeds = list(design.block(converged(exp, exp.heldout), repetition, bases))
    if len(seeds) < bases:
        raise ValueError(f"baseline copies: repetition {repetition} needs {bases} converged held-out network(s) from "
                         f"converged seed {design.start(repetition)} of seeds.heldout={[exp.heldout.start, exp.heldout.stop]}, "
                         f"the store has {len(seeds)}; train them (stage=zoo zoo.range=heldout) or drop the copies "
                         "baselines from evaluate.baselines")
    return seeds


def copies_of(samples: dict[str, torch.Tensor], n: int) -> dict[str, torch.Tensor]:
    """``{key: [b x n, ...]}``: each of the ``b`` networks of ``samples`` (``{key: [b, ...]}``)
    repeated ``n`` times, the copies of one network together."""
    return {key: value.repeat_interleave(n, dim=0) for key, value in samples.items()}


class _Copies(Baseline):
    """Copies of ``bases(exp)`` base networks of each repetition (see the module docstring)."""

    held_out = True
    reach = "most"  # reads only the bases at the blocks' starts, which the methods with the most repetitions draw

    @classmethod
    def bases(cls, exp: Experiment) -> int:
        raise NotImplementedError

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


class Copies(_Copies):
    """``copies``: ``sample.per_method`` copies of the repetition's one-mode base network."""

    name = "copies"
    label = "Copies of the base"
    about = ("the repetition's base network copied sample.per_method times: a one-mode sampler with no spread "
             "at all, the ceiling of the weight-space columns")
    order = 5

    @classmethod
    def bases(cls, exp: Experiment) -> int:
        return 1


class CopiesMulti(_Copies):
    """``copies_multi``: the repetition's ``sample.modes_multi`` multi-mode bases, each copied
    ``per_method / modes_multi`` times."""

    name = "copies_multi"
    label = "Copies of the bases"
    about = ("the repetition's sample.modes_multi multi-mode base networks, each copied per_method / modes_multi "
             "times: a multi-mode sampler with no spread around its modes")
    order = 6

    @classmethod
    def bases(cls, exp: Experiment) -> int:
        return Design.of(exp).modes_multi
