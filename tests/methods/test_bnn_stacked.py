"""The stacked vBNN (methods/bnn_stacked.py) against BLiTZ: one step's ELBO and gradients equal
BLiTZ's with the same random numbers, whatever the other networks of the stack; a training run
follows BLiTZ's one-at-a-time training; which vBNNs are stacked. The same for the symmetry-breaking
variants (ordered biases: a bias transform with its log-Jacobian; fixed skips: vmap with constant
buffers), and a stacked fit's failures surface in ``fit`` as they do one at a time."""
from __future__ import annotations

import pytest
import torch

from benchmark.core.data import InMemoryImageDataset
from benchmark.core.training import FailRule, NonFiniteError, RecipeOverrides, TrainingData, seeded
from methods.base import MethodFitError
from methods.bnn import BNNMethod, VarianceSettings, elbo_loss
from methods.bnn_stacked import VariationalObjective, draw_order
from tests.conftest import one_thread
from tests.methods.conftest import build

pytestmark = pytest.mark.slow  # trains vBNNs both ways: make test, not make test-fast

SEEDS = (11, 12, 13)
VBNNS = ("bnn", "bnn_ordered", "bnn_skip")


def _bnn(exp, rule: FailRule | None = None, name: str = "bnn", **train) -> BNNMethod:
    return build(exp, name, train=RecipeOverrides(fail_rule=rule or FailRule(), **train), kl_weight=0.01)


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("name", VBNNS)
def test_one_step_gives_blitzs_elbo_and_gradients_for_every_network_of_the_stack(tiny_exp, name, dtype):
    method = _bnn(tiny_exp, name=name)
    images, labels = tiny_exp.training_data.train_tensors
    images = images.to(dtype)
    index = torch.stack([torch.arange(8) + 8 * i for i in range(len(SEEDS))])  # each network its own batch
    built = [_built(method, s) for s in SEEDS]
    for net, _ in built:
        net.model.to(dtype)  # BLiTZ's eps buffers too: they draw in that dtype
    expected = []
    for (net, state), idx in zip(built, index):
        blitz = {k: v.clone() for k, v in net.model.state_dict().items()}
        torch.set_rng_state(state)  # BLiTZ draws from the global RNG, from where the fit would start
        loss = elbo_loss(3, 0.01)(net.model, images[idx], labels[idx])
        grads = torch.autograd.grad(loss, [s.mu for s in net.samplers.values()] + [s.rho for s in net.samplers.values()])
        expected.append((float(loss.detach()), grads))
        net.model.load_state_dict(blitz)
    nets = [net for net, _ in built]
    template = method.stacked_template()
    stacked = method.stacked_form(template)
    objective = VariationalObjective(template, stacked, nets, [state for _, state in built], 3, 0.01,
                                     tiny_exp.training_data.input_shape, transforms=method.stacked_transforms())
    params = {k: v.requires_grad_() for k, v in objective.initial().items()}
    source = stacked.source(images, torch.device("cpu"))
    losses = objective.losses(params, lambda copies: stacked.batch(source, index.repeat(copies, 1), None, 0, 0.0),
                              labels[index], list(range(len(SEEDS))))
    keys = list(nets[0].samplers)
    grads = torch.autograd.grad(losses.sum(), [params[f"{k}.mu"] for k in keys] + [params[f"{k}.rho"] for k in keys])
    rel, rtol, atol = (1e-6, 1e-4, 1e-6) if dtype == torch.float32 else (1e-12, 1e-9, 1e-12)
    for lane, (loss, blitz_grads) in enumerate(expected):
        assert float(losses[lane].detach()) == pytest.approx(loss, rel=rel)
        for key, ours, theirs in zip(keys + keys, grads, blitz_grads):
            assert ours.dtype == dtype
            torch.testing.assert_close(ours.select(objective.network_axis(f"{key}.mu"), lane), theirs, rtol=rtol, atol=atol)


