"""The vBNN of ``methods.bnn`` trained K networks at once (``benchmark.core.training.train_networks``).

``methods.bnn`` trains each vBNN through BLiTZ's layers, one network at a time. Here the
variational means and scales of K vBNNs are stacked parameters, and one step computes what BLiTZ
computes for each of them, with each network's own random numbers:

- the weights of Monte Carlo draw ``e`` of network ``k``: ``mu + log1p(exp(rho)) * eps`` with ``eps``
  drawn from that network's own generator, in BLiTZ's order (per draw, each variational layer in
  forward order, its weight then its bias), the generator starting where torch's global RNG
  stood when the network was built under its seed: the numbers BLiTZ's ``eps_w.normal_()`` draws
  in ``methods.bnn``'s fit;
- the loss of network ``k``: the mean over its ``elbo_samples`` draws of the batch's mean
  cross-entropy plus ``kl_weight`` times BLiTZ's one-draw KL estimate (``log q(w) - log p(w)``:
  BLiTZ's Gaussian log posterior and its scale-mixture prior density plus 1e-6, as
  ``blitz.modules.weight_sampler`` computes them), the draws of all K networks run as ``E x K``
  stacked networks on copies of the batches;
- an accuracy: one draw per batch of 2048 images, as ``benchmark.core.training.accuracy`` runs the
  BLiTZ network (which samples in eval mode too);
- BLiTZ's gradient with respect to ``rho``: BLiTZ overwrites its ``eps`` buffer in place at every
  draw (``eps_w.data.normal_()``, unseen by autograd), so the backward pass of ``sigma * eps`` reads
  the step's LAST draw for every draw: the gradient on ``rho`` is ``sigmoid(rho) * eps_last *
  sum_e dL/dw_e`` instead of ``sigmoid(rho) * sum_e eps_e dL/dw_e`` (exact with one draw; the
  means' gradient is right). The paper's vBNN (BLiTZ, 3 draws) trained with it, and so does
  ``methods.bnn`` through BLiTZ's layers; it is reproduced here (``_stale_noise``) so that both
  paths train the same networks.

So a network trained here follows its one-at-a-time BLiTZ training up to float rounding (the
packed kernels sum in another order), whatever the other networks of the stack.

The symmetry-breaking variants train here too: a layer whose parameter is a transform of its
Gaussian draw (``methods.bnn_ordered``: the ordered bias ``b = ordered(y)``) names it in
``transforms`` (the draw ``y`` is BLiTZ's, the network runs on ``b``, the KL is ``log q(y) - log
p(b) - log |det db/dy|``), and an architecture with fixed tensors of its own (``methods.bnn_skip``:
the skip matrices, buffers of its ``SkipChain``) runs through ``ConstantBuffersVmap``.
"""
from __future__ import annotations

import copy
import math
from typing import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from blitz.modules.base_bayesian_module import BayesianModule
from torch import nn

from benchmark.core.training.objective import Gather, stacked_accuracies
from benchmark.core.training.stacked import Params, StackedNetworks, VmapNetworks
from methods.bayesian_layers import BayesianNetwork

