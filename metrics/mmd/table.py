"""Layer-wise MMD between a reference sample set X (m samples) and a method's Y (n samples).

Per layer: 20 MMD^2 U-statistics (10 Laplace + 10 Gaussian bandwidths), their median, mean
and max, and the energy coefficient (the distance kernel's MMD, no bandwidth: ``energy.py``); for
the experiment, the mean over layers of each, weighted by parameter count.
The entry point is ``mmd(x, y)``: two sources (in-memory sample sets or column sources such
as the store's files), compared layer by layer in column blocks. ``layer_mmd`` is its
one-layer step on a stream of aligned column blocks.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import pandas as pd
import torch
from tqdm import tqdm

from metrics.mmd.bandwidths import bandwidth_grid
from metrics.mmd.distances import DEFAULT_MAX_CHUNK_ELEMENTS, PairwiseDistances, pairwise_distances
from metrics.mmd.energy import energy_coefficient, half_sample_energy
from metrics.mmd.layers import MMDInputError, check_comparable_shapes
from metrics.mmd.mmdagg import AggregatedTestResult, PermutationTestConfig, aggregated_permutation_test
from metrics.mmd.sources import Source, as_column_source, layer_columns, zip_column_blocks
from metrics.mmd.statistic import KERNEL_DISTANCE, KERNELS, half_sample_u_statistics, u_statistics

MAX_BANDWIDTH_ROWS = 500
SUMMARIES = ("median", "mean", "max")
ENERGY = "energy"
"""The per-layer column and aggregate key of the energy coefficient (``energy.energy_coefficient``)."""


def summarize(values: torch.Tensor) -> dict[str, torch.Tensor]:
    """Median (mean of the two middle values), mean and max over the last axis of ``values [..., 20]``."""
    return {"median": torch.quantile(values, 0.5, dim=-1), "mean": values.mean(-1), "max": values.max(-1).values}


@dataclass(frozen=True)
class LayerMMD:
    """MMD of one layer. ``values [20]`` float64: Laplace bandwidths 0..9 then Gaussian 0..9
    (MMD^2 U-statistics, unitless); ``bandwidths``: ``{kernel: [10]}`` in distance units.
    ``resampled [B, 20]``: the same values with the reference replaced by B random halves of
    itself (drawn without replacement; empty when no resampling was asked). ``energy``: the
    layer's energy coefficient (unitless, ``energy.energy_coefficient``), ``energy_resampled [B]``
    the same over the halves."""

    layer: str
    n_params: int
    m: int
    n: int
    bandwidths: dict[str, torch.Tensor]
    values: torch.Tensor
    test: AggregatedTestResult | None = None
    resampled: torch.Tensor = field(default_factory=lambda: torch.empty(0, 20, dtype=torch.float64))
    energy: float = float("nan")
    energy_resampled: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.float64))

    def summary(self) -> dict[str, float]:
        """Median (mean of the two middle values), mean and max of the 20 values."""
        return {name: float(value) for name, value in summarize(self.values).items()}


@dataclass(frozen=True)
class MMDResult:
    """``per_kernel``: one row per (layer, kernel, bandwidth); ``per_layer``: median/mean/max and
    the energy coefficient per layer; ``aggregate``: ``{median, mean, max, energy}`` weighted by
    ``n_params`` over layers.
    ``resampled``: the aggregate of each reference half-sample, ``{median, mean, max, energy}: [B]``
    (their spread estimates the standard error due to the finite reference: a half-sample drawn
    without replacement has the variance of the full-sample mean); ``reject_fraction``: the
    fraction of layers whose MMDAgg test rejects "same distribution" (NaN without a test);
    ``shared``: the same comparison with fixed bandwidths shared by every method (``mmd``'s
    ``shared_bandwidths``; ``None`` without)."""

    per_kernel: pd.DataFrame
    per_layer: pd.DataFrame
    aggregate: dict[str, float]
    layers: list[LayerMMD] = field(repr=False)
    resampled: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    reject_fraction: float = float("nan")
    shared: "MMDResult | None" = field(default=None, repr=False)


def _kernel_values(
    distances: PairwiseDistances, max_bandwidth_rows: int, bandwidths: Mapping[str, torch.Tensor] | None = None
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``(bandwidths {kernel: [10]}, the 20 U-statistics [20])`` of one layer's distances; the
    bandwidths are MMDAgg's data-driven grid unless fixed ``bandwidths`` are given."""
    if bandwidths is None:
        bandwidths = {
            kernel: bandwidth_grid(distances.cross(KERNEL_DISTANCE[kernel], max_bandwidth_rows)) for kernel in KERNELS
        }
    values = torch.cat(
        [
            u_statistics(getattr(distances, KERNEL_DISTANCE[kernel]), distances.m, kernel, bandwidths[kernel])
            for kernel in KERNELS
        ]
    )
    return bandwidths, values


