"""Layer-wise MMD between weight sample sets, as MMDAgg (Schrab et al. 2023): 10 Laplace + 10
Gaussian kernels per layer on distances computed once, streamed in column blocks; optional
aggregated permutation test. See ARCHITECTURE.md and DESIGN.md "MMD".

``mmd(x, y)`` is the entry point: two sources, each an in-memory sample set
``{key: [S, ...]}`` or a ``ColumnSource`` (the store's files). ``layer_mmd`` is its
one-layer step on aligned column blocks; the rest are its parts.
"""
from metrics.mmd.bandwidths import bandwidth_grid
from metrics.mmd.distances import DistanceAccumulator, PairwiseDistances, pairwise_distances, split_columns
from metrics.mmd.layers import MMDInputError, check_comparable_shapes, group_layers, layer_name
from metrics.mmd.permutation_test import (
    AggregatedTestResult,
    PermutationTestConfig,
    aggregate_decision,
    aggregated_permutation_test,
    relabelled_statistics,
    relabelling_indicators,
)
from metrics.mmd.sources import ColumnSource, InMemorySource, Source, as_column_source, zip_column_blocks
from metrics.mmd.statistic import KERNELS, iter_kernel_matrices, kernel_matrix, u_statistics
from metrics.mmd.table import (
    LayerMMD, MMDResult, ReferenceResampling, layer_mmd, layer_mmd_from_distances, mmd, summarize, tabulate,
)

__all__ = [
    "mmd", "MMDResult", "LayerMMD", "ReferenceResampling", "summarize", "layer_mmd", "layer_mmd_from_distances", "tabulate", "Source", "ColumnSource",
    "InMemorySource", "as_column_source", "zip_column_blocks", "bandwidth_grid", "DistanceAccumulator",
    "PairwiseDistances", "pairwise_distances", "split_columns", "MMDInputError", "check_comparable_shapes",
    "group_layers", "layer_name", "AggregatedTestResult", "PermutationTestConfig", "aggregate_decision",
    "aggregated_permutation_test", "relabelled_statistics", "relabelling_indicators", "KERNELS",
    "iter_kernel_matrices", "kernel_matrix", "u_statistics",
]