ACCURACY_BATCH = 2048  # images per forward pass of benchmark.core.training.accuracy (one draw each)
LOG_SQRT_2PI = math.log(math.sqrt(2 * math.pi))  # as BLiTZ's log_posterior computes it
Transform = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""``transform(y [K, ...]) -> (b [K, ...], log |det db/dy| [K])``: a parameter ``b`` that is a function
of its Gaussian draw ``y``, for K networks stacked along axis 0 (``VariationalObjective``)."""


def draw_order(net: BayesianNetwork, template: nn.Module, input_shape: Sequence[int]) -> list[str]:
    """The plain keys of ``net``'s variational tensors in the order BLiTZ draws them in a forward
    pass: its Bayesian layers in the order the forward pass calls them, each weight before its bias.
    The order is that of the layers of the same names in ``template``, the plain model ``net`` was
    converted from, recorded in one forward pass on zeros (the plain model draws nothing)."""
    bayesian = {name for name, module in net.model.named_modules() if isinstance(module, BayesianModule)}
    called: list[str] = []
    hooks = [module.register_forward_pre_hook(lambda m, _i, name=name: called.append(name))
             for name, module in template.named_modules() if name in bayesian]
    try:
        with torch.no_grad():
            template(torch.zeros(1, *input_shape, device=next(template.parameters()).device))
    finally:
        for hook in hooks:
            hook.remove()
    keys = [f"{name}.{leaf}" for name in called for leaf in ("weight", "bias")]
    return [key for key in keys if key in net.samplers]


def _unvalidated(prior):
    """BLiTZ's prior ``prior`` (``PriorWeightDistribution``) whose densities take any value: a network
    whose weights became NaN trains on in the stack until the end of its epoch (where the trainer
    records its ``NonFiniteError``), and torch's argument validation would raise a ValueError for
    the whole stack instead. The same densities to the bit (the same ``log_prob``)."""
    prior = copy.copy(prior)
    for part in ("dist1", "dist2"):
        dist = getattr(prior, part, None)
        if dist is not None:
            dist = copy.copy(dist)
            dist._validate_args = False
            setattr(prior, part, dist)
    return prior


class _StaleNoise(torch.autograd.Function):
    """``sigma * eps`` whose gradient with respect to ``sigma`` is ``grad * eps_grad`` (BLiTZ's
    backward reads its overwritten ``eps`` buffer: see the module doc)."""

    @staticmethod
    def forward(ctx, sigma: torch.Tensor, eps: torch.Tensor, eps_grad: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(eps_grad)
        return sigma * eps

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (eps_grad,) = ctx.saved_tensors
        return grad * eps_grad, None, None


class VariationalObjective:
    """The ELBO of K vBNNs ``nets`` (``StackedObjective``; see the module doc).

    ``template``: a plain model of the architecture, ``stacked`` its stacked form; ``rng_states``: torch's global RNG
    state right after each network was built (its draws start there); ``elbo_samples``,
    ``kl_weight``: as ``methods.bnn.BNNSettings``. Parameters are keyed ``<plain key>.mu`` and
    ``<plain key>.rho``. Every plain parameter must be variational (``layers=all``). ``transforms``:
    ``{plain key: Transform}`` for the parameters that are a transform of their Gaussian draw (the
    network runs on the transformed value, the prior density is taken there, and the KL estimate
    subtracts the log-Jacobian; ``mu`` and ``rho`` stay those of the draw).
    """

    def __init__(self, template: nn.Module, stacked: StackedNetworks, nets: Sequence[BayesianNetwork],
                 rng_states: Sequence[torch.Tensor], elbo_samples: int, kl_weight: float, input_shape: Sequence[int],
                 transforms: Mapping[str, Transform] | None = None) -> None:
        template_model, template = template, nets[0]
        plain = [key for key in template.plain_keys if key not in template.samplers]
        if plain:
            raise ValueError(f"VariationalObjective: every parameter must be variational, {plain} are not (layers=all)")
        self.stacked, self.nets = stacked, list(nets)
        self.generators = [torch.Generator().set_state(state) for state in rng_states]
        self.elbo_samples, self.kl_weight = elbo_samples, kl_weight
        self.order = draw_order(template, template_model, input_shape)
        self.transforms = dict(transforms or {})
        unknown = sorted(set(self.transforms) - set(self.order))
        if unknown:
            raise ValueError(f"VariationalObjective: transforms for {unknown}, which are not variational parameters")
        self.priors = {}
        for name, module in template.model.named_modules():
            if isinstance(module, BayesianModule):
                for leaf in ("weight", "bias"):
                    if f"{name}.{leaf}" in template.samplers:
                        self.priors[f"{name}.{leaf}"] = _unvalidated(getattr(module, f"{leaf}_prior_dist"))

    def initial(self) -> Params:
        out = {}
        for key in self.order:
            for part in ("mu", "rho"):
                tensors = [getattr(net.samplers[key], part).detach() for net in self.nets]
                out[f"{key}.{part}"] = torch.stack(tensors, dim=self.stacked.network_axis(key)).contiguous()
        return out

    def network_axis(self, key: str) -> int:
        return self.stacked.network_axis(key.rsplit(".", 1)[0])

    def select(self, tensors: Params, indices: torch.Tensor) -> Params:
        return {key: value.index_select(self.network_axis(key) % value.dim(), indices.to(value.device)).contiguous()
                for key, value in tensors.items()}

    def _eps(self, params: Params, lanes: Sequence[int]) -> dict[str, torch.Tensor]:
        """One draw of every network's ``eps``, stacked like the parameters (per network in BLiTZ's order)."""
        per_lane = []
        for lane in lanes:  # drawn in the parameters' dtype, as BLiTZ's eps buffer of that dtype draws them
            generator = self.generators[lane]
            per_lane.append({key: torch.randn(self.nets[lane].samplers[key].mu.shape, generator=generator,
                                              dtype=params[f"{key}.mu"].dtype) for key in self.order})
        return {key: torch.stack([d[key] for d in per_lane], dim=self.stacked.network_axis(key)).to(
            params[f"{key}.mu"].device) for key in self.order}

    def _sum_per_network(self, values: torch.Tensor, key: str) -> torch.Tensor:
        axis = self.stacked.network_axis(key) % values.dim()
        return values.movedim(axis, 0).reshape(values.shape[axis], -1).sum(1)

    def _weights_and_kl(self, params: Params, eps: dict[str, torch.Tensor],
                        eps_grad: dict[str, torch.Tensor] | None = None) -> tuple[Params, torch.Tensor]:
        """The weights ``{plain key: stacked}`` of the draw ``eps`` and each network's KL estimate
        ``[K]``; ``eps_grad``: the noise the backward pass of ``sigma * eps`` reads (default ``eps``)."""
        weights, kl = {}, 0.0
        for key in self.order:
            mu, rho = params[f"{key}.mu"], params[f"{key}.rho"]
            sigma = torch.log1p(torch.exp(rho))
            noise = sigma * eps[key] if eps_grad is None else _StaleNoise.apply(sigma, eps[key], eps_grad[key])
            y = mu + noise
            log_q = -LOG_SQRT_2PI - torch.log(sigma) - ((y - mu) ** 2) / (2 * sigma**2) - 0.5
            w = y
            if key in self.transforms:
                axis = self.stacked.network_axis(key) % y.dim()
                w, log_det = self.transforms[key](y.movedim(axis, 0))
                w = w.movedim(0, axis)
                kl = kl - log_det
            weights[key] = w
            prior = self.priors[key]
            density = torch.exp(prior.dist1.log_prob(w))
            second = torch.exp(prior.dist2.log_prob(w)) if prior.dist2 is not None else 0
            log_p = torch.log(prior.pi * density + (1 - prior.pi) * second + 1e-6) - 0.5
            kl = kl + self._sum_per_network(log_q, key) - self._sum_per_network(log_p, key)
        return weights, kl

    def losses(self, params: Params, gather: Gather, labels: torch.Tensor, lanes: Sequence[int]) -> torch.Tensor:
        eps = [self._eps(params, lanes) for _ in range(self.elbo_samples)]
        draws = [self._weights_and_kl(params, e, eps[-1]) for e in eps]
        weights = {key: torch.cat([w[key] for w, _ in draws], dim=self.stacked.network_axis(key)) for key in self.order}
        logits = self.stacked.forward(weights, gather(self.elbo_samples))  # [E K, B, classes]
        k, b = labels.shape
        ce = F.cross_entropy(logits.flatten(0, 1), labels.repeat(self.elbo_samples, 1).flatten(),
                             reduction="none").view(self.elbo_samples, k, b).mean(2)
        total = 0.0
        for e, (_, kl) in enumerate(draws):
            total = total + ce[e] + self.kl_weight * kl
        return total / self.elbo_samples

    def accuracies(self, params: Params, tensors: tuple[torch.Tensor, torch.Tensor], lanes: Sequence[int]) -> torch.Tensor:
        images, labels = tensors
        first = next(iter(params.values()))
        correct = torch.zeros(len(lanes), dtype=torch.float64, device="cpu")  # stacked_accuracies: CPU
        with torch.no_grad():
            for start in range(0, len(labels), ACCURACY_BATCH):
                weights, _ = self._weights_and_kl(params, self._eps(params, lanes))
                chunk, truth = images[start : start + ACCURACY_BATCH], labels[start : start + ACCURACY_BATCH]
                correct += stacked_accuracies(lambda part: self.stacked.predict(weights, part), chunk, truth, len(lanes),
                                              first.device, first.dtype) * len(truth)
        return correct / max(1, len(labels))

    def result(self, params: Params, position: int, lane: int) -> dict[str, torch.Tensor]:
        return {key: value.detach().select(self.network_axis(key), position).cpu().contiguous().clone()
                for key, value in params.items()}

    def load_into(self, net: BayesianNetwork, state: dict[str, torch.Tensor]) -> None:
        """Copy a trained network's ``result`` into its BLiTZ samplers (``net``: the one it was built as)."""
        with torch.no_grad():
            for key in self.order:
                net.samplers[key].mu.copy_(state[f"{key}.mu"])
                net.samplers[key].rho.copy_(state[f"{key}.rho"])


