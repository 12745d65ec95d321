"""Layer-wise MMD between weight sample sets, as MMDAgg (Schrab et al. 2023): 10 Laplace + 10
Gaussian kernels per layer on distances computed once, streamed in column blocks; optional
aggregated permutation test. See DESIGN.md "MMD"."""
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
from metrics.mmd.sources import Source, iter_source_columns, source_shapes, zip_column_blocks
from metrics.mmd.statistic import KERNELS, iter_kernel_matrices, kernel_matrix, u_statistics
from metrics.mmd.table import (
    LayerMMD,
    MMDResult,
    layer_mmd_from_chunks,
    layer_mmd_from_distances,
    layer_mmd_from_store,
    mmd_table,
    mmd_table_from_store,
    tabulate,
)

__all__ = [
    "bandwidth_grid", "DistanceAccumulator", "PairwiseDistances", "pairwise_distances", "split_columns",
    "MMDInputError", "check_comparable_shapes", "group_layers", "layer_name", "AggregatedTestResult",
    "PermutationTestConfig", "aggregate_decision", "aggregated_permutation_test", "relabelled_statistics",
    "relabelling_indicators", "Source", "iter_source_columns", "source_shapes", "zip_column_blocks", "KERNELS",
    "iter_kernel_matrices", "kernel_matrix", "u_statistics", "LayerMMD", "MMDResult", "layer_mmd_from_chunks",
    "layer_mmd_from_distances", "layer_mmd_from_store", "mmd_table", "mmd_table_from_store", "tabulate",
]
