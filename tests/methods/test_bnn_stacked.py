"""The stacked vBNN (methods/bnn_stacked.py) against BLiTZ: one step's ELBO and gradients equal
BLiTZ's with the same random numbers, whatever the other networks of the stack; a training run
follows BLiTZ's one-at-a-time training; which vBNNs are stacked."""
from __future__ import annotations

import pytest
import torch

from benchmark.core.training import FailRule, RecipeOverrides, seeded
from benchmark.core.training.stacked import stacked_networks
from methods.bnn import BNNMethod, VarianceSettings, elbo_loss
from methods.bnn_stacked import VariationalObjective, draw_order
from tests.conftest import one_thread
from tests.methods.conftest import build

pytestmark = pytest.mark.slow  # trains vBNNs both ways: make test, not make test-fast

SEEDS = (11, 12, 13)


def _bnn(exp, rule: FailRule | None = None, **train) -> BNNMethod:
    return build(exp, "bnn", train=RecipeOverrides(fail_rule=rule or FailRule(), **train), kl_weight=0.01)


def _built(method: BNNMethod, seed: int):
    with seeded(seed):
        net = method.variational_network()
        return net, torch.get_rng_state()


def test_blitz_reads_the_last_draws_noise_in_the_backward_pass_of_every_draw():
    # What VariationalObjective reproduces (_StaleNoise): BLiTZ overwrites eps_w in place through
    # .data, so autograd's saved eps of earlier draws hold the last draw's values.
    from blitz.modules import BayesianLinear

    torch.manual_seed(0)
    layer = BayesianLinear(3, 2)
    x = torch.randn(5, 3)
    state = torch.get_rng_state()
    blitz = torch.autograd.grad(sum(layer(x).pow(2).sum() for _ in range(3)), [layer.weight_sampler.rho])[0]
    torch.set_rng_state(state)
    mu, rho = layer.weight_sampler.mu.detach(), layer.weight_sampler.rho.detach()
    grads, noise = [], []
    for _ in range(3):
        eps, eps_bias = torch.randn(2, 3), torch.randn(2)
        w = (mu + torch.log1p(torch.exp(rho)) * eps).requires_grad_()
        bias = layer.bias_sampler.mu.detach() + torch.log1p(torch.exp(layer.bias_sampler.rho.detach())) * eps_bias
        grads.append(torch.autograd.grad((x @ w.T + bias).pow(2).sum(), [w])[0])
        noise.append(eps)
    stale = sum(grads) * noise[-1] * torch.sigmoid(rho)
    fresh = sum(g * e for g, e in zip(grads, noise)) * torch.sigmoid(rho)
    torch.testing.assert_close(blitz, stale)
    assert float((blitz - fresh).abs().max()) > 0.1 * float(blitz.abs().max())


def test_the_draw_order_is_blitzs_forward_order(tiny_exp):
    net, _ = _built(_bnn(tiny_exp), 0)
    assert draw_order(net, tiny_exp.model(), tiny_exp.training_data.input_shape) == ["conv1.weight", "conv2.weight", "fc1.weight", "fc1.bias",
                                                                   "fc2.weight", "fc2.bias"]


def test_one_step_gives_blitzs_elbo_and_gradients_for_every_network_of_the_stack(tiny_exp):
    method = _bnn(tiny_exp)
    images, labels = tiny_exp.training_data.train_tensors
    index = torch.stack([torch.arange(8) + 8 * i for i in range(len(SEEDS))])  # each network its own batch
    built = [_built(method, s) for s in SEEDS]
    expected = []
    for (net, state), idx in zip(built, index):
        blitz = {k: v.clone() for k, v in net.model.state_dict().items()}
        torch.set_rng_state(state)  # BLiTZ draws from the global RNG, from where the fit would start
        loss = elbo_loss(3, 0.01)(net.model, images[idx], labels[idx])
        grads = torch.autograd.grad(loss, [s.mu for s in net.samplers.values()] + [s.rho for s in net.samplers.values()])
        expected.append((float(loss.detach()), grads))
        net.model.load_state_dict(blitz)
    nets = [net for net, _ in built]
    template = tiny_exp.model()
    stacked = stacked_networks(template, torch.device("cpu"))
    objective = VariationalObjective(template, stacked, nets, [state for _, state in built], 3, 0.01, tiny_exp.training_data.input_shape)
    params = {k: v.requires_grad_() for k, v in objective.initial().items()}
    source = stacked.source(images, torch.device("cpu"))
    losses = objective.losses(params, lambda copies: stacked.batch(source, index.repeat(copies, 1), None, 0, 0.0),
                              labels[index], list(range(len(SEEDS))))
    keys = list(nets[0].samplers)
    grads = torch.autograd.grad(losses.sum(), [params[f"{k}.mu"] for k in keys] + [params[f"{k}.rho"] for k in keys])
    for lane, (loss, blitz_grads) in enumerate(expected):
        assert float(losses[lane].detach()) == pytest.approx(loss, rel=1e-6)
        for key, ours, theirs in zip(keys + keys, grads, blitz_grads):
            torch.testing.assert_close(ours.select(objective.network_axis(f"{key}.mu"), lane), theirs, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("rule", [FailRule(), FailRule(epoch=1, min_accuracy=0.01)], ids=["no rule", "rule at epoch 1"])
def test_a_stacked_fit_follows_blitzs_one_at_a_time_training(tiny_exp, tiny_bases, rule):
    # with the convergence rule, the validation pass after epoch 1 draws weights too (BLiTZ samples in
    # eval mode), so the draws of epoch 2 come later in each network's stream
    seeds = [seed for seed, _ in tiny_bases[:3]]
    stacked = _bnn(tiny_exp, rule, epochs=2, milestones=[1])
    assert stacked.stacking_problem() is None
    with one_thread():
        stacked.prefit(seeds, lambda seed: {})
        together = {}
        for seed in seeds:
            stacked.fit({}, seed)
            together[seed] = stacked.network
        other = _bnn(tiny_exp, rule, epochs=2, milestones=[1])
        other.prefit([seeds[1], tiny_bases[3][0]], lambda seed: {})  # the same network in another stack
        other.fit({}, seeds[1])
        blitz = _bnn(tiny_exp, rule, epochs=2, milestones=[1])
        blitz.prefit([seeds[1]], lambda seed: {})  # one alone is not stacked: BLiTZ's layers
        blitz.fit({}, seeds[1])
    alone = other
    for key, sampler in together[seeds[1]].samplers.items():
        torch.testing.assert_close(alone.network.samplers[key].mu, sampler.mu, rtol=0, atol=0)  # K does not matter
        torch.testing.assert_close(blitz.network.samplers[key].mu, sampler.mu, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(blitz.network.samplers[key].rho, sampler.rho, rtol=1e-5, atol=1e-6)
    draws = [m.sample(4, torch.Generator().manual_seed(3)) for m in (alone, blitz)]
    for key in draws[0]:
        torch.testing.assert_close(draws[0][key], draws[1][key], rtol=1e-3, atol=1e-4)


def test_only_the_plain_vbnn_with_the_recipes_sgd_is_stacked(tiny_exp):
    assert _bnn(tiny_exp).stacking_problem() is None
    assert "own optimizer" in build(tiny_exp, "bnn", variance=VarianceSettings(optimizer="adam", lr=0.01)).stacking_problem()
    assert "point-estimate" in build(tiny_exp, "bnn", layers="last_layer").stacking_problem()
    assert "builds its own network" in build(tiny_exp, "bnn_ordered").stacking_problem()
    assert "builds its own network" in build(tiny_exp, "bnn_skip").stacking_problem()
