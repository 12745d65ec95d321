"""Kernel matrices and the unbiased MMD^2 U-statistic on precomputed distances.

Kernels (as DESIGN.md and MMDAgg): Laplace ``exp(-|x-y|_1 / l)``, Gaussian
``exp(-|x-y|_2^2 / l^2)`` (MMDAgg's ``exp(-(d/l)^2)``: no factor 2 in the denominator).
Statistic with X = rows ``:m`` and Y = rows ``m:`` of the pooled kernel matrix:
``sum_{i!=i'} k(x_i,x_i')/(m(m-1)) + sum_{j!=j'} k(y_j,y_j')/(n(n-1)) - 2 mean_{i,j} k(x_i,y_j)``.
"""
from __future__ import annotations

from typing import Iterator

import torch

from metrics.mmd.distances import PairwiseDistances

KERNELS = ("laplace", "gaussian")
KERNEL_DISTANCE = {"laplace": "l1", "gaussian": "l2"}


def kernel_matrix(distances: torch.Tensor, kernel: str, bandwidth: float) -> torch.Tensor:
    """``[N, N]`` kernel values from ``[N, N]`` distances (L1 for laplace, L2 for gaussian)."""
    scaled = distances / bandwidth
    if kernel == "laplace":
        return torch.exp(-scaled)
    if kernel == "gaussian":
        return torch.exp(-scaled.square())
    raise ValueError(f"kernel_matrix: unknown kernel {kernel!r}; expected one of {KERNELS}")


def u_statistic(kernel: torch.Tensor, m: int) -> float:
    """Unbiased MMD^2 estimate from a pooled ``[m + n, m + n]`` kernel matrix (X rows first)."""
    n = kernel.shape[0] - m
    within_x = kernel[:m, :m].sum() - kernel[:m, :m].diagonal().sum()
    within_y = kernel[m:, m:].sum() - kernel[m:, m:].diagonal().sum()
    between = kernel[:m, m:].sum()
    value = within_x / (m * (m - 1)) + within_y / (n * (n - 1)) - 2 * between / (m * n)
    return float(value)


def iter_kernel_matrices(
    distances: PairwiseDistances, bandwidths: dict[str, torch.Tensor]
) -> Iterator[tuple[str, int, float, torch.Tensor]]:
    """Yield ``(kernel, bandwidth_index, bandwidth, [N, N] kernel matrix)``, Laplace first.

    ``bandwidths``: ``{"laplace": [10], "gaussian": [10]}``. One matrix is alive at a time.
    """
    for kernel in KERNELS:
        matrix = getattr(distances, KERNEL_DISTANCE[kernel])
        for index, bandwidth in enumerate(bandwidths[kernel].tolist()):
            yield kernel, index, bandwidth, kernel_matrix(matrix, kernel, bandwidth)
