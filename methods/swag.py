"""SWAG (Maddox et al. 2019): a Gaussian with diagonal + low-rank covariance fitted to SGD iterates.

From the base checkpoint, training continues for ``epochs_factor`` x the recipe's epochs with
a learning rate ramped linearly (over ``ramp_fraction`` of the run) from the recipe's final
rate up to the constant ``lr``; ``snapshots`` parameter vectors are collected, evenly over the
second half of the run or ``snapshot_interval_epochs`` apart up to its end (appendix B). With
the snapshots' running mean ``theta_SWA``, diagonal variance ``Sigma_diag = mean(theta^2) -
theta_SWA^2`` and deviation matrix ``D`` (the last ``rank`` columns ``theta_i - theta_SWA,i``,
K of them), a sample is what the SWAG authors' code draws (``SWAG.sample(scale, cov=True)``),
which the paper used with scale 0.1:

    theta = theta_SWA + sqrt(scale) * (Sigma_diag^(1/2) z1 + D z2 / sqrt(K - 1))

so ``Cov = scale * (Sigma_diag + D D^T / (K - 1))``. (The SWAG paper's text writes the two terms
with 1/sqrt(2) each; the authors' code, and hence the paper we reproduce, has no factor 1/2.)
BatchNorm statistics of each sample are recomputed with a pass over training data
(``bn_update``); models without BatchNorm skip it.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters
from torch.optim.swa_utils import update_bn

from benchmark.core.settings import require
from benchmark.core.store import SampleSet, stack_state_dicts
from benchmark.core.training import (
    NonFiniteError, check_weights_finite, iterate_batches, learning_rate, make_optimizer, seeded,
)
from benchmark.core.training.continued import StepPlan, continue_networks
from benchmark.core.training.stacked import stacked_networks
from benchmark.core.training.vectorised import stacking_problem
from methods.base import MethodConfigError, MethodSettings, PosteriorMethod

VAR_CLAMP = 1e-30  # the reference implementation's floor on the diagonal variance


@dataclass
class SwagMoments:
    """Running mean and mean square of flattened snapshots ``[P]`` and their last ``rank`` deviations."""

    rank: int
    count: int = 0
    mean: torch.Tensor | None = None
    sq_mean: torch.Tensor | None = None
    deviations: list[torch.Tensor] = field(default_factory=list)

    def collect(self, theta: torch.Tensor) -> None:
        """Add snapshot ``theta`` ``[P]``; its deviation is taken from the updated mean (reference code)."""
        theta = theta.detach().double()
        if self.mean is None:
            self.mean, self.sq_mean = torch.zeros_like(theta), torch.zeros_like(theta)
        self.count += 1
        self.mean += (theta - self.mean) / self.count
        self.sq_mean += (theta**2 - self.sq_mean) / self.count
        self.deviations = [*self.deviations, theta - self.mean][-self.rank :]

    @property
    def variance(self) -> torch.Tensor:
        """Diagonal variance ``[P]``, clamped below at ``VAR_CLAMP``."""
        return torch.clamp(self.sq_mean - self.mean**2, min=VAR_CLAMP)

    @property
    def deviation_matrix(self) -> torch.Tensor:
        """``D`` ``[P, K]``, K = min(rank, snapshots collected)."""
        return torch.stack(self.deviations, dim=1)

    def gaussian(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(theta_SWA [P], Sigma_diag^(1/2) [P], D [P, K])`` in ``dtype``: the arguments of ``swag_draw``."""
        return self.mean.to(dtype), self.variance.sqrt().to(dtype), self.deviation_matrix.to(dtype)


