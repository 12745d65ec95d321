"""The SGD training recipe of an experiment (paper, appendix B) as plain, typed data.

``Recipe`` is also the schema of the ``train`` node of the Hydra config: its field types
are the ones OmegaConf checks, its defaults the only defaults, and ``__post_init__`` the
range checks (run when the runner converts the config node into a ``Recipe``).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from enum import Enum
from typing import List, Optional

from benchmark.core.settings import require


class Schedule(str, Enum):
    """Learning-rate schedule over epochs."""

    multistep = "multistep"
    """``lr * gamma ** (number of milestones passed)``."""
    cosine = "cosine"
    """``lr / 2 * (1 + cos(pi * epoch / epochs))``."""
    constant = "constant"
    """``lr`` throughout."""


@dataclass
class FailRule:
    """Non-convergence rule: a run whose held-out accuracy (fraction) is below ``min_accuracy``
    after ``epoch`` epochs stops there and is recorded as failed (OptuMNIST's rule), and one
    whose held-out accuracy at the end of training is below ``final_min_accuracy`` is recorded
    as failed too. ``final_min_accuracy: null`` (the paper's rule) judges the end against
    ``min_accuracy``, catching a run that passed the early check and then collapsed. ``null`` in
    ``epoch`` or ``min_accuracy`` disables the whole rule, the end check included."""

    epoch: Optional[int] = None
    min_accuracy: Optional[float] = None
    final_min_accuracy: Optional[float] = None

    def __post_init__(self) -> None:
        require(self.epoch is None or self.epoch >= 1, "epoch", self.epoch, "a positive integer or null")
        # Above 1 is allowed: a rule that fails every run (the tests use 1.01).
        require(self.min_accuracy is None or (math.isfinite(self.min_accuracy) and self.min_accuracy >= 0),
                "min_accuracy", self.min_accuracy, "a number >= 0 (a fraction) or null")
        require(self.final_min_accuracy is None
                or (math.isfinite(self.final_min_accuracy) and 0 <= self.final_min_accuracy <= 1),
                "final_min_accuracy", self.final_min_accuracy, "a fraction in [0, 1] or null")

    @property
    def active(self) -> bool:
        return self.epoch is not None and self.min_accuracy is not None

    @property
    def final_threshold(self) -> float | None:
        """The held-out accuracy a run must reach at the end of training (None: the rule is off)."""
        if not self.active:
            return None
        return self.min_accuracy if self.final_min_accuracy is None else self.final_min_accuracy

    def final_failure(self, accuracy: float) -> str | None:
        """The failure reason of a run that ends with held-out ``accuracy`` (None: it passes)."""
        threshold = self.final_threshold
        if threshold is None or accuracy >= threshold:
            return None
        if self.final_min_accuracy is None:
            # Passed the early check, then collapsed (e.g. every ReLU died later): same threshold.
            return f"held-out accuracy {accuracy:.3f} < {threshold} at the end of training (collapsed)"
        return (f"held-out accuracy {accuracy:.3f} < {threshold} at the end of training "
                "(below fail_rule.final_min_accuracy: not converged)")


@dataclass
class Recipe:
    """SGD training recipe. ``lr`` per step; ``milestones`` in epochs (0-based epoch index at
    which the multistep schedule multiplies the rate by ``gamma``)."""

    epochs: int
    batch_size: int
    lr: float
    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    schedule: Schedule = Schedule.multistep
    milestones: List[int] = field(default_factory=list)
    gamma: float = 0.1
    fail_rule: FailRule = field(default_factory=FailRule)

    def __post_init__(self) -> None:
        self.schedule = Schedule(self.schedule)
        self.milestones = [int(m) for m in self.milestones]
        if isinstance(self.fail_rule, dict):
            self.fail_rule = FailRule(**self.fail_rule)
        require(self.epochs >= 1, "epochs", self.epochs, "a positive integer")
        require(self.batch_size >= 1, "batch_size", self.batch_size, "a positive integer")
        require(math.isfinite(self.lr) and self.lr > 0, "lr", self.lr, "a positive number")
        require(0 <= self.momentum < 1, "momentum", self.momentum, "a number in [0, 1)")
        require(self.weight_decay >= 0, "weight_decay", self.weight_decay, "a number >= 0")
        require(self.gamma > 0, "gamma", self.gamma, "a positive number")

    def replaced(self, **changes: object) -> "Recipe":
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)


@dataclass
class RecipeOverrides:
    """Per-method changes to the experiment's recipe; ``null`` keeps the experiment's value."""

    epochs: Optional[int] = None
    batch_size: Optional[int] = None
    lr: Optional[float] = None
    momentum: Optional[float] = None
    nesterov: Optional[bool] = None
    schedule: Optional[Schedule] = None
    milestones: Optional[List[int]] = None
    gamma: Optional[float] = None
    fail_rule: Optional[FailRule] = None

    def apply(self, recipe: Recipe, **forced: object) -> Recipe:
        """``recipe`` with every non-null override, then ``forced`` values, applied."""
        changes = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}
        if isinstance(changes.get("fail_rule"), dict):
            changes["fail_rule"] = FailRule(**changes["fail_rule"])
        return recipe.replaced(**changes, **forced)
