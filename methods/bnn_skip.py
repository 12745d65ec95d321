"""vBNN with fixed random semi-orthogonal skip connections in each layer (seed 001: Kurle,
Januschowski, Gasthaus & Wang 2021, "On symmetries in variational Bayesian neural nets").

Layer ``l`` computes ``h_l = W_l f(h_{l-1}) + b_l + O_l h_{l-1}`` (the seed's eq. 7): ``O_l`` is a
fixed random matrix with orthonormal rows or columns (``torch.nn.init.orthogonal_`` of a Gaussian,
times ``skip_gain``) applied to the previous layer's *pre-activation* ``h_{l-1}`` (``h_0 = x``).
Because ``O_l`` is fixed, permuting (or rescaling) hidden units no longer leaves the function
unchanged, which removes the symmetric copies of every mode from the posterior.

On a chain network (OptuNet, the MLP) every Linear and Conv2d layer gets one: for a convolution
``O_l`` is a convolution with the layer's kernel size, stride, padding and groups whose
``[out / groups, in / groups * kh * kw]`` matrix per group is semi-orthogonal. Pooling, global
average pooling and Flatten between two layers are applied to the pre-activation stream too
(``O_2`` reads the max-pooled pre-activation of ``conv1``, ``O_3`` (fc1) the spatially averaged
pre-activation of ``conv2``); ReLU and Dropout act on the activation stream only. Networks
that are not chains (ResNets) or contain BatchNorm are refused.

The skip matrices are constants of the architecture, not weights: they are drawn from
``skip_seed`` (the same for every base network and repetition), are not trained, carry no
posterior, and are not in the samples. The samples are the posterior over the layers' own
weights ``W_l, b_l``, keyed like the plain model so MMD and the NS form compare them with the
zoo. But the network they parameterise is the skip network: the plain network carrying the
same weights computes another function (for layers after the first, ``O_l h_{l-1}`` cannot be
folded into ``W_l``: it needs the pre-activation, which ReLU discards). Hence this method's
predictions (``predict_weights``, what the sample stage stores and every predictive column
reads) are the skip network's with each sample's weights, and its MMD rows compare the
posterior of a different model's weights with the plain zoo's: they say how far the skip
model's posterior sits from the plain one, not how well it approximates it.

A round's vBNNs train stacked (``methods.bnn_stacked``), each following its BLiTZ fit to float
rounding, through ``torch.func.vmap`` over the skip network (``ConstantBuffersVmap``: the skips are
buffers shared by the stack): the packed CPU kernels run a chain of layers, not its two streams.
On digits, K = 10 on one thread, that is 2.5-2.7x faster than one at a time through BLiTZ
(``bench/bench_bnn_variants.py``; the plain and ordered vBNNs, on the packed kernels, 7-12x).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F
from torch import nn

from benchmark.core.models import predict_with_weights
from benchmark.core.settings import require
from benchmark.core.store import SampleSet
from benchmark.core.training.stacked import StackedNetworks
from benchmark.core.training import seeded
from methods.base import MethodConfigError
from methods.bayesian_layers import BayesianNetwork, to_bayesian
from methods.bnn import BNNMethod, BNNSettings
from methods.bnn_stacked import ConstantBuffersVmap
from methods.layer_chain import ACTIVATIONS, PARAMETRISED, layer_chain


@dataclass(frozen=True)
class Skip:
    """One layer's fixed skip: ``weight`` ``[out, in]`` (Linear) or ``[out, in / groups, kh, kw]``
    (Conv2d, with ``conv`` = its stride, padding, dilation and groups)."""

    weight: torch.Tensor
    conv: dict | None = None

    def __call__(self, pre: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.conv is None:
            return F.linear(pre, weight)
        return F.conv2d(pre, weight, **self.conv)


def semi_orthogonal(rows: int, cols: int, generator: torch.Generator) -> torch.Tensor:
    """A ``[rows, cols]`` matrix with orthonormal rows (``rows <= cols``) or columns (otherwise):
    the Q factor of a standard Gaussian matrix, sign-fixed (``torch.nn.init.orthogonal_``)."""
    return torch.nn.init.orthogonal_(torch.empty(rows, cols, device=generator.device), generator=generator)


def skip_matrices(model: nn.Module, seed: int, gain: float = 1.0) -> dict[str, Skip]:
    """The fixed skip of every Linear/Conv2d layer of chain network ``model`` (module doc), drawn
    from a generator seeded with ``seed`` in forward order."""
    generator = torch.Generator().manual_seed(seed)
    skips = {}
    for name, module in layer_chain(model):
        if isinstance(module, nn.Linear):
            skips[name] = Skip(gain * semi_orthogonal(module.out_features, module.in_features, generator))
        elif isinstance(module, nn.Conv2d):
            groups = module.groups
            rows, per_group = module.out_channels // groups, module.in_channels // groups
            kh, kw = module.kernel_size
            blocks = [semi_orthogonal(rows, per_group * kh * kw, generator) for _ in range(groups)]
            weight = gain * torch.cat(blocks).reshape(module.out_channels, per_group, kh, kw)
            conv = {"stride": module.stride, "padding": module.padding, "dilation": module.dilation, "groups": groups}
            skips[name] = Skip(weight, conv)
    return skips


class SkipChain(nn.Module):
    """``model``'s layers (registered under their own names, so the state dict is ``model``'s)
    run as a chain with each layer's fixed skip added (module doc). The skip weights are
    non-persistent buffers: they follow the module to its device but are not in its state dict."""

    def __init__(self, model: nn.Module, skips: dict[str, Skip]) -> None:
        super().__init__()
        chain = layer_chain(model)
        missing = [name for name, m in chain if isinstance(m, PARAMETRISED) and name not in skips]
        if missing:
            raise ValueError(f"SkipChain: no skip for layers {missing}")
        for name, child in model.named_children():
            self.add_module(name, child)
        self._chain = chain
        self._skips = skips
        for name, skip in skips.items():
            self.register_buffer(self._buffer(name), skip.weight.clone(), persistent=False)

    @staticmethod
    def _buffer(name: str) -> str:
        return "skip_" + name.replace(".", "_")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pre = act = x  # h_0 = x: the first layer's skip reads the input
        for name, module in self._chain:
            if name in self._skips:
                act = pre = module(act) + self._skips[name](pre, getattr(self, self._buffer(name)))
            elif isinstance(module, (*ACTIVATIONS, nn.Dropout)):
                act = module(act)
            else:  # pooling, Flatten: the pre-activation stream takes the same shape
                act, pre = module(act), module(pre)
        return act


@dataclass
class SkipBNNSettings(BNNSettings):
    """The plain vBNN's settings (``BNNSettings``; in the config they follow ``methods.bnn`` unless
    set under ``methods.bnn_skip``), plus ``skip_seed`` (the fixed skip matrices' draw, the same for every fit)
    and ``skip_gain`` (their scale; the seed uses semi-orthogonal matrices, i.e. 1)."""

    skip_seed: int = 0
    skip_gain: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.skip_seed >= 0, "skip_seed", self.skip_seed, "an integer >= 0")
        require(self.skip_gain > 0, "skip_gain", self.skip_gain, "a positive number")


class SkipBNNMethod(BNNMethod):
    """Mean-field vBNN with fixed semi-orthogonal skips (seed 001); one-mode (see ``modes``)."""

    name = "bnn_skip"
    order = 40
    label = "BNN (orthogonal skips)"
    table_note = (
        "{label}: the vBNN of another model, the network with fixed random semi-orthogonal skip connections added to "
        "every layer (seed 001); the skips are constants, not in the samples, so its weight samples are that model's "
        "posterior over the layers' own weights, compared with the zoo on the shared state-dict keys, and its "
        "predictive columns are the skip network's."
    )
    diagnostics_note = None  # diagnostics.md explains the plain vBNN's columns only
    paper_label = None  # not in the paper's tables (seeds 000 and 001)
    Settings = SkipBNNSettings
    follows = "bnn"
    variant_claims = ("underfitting", "closer")
    # The seed's claim is about one variational posterior; a multi-mode row would add 10 vBNN
    # trainings per repetition, beyond the default experiment's time budget.
    modes = ("one",)
    network_stacks = True  # VariationalObjective on the skip network (stacked_template, stacked_form)

    @cached_property
    def skips(self) -> dict[str, Skip]:
        """The fixed skips of the experiment's model (``settings.skip_seed``, ``skip_gain``)."""
        with seeded(0):  # building a model draws from the global RNG; leave it as it was
            model = self.model_factory()
        return skip_matrices(model, self.settings.skip_seed, self.settings.skip_gain)

    def check(self, mode: str) -> None:
        super().check(mode)
        try:
            _ = self.skips
        except ValueError as err:
            raise MethodConfigError(f"method={self.name}: {err}") from None

    def variational_network(self) -> BayesianNetwork:
        """The plain vBNN's network (BLiTZ layers, same initialisation) run with the fixed skips."""
        net = to_bayesian(self.model_factory(), self.settings.layers, self.settings.variance.rho_init)
        return BayesianNetwork(SkipChain(net.model, self.skips), net.samplers, net.plain_keys)

    def stacked_template(self) -> SkipChain:
        """The skip network: the vBNN's draws run in it."""
        return self.skip_network()

    def stacked_form(self, template: nn.Module) -> StackedNetworks:
        """The skip network through ``torch.func.vmap`` (``ConstantBuffersVmap``: the skips are its
        buffers, the same for every network); the packed CPU kernels run a chain of layers, not its
        two streams (pre-activation and activation)."""
        return ConstantBuffersVmap(template)

    def skip_network(self) -> SkipChain:
        """A plain model (fresh) wrapped with the fixed skips: what the samples parameterise."""
        return SkipChain(self.new_model(), self.skips).to(self.device)

    def predict_weights(self, sample_set: SampleSet, images: torch.Tensor) -> torch.Tensor:
        """Probabilities ``[S, N, C]`` of the skip network carrying each weight sample (not the
        plain network: see the module doc)."""
        return predict_with_weights(self.skip_network(), sample_set, images)
