"""The unbiased MMD^2 U-statistic and kernel matrices, on precomputed distances.

Kernels (as MMDAgg): Laplace ``exp(-|x-y|_1 / l)``, Gaussian
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


def u_statistics(distances: torch.Tensor, m: int, kernel: str, bandwidths: torch.Tensor) -> torch.Tensor:
    """Unbiased MMD^2 estimates ``[K]`` (float64) for one kernel at ``K`` bandwidths.

    ``distances``: pooled ``[m + n, m + n]`` symmetric matrix (L1 for laplace, L2 for gaussian),
    X rows first. Only distinct pairs are evaluated (each within-sample pair once, counted
    twice), so no kernel matrix is formed.
    """
    if kernel not in KERNELS:
        raise ValueError(f"u_statistics: unknown kernel {kernel!r}; expected one of {KERNELS}")
    n = distances.shape[0] - m
    within_x = distances[:m, :m][torch.ones(m, m, dtype=torch.bool, device=distances.device).triu(1)]
    within_y = distances[m:, m:][torch.ones(n, n, dtype=torch.bool, device=distances.device).triu(1)]
    pairs = torch.cat([within_x, within_y, distances[:m, m:].reshape(-1)])
    if kernel == "gaussian":
        pairs = pairs.square()
    scales = bandwidths if kernel == "laplace" else bandwidths.square()
    end_x, end_y = within_x.numel(), within_x.numel() + within_y.numel()
    buffer = torch.empty_like(pairs)
    values = []
    for scale in scales.tolist():
        torch.mul(pairs, -1.0 / scale, out=buffer).exp_()
        sum_x, sum_y, between = 2 * buffer[:end_x].sum(), 2 * buffer[end_x:end_y].sum(), buffer[end_y:].sum()
        values.append(sum_x / (m * (m - 1)) + sum_y / (n * (n - 1)) - 2 * between / (m * n))
    return torch.stack(values).cpu().to(torch.float64)


def half_sample_u_statistics(
    distances: torch.Tensor, m: int, kernel: str, bandwidths: torch.Tensor, halves: torch.Tensor
) -> torch.Tensor:
    """Unbiased MMD^2 estimates ``[B, K]`` (float64) of ``[X[halves[b]]; Y]`` for each of B
    sub-samples of the reference, at K fixed bandwidths.

    ``distances``: pooled ``[m + n, m + n]`` matrix as ``u_statistics``; ``halves``: ``[B, h]``
    distinct row indices into X (h >= 2). With the bandwidths fixed, one kernel matrix per
    bandwidth serves every sub-sample: with v_b the indicator of sub-sample b, its within-X sum
    is ``v_b^T K_xx v_b`` less the diagonal, its cross sum ``v_b^T (K_xy 1)``, and the within-Y
    sum is the same for all. Equal to ``u_statistics`` on each sub-sample's distances.
    """
    if kernel not in KERNELS:
        raise ValueError(f"half_sample_u_statistics: unknown kernel {kernel!r}; expected one of {KERNELS}")
    n, h = distances.shape[0] - m, halves.shape[1]
    indicator = torch.zeros(halves.shape[0], m, dtype=distances.dtype, device=distances.device)
    indicator.scatter_(1, halves.to(distances.device), 1.0)
    d_xx, d_xy = distances[:m, :m], distances[:m, m:]
    d_yy = distances[m:, m:][torch.ones(n, n, dtype=torch.bool, device=distances.device).triu(1)]
    if kernel == "gaussian":
        d_xx, d_xy, d_yy = d_xx.square(), d_xy.square(), d_yy.square()
    scales = bandwidths if kernel == "laplace" else bandwidths.square()
    values = []
    for scale in scales.tolist():
        k_xx = torch.exp(d_xx * (-1.0 / scale))
        sum_x = ((indicator @ k_xx) * indicator).sum(1) - indicator @ k_xx.diagonal()
        sum_y = 2 * torch.exp(d_yy * (-1.0 / scale)).sum()
        between = indicator @ torch.exp(d_xy * (-1.0 / scale)).sum(1)
        values.append(sum_x / (h * (h - 1)) + sum_y / (n * (n - 1)) - 2 * between / (h * n))
    return torch.stack(values, 1).cpu().to(torch.float64)


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
