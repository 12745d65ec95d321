"""Layer-wise MMD between weight sample sets, as MMDAgg (Schrab et al. 2023): 10 Laplace + 10
Gaussian kernels per layer on distances computed once, streamed in column blocks; optional
aggregated permutation test (``mmdagg.py``).

Definition. Per layer (a module owning parameters: its weight and bias flattened together), with
X = reference samples (m) and Y = method samples (n): the Laplace kernels ``exp(-|x-y|_1 / l)`` and
the Gaussian kernels ``exp(-|x-y|_2^2 / l^2)``, 10 bandwidths each (``bandwidths.py``: separately
for L1 and L2, from the cross distances between the first 500 rows of X and of Y; l_min = their
minimum (if < 0.1: max(5% quantile, 0.1)), halved; l_max = 2 * max(max distance, 0.3); 10 values
geometric from l_min to l_max); the unbiased U-statistic
``sum_{i!=i'} k(x,x')/(m(m-1)) + sum_{j!=j'} k(y,y')/(n(n-1)) - 2 mean k(x,y)`` (``statistic.py``);
per layer the median, mean and max over the 20 kernels; the experiment's value is the mean over
layers weighted by parameter count (``table.py``).

``mmd(x, y)`` is the entry point: two sources, each an in-memory sample set
``{key: [S, ...]}`` or a ``ColumnSource`` (the store's files). ``layer_mmd`` is its
one-layer step on aligned column blocks; the rest are its parts. ``reference_bandwidths(x)``
gives one bandwidth grid per layer from the reference alone, for ``mmd(x, y,
shared_bandwidths=...)``: every method on one scale.
"""
from metrics.mmd.bandwidths import bandwidth_grid
from metrics.mmd.distances import DistanceAccumulator, PairwiseDistances, pairwise_distances, split_columns
from metrics.mmd.layers import MMDInputError, check_comparable_shapes, group_layers, layer_name
from metrics.mmd.mmdagg import (
    AggregatedTestResult,
    PermutationTestConfig,
    aggregate_decision,
    aggregated_permutation_test,
    relabelled_statistics,
    relabelling_indicators,
)
from metrics.mmd.sources import ColumnSource, InMemorySource, Source, as_column_source, zip_column_blocks
from metrics.mmd.statistic import KERNELS, half_sample_u_statistics, iter_kernel_matrices, kernel_matrix, u_statistics
from metrics.mmd.table import (
    LayerMMD, MMDResult, ReferenceResampling, check_bandwidths, layer_mmd, layer_mmd_from_distances, mmd, summarize,
    tabulate,
)
from metrics.mmd.shared import reference_bandwidths

__all__ = [
    "mmd", "MMDResult", "LayerMMD", "ReferenceResampling", "summarize", "layer_mmd", "layer_mmd_from_distances", "tabulate", "Source", "ColumnSource",
    "InMemorySource", "as_column_source", "zip_column_blocks", "bandwidth_grid", "DistanceAccumulator",
    "PairwiseDistances", "pairwise_distances", "split_columns", "MMDInputError", "check_comparable_shapes",
    "group_layers", "layer_name", "AggregatedTestResult", "PermutationTestConfig", "aggregate_decision",
    "aggregated_permutation_test", "relabelled_statistics", "relabelling_indicators", "KERNELS",
    "iter_kernel_matrices", "kernel_matrix", "u_statistics", "half_sample_u_statistics", "reference_bandwidths",
    "check_bandwidths",
]
