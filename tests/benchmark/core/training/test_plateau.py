"""train.until_plateau (issue 31): the plateau criterion, both trainers following it alike, and
the recipe's hash left as it was while the option is off."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from benchmark.core.data import InMemoryImageDataset
from benchmark.core.training import FailRule, Plateau, TrainingData, learning_rate, seeded, train_network
from benchmark.core.training.vectorised import train_networks
from benchmark.experiment import Experiment
from tests.conftest import compose_config

DIGITS_HASH = "6c298efae427e4e0"
"""digits_optunet's config_hash before the option existed (computed on the code of 81629f6)."""


def test_the_criterion_on_a_synthetic_curve():
    """U(e) = 200 + 300 exp(-e / 10): the relative fall over 5 epochs, 300 e^(-e/10) (1 - e^(-1/2))
    / U(e - 5), first drops below 1% at e = 46 (x = e^(-(e-5)/10) < 2/115.0); a rising accuracy holds it off."""
    plateau = Plateau(enabled=True, window=5, potential_tol=0.01, accuracy_tol=0.005)
    curve = [200 + 300 * math.exp(-e / 10) for e in range(1, 80)]
    flat = [0.9] * len(curve)
    first = next(e for e in range(6, 80) if plateau.reached(curve[: e], flat[: e]))
    expected = next(e for e in range(6, 80) if curve[e - 6] - curve[e - 1] < 0.01 * curve[e - 6])
    assert first == expected == 46
    assert not plateau.reached(curve[:5], flat[:5]) and not plateau.reached(curve[:6], flat[:6])  # too short / still falling
    rising = [0.9 + 0.002 * e for e in range(len(curve))]  # +1 point over 5 epochs: not plateaued
    assert not any(plateau.reached(curve[: e], rising[: e]) for e in range(6, 80))
    assert plateau.reached([100.0] * 6, [0.9] * 5 + [0.904])  # flat potential, +0.4 point: plateaued
    assert plateau.first_measured(45) == 40 and plateau.first_measured(3) == 1


def test_the_hash_is_unchanged_when_off_and_changes_when_on():
    off = Experiment(compose_config(["store=unused"]))
    assert off.config_hash == DIGITS_HASH and "until_plateau" not in off.recipe_config["train"]
    on = Experiment(compose_config(["store=unused", "train.until_plateau.enabled=true"]))
    assert on.config_hash != DIGITS_HASH and on.recipe_config["train"]["until_plateau"]["enabled"] is True
    other = Experiment(compose_config(["store=unused", "train.until_plateau.enabled=true", "train.until_plateau.window=3"]))
    assert other.config_hash not in (DIGITS_HASH, on.config_hash)
    assert on.recipe.without_plateau() == off.recipe


def test_bad_settings_are_refused_and_the_schedule_keeps_its_last_rate():
    with pytest.raises(Exception, match="max_epochs"):
        Experiment(compose_config(["store=unused", "train.until_plateau.enabled=true",
                                   "train.until_plateau.max_epochs=10"])).recipe
    recipe = Experiment(compose_config(["store=unused", "train.schedule=cosine"])).recipe
    assert learning_rate(recipe, recipe.epochs + 7) == learning_rate(recipe, recipe.epochs - 1) > 0


@pytest.fixture(scope="module")
def exp():
    return Experiment(compose_config(["store=unused"]))


def _models(exp, seeds):
    out = []
    for seed in seeds:
        with seeded(seed):
            out.append(exp.model().double())
    return out


