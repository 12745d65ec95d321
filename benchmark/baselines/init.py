"""``init``: untrained networks, the model's own initialisation under seeds no zoo uses."""
from __future__ import annotations

import torch

from benchmark.baselines.base import Baseline
from benchmark.core.training import seeded
from benchmark.experiment import Experiment
from benchmark.references.zoo import ZooReference

INIT_SEED_START = 5_000_000
"""Untrained networks are initialised under seeds from here on (past every zoo seed, which has
at most six digits): repetition k's i-th under ``INIT_SEED_START + 1000 k + i``."""


def init_samples(exp: Experiment, n: int, repetition: int) -> dict[str, torch.Tensor]:
    """``n`` untrained networks ``{key: [n, ...]}``: the model's initialisation under seeds
    ``INIT_SEED_START + 1000 x repetition + i``."""
    states = []
    for i in range(n):
        with seeded(INIT_SEED_START + 1000 * repetition + i):
            states.append({k: v.detach().cpu() for k, v in exp.model().state_dict().items()})
    return {key: torch.stack([s[key] for s in states]) for key in states[0]}


class Init(Baseline):
    """``init``: untrained networks, the model's own initialisation under seeds no zoo uses."""

    name = "init"
    label = "Untrained init."
    about = "untrained networks at the model's own initialisation"
    order = 1

    @classmethod
    def draw(cls, exp: Experiment, zoo: ZooReference, n: int, repetition: int
             ) -> tuple[dict[str, torch.Tensor], list[int] | None]:
        """``init_samples`` of ``repetition`` and their seeds."""
        return init_samples(exp, n, repetition), [INIT_SEED_START + 1000 * repetition + i for i in range(n)]