class ConstantBuffersVmap(VmapNetworks):
    """``VmapNetworks`` for an architecture whose buffers are constants of the architecture, the same
    for every network and never trained (``methods.bnn_skip``'s skip matrices): each network's
    forward pass reads the template's buffers (as they are on its device) with its own parameters.
    Refuses what ``VmapNetworks`` refuses otherwise (BatchNorm, active dropout).

    A network's numbers do not depend on the stack, by construction: the buffers are handed to
    ``vmap`` expanded along the stack (a view, no copy), as if each network had its own, and
    ``predict`` expands the shared images likewise, so that every product runs per network with that
    network's own shapes: a Linear is a ``bmm`` of one ``[B, in] x [in, out]`` product per network, a
    convolution a grouped one with the networks as groups, which PyTorch's native CPU convolution
    (OptuNet's, ``model.cpu_native_conv``) computes group by group. A buffer left unbatched would be
    folded by ``vmap`` into one product over the whole stack (a skip Linear: one ``mm`` over
    ``K x B`` rows; a convolution on shared images: one over ``K x out`` channels), whose blocking,
    hence each row's rounding, MKL chooses from that size: on an AVX2 path (e.g. an AMD EPYC, or
    ``MKL_ENABLE_INSTRUCTIONS=AVX2``) a network's result then depended on K and on its place in
    the stack (tests/test_dispatch.py runs the stack-independence tests under that dispatch)."""

    keeps_buffers = True

    def _per_network(self, count: int, dtype: torch.dtype) -> Params:
        """The buffers (in ``dtype``: a no-op unless float64) expanded to ``count`` networks."""
        return {name: buffer.to(dtype).expand(count, *buffer.shape) for name, buffer in self.buffers.items()}

    def forward(self, params: Params, batch: torch.Tensor, last_input_scale: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward({**params, **self._per_network(len(batch), batch.dtype)}, batch, last_input_scale)

    def predict(self, params: Params, images: torch.Tensor) -> torch.Tensor:
        count = next(iter(params.values())).shape[0]
        return self.forward(params, images.expand(count, *images.shape))
