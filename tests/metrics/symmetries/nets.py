"""Random networks and their outputs for the symmetry tests (float64)."""
from __future__ import annotations

from typing import Callable

import torch
from hypothesis import strategies as st
from torch import nn

from benchmark.core.models import mlp, optunet
from benchmark.core.store import stack_state_dicts, unstack


def randomize(model: nn.Module, generator: torch.Generator) -> nn.Module:
    """Give every BatchNorm random gamma (both signs), beta and running statistics, so eval-mode
    tests exercise them; other parameters keep the model's random initialisation."""
    for m in model.modules():
        if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d)):
            n = m.num_features
            with torch.no_grad():
                m.weight.copy_(torch.randn(n, generator=generator, dtype=torch.float64))
                m.bias.copy_(torch.randn(n, generator=generator, dtype=torch.float64))
                m.running_mean.copy_(torch.randn(n, generator=generator, dtype=torch.float64))
                m.running_var.copy_(0.5 + 1.5 * torch.rand(n, generator=generator, dtype=torch.float64))
    return model


def random_sample_set(factory: Callable[[], nn.Module], samples: int, seed: int) -> dict[str, torch.Tensor]:
    """``samples`` independently initialised float64 networks from ``factory``, as a sample set."""
    generator = torch.Generator().manual_seed(seed)
    states = []
    for i in range(samples):
        torch.manual_seed(seed * 1000 + i)
        states.append(randomize(factory().double(), generator).state_dict())
    return stack_state_dicts(states)


def conv_chain() -> nn.Sequential:
    """A sequential conv net with every supported piece: BatchNorm2d/1d, a grouped conv reading a
    plain conv, a grouped conv reading a grouped conv, pooling and Flatten of a 2x2 map."""
    return nn.Sequential(
        nn.Conv2d(3, 6, 3), nn.BatchNorm2d(6), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(6, 8, 3, groups=2), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 4, 1, groups=2), nn.ReLU(), nn.Flatten(),
        nn.Linear(4 * 2 * 2, 5), nn.BatchNorm1d(5), nn.ReLU(), nn.Dropout(0.3), nn.Linear(5, 3),
    )


def inputs_for(model: nn.Module, batch: int = 4, seed: int = 0) -> torch.Tensor:
    """Random float64 inputs of the right shape for the test networks."""
    generator = torch.Generator().manual_seed(seed)
    first = next(m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d)))
    if isinstance(first, nn.Linear):
        shape = (batch, first.in_features)
    else:
        side = 28 if first.kernel_size == (4, 4) else 10  # OptuNet needs 28x28; conv_chain/ResNet take 10x10
        shape = (batch, first.in_channels, side, side)
    return torch.randn(*shape, generator=generator, dtype=torch.float64)


@st.composite
def small_networks(draw) -> tuple[Callable[[], nn.Module], int]:
    """(factory, seed): a random-width MLP (1-3 hidden layers), an OptuNet or the conv chain."""
    kind = draw(st.sampled_from(["mlp", "mlp", "optunet", "chain"]))
    seed = draw(st.integers(0, 10_000))
    if kind == "optunet":
        return optunet, seed
    if kind == "chain":
        return conv_chain, seed
    in_features = draw(st.integers(1, 6))
    hidden = draw(st.lists(st.integers(1, 7), min_size=1, max_size=3))
    classes = draw(st.integers(2, 4))
    return (lambda: mlp(in_features, hidden, classes)), seed


def drawn_weights(network: tuple[Callable[[], nn.Module], int], samples: int = 3):
    """(factory, sample set of ``samples`` random nets, spec, seed) for a ``small_networks()`` draw."""
    from metrics.symmetries import spec_for_model

    factory, seed = network
    return factory, random_sample_set(factory, samples, seed), spec_for_model(factory()), seed


@torch.no_grad()
def log_probs(model: nn.Module, sample_set: dict[str, torch.Tensor], inputs: torch.Tensor) -> torch.Tensor:
    """Log-softmax outputs ``[S, B, K]`` of every sample of ``sample_set`` (eval mode)."""
    model = model.double().eval()
    samples = next(iter(sample_set.values())).shape[0]
    out = []
    for s in range(samples):
        model.load_state_dict(unstack(sample_set, s))
        out.append(torch.log_softmax(model(inputs), dim=-1))
    return torch.stack(out)


def assert_same_function(model: nn.Module, before, after, inputs: torch.Tensor | None = None, rtol: float = 1e-6) -> None:
    """The two sample sets compute the same log-probabilities (relative ``rtol``); a ``before``
    of one sample is compared with every sample of ``after``."""
    inputs = inputs_for(model) if inputs is None else inputs
    a, b = log_probs(model, before, inputs), log_probs(model, after, inputs)
    torch.testing.assert_close(b, a.expand_as(b), rtol=rtol, atol=rtol * float(a.abs().max()))


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rtol: float = 1e-6) -> None:
    """Same keys, shapes, dtypes and values (within ``rtol`` of each tensor's largest entry)."""
    assert list(a) == list(b)
    for key in a:
        assert a[key].shape == b[key].shape and a[key].dtype == b[key].dtype, key
        scale = float(a[key].abs().max()) if a[key].is_floating_point() and a[key].numel() else 1.0
        torch.testing.assert_close(b[key], a[key], rtol=rtol, atol=rtol * max(scale, 1e-12), msg=lambda m, k=key: f"{k}: {m}")
