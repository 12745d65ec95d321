"""The vectorised trainer gives each seed what train_network gives it, whatever K."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from benchmark.core.data import InMemoryImageDataset
from benchmark.experiment import Experiment
from benchmark.core.training import FailRule, NonFiniteError, TrainingData, seeded, train_network
from benchmark.core.training.stacked import NotStackableError
from benchmark.core.training.vectorised import networks_that_fit, train_networks
from tests.conftest import compose_config

pytestmark = pytest.mark.slow  # trains zoos both ways: make test, not make test-fast


@pytest.fixture(scope="module")
def exp():
    return Experiment(compose_config(["store=unused", "train.epochs=2", "train.fail_rule.epoch=1",
                                      "train.fail_rule.final_min_accuracy=null"]))


@pytest.fixture(autouse=True)
def one_thread(exp):
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    with exp.backends():
        yield
    torch.set_num_threads(saved)


def models(exp, seeds, dtype=torch.float32):
    out = []
    for seed in seeds:
        with seeded(seed):
            out.append(exp.model().to(dtype))
    return out


def one_at_a_time(exp, data, recipe, seeds, dtype=torch.float32):
    results = []
    for seed, model in zip(seeds, models(exp, seeds, dtype)):
        try:
            results.append(train_network(model, data.train, data.check, recipe, seed, where=f"seed {seed}",
                                         train_eval=data.train_tensors))
        except NonFiniteError as err:
            results.append(err)
    return results


def stacked(exp, data, recipe, seeds, dtype=torch.float32, **kwargs):
    return train_networks(models(exp, seeds, dtype), data, recipe, seeds, [f"seed {s}" for s in seeds],
                          train_eval=data.train_tensors, **kwargs)


def assert_same(ours, theirs, rtol, atol):
    assert type(ours) is type(theirs)
    if isinstance(theirs, NonFiniteError):
        assert str(ours) == str(theirs)
        return
    assert (ours.failure, ours.epochs_run, ours.check_accuracy) == (theirs.failure, theirs.epochs_run, theirs.check_accuracy)
    assert ours.train_accuracy == pytest.approx(theirs.train_accuracy, nan_ok=True)
    assert [h.keys() for h in ours.history] == [h.keys() for h in theirs.history]
    for mine, want in zip(ours.history, theirs.history):
        assert mine == pytest.approx(want, rel=1e-5)
    assert list(ours.state_dict) == list(theirs.state_dict)
    for key, want in theirs.state_dict.items():
        torch.testing.assert_close(ours.state_dict[key], want, rtol=rtol, atol=atol, msg=key)


@pytest.mark.parametrize("implementation", ["packed", "vmap"])
def test_a_few_steps_equal_train_network(exp, implementation):
    recipe = exp.recipe.replaced(epochs=1, fail_rule=dataclasses.replace(exp.recipe.fail_rule, epoch=None))
    seeds = [0, 1, 4, 5]
    data = exp.training_data
    short = TrainingData(InMemoryImageDataset(data.train.images[:320], data.train.labels[:320]), data.train_tensors, data.check)
    want = one_at_a_time(exp, short, recipe, seeds)
    for ours, theirs in zip(stacked(exp, short, recipe, seeds, implementation=implementation), want):
        assert_same(ours, theirs, rtol=1e-5, atol=1e-6)


def test_the_whole_recipe_in_float64_equals_train_network(exp):
    """3 epochs with the convergence rule after epoch 2 (some seeds fail it and leave the stack)
    and random-crop augmentation, in float64 so rounding differences stay near 1e-12."""
    data = exp.training_data
    train = InMemoryImageDataset(data.train.images, data.train.labels, augment_padding=2, fill=-0.9)
    train.images = train.images.double()
    data64 = TrainingData(train, tuple(t.double() if t.is_floating_point() else t for t in data.train_tensors),
                          tuple(t.double() if t.is_floating_point() else t for t in data.check))
    recipe = exp.recipe.replaced(epochs=3, milestones=[2], fail_rule=dataclasses.replace(exp.recipe.fail_rule, epoch=2))
    seeds = list(range(6))
    want = one_at_a_time(exp, data64, recipe, seeds, torch.float64)
    assert {r.failure is None for r in want} == {True, False}, "the seeds should include converged and failed ones"
    for ours, theirs in zip(stacked(exp, data64, recipe, seeds, torch.float64), want):
        assert_same(ours, theirs, rtol=1e-9, atol=1e-11)


def test_the_result_does_not_depend_on_k_or_order(exp):
    data, recipe = exp.training_data, exp.recipe
    seeds = list(range(7))
    together = stacked(exp, data, recipe, seeds)
    apart = stacked(exp, data, recipe, seeds[:2]) + stacked(exp, data, recipe, seeds[2:3]) + stacked(exp, data, recipe, seeds[3:])
    reversed_ = stacked(exp, data, recipe, seeds[::-1])[::-1]
    for a, b, c in zip(together, apart, reversed_):
        for other in (b, c):
            assert (a.failure, a.history, a.check_accuracy) == (other.failure, other.history, other.check_accuracy)
            assert all(torch.equal(a.state_dict[k], other.state_dict[k]) for k in a.state_dict)


def test_nan_in_one_network_is_recorded_and_the_others_go_on(exp):
    data, recipe = exp.training_data, exp.recipe
    seeds = [0, 1, 2]
    nets = models(exp, seeds)
    with torch.no_grad():
        nets[1].fc2.bias.fill_(float("inf"))  # its loss is NaN from the first step on
    done = []
    outcomes = train_networks(nets, data, recipe, seeds, [f"seed {s}" for s in seeds],
                              on_done=lambda i, outcome: done.append(i), train_eval=data.train_tensors)
    assert isinstance(outcomes[1], NonFiniteError)
    assert str(outcomes[1]) == "seed 1, epoch 1: loss became nan at step 0"
    assert done[0] == 1 and sorted(done) == [0, 1, 2]
    alone = stacked(exp, data, recipe, [0, 2])
    for ours, theirs in zip([outcomes[0], outcomes[2]], alone):
        assert all(torch.equal(ours.state_dict[k], theirs.state_dict[k]) for k in theirs.state_dict)


def test_failures_are_reported_as_they_happen(exp):
    data, recipe = exp.training_data, exp.recipe.replaced(epochs=3, milestones=[2])
    seeds = list(range(8))
    done = []
    outcomes = train_networks(models(exp, seeds), data, recipe, seeds, [f"seed {s}" for s in seeds],
                              on_done=lambda i, outcome: done.append((i, outcome.epochs_run)))
    early = [i for i, o in enumerate(outcomes) if o.epochs_run == 1]
    assert early and all("did not converge" in outcomes[i].failure for i in early)
    assert [i for i, _ in done[: len(early)]] == early  # reported after epoch 1, before the others finish
    assert all(o.history[0]["check_accuracy"] == o.check_accuracy for o in outcomes if o.epochs_run == 1)


def test_data_that_cannot_be_stacked_is_refused(exp):
    data = exp.training_data
    listed = TrainingData(list(zip(data.train.images[:4], data.train.labels[:4].tolist())), data.train_tensors, data.check)
    with pytest.raises(NotStackableError, match="in-memory image dataset"):
        stacked(exp, listed, exp.recipe, [0])


def test_memory_sizes_the_stack(exp, monkeypatch):
    template = exp.model()
    monkeypatch.setattr("benchmark.core.training.vectorised.available_bytes", lambda device: 2**30)
    fit, per_network, available = networks_that_fit(template, (1, 28, 28), 32, torch.device("cpu"))
    assert available == 2**30 and 100_000 < per_network < 2_000_000
    assert fit == int((0.5 * 2**30 - 4 * 2**22) // per_network)
    two, _, _ = networks_that_fit(template, (1, 28, 28), 32, torch.device("cpu"), stacks=2)  # two stacks share the half
    assert two == int((0.25 * 2**30 - 4 * 2**22) // per_network) and 2 * two * per_network <= 0.5 * 2**30


def test_a_subset_of_the_training_set_stacks_like_the_same_images_in_memory(exp):
    """A training split with a validation part carved out (a Subset) is sliced in memory by both trainers."""
    from torch.utils.data import Subset

    data = exp.training_data
    kept = list(range(0, len(data.train), 2))
    subset = TrainingData(Subset(data.train, kept), data.train_tensors, data.check)
    direct = TrainingData(InMemoryImageDataset(data.train.images[kept], data.train.labels[kept]), data.train_tensors, data.check)
    recipe = exp.recipe.replaced(epochs=1, fail_rule=dataclasses.replace(exp.recipe.fail_rule, epoch=None))
    for ours, theirs in zip(stacked(exp, subset, recipe, [3, 4]), one_at_a_time(exp, direct, recipe, [3, 4])):
        assert_same(ours, theirs, rtol=1e-5, atol=1e-6)


def test_the_final_threshold_gives_the_same_verdicts_in_both_trainers(exp):
    """``fail_rule.final_min_accuracy`` decides here (the early check at epoch 1 passes every
    seed): both trainers fail exactly the seeds whose end-of-training validation accuracy is
    below it, with the same reason, and keep the others."""
    data = exp.training_data
    short = TrainingData(InMemoryImageDataset(data.train.images[:320], data.train.labels[:320]), data.train_tensors, data.check)
    seeds = list(range(6))
    lenient = exp.recipe.replaced(epochs=2, milestones=[], fail_rule=FailRule(epoch=1, min_accuracy=0.0))
    ends = sorted({r.check_accuracy for r in one_at_a_time(exp, short, lenient, seeds)})
    assert len(ends) >= 2, "the seeds should end at different accuracies"
    threshold = (ends[len(ends) // 2 - 1] + ends[len(ends) // 2]) / 2  # between two reached accuracies
    recipe = lenient.replaced(fail_rule=FailRule(epoch=1, min_accuracy=0.0, final_min_accuracy=threshold))
    want = one_at_a_time(exp, short, recipe, seeds)
    verdicts = [r.failure is None for r in want]
    assert verdicts == [r.check_accuracy >= threshold for r in want] and set(verdicts) == {True, False}
    for r in want:
        assert r.epochs_run == 2  # judged at the end, not stopped early
        if r.failure:
            assert r.failure == (f"held-out accuracy {r.check_accuracy:.3f} < {threshold} at the end of training "
                                 "(below fail_rule.final_min_accuracy: not converged)")
    for ours, theirs in zip(stacked(exp, short, recipe, seeds), want):
        assert_same(ours, theirs, rtol=1e-5, atol=1e-6)


def test_curves_record_every_epochs_accuracies_and_leave_the_weights_as_they_are(exp):
    """With ``curves`` each epoch's record holds the validation accuracy and the accuracy on the
    fixed training subset, in both trainers alike; the weights are those of a run without them, to
    the bit; the last record's numbers are the final network's, recomputed here."""
    from benchmark.core.training import accuracy, curve_subset

    data, recipe = exp.training_data, exp.recipe.replaced(epochs=3, milestones=[2])
    seeds = list(range(5))
    plain = stacked(exp, data, recipe, seeds)
    ours = stacked(exp, data, recipe, seeds, curves=True)
    theirs = [train_network(model, data.train, data.check, recipe, seed, where=f"seed {seed}",
                            train_eval=data.train_tensors, curves=True) for seed, model in zip(seeds, models(exp, seeds))]
    subset = curve_subset(data.train_tensors, len(data.check[1]))
    assert len(subset[1]) == len(data.check[1]) and len(set(subset[1].tolist())) > 1
    for a, b, alone in zip(plain, ours, theirs):
        assert all(torch.equal(a.state_dict[k], b.state_dict[k]) for k in a.state_dict)
        assert [r["epoch"] for r in b.history] == list(range(1, b.epochs_run + 1))
        assert all({"check_accuracy", "train_subset_accuracy"} <= r.keys() for r in b.history)
        assert [h.keys() for h in b.history] == [h.keys() for h in alone.history]
        for mine, want in zip(b.history, alone.history):
            assert mine == pytest.approx(want, rel=1e-5, abs=1.5 / len(data.check[1]))
        if b.failure is None or b.epochs_run == recipe.max_epochs:
            assert b.history[-1]["check_accuracy"] == pytest.approx(b.check_accuracy)
            with seeded(0):
                model = exp.model()
            model.load_state_dict(b.state_dict)
            assert b.history[-1]["train_subset_accuracy"] == pytest.approx(accuracy(model, *subset))
