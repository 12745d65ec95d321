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
from typing import Any, Dict, List, Optional, Sequence

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
class Plateau:
    """Train the zoo to convergence (``train.until_plateau``): off by default.

    ``enabled``: after the recipe's ``epochs``, training goes on, at the schedule's last rate (the
    rate of epoch ``epochs - 1``: the recipe's final phase prolonged; multistep and constant
    recipes simply keep their last rate, a cosine one does not climb back), until the network has
    plateaued or ``max_epochs`` epochs (in all) have run. Plateaued, at the end of an epoch
    ``e >= epochs``: over the last ``window`` epochs the training potential ``U`` (summed training
    cross-entropy plus the recipe's L2 term on the un-augmented training split:
    ``benchmark.core.training.potential.training_potential``, what ``ZooReference.training_potential``
    reports) fell by less than ``potential_tol`` of its value ``window`` epochs before,
    ``U(e - window) - U(e) < potential_tol |U(e - window)|``, AND the training accuracy rose by at
    most ``accuracy_tol`` (a fraction), ``acc(e) - acc(e - window) <= accuracy_tol``. ``U`` and the
    accuracy are measured at the end of each epoch from ``epochs - window`` on (so a network
    plateaued by the recipe's end stops there: no extra epoch); each network stops on its own
    (the stacked trainer lets a plateaued network leave the stack, the rest go on). Each run records
    how many epochs it took (``epochs``) and whether it plateaued (``plateaued``: False = stopped at
    ``max_epochs``) in its checkpoint metadata, and ``potential``/``train_accuracy`` in its history.
    The convergence rule's end check is judged where the run stops. Only the zoo's trainings follow
    it: a method's own training (MC Dropout, the vBNN) keeps the recipe's ``epochs``.

    Chosen (not tuned on any result): ``window`` 5 and ``potential_tol`` 0.01, i.e. U falls by less
    than ~0.2% an epoch; ``accuracy_tol`` 0.005 (about 6 of the 1,295 digits training images
    over the window); ``max_epochs`` 200 (4.4x the digits recipe's 45). Off, the option leaves
    the recipe and its hash (``Recipe.identity``) exactly as they were. Measured on digits
    (``studies/zoo_convergence.py``, 64 seeds): every converged network plateaus 0-14 epochs after
    the recipe's 45 and the zoo's U spread, accuracies, member spread and per-layer MMD do not move
    beyond SGD's noise at the last rate (docs/numbers.md).
    """

    enabled: bool = False
    max_epochs: int = 200
    window: int = 5
    potential_tol: float = 0.01
    accuracy_tol: float = 0.005

    def __post_init__(self) -> None:
        require(self.max_epochs >= 1, "max_epochs", self.max_epochs, "a positive integer")
        require(self.window >= 1, "window", self.window, "a positive integer (epochs)")
        require(math.isfinite(self.potential_tol) and self.potential_tol >= 0, "potential_tol", self.potential_tol,
                "a number >= 0 (a relative change)")
        require(math.isfinite(self.accuracy_tol) and self.accuracy_tol >= 0, "accuracy_tol", self.accuracy_tol,
                "a number >= 0 (a fraction)")

    def first_measured(self, epochs: int) -> int:
        """The first epoch (1-based) whose potential and accuracy are measured, for a recipe of ``epochs``."""
        return max(1, epochs - self.window)

    def reached(self, potentials: Sequence[float], accuracies: Sequence[float]) -> bool:
        """Whether the series measured at consecutive epochs (the last one: now) has plateaued
        (see the class doc); False while fewer than ``window + 1`` values are known."""
        if len(potentials) <= self.window or len(accuracies) != len(potentials):
            return False
        before, now = float(potentials[-1 - self.window]), float(potentials[-1])
        gained = float(accuracies[-1]) - float(accuracies[-1 - self.window])
        return before - now < self.potential_tol * abs(before) and gained <= self.accuracy_tol


@dataclass
class Recipe:
    """SGD training recipe. ``lr`` per step; ``milestones`` in epochs (0-based epoch index at
    which the multistep schedule multiplies the rate by ``gamma``). ``until_plateau``: train on past
    ``epochs`` until the training potential and accuracy plateau (``Plateau``; off by default, and
    then not part of the recipe's identity: ``identity``)."""

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
    until_plateau: Plateau = field(default_factory=Plateau)

    def __post_init__(self) -> None:
        self.schedule = Schedule(self.schedule)
        self.milestones = [int(m) for m in self.milestones]
        if isinstance(self.fail_rule, dict):
            self.fail_rule = FailRule(**self.fail_rule)
        if isinstance(self.until_plateau, dict):
            self.until_plateau = Plateau(**self.until_plateau)
        require(self.epochs >= 1, "epochs", self.epochs, "a positive integer")
        require(self.batch_size >= 1, "batch_size", self.batch_size, "a positive integer")
        require(math.isfinite(self.lr) and self.lr > 0, "lr", self.lr, "a positive number")
        require(0 <= self.momentum < 1, "momentum", self.momentum, "a number in [0, 1)")
        require(self.weight_decay >= 0, "weight_decay", self.weight_decay, "a number >= 0")
        require(self.gamma > 0, "gamma", self.gamma, "a positive number")
        require(not self.until_plateau.enabled or self.until_plateau.max_epochs >= self.epochs,
                "until_plateau.max_epochs", self.until_plateau.max_epochs, f"at least epochs={self.epochs}")

    @property
    def max_epochs(self) -> int:
        """The most epochs a run of this recipe trains: ``epochs``, or ``until_plateau.max_epochs`` when on."""
        return self.until_plateau.max_epochs if self.until_plateau.enabled else self.epochs

    def identity(self) -> Dict[str, Any]:
        """The recipe as a dict of its fields (``dataclasses.asdict``), what a zoo checkpoint's
        ``config_hash`` is computed from; ``until_plateau`` only when it is on, so that every
        recipe without it keeps the hash it had before the option existed (stores and imported
        zoos are keyed by it)."""
        out = dataclasses.asdict(self)
        if not self.until_plateau.enabled:
            del out["until_plateau"]
        return out

    def without_plateau(self) -> "Recipe":
        """This recipe with ``until_plateau`` off (what the methods' own trainings follow)."""
        return self.replaced(until_plateau=Plateau()) if self.until_plateau.enabled else self

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