def test_the_ordered_variant_trains_its_biases_through_the_transform(tiny_exp):
    from methods.bnn_ordered import ordered_transform

    method = _bnn(tiny_exp, name="bnn_ordered")
    assert method.stacked_transforms() == {"fc1.bias": ordered_transform}
    net, state = _built(method, SEEDS[0])
    template = method.stacked_template()
    objective = VariationalObjective(template, method.stacked_form(template), [net], [state], 1, 0.01,
                                     tiny_exp.training_data.input_shape, transforms=method.stacked_transforms())
    params = objective.initial()
    weights, _ = objective._weights_and_kl(params, objective._eps(params, [0]))
    assert (weights["fc1.bias"].diff(dim=-1) > 0).all()  # the network runs on the ordered bias
    with pytest.raises(ValueError, match="not variational"):
        VariationalObjective(template, method.stacked_form(template), [net], [state], 1, 0.01,
                             tiny_exp.training_data.input_shape, transforms={"fc9.bias": ordered_transform})


@pytest.mark.parametrize("name", VBNNS)
@pytest.mark.parametrize("rule", [FailRule(), FailRule(epoch=1, min_accuracy=0.01)], ids=["no rule", "rule at epoch 1"])
def test_a_stacked_fit_follows_blitzs_one_at_a_time_training(tiny_exp, tiny_bases, rule, name):
    # with the convergence rule, the validation pass after epoch 1 draws weights too (BLiTZ samples in
    # eval mode), so the draws of epoch 2 come later in each network's stream
    seeds = [seed for seed, _ in tiny_bases[:3]]
    stacked = _bnn(tiny_exp, rule, name, epochs=2, milestones=[1])
    assert stacked.stacking_problem() is None
    with one_thread():
        stacked.prefit(seeds, lambda seed: {})
        together = {}
        for seed in seeds:
            stacked.fit({}, seed)
            together[seed] = stacked.network
        other = _bnn(tiny_exp, rule, name, epochs=2, milestones=[1])
        other.prefit([seeds[2], seeds[0]], lambda seed: {})  # the same networks in another stack, another order
        others = {}
        for seed in (seeds[2], seeds[0]):
            other.fit({}, seed)
            others[seed] = other.network
        blitz = _bnn(tiny_exp, rule, name, epochs=2, milestones=[1])
        blitz.prefit([seeds[0]], lambda seed: {})  # one alone is not stacked: BLiTZ's layers
        blitz.fit({}, seeds[0])
    for seed in (seeds[0], seeds[2]):  # K and the stack's other members do not matter, to the bit
        for key, sampler in together[seed].samplers.items():
            assert torch.equal(others[seed].samplers[key].mu, sampler.mu), (seed, key)
            assert torch.equal(others[seed].samplers[key].rho, sampler.rho), (seed, key)
    for key, sampler in together[seeds[0]].samplers.items():
        torch.testing.assert_close(blitz.network.samplers[key].mu, sampler.mu, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(blitz.network.samplers[key].rho, sampler.rho, rtol=1e-5, atol=1e-6)
    alone = _bnn(tiny_exp, rule, name, epochs=2, milestones=[1])
    alone._net = together[seeds[0]]
    draws = [m.sample(4, torch.Generator().manual_seed(3)) for m in (alone, blitz)]
    for key in draws[0]:
        torch.testing.assert_close(draws[0][key], draws[1][key], rtol=1e-3, atol=1e-4)


def _in_float64(method: BNNMethod) -> BNNMethod:
    """``method`` training in float64: its data's images and its networks (BLiTZ's too, whose eps
    buffers then draw in float64, as the stacked objective draws in its parameters' dtype)."""
    data = method.data
    train = InMemoryImageDataset(data.train.images, data.train.labels)
    train.images = train.images.double()
    method.data = TrainingData(train, tuple(t.double() if t.is_floating_point() else t for t in data.train_tensors),
                               tuple(t.double() if t.is_floating_point() else t for t in data.check))
    build_network = method.variational_network

    def variational_network():
        net = build_network()
        net.model.double()
        return net

    method.variational_network = variational_network  # the class's network, in float64: still stacked
    return method


@pytest.mark.parametrize("name", VBNNS)
def test_a_stacked_fit_in_float64_follows_blitz_to_rounding(tiny_exp, tiny_bases, name):
    """Two epochs with the convergence rule after the first, in float64: the means and scales of a
    stacked network and of its BLiTZ fit differ by rounding only."""
    seeds = [seed for seed, _ in tiny_bases[:2]]
    rule = FailRule(epoch=1, min_accuracy=0.01)
    stacked = _in_float64(_bnn(tiny_exp, rule, name, epochs=2, milestones=[1]))
    blitz = _in_float64(_bnn(tiny_exp, rule, name, epochs=2, milestones=[1]))
    assert stacked.stacking_problem() is None
    stacked.prefit(seeds, lambda seed: {})
    assert set(stacked._prefitted) == set(seeds)
    for seed in seeds:
        stacked.fit({}, seed)
        blitz.fit({}, seed)
        assert seed not in blitz._prefitted
        for key, sampler in stacked.network.samplers.items():
            theirs = blitz.network.samplers[key]
            assert sampler.mu.dtype == torch.float64
            torch.testing.assert_close(sampler.mu, theirs.mu, rtol=1e-9, atol=1e-11, msg=f"{seed} {key}.mu")
            torch.testing.assert_close(sampler.rho, theirs.rho, rtol=1e-9, atol=1e-11, msg=f"{seed} {key}.rho")


@pytest.mark.parametrize("name", VBNNS)
def test_a_stacked_fits_failures_surface_in_fit(tiny_exp, tiny_bases, name):
    seeds = [seed for seed, _ in tiny_bases[:2]]
    failing = _bnn(tiny_exp, FailRule(epoch=1, min_accuracy=1.01), name, epochs=1, milestones=[])
    failing.prefit(seeds, lambda seed: {})
    assert all(seed in failing._prefitted for seed in seeds)  # trained stacked
    for seed in seeds:
        with pytest.raises(MethodFitError, match=f"bnn seed {seed}: .*did not converge"):
            failing.fit({}, seed)
    diverging = _bnn(tiny_exp, None, name, epochs=1, milestones=[], lr=1e12)
    diverging.prefit(seeds, lambda seed: {})
    assert all(seed in diverging._prefitted for seed in seeds)
    for seed in seeds:
        with pytest.raises(NonFiniteError, match=f"bnn seed {seed}"):
            diverging.fit({}, seed)
    with pytest.raises(RuntimeError, match="call fit"):
        diverging.sample(1, torch.Generator())


def test_only_the_plain_vbnn_with_the_recipes_sgd_is_stacked(tiny_exp):
    assert _bnn(tiny_exp).stacking_problem() is None
    assert "own optimizer" in build(tiny_exp, "bnn", variance=VarianceSettings(optimizer="adam", lr=0.01)).stacking_problem()
    assert "point-estimate" in build(tiny_exp, "bnn", layers="last_layer").stacking_problem()
    assert build(tiny_exp, "bnn_ordered").stacking_problem() is None
    assert build(tiny_exp, "bnn_skip").stacking_problem() is None
    assert "point-estimate" in build(tiny_exp, "bnn_skip", layers="last_layer").stacking_problem()

    class OwnNetwork(type(build(tiny_exp, "bnn_skip"))):  # another network, not declared stackable
        def variational_network(self):
            return super().variational_network()

    own = OwnNetwork(tiny_exp.model, tiny_exp.training_data, tiny_exp.method_settings("bnn_skip"), recipe=tiny_exp.recipe,
                     device=tiny_exp.device)
    assert "builds its own network" in own.stacking_problem()
