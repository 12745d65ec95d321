"""``second_zoo``: converged networks of the reference's own recipe that are not in it: repetition
k's block of ``seeds.heldout`` (the networks Deep Ensembles' repetition k uses as members): the
noise floor of the measure."""
from __future__ import annotations

import torch

from benchmark.baselines.base import Baseline, heldout_block
from benchmark.core.store import load_checkpoints_as_sample_set
from benchmark.experiment import Experiment
from benchmark.references.zoo import ZooReference


def second_zoo_seeds(exp: Experiment, repetition: int, n: int) -> list[int]:
    """The ``n`` converged held-out seeds of repetition ``repetition``'s block (``heldout_block``)."""
    return heldout_block(exp, repetition, n, "second_zoo", "second_zoo")


class SecondZoo(Baseline):
    """``second_zoo``: converged held-out networks of the reference's own recipe (repetition k's
    block of ``seeds.heldout``, Deep Ensembles' members): the noise floor of the measure."""

    name = "second_zoo"
    label = "Second zoo"
    about = ("converged held-out networks of the reference's own recipe (the members of Deep Ensembles' repetition): "
             "the noise floor, what a method sampling the reference exactly scores")
    order = 4
    held_out = True

    @classmethod
    def networks(cls, exp: Experiment, repetition: int, n: int) -> list[int]:
        """``second_zoo_seeds`` of ``repetition``."""
        return second_zoo_seeds(exp, repetition, n)

    @classmethod
    def draw(cls, exp: Experiment, zoo: ZooReference, n: int, repetition: int
             ) -> tuple[dict[str, torch.Tensor], list[int] | None]:
        """The held-out checkpoints of ``second_zoo_seeds`` and their seeds."""
        seeds = second_zoo_seeds(exp, repetition, n)
        return load_checkpoints_as_sample_set(exp.store.checkpoint_paths(seeds)), seeds