def test_both_trainers_stop_each_seed_at_the_same_epoch(exp):
    """Float64 on 320 training images, 2 recipe epochs then until plateau (window 1, max 3): the seeds
    stop at different epochs, some at max_epochs, and the stacked trainer (plateaued networks leaving
    the stack) gives each what train_network gives it."""
    data = exp.training_data
    as64 = lambda pair: tuple(t.double() if t.is_floating_point() else t for t in pair)
    train = InMemoryImageDataset(data.train.images[:320], data.train.labels[:320])
    train.images = train.images.double()
    short = TrainingData(train, as64((data.train.images[:320], data.train.labels[:320])), as64(data.check))
    recipe = exp.recipe.replaced(epochs=2, milestones=[], fail_rule=FailRule(epoch=1, min_accuracy=0.0),
                                 until_plateau=Plateau(enabled=True, max_epochs=3, window=1, potential_tol=0.05,
                                                       accuracy_tol=0.01))
    seeds = list(range(6))
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with exp.backends():
            want = [train_network(m, short.train, short.check, recipe, s, where=f"seed {s}", train_eval=short.train_tensors)
                    for s, m in zip(seeds, _models(exp, seeds))]
            ours = train_networks(_models(exp, seeds), short, recipe, seeds, [f"seed {s}" for s in seeds],
                                  train_eval=short.train_tensors)
    finally:
        torch.set_num_threads(saved)
    ran = [r.epochs_run for r in want]
    assert len(set(ran)) >= 2 and {r.plateaued for r in want} == {True, False}, ran
    assert all(r.plateaued or r.epochs_run == 3 for r in want)
    for mine, theirs in zip(ours, want):
        assert (mine.epochs_run, mine.plateaued, mine.failure) == (theirs.epochs_run, theirs.plateaued, theirs.failure)
        assert mine.check_accuracy == theirs.check_accuracy and mine.train_accuracy == pytest.approx(theirs.train_accuracy)
        assert [h.keys() for h in mine.history] == [h.keys() for h in theirs.history]
        assert all("potential" in h and "train_accuracy" in h for h in theirs.history)  # from epoch max(1, 2 - 1)
        for a, b in zip(mine.history, theirs.history):
            assert a == pytest.approx(b, rel=1e-9)
        for key, value in theirs.state_dict.items():
            torch.testing.assert_close(mine.state_dict[key], value, rtol=1e-9, atol=1e-11)


def test_a_method_training_follows_the_epochs_and_a_custom_loss_is_refused(exp):
    recipe = exp.recipe.replaced(until_plateau=Plateau(enabled=True))
    with seeded(0):
        model = exp.model()
    data = exp.training_data
    with pytest.raises(ValueError, match="until_plateau"):
        train_network(model, data.train, data.check, recipe, 0)  # no train_eval: nothing to measure U on
    with pytest.raises(ValueError, match="until_plateau"):
        train_network(model, data.train, data.check, recipe, 0, train_eval=data.train_tensors,
                      loss_fn=lambda m, x, y: m(x).logsumexp(1).mean())
    assert dataclasses.replace(recipe).without_plateau().until_plateau.enabled is False


@pytest.mark.slow  # trains a zoo twice: make test, not make test-fast
def test_the_zoo_records_epochs_and_plateaued_per_checkpoint(tmp_path):
    """The zoo stage with the option on, stacked and one at a time: the same checkpoints, each with
    how many epochs it took and whether it plateaued in its metadata (absent when the option is off)."""
    import json

    from benchmark.core.store import load_checkpoint
    from benchmark.experiment import SeedRange
    from benchmark.stages.zoo import run_zoo
    from tests.conftest import TINY_TRAIN, one_thread

    common = [*TINY_TRAIN, "train.fail_rule.min_accuracy=0", "seeds.reference=[0,2]", "zoo.range=reference", "zoo.crosscheck=0",
              "train.until_plateau.enabled=true", "train.until_plateau.max_epochs=3", "train.until_plateau.window=1",
              "train.until_plateau.potential_tol=0.05"]
    metas = {}
    for vectorize in ("1", "2"):
        exp = Experiment(compose_config([f"store={tmp_path / vectorize}", f"zoo.vectorize={vectorize}", *common]))
        with exp.backends(), one_thread():
            run_zoo(exp, SeedRange("reference", 0, 2))
        metas[vectorize] = {s: load_checkpoint(exp.store.checkpoint_path(s))[1] for s in exp.store.completed_seeds()}
    assert metas["1"].keys() == metas["2"].keys() and metas["1"]
    for seed, meta in metas["1"].items():
        other = metas["2"][seed]
        assert (meta["epochs"], meta["plateaued"]) == (other["epochs"], other["plateaued"])
        assert 2 <= json.loads(meta["epochs"]) <= 3 and json.loads(meta["plateaued"]) in (True, False)
        assert json.loads(meta["plateaued"]) or json.loads(meta["epochs"]) == 3
        assert json.loads(meta["config"])["train"]["until_plateau"]["enabled"] is True
