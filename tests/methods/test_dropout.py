"""MC Dropout: mask/weight equivalence, the 1/(1-p) scaling, consistency, ResNet-18 path, bad input; a round's
networks trained stacked (prefit) against one at a time: same masks, weights to rounding, independent of the
other networks, failures."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from benchmark.config import ConfigError
from benchmark.core.data import InMemoryImageDataset
from benchmark.core.models import predict_with_weights
from benchmark.core.training import NonFiniteError, Recipe, TrainingData, seeded, train_network
from benchmark.core.training.stacked import stacked_networks
from benchmark.core.training.vectorised import train_networks
from benchmark.experiment import Experiment
from methods import dropout
from methods.base import MethodFitError
from methods.dropout import (
    DropoutMethod, DropoutObjective, DropoutSettings, draw_masks, masked_weights, training_noise, use_mask_generator,
)
from methods.modes import ModePlan, run_mode
from tests.methods.conftest import build, compose_config

pytestmark = pytest.mark.slow  # trains networks (bases, vBNNs, chains): make test, not make test-fast


def test_masked_weights_equal_dropping_the_inputs() -> None:
    generator = torch.Generator().manual_seed(0)
    layer = nn.Linear(6, 4)
    x = torch.randn(5, 6, generator=generator)
    masks = draw_masks(3, 6, 0.5, generator)
    weights = masked_weights(layer.weight.detach(), masks, 0.5)
    for mask, weight in zip(masks, weights):
        by_inputs = layer(x * mask / 0.5)  # inverted dropout of the inputs
        by_weights = x @ weight.T + layer.bias
        torch.testing.assert_close(by_weights, by_inputs, rtol=0, atol=1e-6)
        dropped = mask == 0
        assert torch.all(weight[:, dropped] == 0)
        torch.testing.assert_close(weight[:, ~dropped], layer.weight.detach()[:, ~dropped] * 2.0)


def test_masks_keep_each_unit_with_probability_one_minus_p() -> None:
    masks = draw_masks(20000, 3, 0.2, torch.Generator().manual_seed(1))
    assert set(masks.unique().tolist()) <= {0.0, 1.0}
    # binomial standard error sqrt(0.16 / 20000) = 0.0028: 5 sigma
    torch.testing.assert_close(masks.mean(0), torch.full((3,), 0.8), rtol=0, atol=0.014)


def _fitted(exp: Experiment, seed: int) -> DropoutMethod:
    method = build(exp, "dropout")
    method.check("one")
    method.fit({}, seed)
    return method


def _assert_consistent(method: DropoutMethod, exp: Experiment, images: torch.Tensor, n: int) -> dict:
    samples = method.sample(n, torch.Generator().manual_seed(7))
    own = method.predict_own(images, n, torch.Generator().manual_seed(7))
    by_weights = predict_with_weights(exp.model(), samples, images)
    assert own.shape == by_weights.shape == (n, len(images), exp.info.num_classes)
    torch.testing.assert_close(by_weights, own, rtol=0, atol=1e-5)
    return samples


def test_optunet_samples_are_the_dropout_network_with_masked_last_layer(tiny_exp, tiny_bases) -> None:
    seed = tiny_bases[0][0]
    method = _fitted(tiny_exp, seed)
    assert method.p == tiny_exp.config.methods.dropout.p == 0.2
    samples = _assert_consistent(method, tiny_exp, tiny_exp.test_tensors[0][:64], 6)
    trained = method._weights
    for key, value in samples.items():
        if key != "fc2.weight":
            assert torch.equal(value, trained[key][None].expand_as(value)), key
    kept = samples["fc2.weight"] != 0  # [S, C, 3]; whole columns are dropped or kept
    assert torch.equal(kept, kept[:, :1, :].expand_as(kept))
    ratio = samples["fc2.weight"][kept] / trained["fc2.weight"][None].expand_as(kept)[kept]
    torch.testing.assert_close(ratio, torch.full_like(ratio, 1 / 0.8))
    # the dropout network is retrained from the base's seed, not copied from the base checkpoint
    assert not torch.equal(trained["conv1.weight"], dict(tiny_bases)[seed]["conv1.weight"])


def test_resnet18_last_layer_dropout(tiny_resnet) -> None:
    exp = tiny_resnet()
    assert "BatchNorm" in build(exp, "dropout").stacking_problem()  # trained one at a time
    method = _fitted(exp, 3)
    assert method.p == 0.5
    samples = _assert_consistent(method, exp, exp.test_tensors[0], 2)
    assert samples["fc.weight"].shape == (2, 10, 64)
    assert torch.equal(samples["layer4.1.bn2.running_var"][0], method._weights["layer4.1.bn2.running_var"])


@pytest.mark.parametrize("p", [0.0, 1.0, 1.5])
def test_bad_rate_is_refused_by_the_schema(compose_tiny, tmp_path, p) -> None:
    with pytest.raises(ConfigError, match=rf"methods.dropout.p={p}: expected a dropout rate in \(0, 1\)"):
        Experiment(compose_tiny(tmp_path, f"methods.dropout.p={p}"))
    with pytest.raises(ValueError, match=rf"p={p}: expected a dropout rate"):
        DropoutSettings(p=p)


def test_retraining_depends_only_on_the_seed(tiny_exp) -> None:
    torch.manual_seed(123)  # the global RNG state must not matter (dropout masks during training)
    first = _fitted(tiny_exp, 100001)._weights
    torch.rand(5)
    second = _fitted(tiny_exp, 100001)._weights
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_non_converged_retraining_is_a_fit_error(compose_tiny, tmp_path) -> None:
    exp = Experiment(compose_tiny(tmp_path, "train.fail_rule.epoch=1", "train.fail_rule.min_accuracy=1.01"))
    with pytest.raises(MethodFitError, match="seed 5 failed: held-out accuracy"):
        _fitted(exp, 5)
    with pytest.raises(RuntimeError, match="call fit"):
        build(exp, "dropout").sample(1, torch.Generator())


def test_nan_during_training_stops_the_fit(compose_tiny, tmp_path) -> None:
    exp = Experiment(compose_tiny(tmp_path, "train.lr=1e30", "train.epochs=1"))
    with pytest.raises(NonFiniteError, match="dropout seed 5"):
        _fitted(exp, 5)


# --- the networks of one round trained stacked (prefit) against one at a time (fit alone) ---------------------------

SEEDS = (11, 12, 13)


@pytest.fixture(scope="module")
def digits(tmp_path_factory) -> Experiment:
    """digits/OptuNet with 2 epochs, the convergence rule's check after epoch 1 (no zoo trained)."""
    return Experiment(compose_config(tmp_path_factory.mktemp("dropout_store") / "store", "train.milestones=[1]",
                                     "train.fail_rule.epoch=1"))


