"""MMDAgg's aggregated permutation test (Schrab et al. 2023, Algorithm 1), on the same distances.

For each of the K = 20 kernels, the MMD^2 U-statistic is recomputed under random
relabellings of the pooled sample: B1 relabellings (plus the observed labelling) estimate
each kernel's quantiles, B2 others estimate the level correction ``u`` found by B3 bisection
steps so that the aggregated test (reject if any kernel exceeds its ``1 - u w_k`` quantile)
has level ``alpha``. Kernel weights are uniform (``w_k = 1 / K``), as MMDAgg's default.
Permutations are always used (MMDAgg switches to a wild bootstrap when m == n).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from metrics.mmd.distances import PairwiseDistances
from metrics.mmd.statistic import iter_kernel_matrices


@dataclass(frozen=True)
class PermutationTestConfig:
    """MMDAgg's test settings: level ``alpha``; ``b1`` relabellings for the quantiles, ``b2`` for
    the level correction, ``b3`` bisection steps; ``seed`` of the relabellings."""

    alpha: float = 0.05
    b1: int = 2000
    b2: int = 2000
    b3: int = 50
    seed: int = 42

    def __post_init__(self) -> None:
        if not 0 < self.alpha < 1:
            raise ValueError(f"permutation test: alpha must be in (0, 1), got {self.alpha}")
        for name in ("b1", "b2", "b3"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"permutation test: {name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class AggregatedTestResult:
    """Per kernel (Laplace x 10 then Gaussian x 10): ``p_values [K]``, ``thresholds [K]`` (= u w_k),
    ``reject_each [K]`` (p <= threshold); ``reject``: the aggregated decision; ``u``: the
    level correction."""

    p_values: torch.Tensor
    thresholds: torch.Tensor
    reject_each: torch.Tensor
    reject: bool
    u: float


def relabelling_indicators(
    m: int, n: int, count: int, seed: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """``[m + n, count]`` float64: column b is 1 on the rows labelled X by random relabelling b.

    Each column labels a uniformly random subset of m rows as X (argsort of uniforms).
    """
    generator = torch.Generator().manual_seed(seed)
    order = torch.rand(count, m + n, generator=generator, dtype=torch.float64).argsort(dim=1)
    return (order < m).T.to(device=device, dtype=torch.float64)


def relabelled_statistics(kernel: torch.Tensor, m: int, indicators: torch.Tensor) -> torch.Tensor:
    """U-statistics ``[B]`` (float64) of a pooled ``[N, N]`` kernel matrix under relabellings ``[N, B]``.

    With a = X indicator, b = 1 - a and K0 = K with zero diagonal:
    S_xx = a'K0a, S_xy = a'K0b, S_yy = 1'K0 1 - S_xx - 2 S_xy (one matrix product per kernel).
    The product runs in float32 (kernel values lie in [0, 1]; its rounding, ~1e-7 of a row sum,
    is far below the spread of the relabelled statistics) and the sums in float64.
    """
    n = kernel.shape[0] - m
    off_diagonal = kernel.to(torch.float32)
    off_diagonal.fill_diagonal_(0.0)
    product = (off_diagonal @ indicators.to(torch.float32)).to(torch.float64)
    within_x = (indicators * product).sum(dim=0)
    between = ((1.0 - indicators) * product).sum(dim=0)
    within_y = off_diagonal.sum(dtype=torch.float64) - within_x - 2 * between
    return within_x / (m * (m - 1)) + within_y / (n * (n - 1)) - 2 * between / (m * n)


def aggregate_decision(
    observed: torch.Tensor, quantile_draws: torch.Tensor, level_draws: torch.Tensor, alpha: float, steps: int
) -> AggregatedTestResult:
    """MMDAgg's decision from ``observed [K]``, ``quantile_draws [K, B1]``, ``level_draws [K, B2]``.

    p-value of kernel k = fraction of the B1 draws plus the observed value that are >= observed.
    """
    kernels, b1 = quantile_draws.shape
    weights = torch.full((kernels,), 1.0 / kernels, dtype=torch.float64)
    ranked = torch.sort(torch.cat([quantile_draws, observed[:, None]], dim=1), dim=1).values.cpu()
    level_draws = level_draws.cpu()

    def quantiles(u: float) -> torch.Tensor:
        index = [max(0, math.ceil((b1 + 1) * (1 - u * w)) - 1) for w in weights.tolist()]
        return ranked[torch.arange(kernels), torch.tensor(index)]

    u_low, u_high = 0.0, float((1 / weights).min())
    for _ in range(steps):
        u = (u_low + u_high) / 2
        exceed = ((level_draws - quantiles(u)[:, None]).max(dim=0).values > 0).double().mean()
        if float(exceed) <= alpha:
            u_low = u
        else:
            u_high = u
    u = u_low
    p_values = (ranked >= observed.cpu()[:, None]).double().mean(dim=1)
    thresholds = u * weights
    reject_each = p_values <= thresholds
    return AggregatedTestResult(p_values, thresholds, reject_each, bool(reject_each.any()), u)


def aggregated_permutation_test(
    distances: PairwiseDistances,
    bandwidths: dict[str, torch.Tensor],
    observed: torch.Tensor,
    config: PermutationTestConfig = PermutationTestConfig(),
) -> AggregatedTestResult:
    """Run MMDAgg's test for the 20 kernels on one layer's distances.

    ``bandwidths``: ``{"laplace": [10], "gaussian": [10]}``; ``observed``: the 20 MMD values
    ``[K]`` in the same order (Laplace first). Cost: one ``[N, N] x [N, b1 + b2]`` product per kernel.
    """
    device = distances.l1.device
    indicators = relabelling_indicators(distances.m, distances.n, config.b1 + config.b2, config.seed, device)
    draws = torch.stack(
        [relabelled_statistics(k, distances.m, indicators) for *_, k in iter_kernel_matrices(distances, bandwidths)]
    )
    return aggregate_decision(
        observed.to(torch.float64).cpu(), draws[:, : config.b1].cpu(), draws[:, config.b1 :].cpu(), config.alpha, config.b3
    )
