"""Layer-wise MMD between a reference sample set X (m samples) and a method's Y (n samples).

Per layer: 20 MMD^2 U-statistics (10 Laplace + 10 Gaussian bandwidths), their median, mean
and max; for the experiment, the mean over layers of each, weighted by parameter count.
Entry points: ``mmd_table`` (in-memory sample sets), ``mmd_table_from_store`` (files, streamed
layer by layer in column blocks), ``layer_mmd_from_chunks`` (any stream of column blocks).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import pandas as pd
import torch
from tqdm import tqdm

from metrics.mmd.bandwidths import bandwidth_grid
from metrics.mmd.distances import DEFAULT_MAX_CHUNK_ELEMENTS, PairwiseDistances, pairwise_distances
from metrics.mmd.layers import MMDInputError, check_comparable_shapes, iter_layer_blocks
from metrics.mmd.permutation_test import AggregatedTestResult, PermutationTestConfig, aggregated_permutation_test
from metrics.mmd.sources import Source, iter_source_columns, source_shapes, zip_column_blocks
from metrics.mmd.statistic import KERNEL_DISTANCE, KERNELS, u_statistics

MAX_BANDWIDTH_ROWS = 500
SUMMARIES = ("median", "mean", "max")


@dataclass(frozen=True)
class LayerMMD:
    """MMD of one layer. ``values [20]`` float64: Laplace bandwidths 0..9 then Gaussian 0..9
    (MMD^2 U-statistics, unitless); ``bandwidths``: ``{kernel: [10]}`` in distance units."""

    layer: str
    n_params: int
    m: int
    n: int
    bandwidths: dict[str, torch.Tensor]
    values: torch.Tensor
    test: AggregatedTestResult | None = None

    def summary(self) -> dict[str, float]:
        """Median (mean of the two middle values), mean and max of the 20 values."""
        return {
            "median": float(torch.quantile(self.values, 0.5)),
            "mean": float(self.values.mean()),
            "max": float(self.values.max()),
        }


@dataclass(frozen=True)
class MMDResult:
    """``per_kernel``: one row per (layer, kernel, bandwidth); ``per_layer``: median/mean/max per
    layer; ``aggregate``: ``{median, mean, max}`` weighted by ``n_params`` over layers."""

    per_kernel: pd.DataFrame
    per_layer: pd.DataFrame
    aggregate: dict[str, float]
    layers: list[LayerMMD] = field(repr=False)


def layer_mmd_from_distances(
    distances: PairwiseDistances,
    layer: str = "layer",
    *,
    max_bandwidth_rows: int = MAX_BANDWIDTH_ROWS,
    permutation_test: PermutationTestConfig | None = None,
) -> LayerMMD:
    """The 20 MMD values (and optionally MMDAgg's test) of one layer from its distance matrices."""
    if max_bandwidth_rows < 1:
        raise ValueError(f"max_bandwidth_rows must be >= 1, got {max_bandwidth_rows}")
    bandwidths = {
        kernel: bandwidth_grid(distances.cross(KERNEL_DISTANCE[kernel], max_bandwidth_rows)) for kernel in KERNELS
    }
    values = torch.cat(
        [
            u_statistics(getattr(distances, KERNEL_DISTANCE[kernel]), distances.m, kernel, bandwidths[kernel])
            for kernel in KERNELS
        ]
    )
    test = None
    if permutation_test is not None:
        test = aggregated_permutation_test(distances, bandwidths, values, permutation_test)
    return LayerMMD(layer, distances.n_params, distances.m, distances.n, bandwidths, values, test)


def layer_mmd_from_chunks(
    chunks: Iterable[tuple[torch.Tensor, torch.Tensor]],
    *,
    layer: str = "layer",
    max_bandwidth_rows: int = MAX_BANDWIDTH_ROWS,
    device: torch.device | str | None = None,
    permutation_test: PermutationTestConfig | None = None,
) -> LayerMMD:
    """MMD of one layer streamed as aligned column blocks ``(X [m, d_i], Y [n, d_i])``.

    Peak memory: the blocks in flight plus a few ``[m + n, m + n]`` float64 matrices.
    """
    distances = pairwise_distances(chunks, layer=layer, device=device)
    return layer_mmd_from_distances(
        distances, layer, max_bandwidth_rows=max_bandwidth_rows, permutation_test=permutation_test
    )


def layer_mmd_from_store(
    x_source: Source,
    y_source: Source,
    keys: Sequence[str],
    *,
    layer: str = "layer",
    max_elements: int = DEFAULT_MAX_CHUNK_ELEMENTS,
    max_bandwidth_rows: int = MAX_BANDWIDTH_ROWS,
    device: torch.device | str | None = None,
    permutation_test: PermutationTestConfig | None = None,
) -> LayerMMD:
    """MMD of the layer made of ``keys``, read from two sources in column blocks.

    A source is a sample-set file or a list of single-checkpoint files (a zoo);
    ``max_elements`` bounds each block read (``S * d_i`` values per side).
    """
    chunks = zip_column_blocks(
        iter_source_columns(x_source, keys, max_elements), iter_source_columns(y_source, keys, max_elements), layer
    )
    return layer_mmd_from_chunks(
        chunks, layer=layer, max_bandwidth_rows=max_bandwidth_rows, device=device, permutation_test=permutation_test
    )


def mmd_table(
    x: Mapping[str, torch.Tensor],
    y: Mapping[str, torch.Tensor],
    *,
    max_bandwidth_rows: int = MAX_BANDWIDTH_ROWS,
    device: torch.device | str | None = None,
    max_chunk_elements: int = DEFAULT_MAX_CHUNK_ELEMENTS,
    permutation_test: PermutationTestConfig | None = None,
    progress: bool = False,
) -> MMDResult:
    """Layer-wise MMD of in-memory sample sets ``x`` (reference, ``{key: [m, ...]}``) and ``y``
    (method, ``{key: [n, ...]}``), layers as ``group_layers``; see ``MMDResult``.

    Layers are processed in column blocks of at most ``max_chunk_elements`` float64 values.
    """
    layers = check_comparable_shapes(
        {k: tuple(v.shape) for k, v in x.items()}, {k: tuple(v.shape) for k, v in y.items()}
    )
    results = []
    for layer, keys in tqdm(layers.items(), desc="MMD", unit="layer", disable=not progress):
        width = max(1, max_chunk_elements // (x[keys[0]].shape[0] + y[keys[0]].shape[0]))
        chunks = zip(iter_layer_blocks(x, keys, width), iter_layer_blocks(y, keys, width))
        results.append(
            layer_mmd_from_chunks(
                chunks,
                layer=layer,
                max_bandwidth_rows=max_bandwidth_rows,
                device=device,
                permutation_test=permutation_test,
            )
        )
    return tabulate(results)


def mmd_table_from_store(
    x_source: Source,
    y_source: Source,
    *,
    max_elements: int = DEFAULT_MAX_CHUNK_ELEMENTS,
    max_bandwidth_rows: int = MAX_BANDWIDTH_ROWS,
    device: torch.device | str | None = None,
    permutation_test: PermutationTestConfig | None = None,
    progress: bool = False,
) -> MMDResult:
    """Like ``mmd_table`` but reading both sides from the store (sample-set file or zoo file list),
    one layer at a time in column blocks; keys and shapes are checked from headers first."""
    layers = check_comparable_shapes(source_shapes(x_source), source_shapes(y_source))
    results = [
        layer_mmd_from_store(
            x_source,
            y_source,
            keys,
            layer=layer,
            max_elements=max_elements,
            max_bandwidth_rows=max_bandwidth_rows,
            device=device,
            permutation_test=permutation_test,
        )
        for layer, keys in tqdm(layers.items(), desc="MMD", unit="layer", disable=not progress)
    ]
    return tabulate(results)


def tabulate(layers: Sequence[LayerMMD]) -> MMDResult:
    """Tidy tables and the parameter-weighted aggregate of per-layer results."""
    if not layers:
        raise MMDInputError("no layers to compare: the sample sets hold no parameters")
    kernel_rows, layer_rows = [], []
    for result in layers:
        position = 0
        for kernel in KERNELS:
            for index, bandwidth in enumerate(result.bandwidths[kernel].tolist()):
                row = {
                    "layer": result.layer,
                    "n_params": result.n_params,
                    "kernel": kernel,
                    "bandwidth_index": index,
                    "bandwidth": bandwidth,
                    "mmd": float(result.values[position]),
                }
                if result.test is not None:
                    row["p_value"] = float(result.test.p_values[position])
                    row["reject"] = bool(result.test.reject_each[position])
                kernel_rows.append(row)
                position += 1
        layer_row = {"layer": result.layer, "n_params": result.n_params, **result.summary()}
        if result.test is not None:
            layer_row["reject"] = result.test.reject
        layer_rows.append(layer_row)
    per_layer = pd.DataFrame(layer_rows)
    weights = per_layer["n_params"] / per_layer["n_params"].sum()
    aggregate = {name: float((weights * per_layer[name]).sum()) for name in SUMMARIES}
    return MMDResult(pd.DataFrame(kernel_rows), per_layer, aggregate, list(layers))
