import math

import pytest
import torch

from metrics.mmd import bandwidth_grid
from tests.metrics.mmd.brute_force import bandwidths_by_hand


def test_regular_branch_matches_a_hand_computation():
    # min 0.5 >= 0.1: l_min = 0.25, l_max = 2 * 3 = 6, ratio (6 / 0.25)^(1/9) = 24^(1/9)
    grid = bandwidth_grid(torch.tensor([[0.5, 1.0], [2.0, 3.0]]))
    expected = [0.25 * 24 ** (i / 9) for i in range(10)]
    assert grid.dtype == torch.float64
    assert grid.tolist() == pytest.approx(expected, rel=1e-14)
    assert grid[0] == 0.25 and grid[-1] == pytest.approx(6.0, rel=1e-14)


def test_small_minimum_uses_the_five_percent_order_statistic():
    # 40 values: index floor(40 * 0.05) = 2 of the sorted list, i.e. 0.4 (>= 0.1 so kept)
    d = torch.tensor([0.0, 0.01, 0.4] + [1.0 + i for i in range(37)], dtype=torch.float64)
    grid = bandwidth_grid(d)
    assert grid[0] == pytest.approx(0.2, rel=1e-15)
    assert grid[-1] == pytest.approx(2 * 37.0, rel=1e-15)
    assert grid.tolist() == pytest.approx(bandwidths_by_hand(d.tolist()), rel=1e-14)


def test_small_order_statistic_is_floored_at_one_tenth():
    d = torch.tensor([0.0, 0.0, 0.0, 0.05, 0.2], dtype=torch.float64)  # floor(5 * 0.05) = 0 -> 0.0 -> floored to 0.1
    grid = bandwidth_grid(d)
    assert grid[0] == pytest.approx(0.05, rel=1e-15)
    assert grid[-1] == pytest.approx(0.6, rel=1e-15)  # max 0.2 < 0.3 floor


def test_identical_samples_give_finite_positive_bandwidths():
    grid = bandwidth_grid(torch.zeros(25))
    assert torch.isfinite(grid).all() and (grid > 0).all()
    assert grid[0] == pytest.approx(0.05) and grid[-1] == pytest.approx(0.6)


def test_grid_is_geometric_with_requested_count():
    grid = bandwidth_grid(torch.tensor([1.0, 5.0]), count=4)
    ratios = (grid[1:] / grid[:-1]).tolist()
    assert ratios == pytest.approx([math.pow(20, 1 / 3)] * 3, rel=1e-13)


@pytest.mark.parametrize("bad, count", [(torch.tensor([]), 10), (torch.tensor([1.0]), 1)])
def test_bad_input(bad, count):
    with pytest.raises(ValueError, match="bandwidth_grid"):
        bandwidth_grid(bad, count=count)