def _method(exp: Experiment, data: TrainingData | None = None, recipe: Recipe | None = None) -> DropoutMethod:
    return DropoutMethod(exp.model, data or exp.training_data, exp.method_settings("dropout"),
                         recipe=recipe or exp.recipe, device="cpu")


def _rule(exp: Experiment, min_accuracy: float | None) -> Recipe:
    """The recipe with the rule's check after epoch 1 at ``min_accuracy`` (None: no threshold) and no end check."""
    return exp.recipe.replaced(fail_rule=dataclasses.replace(exp.recipe.fail_rule, epoch=1, min_accuracy=min_accuracy,
                                                             final_min_accuracy=0.0))


def _fits(method: DropoutMethod, seeds, stacked: bool) -> dict[int, dict[str, torch.Tensor]]:
    if stacked:
        method.prefit(seeds, lambda seed: {})
        assert set(method._prefitted) >= set(seeds)
    out = {}
    for seed in seeds:
        method.fit({}, seed)
        out[seed] = method._weights
    return out


def test_a_stacked_round_gets_the_same_masks_and_weights_as_one_at_a_time(digits, monkeypatch) -> None:
    """float32, the packed kernels, 10 steps (320 images, one epoch): the masks are the same tensors
    and the weights agree to float rounding."""
    data = digits.training_data
    short = TrainingData(InMemoryImageDataset(data.train.images[:320], data.train.labels[:320]), data.train_tensors,
                         data.check)
    recipe = digits.recipe.replaced(epochs=1, fail_rule=dataclasses.replace(digits.recipe.fail_rule, epoch=None))
    drawn: dict[str, dict[int, list[torch.Tensor]]] = {}
    seeds_of: dict[int, int] = {}

    def generator_of(seed: int) -> torch.Generator:
        generator = dropout.mask_generator.__wrapped__(seed)
        seeds_of[id(generator)] = seed
        return generator

    def noise(batch, width, p, generator, dtype):
        out = dropout.training_noise.__wrapped__(batch, width, p, generator, dtype)
        drawn[path].setdefault(seeds_of[id(generator)], []).append(out)
        return out

    generator_of.__wrapped__, noise.__wrapped__ = dropout.mask_generator, dropout.training_noise
    monkeypatch.setattr(dropout, "mask_generator", generator_of)
    monkeypatch.setattr(dropout, "training_noise", noise)
    weights = {}
    for path, stacked in (("alone", False), ("stacked", True)):
        drawn[path] = {}
        method = _method(digits, short, recipe)
        assert method.stacking_problem() is None
        weights[path] = _fits(method, SEEDS, stacked)
    for seed in SEEDS:
        assert len(drawn["stacked"][seed]) == len(drawn["alone"][seed]) == 10
        assert all(torch.equal(a, b) for a, b in zip(drawn["stacked"][seed], drawn["alone"][seed]))
        for key, want in weights["alone"][seed].items():
            torch.testing.assert_close(weights["stacked"][seed][key], want, rtol=1e-5, atol=1e-6, msg=key)
    assert not torch.equal(drawn["alone"][SEEDS[0]][0], drawn["alone"][SEEDS[1]][0])  # each network its own masks