def swag_draw(mean: torch.Tensor, std: torch.Tensor, deviations: torch.Tensor, scale: float,
              generator: torch.Generator) -> torch.Tensor:
    """One SWAG sample ``[P]`` in ``mean``'s dtype (see module doc) from ``theta_SWA`` ``mean`` ``[P]``,
    ``Sigma_diag^(1/2)`` ``std`` ``[P]`` and ``D`` ``deviations`` ``[P, K]``; z1 ``[P]`` then z2 ``[K]``
    are drawn from ``generator``. Its covariance is ``scale * (diag(std^2) + D D^T / (K - 1))``."""
    k = deviations.shape[1]
    if k < 2:
        raise MethodConfigError(f"method=swag: the low-rank term needs at least 2 snapshots, got {k}")
    z1 = torch.randn(mean.shape, generator=generator, dtype=mean.dtype)
    z2 = torch.randn(k, generator=generator, dtype=mean.dtype)
    return mean + math.sqrt(scale) * (std * z1 + deviations @ z2 / math.sqrt(k - 1))


@dataclass(frozen=True)
class SwagSchedule:
    """Step-level plan of the SWAG run: length, lr ramp and the steps after which snapshots are taken."""

    total_steps: int
    ramp_steps: int
    lr_start: float
    lr_high: float
    snapshot_steps: frozenset[int]

    def lr(self, step: int) -> float:
        """Learning rate of 0-based ``step``: linear from ``lr_start`` to ``lr_high``, then constant."""
        if step >= self.ramp_steps:
            return self.lr_high
        return self.lr_start + (self.lr_high - self.lr_start) * (step + 1) / self.ramp_steps


@dataclass
class SWAGSettings(MethodSettings):
    """SWAG settings (appendix B; Maddox et al. 2019).

    ``epochs_factor``: SWAG run length in units of the recipe's epochs (paper: twice).
    ``lr``: the constant high learning rate (null = the recipe's initial ``lr``).
    ``ramp_fraction``: fraction of the run spent ramping linearly from the recipe's final rate
    up to ``lr``. ``snapshots``: parameter vectors collected (paper: 20).
    ``snapshot_interval_epochs``: epochs between snapshots, the last at the end of the run;
    null = evenly over the run's second half. (The paper writes "20 models with 10-epoch
    intervals" within a run twice the recipe; for MNIST, 20 x 10 = 200 epochs do not fit in 120,
    so the three cannot all hold: by default we keep the run length and the 20 snapshots.)
    ``rank``: deviation columns kept (paper: 20). ``scale``: multiplies the covariance
    (paper: 0.1, the authors' code's ``scale``). ``bn_update_batches``: train batches per draw
    for the BatchNorm statistics (null = one epoch; a no-op without BatchNorm).
    """

    epochs_factor: int = 2
    lr: Optional[float] = None
    ramp_fraction: float = 0.25
    snapshots: int = 20
    snapshot_interval_epochs: Optional[float] = None
    rank: int = 20
    scale: float = 0.1
    bn_update_batches: Optional[int] = None

    def __post_init__(self) -> None:
        require(self.epochs_factor >= 1, "epochs_factor", self.epochs_factor, "an integer >= 1")
        require(self.lr is None or self.lr > 0, "lr", self.lr, "a positive number or null (= train.lr)")
        require(0.0 <= self.ramp_fraction <= 0.5, "ramp_fraction", self.ramp_fraction, "a number in [0, 0.5]")
        require(self.snapshots >= 2, "snapshots", self.snapshots, "an integer >= 2")
        require(self.snapshot_interval_epochs is None or self.snapshot_interval_epochs > 0, "snapshot_interval_epochs",
                self.snapshot_interval_epochs, "a positive number of epochs or null (= evenly over the second half)")
        require(self.rank >= 2, "rank", self.rank, "an integer >= 2")
        require(self.scale >= 0.0, "scale", self.scale, "a number >= 0")
        require(self.bn_update_batches is None or self.bn_update_batches >= 1, "bn_update_batches",
                self.bn_update_batches, "a positive integer or null (= one epoch)")


