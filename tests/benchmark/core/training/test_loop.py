import math

import pytest
import torch

from benchmark.config import ConfigError
from benchmark.core.data import stratified_split
from benchmark.experiment import Experiment, threads_per_job
from benchmark.stages.zoo import train_seed
from benchmark.core.training import FailRule, NonFiniteError, Recipe, RecipeOverrides, learning_rate
from tests.conftest import compose_config

pytestmark = pytest.mark.slow  # trains networks through the loop: make test, not make test-fast


def test_recipe_from_config_and_schedules():
    r = Experiment(compose_config([])).recipe
    assert (r.epochs, r.batch_size, r.lr, r.momentum, r.milestones, r.gamma) == (45, 32, 0.05, 0.9, [30, 38], 0.5)
    assert r.fail_rule == FailRule(epoch=3, min_accuracy=0.15, final_min_accuracy=0.5)
    assert [learning_rate(r, e) for e in (0, 29, 30, 37, 38, 44)] == [0.05, 0.05, 0.025, 0.025, 0.0125, 0.0125]
    cos = Recipe(epochs=4, batch_size=1, lr=1.0, schedule="cosine")
    assert [round(learning_rate(cos, e), 6) for e in range(4)] == [1.0, round(0.5 * (1 + math.cos(math.pi / 4)), 6), 0.5, round(0.5 * (1 + math.cos(3 * math.pi / 4)), 6)]
    with pytest.raises(ValueError, match="'step' is not a valid Schedule"):
        Recipe(epochs=1, batch_size=1, lr=1.0, schedule="step")
    with pytest.raises(ValueError, match="epochs=0: expected a positive integer"):
        Recipe(epochs=0, batch_size=1, lr=1.0)


def test_recipe_overrides_change_only_what_they_set():
    r = Recipe(epochs=4, batch_size=8, lr=0.1, weight_decay=1e-4, milestones=[2])
    changed = RecipeOverrides(epochs=2, milestones=[1]).apply(r, weight_decay=0.0)
    assert (changed.epochs, changed.milestones, changed.weight_decay, changed.lr, changed.batch_size) == (2, [1], 0.0, 0.1, 8)
    assert r.epochs == 4
    with pytest.raises(ValueError, match="lr=-1.0: expected a positive number"):
        RecipeOverrides(lr=-1.0).apply(r)


@pytest.mark.parametrize("override, message", [
    ("train.epochs=0", "train.epochs=0: expected a positive integer"),
    ("train.momentum=1.5", "train.momentum=1.5: expected a number in [0, 1)"),
    ("train.schedule=step", "train.schedule: Invalid value 'step', expected one of [multistep, cosine, constant]"),
    ("train.fail_rule.final_min_accuracy=1.5", "train.fail_rule.final_min_accuracy=1.5: expected a fraction in [0, 1] or null"),
    ("train.fail_rule.final_min_accuracy=-0.1", "train.fail_rule.final_min_accuracy=-0.1: expected a fraction in [0, 1] or null"),
    ("train.fail_rule.min_accuracy=-1", "train.fail_rule.min_accuracy=-1.0: expected a number >= 0 (a fraction) or null"),
    ("train.fail_rule.epoch=0", "train.fail_rule.epoch=0: expected a positive integer or null"),
])
def test_bad_recipes_are_refused_with_the_key(override, message):
    from benchmark.cli import check_command_line

    assert check_command_line([override]) == message


def test_same_seed_gives_bit_identical_weights(tiny_cfg):
    exp = Experiment(tiny_cfg)
    a, b = train_seed(exp, 7), train_seed(exp, 7)
    c = train_seed(exp, 8)
    assert a.state_dict.keys() == b.state_dict.keys()
    assert all(torch.equal(a.state_dict[k], b.state_dict[k]) for k in a.state_dict)
    assert not all(torch.equal(a.state_dict[k], c.state_dict[k]) for k in a.state_dict)
    assert a.check_accuracy == b.check_accuracy


def test_divergence_raises_and_non_convergence_is_reported(tiny_cfg):
    tiny_cfg.train.lr = 1e9
    with pytest.raises(NonFiniteError, match="seed 0, epoch 1"):
        train_seed(Experiment(tiny_cfg), 0)
    tiny_cfg.train.lr = 0.05
    tiny_cfg.train.fail_rule.min_accuracy = 1.01
    result = train_seed(Experiment(tiny_cfg), 0)
    assert result.failure and "< 1.01 after epoch 1" in result.failure and result.epochs_run == 1
    tiny_cfg.train.fail_rule.epoch = 5  # never checked early (2 epochs): the final check catches it
    result = train_seed(Experiment(tiny_cfg), 0)
    assert result.failure and "at the end of training (collapsed)" in result.failure and result.epochs_run == 2


def test_threads_per_job(monkeypatch):
    monkeypatch.setattr("benchmark.experiment.available_cores", lambda: 8)
    assert threads_per_job("auto", 2, sweep_job=True) == 4 and threads_per_job("auto", 16, sweep_job=True) == 1
    assert threads_per_job("auto", 2, sweep_job=False) == 8 and threads_per_job("3", 2, sweep_job=True) == 3
    for bad in ("0", "many"):
        with pytest.raises(ConfigError, match=f"threads='{bad}'"):
            threads_per_job(bad, 1, sweep_job=False)


def test_the_convergence_rule_is_judged_on_a_validation_part_of_the_train_split(tiny_cfg):
    exp = Experiment(tiny_cfg)
    train, validation = exp.train_tensors, exp.validation_tensors
    assert (len(train[1]), len(validation[1])) == (1295, 142)  # digits: 10% of each class of the 1437 held out
    assert torch.bincount(validation[1]).tolist() == [round(0.1 * n) for n in torch.bincount(torch.cat([train[1], validation[1]])).tolist()]
    kept, held = stratified_split(torch.cat([train[1], validation[1]]).sort().values, 0.1)
    assert len(set(kept.tolist()) & set(held.tolist())) == 0 and len(kept) + len(held) == 1437
    full = exp.test_tensors[0]  # none of the validation images is a test image
    assert not any(torch.equal(v, t) for v in validation[0][:20] for t in full)
    assert exp.training_data.check is exp.validation_tensors and len(exp.train_set) == 1295


def test_a_rule_without_held_out_data_is_refused():
    with pytest.raises(ConfigError, match="train.fail_rule=.*needs held-out data.*dataset.validation_fraction > 0"):
        Experiment(compose_config(["dataset.validation_fraction=0"]))
    assert Experiment(compose_config(["dataset.validation_fraction=0", "train.fail_rule.epoch=null"])).validation_tensors is None


def test_on_step_runs_after_every_optimiser_step_with_the_updated_model():
    from benchmark.core.data import InMemoryImageDataset
    from benchmark.core.models import mlp
    from benchmark.core.training import seeded, train_network

    images, labels = torch.randn(10, 1, 2, 2), torch.arange(10) % 3  # the MLP flattens 1x2x2 to 4 inputs
    with seeded(0):
        model = mlp(4, [5], 3)
    calls = []
    recipe = Recipe(epochs=2, batch_size=4, lr=0.1)
    train_network(model, InMemoryImageDataset(images, labels), None, recipe, seed=0,
                  on_step=lambda epoch, step, net: calls.append((epoch, step, net.fc2.bias.detach().clone())))
    assert [c[:2] for c in calls] == [(e, s) for e in range(2) for s in range(3)]  # ceil(10 / 4) = 3 steps per epoch
    assert torch.equal(calls[-1][2], model.fc2.bias.detach()), "the callback sees the model after the step"
    assert not torch.equal(calls[0][2], calls[1][2])
