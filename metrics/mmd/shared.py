"""One bandwidth grid per layer for every method of an experiment, from the reference alone.

MMDAgg chooses each comparison's bandwidths from the distances between its two samples, so
every method's MMD is measured with its own kernels: a broad method gets long bandwidths and
rows are not on one scale. ``reference_bandwidths`` applies the same rule (``bandwidth_grid``)
to the distances between two disjoint parts of the reference: its first h rows against its
next h rows, h = min(``max_bandwidth_rows``, m // 2) (500 x 500 distances for a zoo of 1000,
as many as MMDAgg's own rule reads). That is the grid MMDAgg would pick for a method whose
samples were a second draw from the reference (the null case): the natural scale of the
reference's own spread, and the same for every method compared with it. Pass it to
``mmd(x, y, shared_bandwidths=...)``.
"""
from __future__ import annotations

import torch
from tqdm import tqdm

from metrics.mmd.bandwidths import bandwidth_grid
from metrics.mmd.distances import DEFAULT_MAX_CHUNK_ELEMENTS, pairwise_distances
from metrics.mmd.layers import check_comparable_shapes
from metrics.mmd.sources import Source, as_column_source, layer_columns
from metrics.mmd.statistic import KERNEL_DISTANCE, KERNELS
from metrics.mmd.table import MAX_BANDWIDTH_ROWS


def reference_bandwidths(
    reference: Source,
    *,
    max_bandwidth_rows: int = MAX_BANDWIDTH_ROWS,
    device: torch.device | str | None = None,
    max_chunk_elements: int = DEFAULT_MAX_CHUNK_ELEMENTS,
    progress: bool = False,
) -> dict[str, dict[str, torch.Tensor]]:
    """``{layer: {"laplace": [10], "gaussian": [10]}}`` (float64, units of the L1 / L2 distances):
    MMDAgg's grid from the distances between rows ``:h`` and ``h:2h`` of ``reference``
    (``h = min(max_bandwidth_rows, m // 2)``; see the module doc).

    ``reference``: an in-memory sample set ``{key: [m, ...]}`` or a ``ColumnSource`` (streamed
    in column blocks of at most ``max_chunk_elements // m`` columns), m >= 2 (with 2 or 3 the
    grid comes from the one distance between the first two); layers as ``group_layers``
    (buffers dropped). Raises ``MMDInputError`` naming the layer otherwise.
    """
    if max_bandwidth_rows < 2:
        raise ValueError(f"reference_bandwidths: max_bandwidth_rows must be >= 2, got {max_bandwidth_rows}")
    source = as_column_source(reference)
    shapes = source.shapes()
    layers = check_comparable_shapes(shapes, shapes)
    grids = {}
    for layer, keys in tqdm(layers.items(), desc="shared bandwidths", unit="layer", disable=not progress):
        m = shapes[keys[0]][0]
        h = min(max_bandwidth_rows, m // 2)
        blocks = layer_columns(source, keys, max(1, max_chunk_elements // m))
        if h >= 2:
            distances = pairwise_distances(((b[:h], b[h : 2 * h]) for b in blocks), layer=layer, device=device)
            cross = {kind: distances.cross(kind, h) for kind in ("l1", "l2")}
        else:  # 2 or 3 reference samples: the one distance between the first two
            cross = _one_distance(blocks)
        grids[layer] = {kernel: bandwidth_grid(cross[KERNEL_DISTANCE[kernel]]) for kernel in KERNELS}
    return grids


def _one_distance(blocks) -> dict[str, torch.Tensor]:
    """``{"l1": [1], "l2": [1]}``: the distances between rows 0 and 1 of a layer's column blocks."""
    l1 = squared = torch.zeros((), dtype=torch.float64, device="cpu")  # the blocks are moved to the CPU
    for block in blocks:
        difference = (block[0] - block[1]).to("cpu", torch.float64)
        l1, squared = l1 + difference.abs().sum(), squared + difference.square().sum()
    return {"l1": l1.reshape(1), "l2": squared.sqrt().reshape(1)}
