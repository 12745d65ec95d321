"""continue_networks gives each network what the one-at-a-time SGD loop gives it, whatever its stack."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.utils import parameters_to_vector

from benchmark.core.data import InMemoryImageDataset
from benchmark.core.training import NonFiniteError, iterate_batches, make_optimizer, seeded
from benchmark.core.training.continued import StepPlan, continue_networks, flat_parameters
from benchmark.experiment import Experiment
from tests.conftest import compose_config

pytestmark = pytest.mark.slow  # trains networks both ways: make test, not make test-fast


@pytest.fixture(scope="module")
def exp():
    return Experiment(compose_config(["store=unused", "train.epochs=2"]))


@pytest.fixture(autouse=True)
def one_thread(exp):
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    with exp.backends():
        yield
    torch.set_num_threads(saved)


def plan_of(total: int, snapshots: set[int]) -> StepPlan:
    return StepPlan(total, lambda step: 0.01 + 0.04 * min(1.0, (step + 1) / 7), frozenset(snapshots))


def bases(exp, seeds, dtype):
    out = []
    for seed in seeds:
        with seeded(seed):
            out.append({k: v.to(dtype) for k, v in exp.model().state_dict().items()})
    return out


def one_at_a_time(exp, train, state, seed, plan, dtype):
    """The loop SWAG writes: iterate_batches from the seed's generator, the rate set before each step."""
    model = exp.model().to(dtype)
    model.load_state_dict(state)
    optimizer = make_optimizer(model.parameters(), exp.recipe, lr=plan.lr(0))
    generator, step, snapshots = torch.Generator().manual_seed(seed), 0, {}
    while step < plan.total_steps:
        for images, labels in iterate_batches(train, exp.recipe.batch_size, generator, torch.device("cpu")):
            for group in optimizer.param_groups:
                group["lr"] = plan.lr(step)
            loss = F.cross_entropy(model(images), labels)
            if not torch.isfinite(loss):
                raise NonFiniteError(f"seed {seed}: loss became {loss.item()} at step {step + 1}")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            if step in plan.snapshot_steps:
                snapshots[step] = parameters_to_vector(model.parameters()).detach().double()
            if step == plan.total_steps:
                break
    return model.state_dict(), snapshots


def stacked(exp, train, states, seeds, plan, implementation="auto"):
    snapshots = {i: {} for i in range(len(seeds))}

    def keep(index, step, theta):
        snapshots[index][step] = theta

    with seeded(0):
        template = exp.model().to(next(iter(states[0].values())).dtype)
    outcomes = continue_networks(template, states, train, exp.recipe, seeds, [f"seed {s}" for s in seeds], plan, keep,
                                 implementation=implementation)
    return outcomes, snapshots


def test_over_epochs_with_crops_in_float64_it_equals_the_one_at_a_time_loop(exp):
    """Two and a half epochs (the last cut short mid-epoch) with random-crop augmentation, in float64
    so that rounding differences stay near 1e-12; snapshots inside and at the end."""
    data = exp.training_data
    train = InMemoryImageDataset(data.train.images[:256], data.train.labels[:256], augment_padding=2, fill=-0.9)
    train.images = train.images.double()
    steps = math.ceil(256 / exp.recipe.batch_size)
    plan = plan_of(2 * steps + 3, {3, steps, 2 * steps + 3})
    seeds = [3, 8, 11]
    states = bases(exp, seeds, torch.float64)
    outcomes, snapshots = stacked(exp, train, states, seeds, plan)
    for i, seed in enumerate(seeds):
        final, want = one_at_a_time(exp, train, states[i], seed, plan, torch.float64)
        assert set(snapshots[i]) == set(want) == set(plan.snapshot_steps)
        for step, theta in want.items():
            torch.testing.assert_close(snapshots[i][step], theta, rtol=1e-9, atol=1e-11)
        for key, value in final.items():
            torch.testing.assert_close(outcomes[i][key], value, rtol=1e-9, atol=1e-11, msg=key)
        model = exp.model().double()
        model.load_state_dict(final)
        assert torch.equal(flat_parameters(final, model), parameters_to_vector(model.parameters()).detach())


@pytest.mark.parametrize("implementation", ["packed", "vmap"])
def test_a_few_float32_steps_equal_the_one_at_a_time_loop(exp, implementation):
    data = exp.training_data
    train = InMemoryImageDataset(data.train.images[:320], data.train.labels[:320])
    plan = plan_of(10, {5, 10})
    seeds = [0, 1]
    states = bases(exp, seeds, torch.float32)
    outcomes, snapshots = stacked(exp, train, states, seeds, plan, implementation)
    for i, seed in enumerate(seeds):
        final, want = one_at_a_time(exp, train, states[i], seed, plan, torch.float32)
        for step, theta in want.items():
            torch.testing.assert_close(snapshots[i][step], theta, rtol=1e-5, atol=1e-6)
        for key, value in final.items():
            torch.testing.assert_close(outcomes[i][key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_a_network_gets_the_same_bits_whatever_its_stack(exp):
    data = exp.training_data
    plan = plan_of(2 * math.ceil(len(data.train) / exp.recipe.batch_size), {40, 81})
    seeds = [5, 6, 7]
    states = dict(zip(seeds, bases(exp, seeds, torch.float32)))
    runs = {tuple(order): stacked(exp, data.train, [states[s] for s in order], list(order), plan)
            for order in ([5, 6, 7], [7, 5], [5])}
    alone_final, alone_snaps = runs[(5,)][0][0], runs[(5,)][1][0]
    for order, (outcomes, snapshots) in runs.items():
        at = order.index(5)
        assert all(torch.equal(outcomes[at][k], v) for k, v in alone_final.items()), order
        assert all(torch.equal(snapshots[at][s], v) for s, v in alone_snaps.items()), order


def test_a_diverging_network_leaves_with_the_loops_error_and_the_others_go_on(exp):
    data = exp.training_data
    train = InMemoryImageDataset(data.train.images[:320], data.train.labels[:320])
    plan = plan_of(15, {15})
    seeds = [0, 1]
    states = bases(exp, seeds, torch.float32)
    blown = {k: v * 1e30 if k.endswith("weight") else v for k, v in states[1].items()}
    outcomes, snapshots = stacked(exp, train, [states[0], blown], seeds, plan)
    alone, alone_snaps = stacked(exp, train, [states[0]], [0], plan)
    assert all(torch.equal(outcomes[0][k], v) for k, v in alone[0].items())
    assert isinstance(outcomes[1], NonFiniteError)
    with pytest.raises(NonFiniteError) as loop:
        one_at_a_time(exp, train, blown, 1, plan, torch.float32)
    assert str(outcomes[1]) == str(loop.value)
