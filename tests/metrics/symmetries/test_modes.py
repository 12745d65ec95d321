"""The D.1 mode count against brute force: apply every allowed permutation to a small network
with a grouped convolution and count the distinct weight vectors."""
import itertools
import math

import pytest
import torch
from torch import nn

from benchmark.core.store import stack_state_dicts
from metrics.symmetries import check_permutations, log10_permutation_modes, permute, sequential_spec
from metrics.symmetries.engine import block_permutation


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 2, 2), nn.ReLU(), nn.Conv2d(2, 4, 2, groups=2), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)).double()


def _brute_force(state: dict, spec, block_moves: bool) -> int:
    """Distinct weight vectors over every allowed permutation of every group."""
    candidates = {g.name: list(itertools.permutations(range(g.size))) for g in spec.groups}
    combos = []
    for choice in itertools.product(*candidates.values()):
        perms = {name: torch.tensor([p]) for name, p in zip(candidates, choice)}
        try:
            check_permutations(spec, perms, 1)
        except ValueError:
            continue
        leaders = [g for g in spec.groups if g.blocks > 1 and g.follows is None]
        if not block_moves and any(not torch.equal(block_permutation(perms[g.name], g.blocks)[0], torch.arange(g.blocks))
                                   for g in leaders):
            continue
        combos.append(perms)
    batch = {k: v[None].expand(len(combos), *v.shape).clone() for k, v in state.items()}
    stacked = {name: torch.cat([c[name] for c in combos]) for name in candidates}
    permuted = permute(batch, spec, stacked)
    flat = torch.cat([permuted[k].flatten(1) for k in spec.shapes], dim=1)
    return len(torch.unique(torch.round(flat * 1e9), dim=0))


def _duplicate(state: dict, spec, group: str, a: int, b: int) -> dict:
    """``state`` with unit ``b`` of ``group`` made identical to unit ``a`` (every axis of the group)."""
    out = {k: v.clone() for k, v in state.items()}
    for ax in spec.group(group).axes():
        out[ax.key].select(ax.axis, b).copy_(out[ax.key].select(ax.axis, a))
    return out


@pytest.mark.parametrize("duplicate", [None, ("6", 0, 1), ("2", 2, 3)])
@pytest.mark.parametrize("block_moves", [True, False])
def test_mode_count_matches_brute_force(duplicate, block_moves):
    net = _net()
    spec = sequential_spec(net)
    state = net.state_dict()
    if duplicate:
        state = _duplicate(state, spec, *duplicate)
    counts = log10_permutation_modes(stack_state_dicts([state]), spec, block_moves=block_moves)
    assert 10 ** float(counts["total"][0]) == pytest.approx(_brute_force(state, spec, block_moves), rel=1e-9)
    assert float(counts["total"][0]) == pytest.approx(sum(float(v[0]) for k, v in counts.items() if k != "total"))


def test_distinct_units_give_the_factorials_and_optunet_conv1_counts_two_or_one():
    from benchmark.core.models import optunet
    from metrics.symmetries import optunet_spec

    torch.manual_seed(1)
    model = optunet()
    counts = log10_permutation_modes(stack_state_dicts([model.state_dict()]), optunet_spec(model))
    assert 10 ** float(counts["conv1"][0]) == pytest.approx(2)  # the two blocks moved whole (G! with b = 1)
    assert 10 ** float(counts["conv2"][0]) == pytest.approx(math.factorial(5) ** 2)
    assert 10 ** float(counts["fc1"][0]) == pytest.approx(6)
    paper = log10_permutation_modes(stack_state_dicts([model.state_dict()]), optunet_spec(model), block_moves=False)
    assert 10 ** float(paper["conv1"][0]) == pytest.approx(1)  # appendix D.4.2: intra-group only, (C/G)!^G = 1
