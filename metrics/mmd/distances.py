"""Pairwise L1 and L2 distances of the pooled sample Z = [X; Y], built from column blocks.

Both matrices are computed once per layer and shared by all 20 kernels. Columns arrive in
blocks (from memory or from disk), so the memory held is two ``[N, N]`` float64
accumulators plus one block, whatever the layer size.
- L2 goes through the Gram matrix: ``|z_i - z_j|^2 = G_ii + G_jj - 2 G_ij``, in float64.
  Each block is centred on its column means first: distances do not change under a
  translation, and centring removes most of the cancellation the Gram trick suffers from.
- L1 is summed block by block in float64 (``l1_kernel`` on CPU, ``torch.cdist`` on CUDA).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

from metrics.mmd.l1_kernel import accumulate_l1_upper
from metrics.mmd.layers import MMDInputError

DEFAULT_MAX_CHUNK_ELEMENTS = 2**24


@dataclass(frozen=True)
class PairwiseDistances:
    """Distances between all rows of Z = [X; Y] (X first: rows ``:m``, Y rows ``m:``).

    ``l1``, ``l2``: ``[m + n, m + n]`` float64, symmetric, zero diagonal, in the units of the
    weights (L2 is the Euclidean distance, not its square). ``n_params``: columns seen.
    """

    l1: torch.Tensor
    l2: torch.Tensor
    m: int
    n: int
    n_params: int

    def subset_x(self, rows: torch.Tensor) -> "PairwiseDistances":
        """The distances of Z' = [X[rows]; Y]: a sub-sample of the reference, Y kept whole."""
        index = torch.cat([rows.to(self.l1.device), torch.arange(self.m, self.m + self.n, device=self.l1.device)])
        pick = lambda matrix: matrix.index_select(0, index).index_select(1, index)  # noqa: E731
        return PairwiseDistances(pick(self.l1), pick(self.l2), len(rows), self.n, self.n_params)

    def cross(self, which: str, max_rows: int) -> torch.Tensor:
        """Distances between the first ``max_rows`` rows of X and of Y, flattened: ``[<=500*500]``."""
        matrix = {"l1": self.l1, "l2": self.l2}[which]
        mx, ny = min(max_rows, self.m), min(max_rows, self.n)
        return matrix[:mx, self.m : self.m + ny].reshape(-1)