@pytest.mark.parametrize("implementation", ["packed", "vmap"])
def test_the_whole_recipe_in_float64_follows_one_at_a_time(digits, implementation) -> None:
    """2 epochs of every training image with the convergence rule after epoch 1, in float64 (rounding
    differences near 1e-12), through the packed kernels and through vmap: same verdicts, same weights."""
    data = digits.training_data
    train = InMemoryImageDataset(data.train.images, data.train.labels)
    train.images = train.images.double()
    data64 = TrainingData(train, tuple(t.double() if t.is_floating_point() else t for t in data.train_tensors),
                          tuple(t.double() if t.is_floating_point() else t for t in data.check))
    method = _method(digits, data64)
    seeds = list(range(6))
    alone = []
    for seed in seeds:
        model, generator = method.built(seed)
        use_mask_generator(model.double(), generator)
        alone.append(train_network(model, train, data64.check, method.recipe, seed, where=f"dropout seed {seed}"))
    assert {r.failure is None for r in alone} == {True, False}, "the seeds should include converged and failed ones"
    models, generators = zip(*(method.built(seed) for seed in seeds))
    with seeded(0):
        template = method.new_model().double()
    objective = DropoutObjective(stacked_networks(template, torch.device("cpu"), implementation),
                                 [m.double() for m in models], generators, method.p, 3)
    together = train_networks([template] * len(seeds), data64, method.recipe, seeds, [f"dropout seed {s}" for s in seeds],
                              implementation=implementation, objective=objective)
    for ours, theirs in zip(together, alone):
        assert (ours.failure, ours.epochs_run, ours.check_accuracy) == (theirs.failure, theirs.epochs_run, theirs.check_accuracy)
        for mine, want in zip(ours.history, theirs.history):
            assert mine == pytest.approx(want, rel=1e-9)
        for key, want in theirs.state_dict.items():
            torch.testing.assert_close(ours.state_dict[key], want, rtol=1e-9, atol=1e-11, msg=key)


def _stacked_alone(method: DropoutMethod, seed: int) -> dict[str, torch.Tensor]:
    """The network of ``seed`` trained as a stack of one (``prefit`` trains one alone one at a time: MIN_STACK)."""
    model, generator = method.built(seed)
    with seeded(0):
        template = method.new_model()
    objective = DropoutObjective(stacked_networks(template, torch.device("cpu")), [model], [generator], method.p, 3)
    (outcome,) = train_networks([template], method.data, method.recipe, [seed], [f"dropout seed {seed}"], objective=objective)
    return outcome.state_dict


def test_a_networks_stacked_result_does_not_depend_on_the_others(digits) -> None:
    a, b, c = SEEDS
    recipe = _rule(digits, None)  # 2 epochs whatever the accuracy
    first = _fits(_method(digits, recipe=recipe), [a, b, c], stacked=True)
    for seeds in ([c, a], [a, 99]):
        again = _fits(_method(digits, recipe=recipe), seeds, stacked=True)
        for seed in set(seeds) & set(first):
            assert all(torch.equal(again[seed][k], first[seed][k]) for k in first[seed]), (seeds, seed)
    alone = _stacked_alone(_method(digits, recipe=recipe), a)
    assert all(torch.equal(alone[k], first[a][k]) for k in first[a])
    assert dropout.MIN_STACK == 2  # prefit of a lone seed: one at a time, which is faster (bench_methods_stacked)
    lone = _method(digits, recipe=recipe)
    lone.prefit([a], lambda seed: {})
    assert not lone._prefitted


