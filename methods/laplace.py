"""Laplace approximation around a trained base network, with laplace-torch (Daxberger et al. 2021).

Subset of weights and Hessian structure come from the settings (the config wires them to
``conf/model/*.yaml``; appendix B: OptuNet = all weights, full GGN; ResNet-18 = last layer, KFAC).
The GGN is fitted on the un-augmented train set, the prior precision optimised post hoc
(``prior_optimization``, default the marginal likelihood), and weight samples are ``la.sample(n, generator)``: flat vectors over
the Laplace subset (``la.params`` for 'all', the last Linear's weight then bias otherwise),
written back into full state dicts where every other key keeps its MAP value.
"""
from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass
from enum import Enum

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from benchmark.core.settings import require
from benchmark.core.store import SampleSet
from benchmark.core.training import NonFiniteError, seeded
from methods.base import MethodConfigError, MethodSettings, PosteriorMethod


class SubsetOfWeights(str, Enum):
    """Which weights the Laplace approximation covers (laplace-torch's ``subset_of_weights``)."""

    all = "all"
    last_layer = "last_layer"


class HessianStructure(str, Enum):
    """Structure of the GGN/Hessian (laplace-torch's ``hessian_structure``)."""

    full = "full"
    kron = "kron"
    diag = "diag"


class PriorOptimization(str, Enum):
    """How the prior precision is chosen post hoc."""

    marglik = "marglik"
    """laplace-torch's marginal-likelihood maximisation."""


class PriorStructure(str, Enum):
    """Shape of the prior precision: one value, one per layer, or one per weight."""

    scalar = "scalar"
    layerwise = "layerwise"
    diag = "diag"


@dataclass
class LaplaceSettings(MethodSettings):
    """Laplace settings (appendix B: OptuNet = all weights with the full GGN; ResNet-18 = last
    layer with KFAC; the config takes both from ``conf/model/*.yaml``).

    ``prior_optimization``/``prior_structure``: the post-hoc prior precision; ``marglik_steps``
    and ``marglik_lr``: Adam steps and rate on its log; ``fit_batch_size``: batch size of the
    GGN pass over the un-augmented train set; ``max_full_params``: refuse a full Hessian over
    all weights above this many parameters.
    """

    subset_of_weights: SubsetOfWeights = SubsetOfWeights.all
    hessian_structure: HessianStructure = HessianStructure.full
    prior_optimization: PriorOptimization = PriorOptimization.marglik
    prior_structure: PriorStructure = PriorStructure.scalar
    marglik_steps: int = 100
    marglik_lr: float = 0.1
    fit_batch_size: int = 256
    max_full_params: int = 100_000

    def __post_init__(self) -> None:
        self.subset_of_weights = SubsetOfWeights(self.subset_of_weights)
        self.hessian_structure = HessianStructure(self.hessian_structure)
        self.prior_optimization = PriorOptimization(self.prior_optimization)
        self.prior_structure = PriorStructure(self.prior_structure)
        require(self.marglik_steps >= 1, "marglik_steps", self.marglik_steps, "a positive integer")
        require(self.marglik_lr > 0, "marglik_lr", self.marglik_lr, "a positive number")
        require(self.fit_batch_size >= 1, "fit_batch_size", self.fit_batch_size, "a positive integer")
        require(self.max_full_params >= 1, "max_full_params", self.max_full_params, "a positive integer")