class DistanceAccumulator:
    """Accumulate L1 and Gram sums over column blocks of X (``[m, d_i]``) and Y (``[n, d_i]``).

    ``layer`` only names the layer in error messages. ``device``: where the work runs
    (``None`` = CPU). Call ``add`` per block, then ``finish`` once.
    """

    def __init__(self, layer: str = "layer", device: torch.device | str | None = None) -> None:
        self.layer = layer
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.m: int | None = None
        self.n: int | None = None
        self.n_params = 0
        self._l1: torch.Tensor | None = None
        self._gram: torch.Tensor | None = None

    def add(self, x_block: torch.Tensor, y_block: torch.Tensor) -> None:
        """Add one block of columns: ``x_block [m, d_i]`` and ``y_block [n, d_i]`` (same columns)."""
        x_block, y_block = self._check_block(x_block, y_block)
        z = torch.cat([x_block, y_block]).to(self.device, torch.float64)
        z -= z.mean(dim=0, keepdim=True)
        size = z.shape[0]
        if self._gram is None:
            self._gram = torch.zeros(size, size, dtype=torch.float64, device=self.device)
            self._l1 = torch.zeros(size, size, dtype=torch.float64, device=self.device)
        _add_upper_gram(z, self._gram)
        if self.device.type == "cpu":
            accumulate_l1_upper(z, self._l1)
        else:
            self._l1 += torch.cdist(z, z, p=1)
        self.n_params += z.shape[1]

    def finish(self) -> PairwiseDistances:
        """The symmetric L1 and L2 distance matrices of everything added so far."""
        if self._gram is None or self.m is None or self.n is None:
            raise MMDInputError(f"layer {self.layer!r}: no column blocks were given")
        if self.device.type == "cpu":
            upper = self._l1.triu(1)
            l1 = upper + upper.T
        else:
            l1 = (self._l1 + self._l1.T) / 2
            l1.fill_diagonal_(0.0)
        gram = self._gram.triu()
        gram = gram + gram.triu(1).T
        norms = gram.diagonal()
        squared = (norms[:, None] + norms[None, :] - 2 * gram).clamp_min_(0.0)
        # Symmetrise exactly (addmm rounding may differ across the diagonal) and pin the diagonal.
        squared = (squared + squared.T) / 2
        squared.fill_diagonal_(0.0)
        return PairwiseDistances(l1=l1, l2=squared.sqrt_(), m=self.m, n=self.n, n_params=self.n_params)

    def _check_block(self, x_block: torch.Tensor, y_block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        where = f"layer {self.layer!r}"
        if x_block.dim() != 2 or y_block.dim() != 2:
            raise MMDInputError(
                f"{where}: column blocks must be 2-D [samples, columns], got X {list(x_block.shape)} "
                f"and Y {list(y_block.shape)}"
            )
        if x_block.shape[1] != y_block.shape[1]:
            raise MMDInputError(
                f"{where}: X block has {x_block.shape[1]} columns but Y block has {y_block.shape[1]}"
            )
        if self.m is None:
            self.m, self.n = int(x_block.shape[0]), int(y_block.shape[0])
            for side, count in (("X", self.m), ("Y", self.n)):
                if count < 2:
                    raise MMDInputError(f"{where}: {side} has {count} sample(s); need at least 2")
        elif (x_block.shape[0], y_block.shape[0]) != (self.m, self.n):
            raise MMDInputError(
                f"{where}: block has {x_block.shape[0]} X and {y_block.shape[0]} Y samples, "
                f"earlier blocks had {self.m} and {self.n}"
            )
        for side, block in (("X (reference)", x_block), ("Y (method)", y_block)):
            if block.is_floating_point() and not bool(torch.isfinite(block).all()):
                raise MMDInputError(f"{where}: {side} samples contain NaN or Inf values")
        return x_block, y_block


GRAM_TILES = 4


def _add_upper_gram(z: torch.Tensor, gram: torch.Tensor, tiles: int = GRAM_TILES) -> None:
    """``gram += z z^T`` on the row tiles on and above the diagonal only (``[N, N]``, in place).

    The Gram matrix is symmetric, so with 4 row tiles 10 of the 16 tile products suffice
    (62.5% of the float64 multiply-adds, the dominant cost of the L2 distances); ``finish``
    mirrors the upper triangle.
    """
    edges = torch.linspace(0, z.shape[0], tiles + 1, device="cpu").round().long().tolist()
    spans = [(a, b) for a, b in zip(edges[:-1], edges[1:]) if b > a]
    for i, (a, b) in enumerate(spans):
        for c, d in spans[i:]:
            gram[a:b, c:d].addmm_(z[a:b], z[c:d].T)


def pairwise_distances(
    blocks: Iterable[tuple[torch.Tensor, torch.Tensor]],
    *,
    layer: str = "layer",
    device: torch.device | str | None = None,
) -> PairwiseDistances:
    """L1 and L2 distances of Z = [X; Y] from aligned column blocks ``([m, d_i], [n, d_i])``."""
    accumulator = DistanceAccumulator(layer=layer, device=device)
    for x_block, y_block in blocks:
        accumulator.add(x_block, y_block)
    return accumulator.finish()


def split_columns(
    x: torch.Tensor, y: torch.Tensor, max_chunk_elements: int = DEFAULT_MAX_CHUNK_ELEMENTS
) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
    """Aligned column blocks of in-memory ``x [m, d]`` and ``y [n, d]`` with ``(m+n)*d_i <= max``."""
    width = max(1, max_chunk_elements // (x.shape[0] + y.shape[0]))
    for start in range(0, x.shape[1], width):
        yield x[:, start : start + width], y[:, start : start + width]