def test_a_network_failing_the_rule_leaves_the_others_unchanged_and_its_fit_raises(digits) -> None:
    seeds = [0, 1, 2, 3]
    free = _method(digits, recipe=_rule(digits, None))  # the rule's check after epoch 1 without a threshold
    free.prefit(seeds, lambda seed: {})
    accuracies = {seed: free._prefitted[seed].history[0]["check_accuracy"] for seed in seeds}
    low, next_ = sorted(set(accuracies.values()))[:2]
    failing = [s for s in seeds if accuracies[s] == low]
    kept = [s for s in seeds if s not in failing]
    assert len(kept) >= 2
    want = _fits(free, seeds, stacked=False)  # taken from the prefit
    ruled = _method(digits, recipe=_rule(digits, (low + next_) / 2))
    ruled.prefit(seeds, lambda seed: {})
    for seed in seeds:
        if seed in failing:
            with pytest.raises(MethodFitError, match=rf"seed {seed} failed: held-out accuracy .* after epoch 1"):
                ruled.fit({}, seed)
        else:
            ruled.fit({}, seed)
            assert all(torch.equal(ruled._weights[k], want[seed][k]) for k in want[seed])
    # run_mode skips the failed candidate and fits the next one (in a round of its own)
    samples, used, _ = run_mode(_method(digits, recipe=_rule(digits, (low + next_) / 2)),
                                ModePlan("multi", (failing[0], *kept), 2, 3), lambda seed: {}, progress=False)
    assert used == tuple(kept[:2])
    assert samples["fc2.weight"].shape == (6, 10, 3)


def test_nan_in_a_stacked_round_stops_that_fit(compose_tiny, tmp_path) -> None:
    exp = Experiment(compose_tiny(tmp_path, "train.lr=1e30", "train.epochs=1"))
    method = build(exp, "dropout")
    method.prefit([5, 6], lambda seed: {})
    with pytest.raises(NonFiniteError, match="dropout seed 5"):
        method.fit({}, 5)


def test_one_masked_step_is_the_same_through_the_packed_kernels_autograd_and_vmap(digits) -> None:
    """loss_and_grads with a last-input multiplier (what a stacked dropout round runs on a CPU) against
    autograd over forward with it (packed, and vmap) and each network alone with its mask."""
    method = _method(digits)
    images, labels = digits.training_data.train_tensors
    index = torch.stack([torch.arange(20) + 20 * i for i in range(3)])  # each network its own 20 images (2 parts)
    models = [method.built(seed)[0] for seed in SEEDS]
    scale = torch.stack([training_noise(20, 3, method.p, torch.Generator().manual_seed(i), torch.float32) for i in range(3)])
    results = {}
    for implementation in ("packed", "vmap"):
        stacked = stacked_networks(method.new_model(), torch.device("cpu"), implementation)
        params = {k: v.requires_grad_() for k, v in stacked.pack([m.state_dict() for m in models]).items()}
        batch = stacked.batch(stacked.source(images, torch.device("cpu")), index, None, 0, 0.0)
        logits = stacked.forward(params, batch, scale)
        losses = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels[index].flatten(), reduction="none").view(3, 20).mean(1)
        grads = torch.autograd.grad(losses.sum(), list(params.values()))
        results[implementation] = (losses.detach(), {k: g for k, g in zip(params, grads)}, stacked)
        if implementation == "packed":
            fused_losses, fused = stacked.loss_and_grads({k: v.detach() for k, v in params.items()}, batch, labels[index], scale)
            torch.testing.assert_close(fused_losses, losses.detach(), rtol=1e-6, atol=1e-7)
            for key, grad in results["packed"][1].items():
                torch.testing.assert_close(fused[key], grad, rtol=1e-5, atol=1e-7, msg=key)
    for lane, (model, seed) in enumerate(zip(models, SEEDS)):
        model.train()
        generator = torch.Generator().manual_seed(lane)
        use_mask_generator(model, generator)  # draws what training_noise drew for `scale` above
        loss = torch.nn.functional.cross_entropy(model(images[index[lane]]), labels[index[lane]])
        alone = dict(zip([k for k, _ in model.named_parameters()], torch.autograd.grad(loss, list(model.parameters()))))
        for implementation, (losses, grads, stacked) in results.items():
            assert float(losses[lane]) == pytest.approx(float(loss.detach()), rel=1e-6)
            for key, grad in alone.items():
                torch.testing.assert_close(grads[key].select(stacked.network_axis(key) % grads[key].dim(), lane), grad,
                                           rtol=1e-5, atol=1e-7, msg=f"{implementation} {key}")