@functools.cache
def per_sample_jacobian_ggn() -> type:
    """``PerSampleJacobianGGN``: laplace-torch's curvlinops GGN, except that the full matrix is
    ``sum_n J_n^T H_n J_n`` from per-sample Jacobians ``J_n`` ``[C, P]`` (``torch.func.vmap``
    over the batch).

    Same matrix as curvlinops' (which multiplies the GGN operator by all P unit vectors, one
    backward pass each), ~50x faster on OptuNet, where C = 10 is far smaller than P = 355.
    Built on first use: laplace-torch takes seconds to import.
    """
    from laplace.curvature import CurvlinopsGGN
    from laplace.curvature.curvature import GGNInterface

    class PerSampleJacobianGGN(CurvlinopsGGN):
        def jacobians(self, x: torch.Tensor, enable_backprop: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
            """``(Js [B, C, P], f [B, C])`` of the model at its current parameters (``x`` ``[B, ...]``)."""

            def one_output(params: dict[str, torch.Tensor], xi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                out = torch.func.functional_call(self.model, (params, self.buffers_dict), (xi[None],))[0]
                return out, out

            per_sample = torch.func.vmap(torch.func.jacrev(one_output, has_aux=True), in_dims=(None, 0))
            js, f = per_sample(self.params_dict, x)
            js = torch.cat([j.flatten(start_dim=2) for j in js.values()], dim=2)
            return (js, f) if enable_backprop else (js.detach(), f.detach())

        def full(self, x: torch.Tensor, y: torch.Tensor, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
            """``(loss, GGN [P, P])`` of the batch ``(x, y)`` from its per-sample Jacobians."""
            return GGNInterface.full(self, x, y, **kwargs)

    return PerSampleJacobianGGN


def last_linear_name(model: nn.Module) -> str:
    """Module name of the model's last ``nn.Linear`` (its output layer)."""
    names = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not names:
        raise MethodConfigError(f"method=laplace: model {type(model).__name__} has no Linear output layer")
    return names[-1]


class LaplaceMethod(PosteriorMethod):
    """Laplace around a trained base network; ``fit`` uses the base's weights (``seed`` is unused: no randomness)."""

    name = "laplace"
    order = 80
    paper_label = "Laplace"
    label = "Laplace"
    diagnostics_note = (
        "Laplace: optimised prior precision; GGN eigen-directions below it (near-flat: the posterior variance there "
        "is the prior's, 1/precision); test accuracy of laplace-torch's GLM predictive (probit), of the sampled "
        "predictive (100 draws) and of one draw. A sampled predictive far below the GLM one means the weight samples "
        "are broader than the linearised model assumes."
    )
    Settings = LaplaceSettings
    starts_from_base = True  # the approximation is centred at the repetition's base network

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._la = None
        self._map: dict[str, torch.Tensor] = {}
        self._keys: list[str] = []

    def check(self, mode: str) -> None:
        """Refuse a whole-network Hessian the model cannot have (size, BatchNorm)."""
        super().check(mode)
        s = self.settings
        if s.subset_of_weights != SubsetOfWeights.all or s.hessian_structure == HessianStructure.diag:
            return
        with seeded(0):  # building a model draws from the global RNG; leave it as it was
            model = self.model_factory()
        n_params = sum(p.numel() for p in model.parameters())
        has_bn = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
        reasons = []
        if s.hessian_structure == HessianStructure.full and n_params > s.max_full_params:
            reasons.append(f"its {n_params:,} x {n_params:,} Hessian does not fit (methods.laplace.max_full_params={s.max_full_params:,})")
        if has_bn:
            reasons.append(f"the {s.hessian_structure.value} curvature backends do not handle its BatchNorm layers")
        if reasons:
            raise MethodConfigError(
                f"method=laplace on {type(model).__name__} with subset_of_weights=all "
                f"hessian_structure={s.hessian_structure.value}: {'; '.join(reasons)}. Use "
                f"methods.laplace.subset_of_weights=last_layer methods.laplace.hessian_structure=kron (appendix B)"
            )

    def fit(self, base: dict[str, torch.Tensor], seed: int) -> None:
        """Fit the Laplace approximation at ``base`` on the un-augmented train set and optimise
        its prior precision. A non-finite prior precision or posterior raises ``NonFiniteError``."""
        from laplace import Laplace

        s = self.settings
        subset, structure = s.subset_of_weights.value, s.hessian_structure.value
        self._la = None
        with seeded(seed):  # building a model draws from the global RNG; leave it as it was
            model = self.new_model()
        model.load_state_dict(base)
        model.eval()
        options = {"backend": per_sample_jacobian_ggn()} if (subset, structure) == ("all", "full") else {}
        if subset == "last_layer":
            options["last_layer_name"] = last_linear_name(model)
        la = Laplace(model, "classification", subset_of_weights=subset, hessian_structure=structure, **options)
        la.fit(DataLoader(TensorDataset(*self.data.train_tensors), batch_size=s.fit_batch_size))
        with warnings.catch_warnings():  # link_approx only matters for the GLM predictive, which we do not use
            warnings.filterwarnings("ignore", message=".*link_approx.*")
            la.optimize_prior_precision(
                method=s.prior_optimization.value, prior_structure=s.prior_structure.value,
                n_steps=s.marglik_steps, lr=s.marglik_lr,
            )
        where = f"laplace seed {seed}"
        if not bool(torch.isfinite(la.prior_precision).all()):
            raise NonFiniteError(f"{where}: optimised prior precision is {la.prior_precision.tolist()}")
        if not math.isfinite(float(la.log_det_posterior_precision)):
            raise NonFiniteError(f"{where}: posterior precision is singular or non-finite")
        self._la, self._map = la, {k: v.detach().clone() for k, v in model.state_dict().items()}
        self._keys = self._subset_keys(model, subset)

    @staticmethod
    def _subset_keys(model: nn.Module, subset: str) -> list[str]:
        """State-dict keys of the Laplace parameters, in the order of laplace-torch's flat vectors."""
        if subset == "all":
            return [name for name, p in model.named_parameters() if p.requires_grad]
        layer = last_linear_name(model)
        return [f"{layer}.{name}" for name, _ in dict(model.named_modules())[layer].named_parameters()]

    def _fitted(self):
        if self._la is None:
            raise RuntimeError("method=laplace: call fit() before sample() or predict_own()")
        return self._la

    def diagnostics(self, images: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        """The optimised prior precision (mean over its entries); the number and fraction of
        near-flat directions (GGN eigenvalues below the prior precision: there the posterior
        variance is set by the prior, not the data); and accuracies (fractions) on ``images``: of
        laplace-torch's GLM predictive (probit), of the sampled predictive (100 draws averaged,
        what the benchmark's samples amount to), and the mean accuracy of one draw."""
        la = self._fitted()
        prior = float(la.prior_precision.mean())
        eigenvalues = self._ggn_eigenvalues(la)
        out = {"prior_precision": prior, "parameters": float(la.n_params)}
        if eigenvalues is not None:
            flat = int((eigenvalues < prior).sum())
            out |= {"near_flat_directions": float(flat), "near_flat_fraction": flat / eigenvalues.numel()}
        x, y = images.to(self.device), labels.cpu()
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            glm = la(x, pred_type="glm", link_approx="probit").cpu()
            draws = la.predictive_samples(x, pred_type="nn", n_samples=100,
                                          generator=torch.Generator(device=self.device).manual_seed(0)).cpu()
        out["glm_accuracy"] = float((glm.argmax(-1) == y).double().mean())
        out["sampled_accuracy"] = float((draws.mean(0).argmax(-1) == y).double().mean())
        out["draw_accuracy"] = float((draws.argmax(-1) == y).double().mean())
        return out

    @staticmethod
    def _ggn_eigenvalues(la) -> torch.Tensor | None:
        """Eigenvalues of the GGN (the data term of the posterior precision) when laplace-torch
        holds it as a full matrix (``la.H``) or as Kronecker factors (``la.H.kfacs``: a block's
        eigenvalues are the products of its factors' eigenvalues); None otherwise."""
        H = la.H
        if isinstance(H, torch.Tensor) and H.dim() == 2:
            return torch.linalg.eigvalsh(H.double())
        kfacs = getattr(H, "kfacs", None)
        if kfacs is None:
            return None
        blocks = []
        for factors in kfacs:
            values = torch.ones(1, dtype=torch.float64, device=factors[0].device)
            for factor in factors:
                values = torch.outer(values, torch.linalg.eigvalsh(factor.double())).flatten()
            blocks.append(values.cpu())
        return torch.cat(blocks)

    def _device_generator(self, generator: torch.Generator) -> torch.Generator:
        """laplace-torch wants a generator on its device: one seeded from ``generator``."""
        seed = int(torch.randint(0, 2**62, (1,), generator=generator))
        return torch.Generator(device=self.device).manual_seed(seed)

    def to_sample_set(self, flat: torch.Tensor) -> SampleSet:
        """Full state dicts ``{key: [n, ...]}`` from flat subset vectors ``flat`` ``[n, P_subset]``; other keys MAP."""
        n = flat.shape[0]
        out = {k: v[None].expand(n, *v.shape).clone().cpu() for k, v in self._map.items()}
        offset = 0
        for key in self._keys:
            size = self._map[key].numel()
            out[key] = flat[:, offset : offset + size].reshape(n, *self._map[key].shape).detach().cpu()
            offset += size
        if offset != flat.shape[1]:
            raise RuntimeError(f"method=laplace: samples have {flat.shape[1]} entries, the subset {self._keys} has {offset}")
        return out

    def sample(self, n: int, generator: torch.Generator) -> SampleSet:
        """``n`` Laplace draws ``la.sample(n)`` as full state dicts (non-subset keys at the MAP)."""
        la = self._fitted()
        return self.to_sample_set(la.sample(n, generator=self._device_generator(generator)))

    @torch.no_grad()
    def predict_own(self, images: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
        """laplace-torch's sampled ("nn") predictive ``[n, N, C]`` with the draws ``sample`` makes."""
        la = self._fitted()
        probs = la.predictive_samples(images.to(self.device), pred_type="nn", n_samples=n,
                                      generator=self._device_generator(generator))
        return probs.float().cpu()