@dataclass(frozen=True)
class ReferenceResampling:
    """``count`` random halves of the reference (``floor(m / 2)`` rows each, without replacement),
    drawn from ``seed``; the same halves for every layer of one comparison."""

    count: int = 20
    seed: int = 0

    def __post_init__(self) -> None:
        if self.count < 2:
            raise ValueError(f"reference resampling: count must be >= 2, got {self.count}")

    def halves(self, m: int) -> torch.Tensor:
        """Row indices ``[count, m // 2]`` of the halves (sorted within each)."""
        if m < 4:
            raise MMDInputError(f"reference resampling needs at least 4 reference samples, got {m}")
        generator = torch.Generator().manual_seed(self.seed)
        return torch.rand(self.count, m, generator=generator).argsort(dim=1)[:, : m // 2].sort(dim=1).values


def layer_mmd_from_distances(
    distances: PairwiseDistances,
    layer: str = "layer",
    *,
    max_bandwidth_rows: int = MAX_BANDWIDTH_ROWS,
    permutation_test: PermutationTestConfig | None = None,
    resampling: ReferenceResampling | None = None,
    bandwidths: Mapping[str, torch.Tensor] | None = None,
) -> LayerMMD:
    """The 20 MMD values of one layer from its distance matrices, optionally MMDAgg's test and
    the values of reference half-samples (each with its own bandwidths, as a fresh comparison).

    ``bandwidths``: a fixed grid ``{"laplace": [K], "gaussian": [K]}`` (distance units, > 0) used
    instead of MMDAgg's data-driven one, for the values, the test and every half-sample (e.g. one
    grid shared by all methods: ``reference_bandwidths``)."""
    if max_bandwidth_rows < 1:
        raise ValueError(f"max_bandwidth_rows must be >= 1, got {max_bandwidth_rows}")
    fixed = check_bandwidths(bandwidths, layer) if bandwidths is not None else None
    grid, values = _kernel_values(distances, max_bandwidth_rows, fixed)
    test = None
    if permutation_test is not None:
        test = aggregated_permutation_test(distances, grid, values, permutation_test)
    resampled = torch.empty(0, len(values), dtype=torch.float64, device=values.device)
    energy_resampled = torch.empty(0, dtype=torch.float64, device="cpu")
    if resampling is not None:
        halves = resampling.halves(distances.m)
        energy_resampled = half_sample_energy(distances, halves)
        if fixed is not None:  # one kernel matrix per bandwidth serves every half
            resampled = torch.cat([half_sample_u_statistics(getattr(distances, KERNEL_DISTANCE[kernel]), distances.m,
                                                            kernel, fixed[kernel], halves) for kernel in KERNELS], dim=1)
        else:
            resampled = torch.stack([_kernel_values(distances.subset_x(rows), max_bandwidth_rows, fixed)[1]
                                     for rows in halves])
    return LayerMMD(layer, distances.n_params, distances.m, distances.n, grid, values, test, resampled,
                    energy_coefficient(distances), energy_resampled)


def check_bandwidths(bandwidths: Mapping[str, torch.Tensor], layer: str = "layer") -> dict[str, torch.Tensor]:
    """A fixed grid ``{kernel: [K]}`` for every kernel of ``KERNELS``, as float64 CPU tensors;
    ``MMDInputError`` naming the layer when a kernel is missing or a bandwidth is not finite and > 0."""
    missing = [kernel for kernel in KERNELS if kernel not in bandwidths]
    if missing:
        raise MMDInputError(f"layer {layer!r}: fixed bandwidths lack the kernel(s) {missing}; expected {list(KERNELS)}")
    out = {}
    for kernel in KERNELS:
        grid = torch.as_tensor(bandwidths[kernel], device="cpu").detach().to(torch.float64).reshape(-1)
        if grid.numel() == 0 or not bool(torch.isfinite(grid).all()) or not bool((grid > 0).all()):
            raise MMDInputError(f"layer {layer!r}: fixed {kernel} bandwidths must be finite and > 0, got {grid.tolist()}")
        out[kernel] = grid
    return out


def layer_mmd(
    chunks: Iterable[tuple[torch.Tensor, torch.Tensor]],
    *,
    layer: str = "layer",
    max_bandwidth_rows: int = MAX_BANDWIDTH_ROWS,
    device: torch.device | str | None = None,
    permutation_test: PermutationTestConfig | None = None,
    resampling: ReferenceResampling | None = None,
    bandwidths: Mapping[str, torch.Tensor] | None = None,
) -> LayerMMD:
    """MMD of one layer streamed as aligned column blocks ``(X [m, d_i], Y [n, d_i])``
    (``bandwidths``: a fixed grid, see ``layer_mmd_from_distances``).

    Peak memory: the blocks in flight plus a few ``[m + n, m + n]`` float64 matrices.
    """
    distances = pairwise_distances(chunks, layer=layer, device=device)
    return layer_mmd_from_distances(
        distances, layer, max_bandwidth_rows=max_bandwidth_rows, permutation_test=permutation_test,
        resampling=resampling, bandwidths=bandwidths,
    )


def mmd(
    x: Source,
    y: Source,
    *,
    max_bandwidth_rows: int = MAX_BANDWIDTH_ROWS,
    device: torch.device | str | None = None,
    max_chunk_elements: int = DEFAULT_MAX_CHUNK_ELEMENTS,
    permutation_test: PermutationTestConfig | None = None,
    resampling: ReferenceResampling | None = None,
    shared_bandwidths: Mapping[str, Mapping[str, torch.Tensor]] | None = None,
    progress: bool = False,
) -> MMDResult:
    """Layer-wise MMD between reference ``x`` (m samples) and method ``y`` (n samples).

    Each side is an in-memory sample set ``{key: [S, ...]}`` or a ``ColumnSource`` (e.g. the
    store's sample-set file or zoo file list); keys and shapes are checked before any data is
    read, layers are as ``group_layers``, and each layer is streamed in column blocks of at
    most ``max_chunk_elements // (m + n)`` columns (float64 accumulation). See ``MMDResult``.

    ``shared_bandwidths``: ``{layer: {"laplace": [K], "gaussian": [K]}}``, a fixed grid per layer
    (e.g. ``reference_bandwidths(x)``, the same for every method compared with ``x``); the result's
    ``shared`` then holds the same comparison with those grids, on the same distances (so at the
    cost of the extra U-statistics only) and the same reference halves, without a test. The main
    result keeps MMDAgg's data-driven bandwidths, unchanged.
    """
    xs, ys = as_column_source(x), as_column_source(y)
    x_shapes, y_shapes = xs.shapes(), ys.shapes()
    layers = check_comparable_shapes(x_shapes, y_shapes)
    if shared_bandwidths is not None:
        absent = [layer for layer in layers if layer not in shared_bandwidths]
        if absent:
            raise MMDInputError(f"shared bandwidths: no grid for layer(s) {absent}; reference_bandwidths(x) gives one "
                                f"per layer of x")
    results, shared = [], []
    for layer, keys in tqdm(layers.items(), desc="MMD", unit="layer", disable=not progress):
        width = max(1, max_chunk_elements // (x_shapes[keys[0]][0] + y_shapes[keys[0]][0]))
        chunks = zip_column_blocks(layer_columns(xs, keys, width), layer_columns(ys, keys, width), layer)
        distances = pairwise_distances(chunks, layer=layer, device=device)
        results.append(
            layer_mmd_from_distances(
                distances, layer, max_bandwidth_rows=max_bandwidth_rows, permutation_test=permutation_test,
                resampling=resampling,
            )
        )
        if shared_bandwidths is not None:
            shared.append(layer_mmd_from_distances(distances, layer, resampling=resampling,
                                                   bandwidths=shared_bandwidths[layer]))
    result = tabulate(results)
    return dataclasses.replace(result, shared=tabulate(shared)) if shared else result


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
        layer_row = {"layer": result.layer, "n_params": result.n_params, **result.summary(), ENERGY: result.energy}
        if result.test is not None:
            layer_row["reject"] = result.test.reject
        layer_rows.append(layer_row)
    per_layer = pd.DataFrame(layer_rows)
    weights = per_layer["n_params"] / per_layer["n_params"].sum()
    aggregate = {name: float((weights * per_layer[name]).sum()) for name in (*SUMMARIES, ENERGY)}
    resampled = {}
    if all(len(result.resampled) for result in layers):
        w = torch.tensor(weights.to_numpy(), dtype=torch.float64, device=layers[0].resampled.device)
        per_resample = [summarize(result.resampled) for result in layers]  # each {name: [B]}
        resampled = {name: sum(w[i] * s[name] for i, s in enumerate(per_resample)) for name in SUMMARIES}
        if all(len(result.energy_resampled) for result in layers):
            resampled[ENERGY] = sum(w[i].cpu() * result.energy_resampled for i, result in enumerate(layers))
    tested = [result.test for result in layers if result.test is not None]
    reject = sum(t.reject for t in tested) / len(tested) if len(tested) == len(layers) else float("nan")
    return MMDResult(pd.DataFrame(kernel_rows), per_layer, aggregate, list(layers), resampled, reject)
