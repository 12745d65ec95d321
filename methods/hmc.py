"""Full-batch Hamiltonian Monte Carlo on the network's weight posterior: the gold-standard
reference of Izmailov et al. (2021), affordable for OptuNet-sized networks, many chains at once.

Target, at ``temperature`` T (1: the Bayesian posterior), over all parameters ``w`` of the plain
model (D of them) given the experiment's un-augmented training split (N images):

    U(w) = [ sum_{i=1..N} CE(f_w(x_i), y_i)  +  (N * weight_decay / 2) |w|^2 ] / T,   p(w | D) ∝ exp(-U(w)).

The recipe trains on ``mean NLL + (weight_decay / 2) |w|^2`` (SGD's ``weight_decay`` on every
parameter), i.e. ``U / N``; the same minimiser, the same curvature per example. So the likelihood
is the recipe's cross-entropy summed over the N images, and the prior is Gaussian N(0, I / lambda)
with precision ``lambda = N * weight_decay`` (digits: 1295 x 2e-4 = 0.259, prior std 1.97).
The likelihood must be a fixed function of ``w``: a model with BatchNorm (batch statistics, running
averages) or active dropout (random masks) is refused before any work.

The chains (``methods.hmc_kernel``) run stacked: one forward and backward pass over the N images
computes every chain's potential and gradient, through the zoo trainer's stacked networks
(``benchmark.core.training.stacked``: on CPU the packed numba kernels' fused cross-entropy step, as
the zoo's SGD takes it; ``torch.func.vmap`` elsewhere; a plain per-chain loop for architectures
neither supports).

Two ways to use it:

- the ``PosteriorMethod`` protocol (``fit(base, seed)``: warm-up of one chain; ``sample(n, generator)``:
  its next ``n`` kept draws), so that the sample stage runs HMC like any method, one chain per base
  (one-mode: one chain; multi-mode: ``modes_multi`` chains);
- the batched API for many chains at once, resumable per chain: ``start_chains(seeds, bases)``,
  ``run_chains(chains, draws, files=...)``, ``chain_samples(chain)``, ``chain_predictions``
  (the input of ``metrics.mcmc.predictive_convergence``), ``ChainState.summary()``.
  A chain ``start_chains([seed], [base])`` run to ``n`` draws gives exactly the draws of
  ``fit(base, seed)`` then ``sample(n, torch.Generator().manual_seed(seed))``.

Where a chain starts: ``start=init`` (default) an initialisation of the model factory under a
seed of its own (``init_seed``: never a zoo seed, so the chain shares neither weights nor an
initialisation with any zoo network, the base network included, which is not used), moved
towards the posterior's bulk by ``descent_steps`` of full-batch Adam on the potential (part of
the warm-up: nothing is kept from it; HMC itself descends from a random initialisation
hundreds of times slower, its steps held small by the energy it sheds); a start whose training
accuracy is then below ``start_min_accuracy`` (a network with dead units, in a region of
negligible posterior mass that no chain leaves in practice: the zoo's convergence rule refuses
such networks too) is drawn again from the next initialisation seed, up to ``start_attempts``
times. ``start=base``: the base network itself (no descent: it is trained already), so a
one-mode chain explores the base's mode. ``chains_per_start`` k > 1 (``start=init``): the chains
whose seeds share ``seed // k`` share the start of the group's first seed (``start_seed``), each on
its own random stream. ``M^-1`` starts at the inverse of the curvature at the start
(``initial_mass=fisher``).
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, jacrev, vmap
from tqdm.auto import tqdm

from benchmark.core.models import predict_with_weights
from benchmark.core.settings import require
from benchmark.core.fingerprint import code_fingerprint
from benchmark.core.store import MAX_SEED, ChainFiles, CheckpointError, SampleSet, SampleSetMetadata, Unit
from benchmark.core.training import seeded
from benchmark.core.training.stacked import LANES, NotStackableError, PackedChain, stacked_networks
from methods.base import MethodConfigError, MethodFitError, MethodSettings, PosteriorMethod, ResumableChains
from methods.hmc_kernel import DIVERGED, SAMPLING, ChainState, KernelSettings, StackedHMC, new_chain

log = logging.getLogger(__name__)
STARTS = ("init", "base")
FORWARDS = ("auto", "packed", "vmap", "loop")
INITIAL_MASSES = ("identity", "fisher")
INIT_SEEDS = 10_000_000
"""``start=init``: attempt ``a`` of chain ``seed`` initialises under ``INIT_SEEDS + a x (MAX_SEED + 1) + seed``
(``init_seed``), above every zoo seed (at most ``MAX_SEED``)."""
FISHER_CHUNK = 256  # images per batched Jacobian in NetworkPotential.fisher_diagonal
FULL_BATCH_PART = 128
"""Images per part of the packed kernels' full-batch pass (``PackedChain.loss_and_grads``'s
``part_images``): with the zoo's 16, a gradient over digits' 1,295 images (81 parts, each a dozen
calls of the kernels) cost 1.2-1.4x more CPU per chain than with 128 or 256, which cost the same
(10, 16 and 32 chains, one thread, side by side; 2026-11-28)."""


def stochastic_layers(model: nn.Module) -> list[str]:
    """Why ``model``'s likelihood is not a fixed function of its weights: one line per BatchNorm
    layer or dropout layer with ``p > 0`` (empty when there is none)."""
    problems = []
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            problems.append(f"{name or type(model).__name__}: {type(module).__name__} (batch statistics and running "
                            "averages change the function with the batch)")
        elif isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            problems.append(f"{name or type(model).__name__}: {type(module).__name__}(p={module.p}) (random masks)")
    return problems


def refuse_stochastic(model: nn.Module, where: str = "method=hmc") -> None:
    """``MethodConfigError`` naming the layers that make the likelihood random (see ``stochastic_layers``)."""
    problems = stochastic_layers(model)
    if problems:
        raise MethodConfigError(
            f"{where}: HMC needs a fixed likelihood, but {type(model).__name__} has {'; '.join(problems)}. "
            "Use a model without BatchNorm and with dropout 0."
        )


class NetworkPotential:
    """``U(q) = (sum of the cross-entropies over the N images + precision/2 |q|^2) / temperature``
    for ``C`` weight vectors ``q [C, D]`` at once, with its gradient (a ``methods.hmc_kernel.Potential``).

    ``q`` concatenates the plain model's parameters in ``named_parameters`` order, each flattened
    (``flatten``/``unflatten`` convert). Each chain's value depends on its own row only.
    ``implementation``: ``auto`` (the stacked networks: numba kernels on CPU, vmap elsewhere; a
    loop where neither applies), ``packed``, ``vmap``, or ``loop`` (the plain model, one chain after
    the other: the cheapest for a single chain, as the packed kernels compute 16 lanes at once).
    With the packed kernels the value and gradient come from their fused cross-entropy step, as
    the zoo trainer's (``PackedChain.loss_and_grads``); otherwise from autograd over the logits.
    """

    def __init__(self, model: nn.Module, images: torch.Tensor, labels: torch.Tensor, prior_precision: float,
                 temperature: float = 1.0, device: torch.device | str = "cpu", implementation: str = "auto") -> None:
        refuse_stochastic(model)
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        self.keys = [name for name, _ in model.named_parameters()]
        self.shapes = [tuple(p.shape) for _, p in model.named_parameters()]
        self.sizes = [p.numel() for _, p in model.named_parameters()]
        self.buffers = {k: v.detach() for k, v in model.named_buffers()}
        self.state_keys = list(model.state_dict())
        self.images, self.labels = images.to(self.device), labels.to(self.device)
        self.prior_precision, self.temperature = float(prior_precision), float(temperature)
        self.net = None
        if implementation != "loop" and not self.buffers:
            try:
                self.net = stacked_networks(model, self.device, implementation)
            except NotStackableError as err:
                if implementation != "auto":
                    raise
                log.info("method=hmc: %s; one forward pass per chain instead", err)
        self._batches: dict[int, torch.Tensor] = {}

    @property
    def dimension(self) -> int:
        return sum(self.sizes)

    def flatten(self, state_dict: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The parameters of a plain state dict as one vector ``[D]`` (float32, on the device)."""
        return torch.cat([state_dict[k].detach().reshape(-1).float() for k in self.keys]).to(self.device)

    def unflatten(self, q: torch.Tensor) -> dict[str, torch.Tensor]:
        """Plain state dict (CPU) of weights ``q [D]`` (buffers the model's), keys in state-dict order."""
        params = dict(zip(self.keys, (v.reshape(s) for v, s in zip(q.detach().cpu().split(self.sizes), self.shapes))))
        merged = {**params, **{k: v.cpu() for k, v in self.buffers.items()}}
        return {k: merged[k].contiguous() for k in self.state_keys}

    def samples(self, draws: torch.Tensor) -> SampleSet:
        """Sample set ``{key: [S, ...]}`` (CPU, plain keys) of weight vectors ``draws [S, D]``."""
        parts = draws.detach().cpu().split(self.sizes, dim=1)
        out = {k: v.reshape(len(draws), *s).contiguous() for k, v, s in zip(self.keys, parts, self.shapes)}
        for key, value in self.buffers.items():
            out[key] = value.cpu()[None].expand(len(draws), *value.shape).contiguous()
        return {k: out[k] for k in self.state_keys}

    def _stacked(self, q: torch.Tensor) -> dict[str, torch.Tensor]:
        """The weights ``q [C, D]`` as the stacked networks' parameters (each chain along ``network_axis``)."""
        parts = [v.reshape(len(q), *s) for v, s in zip(q.split(self.sizes, dim=1), self.shapes)]
        return {k: p.movedim(0, self.net.network_axis(k)) for k, p in zip(self.keys, parts)}

    def _packed_batch(self, chains: int) -> torch.Tensor:
        """The N images laid out for the packed kernels' ``chains`` networks (lanes padded to ``LANES``), kept
        for the last lane count."""
        lanes = chains + (-chains % LANES)
        if lanes not in self._batches:
            index = torch.arange(len(self.images), device="cpu").expand(chains, -1)  # packed kernels: CPU only
            self._batches = {lanes: self.net.batch(self.net.source(self.images, self.device), index, None, 0, 0.0)}
        return self._batches[lanes]

    def _logits(self, q: torch.Tensor) -> torch.Tensor:
        """Logits ``[C, N, classes]`` of each chain's network on every training image."""
        chains = len(q)
        if self.net is None:
            parts = [v.reshape(chains, *s) for v, s in zip(q.split(self.sizes, dim=1), self.shapes)]
            return torch.stack([
                functional_call(self.model, {**dict(zip(self.keys, (p[c] for p in parts))), **self.buffers}, (self.images,))
                for c in range(chains)])
        if isinstance(self.net, PackedChain):
            return self.net.forward(self._stacked(q), self._packed_batch(chains))
        return self.net.predict(self._stacked(q), self.images)

    def fisher_diagonal(self, q: torch.Tensor) -> torch.Tensor:
        """The diagonal of the Fisher information of the likelihood at each chain's weights ``q [C, D]``:
        ``sum_i sum_c p_ic (d log p_ic / dq)^2`` over the N images and the classes (exactly, not
        sampled: the Gauss-Newton diagonal of the summed cross-entropy), ``[C, D]``, divided by the
        temperature. With the prior precision added it is a diagonal guess of the potential's
        curvature, hence of ``M^-1``'s inverse (``HMCSettings.initial_mass``)."""
        out = []
        for row in q.detach():
            params = dict(zip(self.keys, (v.reshape(s) for v, s in zip(row.split(self.sizes), self.shapes))))

            def log_probs(p, image):
                return torch.log_softmax(functional_call(self.model, {**p, **self.buffers}, (image[None],))[0], -1)

            total = torch.zeros(self.dimension, dtype=torch.float64, device=self.device)
            for first in range(0, len(self.images), FISHER_CHUNK):
                images = self.images[first : first + FISHER_CHUNK]
                jacobian = vmap(jacrev(log_probs), in_dims=(None, 0))(params, images)  # key -> [B, classes, *shape]
                flat = torch.cat([jacobian[k].reshape(len(images), jacobian[k].shape[1], -1) for k in self.keys], -1)
                probs = vmap(log_probs, in_dims=(None, 0))(params, images).exp()
                total += (probs[:, :, None].double() * flat.double() ** 2).sum((0, 1))
            out.append(total / self.temperature)
        return torch.stack(out).to(q.dtype)

    def curvature_inverse_mass(self, q: torch.Tensor) -> torch.Tensor:
        """``M^-1 [C, D]`` guessed from the curvature at ``q [C, D]``: ``1 / (Fisher diagonal + prior precision / T)``."""
        return 1.0 / (self.fisher_diagonal(q) + self.prior_precision / self.temperature)

    def __call__(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(U [C], dU/dq [C, D])`` at ``q [C, D]``: through the packed kernels' fused cross-entropy
        step (``PackedChain.loss_and_grads``, no autograd graph) where the networks are a packed
        chain, else autograd over ``_logits``."""
        if isinstance(self.net, PackedChain):
            return self._packed_potential(q.detach())
        return self._autograd_potential(q)

    def _autograd_potential(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``__call__`` by autograd over ``_logits`` (any stacked form, or the plain model chain by chain)."""
        with torch.enable_grad():
            q = q.detach().requires_grad_()
            logits = self._logits(q)
            chains, n = logits.shape[:2]
            nll = F.cross_entropy(logits.reshape(chains * n, -1), self.labels.repeat(chains), reduction="none")
            u = (nll.view(chains, n).sum(1) + 0.5 * self.prior_precision * (q * q).sum(1)) / self.temperature
            (gradient,) = torch.autograd.grad(u.sum(), q)
        return u.detach(), gradient

    def _packed_potential(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``__call__`` through ``PackedChain.loss_and_grads``: the mean cross-entropy over the N
        images and its gradient, times N, plus the prior's, over the temperature."""
        chains, n = len(q), len(self.labels)
        mean, grads = self.net.loss_and_grads(self._stacked(q), self._packed_batch(chains), self.labels.expand(chains, -1),
                                              part_images=FULL_BATCH_PART)
        likelihood = torch.cat([grads[k].movedim(self.net.network_axis(k) % grads[k].dim(), 0).reshape(chains, -1)
                                for k in self.keys], dim=1)
        u = (n * mean + 0.5 * self.prior_precision * (q * q).sum(1)) / self.temperature
        return u, (n * likelihood + self.prior_precision * q) / self.temperature


@dataclass
class HMCSettings(KernelSettings, MethodSettings):
    """Full-batch HMC settings: the kernel's (``methods.hmc_kernel.KernelSettings``: trajectory
    length, warm-up, thinning, step-size adaptation, divergences and restarts, mass adaptation),
    with the method's defaults for OptuNet-sized networks (``max_leapfrog_steps`` 32, ``warmup`` 50,
    ``thinning`` 2, no windowed mass adaptation: ``M^-1`` stays the Fisher guess at the start;
    conf/methods/hmc.yaml says why), and the method's own.

    ``start``: ``init`` (an independent initialisation of the model factory under ``init_seed(seed, attempt)``)
    or ``base`` (the base network); ``temperature``: T of ``p(w | D)^(1/T)``;
    ``weight_decay``: the prior precision per example (null = the recipe's; precision N x it);
    ``descent_steps``, ``descent_lr``: ``start=init``'s full-batch Adam steps on the mean potential
    ``U / N`` before the warm-up, its learning rate cosine-decayed from ``descent_lr`` to 0 (0
    steps: none); ``start_min_accuracy``: a ``start=init`` start whose accuracy on the training
    split after the descent is below it is drawn again (null: every start is kept);
    ``start_attempts``: initialisations a chain tries before it stops with ``MethodFitError``;
    ``chains_per_start``: ``start=init`` chains whose seeds share ``seed // chains_per_start`` share one
    start (``start_seed``: the descended initialisation of the group's first seed, and its ``M^-1``),
    each with its own random stream, so that the chains of one start can be compared (the R-hat
    within a start, apart from the differences between modes; ``benchmark/report/hmc.py``);
    ``initial_mass``: where ``M^-1`` starts before its warm-up adaptation: ``identity``, or
    ``fisher``, the inverse of the curvature guessed at the chain's start (the likelihood's Fisher
    diagonal plus the prior precision: ``NetworkPotential.curvature_inverse_mass``), so that the
    first warm-up iterations move every weight on its own scale;
    ``chains_at_once``: chains stacked in one pass by ``run_chains`` (the CPU kernels run 16
    networks per vector; more costs proportionally); ``save_every``: iterations between saved
    chain states in ``run_chains`` with ``files``; ``forward``: how the chains' forward passes
    run (``NetworkPotential``'s ``implementation``: auto, packed, vmap, loop).
    """

    max_leapfrog_steps: int = 32
    warmup: int = 50
    thinning: int = 2
    adapt_mass: bool = False
    start: str = "init"
    temperature: float = 1.0
    weight_decay: Optional[float] = None
    chains_at_once: int = 16
    save_every: int = 10
    forward: str = "auto"
    initial_mass: str = "fisher"
    descent_steps: int = 1000
    descent_lr: float = 0.03
    start_min_accuracy: Optional[float] = 0.5
    start_attempts: int = 4
    chains_per_start: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()  # the kernel's own range checks
        require(self.initial_mass in INITIAL_MASSES, "initial_mass", self.initial_mass,
                f"one of {', '.join(INITIAL_MASSES)}")
        require(self.descent_steps >= 0, "descent_steps", self.descent_steps, "an integer >= 0 (0 = no descent)")
        require(math.isfinite(self.descent_lr) and self.descent_lr > 0, "descent_lr", self.descent_lr, "a positive number")
        require(self.start_min_accuracy is None or 0 <= self.start_min_accuracy < 1, "start_min_accuracy",
                self.start_min_accuracy, "a fraction in [0, 1) or null (keep every start)")
        require(self.start_attempts >= 1, "start_attempts", self.start_attempts, "a positive integer")
        require(self.chains_per_start >= 1, "chains_per_start", self.chains_per_start, "a positive integer")
        require(self.chains_per_start == 1 or self.start == "init", "chains_per_start", self.chains_per_start,
                "1 with start=base (chains sharing a start need start=init)")
        require(self.forward in FORWARDS, "forward", self.forward, f"one of {', '.join(FORWARDS)}")
        require(self.start in STARTS, "start", self.start, f"one of {', '.join(STARTS)}")
        require(math.isfinite(self.temperature) and self.temperature > 0, "temperature", self.temperature,
                "a positive number")
        require(self.weight_decay is None or self.weight_decay >= 0, "weight_decay", self.weight_decay,
                "a number >= 0 or null (= train.weight_decay)")
        require(self.chains_at_once >= 1, "chains_at_once", self.chains_at_once, "a positive integer")
        require(self.save_every >= 1, "save_every", self.save_every, "a positive integer")

    def kernel(self) -> KernelSettings:
        """The kernel part of the settings."""
        return KernelSettings(**{f.name: getattr(self, f.name) for f in fields(KernelSettings)})


def chain_name(seed: int) -> str:
    """The name of the chain of base ``seed`` (``seed_000042``), its state file's stem: the store's
    ``Unit.chain_stem``, so that ``store.chain_files(unit, key).path(seed)`` is that file."""
    return Unit.zoo("", seed).stem


def chain_seed(name: str) -> int:
    """The base seed of the chain named ``name`` (``chain_name``'s inverse)."""
    unit = Unit.parse("", f"{name}.safetensors")
    if unit is None or not unit.is_seed:
        raise ValueError(f"method=hmc: {name!r} is not a chain name (seed_<six digits>)")
    return int(unit.seed)


def sampling_seed(seed: int) -> int:
    """The seed of a chain's sampling phase: the first draw of ``torch.Generator().manual_seed(seed)``,
    as ``HMCMethod.sample`` takes it from the generator the sample stage seeds with the base seed."""
    return int(torch.randint(0, 2**62, (1,), generator=torch.Generator().manual_seed(seed)))


def start_seed(seed: int, chains_per_start: int = 1) -> int:
    """The seed whose initialisation chain ``seed`` starts from: ``seed`` rounded down to a multiple
    of ``chains_per_start`` (``HMCSettings.chains_per_start``; 1: the chain's own seed)."""
    return int(seed) - int(seed) % int(chains_per_start)


def init_seed(seed: int, attempt: int = 0) -> int:
    """The seed of attempt ``attempt`` at initialising chain ``seed`` (``start=init``; see ``INIT_SEEDS``)."""
    return INIT_SEEDS + attempt * (MAX_SEED + 1) + int(seed)


class ChainsInterrupted(RuntimeError):
    """``run_chains`` stopped early because its ``should_stop`` said so (e.g. a claim was lost)."""


class HMCMethod(ResumableChains, PosteriorMethod):
    """Full-batch HMC (see the module doc): one chain per base network in the sample stage's
    protocol, or many chains at once through ``start_chains`` / ``run_chains``; resumable chain
    states in a folder (``ResumableChains``: the sample stage runs them under per-chain claims)."""

    name = "hmc"
    order = 100
    label = "HMC"
    Settings = HMCSettings
    modes = ("one", "multi")
    # Not in method=all until its cost on the default run is measured on an idle machine (see
    # conf/methods/hmc.yaml); method=hmc runs it.
    in_default_run = False
    markov_chain = True

    @classmethod
    def chain_layout(cls, meta: SampleSetMetadata, n: int) -> tuple[int, int] | None:
        """One chain per base, ``samples_per_base`` draws each."""
        if meta.base_seeds and meta.samples_per_base and len(meta.base_seeds) * meta.samples_per_base == n:
            return len(meta.base_seeds), int(meta.samples_per_base)
        return None

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._potential: NetworkPotential | None = None
        self._warm: ChainState | None = None
        self._sampled: ChainState | None = None
        self._cache: tuple[int, int, ChainState] | None = None
        self._chain_files: ChainFiles | None = None
        self._pending: tuple[int, Mapping[str, torch.Tensor] | None] | None = None

    # -- set-up -----------------------------------------------------------------------------------
    def _template(self) -> nn.Module:
        with seeded(0):  # building a model draws from the global RNG; leave it as it was
            return self.new_model()

    def check(self, mode: str) -> None:
        """Refuses, besides the mode and ``unavailable``, a model with BatchNorm or active dropout."""
        super().check(mode)
        refuse_stochastic(self._template())

    @property
    def prior_precision(self) -> float:
        """``N x weight_decay`` (N: training images): the Gaussian prior's precision per weight."""
        wd = self.recipe.weight_decay if self.settings.weight_decay is None else self.settings.weight_decay
        return len(self.data.train_tensors[1]) * wd

    @property
    def potential(self) -> NetworkPotential:
        """The potential on the un-augmented training split (built once)."""
        if self._potential is None:
            images, labels = self.data.train_tensors
            self._potential = NetworkPotential(self._template(), images, labels, self.prior_precision,
                                               self.settings.temperature, self.device, self.settings.forward)
        return self._potential

    def kernel(self) -> StackedHMC:
        return StackedHMC(self.potential, self.settings.kernel())

    def fingerprint(self) -> str:
        """What a saved chain state must match to be resumed, as far as the method can tell: the
        settings that change its draws, the training data's identity (a digest of its images and
        labels), the prior precision, the parameter layout and the code of this module and of
        what it imports (``code_fingerprint``). The sample stage adds the unit's key (the zoo,
        the sample counts, the held-out range: ``ChainFiles.key``)."""
        relevant = {k: v for k, v in asdict(self.settings).items() if k not in ("unavailable", "chains_at_once", "save_every")}
        images, labels = self.data.train_tensors
        data = hashlib.sha256()
        for tensor in (images, labels):
            data.update(str((tuple(tensor.shape), tensor.dtype)).encode())
            data.update(tensor.detach().cpu().contiguous().numpy().tobytes())
        payload = {"settings": relevant, "prior_precision": self.prior_precision, "data": data.hexdigest()[:16],
                   "layout": list(zip(self.potential.keys, self.potential.shapes)),
                   "code": code_fingerprint((type(self).__module__,))}
        return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def _tag(self, files: ChainFiles | None) -> str:
        """The tag a chain saved in ``files`` must carry: ``files.key`` (the unit's key, with this
        method's ``fingerprint`` in it), or the fingerprint alone outside a store."""
        return files.key if files is not None and files.key else self.fingerprint()

    def chain_start(self, seed: int, base: Mapping[str, torch.Tensor] | None = None, attempt: int = 0) -> torch.Tensor:
        """Where chain ``seed`` starts ``[D]``, before any descent: the base (``start=base``) or the
        model factory's initialisation under ``init_seed(seed, attempt)`` (``start=init``)."""
        if self.settings.start == "base":
            if base is None:
                raise ValueError("method=hmc start=base: a chain needs its base network")
            missing = [k for k in self.potential.keys if k not in base]
            if missing:
                raise ValueError(f"method=hmc: the base network lacks the parameters {missing}")
            return self.potential.flatten(base)
        with seeded(init_seed(seed, attempt)):
            model = self.new_model()
        return self.potential.flatten(model.state_dict())

    def descend(self, q: torch.Tensor, progress: bool = False) -> torch.Tensor:
        """``q [C, D]`` after ``descent_steps`` of full-batch Adam on each row's mean potential ``U / N``
        (learning rate cosine-decayed from ``descent_lr`` to 0); every row on its own (Adam is
        elementwise and the potential is per row), so a row's result does not depend on the others."""
        steps = self.settings.descent_steps
        if steps == 0:
            return q
        n = len(self.potential.labels)
        q = q.detach().clone().requires_grad_()
        optimizer = torch.optim.Adam([q], lr=self.settings.descent_lr)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
        for _ in tqdm(range(steps), desc=f"hmc descent of {len(q)} start(s)", unit="step", dynamic_ncols=True,
                      disable=not progress):
            _, gradient = self.potential(q.detach())
            q.grad = gradient / n
            optimizer.step()
            schedule.step()
        return q.detach()

    def train_accuracy(self, q: torch.Tensor) -> torch.Tensor:
        """Accuracy ``[C]`` on the (un-augmented) training split of the networks ``q [C, D]``."""
        with torch.no_grad():
            logits = self.potential._logits(q.detach())
        return (logits.argmax(-1) == self.potential.labels).double().mean(-1)

    def chain_starts(self, seeds: Sequence[int], bases: Sequence[Mapping[str, torch.Tensor] | None],
                     progress: bool = False) -> list[tuple[torch.Tensor, dict[str, int]]]:
        """``(start [D], origin)`` of each chain (``{"base": seed}``, or ``{"init_seed": ..., "attempt": ...}``):
        ``start=base`` the base; ``start=init``
        the first of attempts 0, 1, ... (``init_seed``) whose descended start reaches
        ``start_min_accuracy`` on the training split, two attempts per chain descended at once
        (each row on its own: a chain's start does not depend on the others); with
        ``chains_per_start`` > 1, that of ``start_seed(seed)``, descended once for the chains sharing
        it (``origin`` adds ``start_seed``). ``MethodFitError`` naming the chain when all
        ``start_attempts`` fail."""
        s = self.settings
        if s.start == "base":
            return [(self.chain_start(seed, base), {"base": int(seed)}) for seed, base in zip(seeds, bases)]
        if s.chains_per_start > 1:  # one descent per shared start; each chain records the seed it starts from
            leaders = sorted({start_seed(seed, s.chains_per_start) for seed in seeds})
            begun = dict(zip(leaders, self._init_starts(leaders, progress)))
            return [(begun[start_seed(seed, s.chains_per_start)][0].clone(),
                     {**begun[start_seed(seed, s.chains_per_start)][1], "start_seed": start_seed(seed, s.chains_per_start)})
                    for seed in seeds]
        return self._init_starts(list(seeds), progress)

    def _init_starts(self, seeds: Sequence[int], progress: bool) -> list[tuple[torch.Tensor, dict[str, int]]]:
        """``chain_starts`` of ``start=init`` for the initialisations of ``seeds``."""
        s = self.settings
        found: dict[int, tuple[torch.Tensor, dict[str, int]]] = {}
        next_attempt = {i: 0 for i in range(len(seeds))}
        while next_attempt:
            rows = [(i, a) for i, first in next_attempt.items() for a in (first, first + 1) if a < s.start_attempts]
            q = self.descend(torch.stack([self.chain_start(seeds[i], attempt=a) for i, a in rows]), progress)
            accuracy = self.train_accuracy(q) if s.start_min_accuracy is not None else torch.ones(len(rows), device="cpu")
            for (i, a), start, acc in zip(rows, q, accuracy.tolist()):
                if i not in found and i in next_attempt and acc >= (s.start_min_accuracy or 0.0):
                    found[i] = (start, {"init_seed": init_seed(seeds[i], a), "attempt": a})
                    del next_attempt[i]
                elif i in next_attempt:
                    log.info("method=hmc chain %s: initialisation %d reaches %.1f%% training accuracy after the descent, "
                             "below start_min_accuracy; trying the next", chain_name(seeds[i]), init_seed(seeds[i], a),
                             100 * acc)
            for i in list(next_attempt):
                next_attempt[i] += 2
                if next_attempt[i] >= s.start_attempts:
                    raise MethodFitError(
                        f"method=hmc chain {chain_name(seeds[i])}: none of its {s.start_attempts} initialisations reached "
                        f"{s.start_min_accuracy:.0%} training accuracy after {s.descent_steps} descent steps (raise "
                        "methods.hmc.start_attempts or descent_steps, or lower start_min_accuracy)")
        return [found[i] for i in range(len(seeds))]

    # -- many chains at once -------------------------------------------------------------------
    def start_chains(self, seeds: Sequence[int], bases: Sequence[Mapping[str, torch.Tensor] | None] | None = None
                     ) -> list[ChainState]:
        """New chains ``seed_<seed>`` (six digits), one per seed, each started where ``chain_starts``
        says (recorded as the chain's ``origin``), its ``M^-1`` from ``initial_mass``, its random
        stream seeded by the seed (the sampling phase by ``sampling_seed(seed)``)."""
        bases = [None] * len(seeds) if bases is None else list(bases)
        if len(bases) != len(seeds):
            raise ValueError(f"method=hmc: {len(seeds)} seeds but {len(bases)} bases")
        if not seeds:
            return []
        starts = self.chain_starts(seeds, bases, progress=True)
        masses = [None] * len(seeds)
        if self.settings.initial_mass == "fisher":  # row by row: independent of the other chains
            masses = list(self.potential.curvature_inverse_mass(torch.stack([start for start, _ in starts])))
        chains = []
        for seed, (start, origin), mass in zip(seeds, starts, masses):
            chain = new_chain(chain_name(seed), start, seed, sampling_seed(seed), mass)
            chain.origin = origin
            chains.append(chain)
        return chains

    def run_chains(self, chains: Sequence[ChainState], draws: int, *, files: ChainFiles | None = None,
                   progress: bool = True, restart_stale: bool = False,
                   should_stop: Callable[[], bool] | None = None) -> list[ChainState]:
        """Run ``chains`` until each has ``draws`` kept draws (or has diverged for good), in groups
        of ``chains_at_once`` stacked chains. With ``files`` (the store's ``ChainFiles``), a chain
        whose state ``files.path(seed)`` exists resumes from it, and every chain's state is saved
        there every ``save_every`` iterations and at the end. A saved state of another tag (other
        settings, data, code or unit key: ``_tag``), or a damaged one, raises ``ValueError`` naming
        the file, or with ``restart_stale`` is logged and the chain starts again (the same draws: a
        chain is fixed by its seed). ``should_stop()``, asked after each saved iteration, ends the
        run early with ``ChainsInterrupted`` (what was saved stays). Returns the chains' final
        states, in order."""
        tag = self._tag(files)
        states = []
        for chain in chains:
            path = None if files is None else files.path(chain_seed(chain.name))
            saved = self._saved_state(path, tag, restart_stale) if path is not None and path.exists() else None
            chain = saved or chain
            chain.tag = tag
            states.append(chain)
            if path is not None and saved is None:  # its start (the descent) is kept from now on
                path.parent.mkdir(parents=True, exist_ok=True)
                chain.save(path)
        kernel, size = self.kernel(), self.settings.chains_at_once
        for first in range(0, len(states), size):
            group = states[first : first + size]
            if all(kernel.finished(c, draws) for c in group):
                continue
            counter = {"iterations": 0}

            def save(current: Sequence[ChainState], group=group, counter=counter) -> None:
                counter["iterations"] += 1
                if files is not None and counter["iterations"] % self.settings.save_every == 0:
                    for chain in group:
                        chain.save(files.path(chain_seed(chain.name)))
                    if should_stop is not None and should_stop():
                        raise ChainsInterrupted(f"method=hmc: chains {[c.name for c in group]} stopped (their states "
                                                f"are saved in {files.directory})")

            kernel.run(group, draws, on_iteration=save, progress=progress,
                       description=f"hmc chains {first + 1}-{first + len(group)} of {len(states)}")
            if files is not None:
                for chain in group:
                    chain.save(files.path(chain_seed(chain.name)))
        return states

    def _saved_state(self, path: Path, tag: str, restart_stale: bool) -> ChainState | None:
        """The chain saved at ``path`` if it was run under fingerprint ``tag``; otherwise ``ValueError``,
        or (``restart_stale``) None after removing the file."""
        try:
            saved = ChainState.load(path, self.device)
            problem = None if saved.tag == tag else (f"saved under other HMC settings, data, code or inputs (key "
                                                     f"{saved.tag}, now {tag})")
        except CheckpointError as err:
            saved, problem = None, f"unreadable ({err})"
        if problem is None:
            return saved
        if not restart_stale:
            raise ValueError(f"{path}: {problem}; remove it to start the chain again")
        log.warning("%s: %s; the chain starts again", path, problem)
        path.unlink(missing_ok=True)
        return None

    # -- resumable chains in the sample stage (ResumableChains) -------------------------------------
    @property
    def chains_at_once(self) -> int:
        return self.settings.chains_at_once

    def chain_finished(self, files: ChainFiles, seed: int, draws: int) -> bool:
        """Whether ``files`` hold chain ``seed_<seed>`` of the current tag (``_tag``) with ``draws``
        kept draws, or diverged for good (unreadable or stale states count as not finished)."""
        path = files.path(seed)
        if not path.exists():
            return False
        try:
            saved = ChainState.load(path, "cpu")
        except (CheckpointError, OSError):
            return False
        return saved.tag == self._tag(files) and (saved.phase == DIVERGED or (saved.phase == SAMPLING and len(saved.draws) >= draws))

    def run_chains_in(self, files: ChainFiles, seeds: Sequence[int], load_base: Callable[[int], dict[str, torch.Tensor]],
                      draws: int, should_stop: Callable[[], bool]) -> bool:
        """``run_chains`` of the chains of bases ``seeds`` (started as ``start_chains`` does; the
        bases are loaded only with ``start=base``), saved in ``files``; False if stopped."""
        try:
            self.run_chains(self.resumed_or_started(files, seeds, load_base), draws, files=files,
                            restart_stale=True, should_stop=should_stop)
        except ChainsInterrupted as err:
            log.warning("%s", err)
            return False
        return True

    def resumed_or_started(self, files: ChainFiles, seeds: Sequence[int],
                           load_base: Callable[[int], Mapping[str, torch.Tensor] | None]) -> list[ChainState]:
        """The chains of ``seeds``: each one's saved state in ``files`` when it is usable (the
        current tag, readable), else a new chain (``start_chains``; a stale or damaged state is
        logged and removed), so that a resumed run does not redo the starts' descent."""
        tag, saved = self._tag(files), {}
        for seed in seeds:
            path = files.path(seed)
            state = self._saved_state(path, tag, restart_stale=True) if path.exists() else None
            if state is not None:
                saved[seed] = state
        fresh = [s for s in seeds if s not in saved]
        bases = [load_base(s) if self.settings.start == "base" else None for s in fresh]
        started = dict(zip(fresh, self.start_chains(fresh, bases)))
        return [saved.get(s) or started[s] for s in seeds]

    def use_chain_states(self, files: ChainFiles | None) -> None:
        """``fit(base, seed)`` then ``sample(n, Generator().manual_seed(seed))`` resume (or run and
        save) chain ``seed_<seed>`` in ``files`` instead of running it in memory."""
        self._chain_files = files

    def chain_samples(self, chain: ChainState) -> SampleSet:
        """The kept draws of ``chain`` as a sample set ``{plain key: [n, ...]}`` (CPU)."""
        return self.potential.samples(chain.draws)

    def chain_predictions(self, chains: Sequence[ChainState], images: torch.Tensor) -> torch.Tensor:
        """Softmax outputs ``[chains, draws, N, classes]`` (float32, CPU) of every kept draw of
        ``chains`` (all with the same number of draws) on ``images [N, ...]``: what the predictive
        R-hat of Izmailov et al. is computed on (``metrics.mcmc.predictive_convergence``, by the runner)."""
        lengths = {len(c.draws) for c in chains}
        if len(lengths) != 1:
            raise ValueError(f"method=hmc: chains with different numbers of draws {sorted(lengths)}")
        model = self._template()
        return torch.stack([predict_with_weights(model, self.chain_samples(c), images) for c in chains])

    # -- the sample stage's protocol --------------------------------------------------------------
    def fit(self, base: dict[str, torch.Tensor], seed: int) -> None:
        """Warm up one chain ``seed_<seed>`` started by ``chain_start(seed, base)`` (with
        ``use_chain_states``: deferred to ``sample``, which resumes the chain saved there)."""
        self._warm = self._sampled = self._cache = None
        self._pending = (seed, base)
        if self._chain_files is not None:
            return
        chain = self._unseeded_chain(seed, base)
        self.kernel().run([chain], 0, warmup_only=True, description=f"hmc warm-up seed {seed}")
        self._warm = chain

    def _unseeded_chain(self, seed: int, base: Mapping[str, torch.Tensor] | None) -> ChainState:
        """The chain ``start_chains`` makes for ``seed``, without its sampling phase's seed (set by ``_continue``)."""
        chain = self.start_chains([seed], [base])[0]
        chain.sampling_seed = None
        return chain

    def _continue(self, n: int, generator: torch.Generator) -> ChainState:
        """The warmed-up chain continued to ``n`` draws, its sampling stream seeded from ``generator``."""
        if self._pending is None:
            raise RuntimeError("method=hmc: call fit() before sample() or predict_own()")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"method=hmc: number of samples must be a positive integer, got {n!r}")
        seed = int(torch.randint(0, 2**62, (1,), generator=generator))
        if self._cache is not None and self._cache[:2] == (seed, n):  # the chain is fixed by its seed
            return self._cache[2]
        chain_seed, base = self._pending
        if self._chain_files is not None and seed == sampling_seed(chain_seed):  # the saved chain is this one
            chains = self.resumed_or_started(self._chain_files, [chain_seed], lambda _: base)
            chain = self.run_chains(chains, n, files=self._chain_files, progress=False, restart_stale=True)[0]
        else:
            if self._warm is None:
                self._warm = self._unseeded_chain(chain_seed, base)
                self.kernel().run([self._warm], 0, warmup_only=True, description=f"hmc warm-up seed {chain_seed}")
            chain = self._warm.copy()
            chain.sampling_seed = seed
            self.kernel().run([chain], n, description=f"hmc {chain.name}")
        if chain.phase == DIVERGED:
            raise MethodFitError(f"method=hmc chain {chain.name}: diverged after {chain.restarts} restarts with smaller "
                                 f"steps; divergences {chain.divergences} (raise methods.hmc.target_accept for smaller steps, "
                                 "or methods.hmc.max_restarts)")
        chain = chain.copy()
        chain.draws = chain.draws[:n]
        self._cache = (seed, n, chain)
        self._sampled = chain
        return chain

    def sample(self, n: int, generator: torch.Generator) -> SampleSet:
        """The chain's next ``n`` kept draws after warm-up ``{plain key: [n, ...]}`` (CPU); one seed
        drawn from ``generator`` fixes them."""
        return self.chain_samples(self._continue(n, generator))

    def predict_own(self, images: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
        """Softmax probabilities ``[n, N, C]`` of the draws ``sample(n, generator)`` returns (the
        same chain: it is fixed by the seed drawn from ``generator``)."""
        chain = self._continue(n, generator)
        return predict_with_weights(self._template(), self.chain_samples(chain), images)

    def diagnostics(self, images: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        """Of the last sampled chain: ``start_attempts`` (initialisations tried), ``step_size``,
        ``accept_prob`` (mean Metropolis probability over the sampling iterations), ``leapfrog_per_draw`` (all its leapfrog steps, warm-up and restarts
        included, per kept draw: the cost), ``truncated_fraction`` (the share of its sampling
        iterations whose trajectory ``max_leapfrog_steps`` cut short), ``warmup_divergences``, ``divergences`` (after warm-up)
        and ``restarts``. The predictive R-hat and ESS come from the stored predictions
        (``metrics.mcmc``), not from here: methods do not import metrics."""
        chain = self._sampled
        if chain is None:
            return {}
        summary = chain.summary()
        return {"start_attempts": float(summary["origin"].get("attempt", 0) + 1),
                "step_size": summary["step_size"], "accept_prob": summary["accept_prob"],
                "leapfrog_per_draw": summary["n_leapfrog"] / max(1, summary["kept"]),
                "truncated_fraction": summary["truncated_fraction"],
                "warmup_divergences": float(summary["warmup_divergences"]),
                "divergences": float(len(summary["divergences"])), "restarts": float(summary["restarts"])}