class SWAGMethod(PosteriorMethod):
    """SWAG around a trained base network (``fit`` continues its training and collects snapshots)."""

    name = "swag"
    order = 70
    paper_label = "SWAG"
    label = "SWAG"
    diagnostics_note = (
        "SWAG: mean over weights of the snapshots' diagonal variance and of the low-rank variance diag(D D^T)/(K-1); "
        "a draw's variance is scale x their sum."
    )
    Settings = SWAGSettings
    starts_from_base = True  # repetition k continues training the repetition's base network

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._model: nn.Module | None = None
        self._moments: SwagMoments | None = None
        self._gaussian: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._seed = 0
        # seed -> (final state dict or the NonFiniteError, moments) of the fits run stacked; kept (a few
        # vectors of P floats each) so that a base shared by two units (one-mode's base is the first
        # multi-mode base of its repetition) is fitted once
        self._stacked_fits: dict[int, tuple[dict[str, torch.Tensor] | NonFiniteError, SwagMoments]] = {}
        self._stacking: tuple[str | None] | None = None

    def schedule(self) -> SwagSchedule:
        """The step plan from the settings and the experiment's recipe."""
        s, recipe = self.settings, self.recipe
        epochs = recipe.epochs * s.epochs_factor
        lr_high = recipe.lr if s.lr is None else s.lr
        steps_per_epoch = math.ceil(len(self.data.train) / recipe.batch_size)
        total = epochs * steps_per_epoch
        ramp = max(1, round(s.ramp_fraction * total))
        if s.snapshot_interval_epochs is None:
            half = total // 2
            if s.snapshots > total - half:
                raise MethodConfigError(
                    f"methods.swag.snapshots={s.snapshots}: the second half of the SWAG run has only {total - half} "
                    f"steps; lower it or raise methods.swag.epochs_factor"
                )
            steps = frozenset(half + round((i + 1) * (total - half) / s.snapshots) for i in range(s.snapshots))
        else:
            interval = s.snapshot_interval_epochs * steps_per_epoch
            steps = frozenset(total - round(i * interval) for i in range(s.snapshots))
            if len(steps) < s.snapshots or min(steps) <= ramp:
                raise MethodConfigError(
                    f"methods.swag.snapshot_interval_epochs={s.snapshot_interval_epochs}: {s.snapshots} snapshots that "
                    f"far apart do not fit after the {ramp}-step ramp of the {total}-step run; raise "
                    f"methods.swag.epochs_factor or lower the interval or methods.swag.snapshots"
                )
        return SwagSchedule(total, ramp, learning_rate(recipe, recipe.epochs - 1), float(lr_high), steps)

    def check(self, mode: str) -> None:
        super().check(mode)
        self.schedule()

    def stacking_problem(self) -> str | None:
        """Why SWAG's SGD phase cannot run as stacked networks here (``continue_networks``: an
        in-memory training set and an architecture the stacked networks run), or None (then every
        fit runs stacked, alone or with others, so that a base's fit does not depend on which
        bases share its stack)."""
        if self._stacking is None:
            self._stacking = (stacking_problem(self.data.train, lambda: stacked_networks(self.new_model(), self.device)),)
        return self._stacking[0]

    def prefit(self, seeds: Sequence[int], load_base: Callable[[int], dict[str, torch.Tensor]]) -> None:
        """Run the SWAG phase of every base of ``seeds`` not fitted yet together, as stacked networks
        (``benchmark.core.training.continued``), when ``stacking_problem`` allows: each follows the
        one-at-a-time loop of ``fit`` up to float rounding, and its bits do not depend on the other
        bases of the stack. ``fit`` then takes its result."""
        todo = [s for s in dict.fromkeys(int(s) for s in seeds) if s not in self._stacked_fits]
        if not todo or self.stacking_problem() is not None:
            return
        plan = self.schedule()
        with seeded(0):  # building a model draws from the global RNG; leave it as it was
            template = self.new_model()
        moments = [SwagMoments(rank=self.settings.rank) for _ in todo]
        outcomes = continue_networks(
            template, [load_base(s) for s in todo], self.data.train, self.recipe, todo, [f"swag seed {s}" for s in todo],
            StepPlan(plan.total_steps, plan.lr, plan.snapshot_steps),
            lambda index, _step, theta: moments[index].collect(theta), progress=len(todo) > 1,
        )
        for seed, outcome, collected in zip(todo, outcomes, moments):
            self._stacked_fits[seed] = (outcome, collected)

    def fit(self, base: dict[str, torch.Tensor], seed: int) -> None:
        """Continue training ``base`` under the SWAG schedule (data order from ``seed``) and collect
        the snapshot moments: as stacked networks when ``stacking_problem`` allows (``prefit``'s
        result, or a stack of one), else one at a time. NaN/Inf raises ``NonFiniteError`` and leaves
        the method unfitted."""
        recipe, plan = self.recipe, self.schedule()
        self._model = self._moments = self._gaussian = None
        if self.stacking_problem() is None:
            self.prefit([seed], lambda _seed: base)
            outcome, moments = self._stacked_fits[int(seed)]
            if isinstance(outcome, NonFiniteError):
                raise outcome
            with seeded(seed):
                model = self.new_model()
            model.load_state_dict(outcome)
            self._model, self._moments, self._gaussian, self._seed = model, moments, moments.gaussian(), seed
            return
        with seeded(seed):  # building a model draws from the global RNG; leave it as it was
            model = self.new_model()
        model.load_state_dict(base)
        moments = SwagMoments(rank=self.settings.rank)
        optimizer = make_optimizer(model.parameters(), recipe, lr=plan.lr(0))
        generator = torch.Generator().manual_seed(seed)
        where = f"swag seed {seed}"
        step = 0
        model.train()
        while step < plan.total_steps:
            for images, labels in iterate_batches(self.data.train, recipe.batch_size, generator, self.device):
                for group in optimizer.param_groups:
                    group["lr"] = plan.lr(step)
                loss = F.cross_entropy(model(images), labels)
                if not torch.isfinite(loss):
                    raise NonFiniteError(f"{where}: loss became {loss.item()} at step {step + 1}")
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                step += 1
                if step in plan.snapshot_steps:
                    moments.collect(parameters_to_vector(model.parameters()).cpu())
                if step == plan.total_steps:
                    break
            check_weights_finite(model, f"{where}, step {step}")
        self._model, self._moments, self._gaussian, self._seed = model, moments, moments.gaussian(), seed

    def _draw_weights(self, generator: torch.Generator) -> nn.Module:
        """Load one SWAG draw into the fitted model and recompute its BatchNorm statistics."""
        if self._model is None or self._gaussian is None:
            raise RuntimeError("method=swag: call fit() before sample() or predict_own()")
        model = self._model
        theta = swag_draw(*self._gaussian, self.settings.scale, generator)
        vector_to_parameters(theta.to(self.device), model.parameters())
        batches = self.settings.bn_update_batches
        data = iterate_batches(self.data.train, self.recipe.batch_size, torch.Generator().manual_seed(self._seed), self.device)
        update_bn(itertools.islice(data, batches) if batches is not None else data, model)
        return model.eval()

    def diagnostics(self, images: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        """Mean over weights of the diagonal variance ``Sigma_diag``, of the low-rank variance
        ``diag(D D^T) / (K - 1)``, and of the variance a draw has (``scale`` x their sum)."""
        if self._gaussian is None:
            return {}
        _, std, deviations = self._gaussian
        diagonal = float((std.double() ** 2).mean())
        low_rank = float((deviations.double() ** 2).sum(1).mean() / (deviations.shape[1] - 1))
        return {"diagonal_variance": diagonal, "low_rank_variance": low_rank,
                "sample_variance": self.settings.scale * (diagonal + low_rank), "snapshots": float(self._moments.count)}

    def sample(self, n: int, generator: torch.Generator) -> SampleSet:
        """``n`` SWAG draws as full state dicts ``{key: [n, ...]}`` (BatchNorm buffers recomputed per draw)."""
        states = []
        for _ in range(n):
            model = self._draw_weights(generator)
            states.append({k: v.detach().cpu().clone() for k, v in model.state_dict().items()})
        return stack_state_dicts(states)

    @torch.no_grad()
    def predict_own(self, images: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
        """Probabilities ``[n, N, C]`` of the fitted network carrying each SWAG draw in turn."""
        out = []
        for _ in range(n):
            model = self._draw_weights(generator)
            out.append(torch.softmax(model(images.to(self.device)), dim=-1).float().cpu())
        return torch.stack(out)
