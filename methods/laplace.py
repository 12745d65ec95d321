"""Laplace approximation around a trained base network, with laplace-torch (Daxberger et al. 2021).

Subset of weights and Hessian structure come from ``model.laplace`` (appendix B: OptuNet = all
weights, full GGN; ResNet-18 = last layer, KFAC). The GGN is fitted on the un-augmented train
set, the prior precision optimised post hoc (``methods.laplace.prior_optimization``, default
the marginal likelihood), and weight samples are ``la.sample(n, generator)``: flat vectors over
the Laplace subset (``la.params`` for 'all', the last Linear's weight then bias otherwise),
written back into full state dicts where every other key keeps its MAP value.
"""
from __future__ import annotations

import math
import warnings

import torch
from laplace import Laplace
from laplace.baselaplace import BaseLaplace
from laplace.curvature import CurvlinopsGGN
from laplace.curvature.curvature import GGNInterface
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from benchmark.store import SampleSet
from benchmark.training import NonFiniteError, seeded
from methods.base import MethodConfigError, PosteriorMethod

SUBSETS = ("all", "last_layer")
STRUCTURES = ("full", "kron", "diag")
PRIOR_METHODS = ("marglik",)


class PerSampleJacobianGGN(CurvlinopsGGN):
    """laplace-torch's curvlinops GGN, except that the full matrix is ``sum_n J_n^T H_n J_n`` from
    per-sample Jacobians ``J_n`` ``[C, P]`` (``torch.func.vmap`` over the batch).

    Same matrix as curvlinops' (which multiplies the GGN operator by all P unit vectors, one
    backward pass each), ~50x faster on OptuNet, where C = 10 is far smaller than P = 355.
    """

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


def last_linear_name(model: nn.Module) -> str:
    """Module name of the model's last ``nn.Linear`` (its output layer)."""
    names = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not names:
        raise MethodConfigError(f"method=laplace: model {type(model).__name__} has no Linear output layer")
    return names[-1]


class LaplaceMethod(PosteriorMethod):
    """Laplace around a trained base network; ``fit`` uses the base's weights (``seed`` is unused: no randomness)."""

    name = "laplace"

    def __init__(self, exp, settings) -> None:
        super().__init__(exp, settings)
        self._la: BaseLaplace | None = None
        self._map: dict[str, torch.Tensor] = {}
        self._keys: list[str] = []

    def structure(self) -> tuple[str, str]:
        """Validated ``(model.laplace.subset_of_weights, model.laplace.hessian_structure)``."""
        cfg = self.exp.cfg.model.get("laplace") or {}
        subset, structure = str(cfg.get("subset_of_weights")), str(cfg.get("hessian_structure"))
        if subset not in SUBSETS:
            raise MethodConfigError(f"model.laplace.subset_of_weights={subset!r}: expected one of {', '.join(SUBSETS)}")
        if structure not in STRUCTURES:
            raise MethodConfigError(f"model.laplace.hessian_structure={structure!r}: expected one of {', '.join(STRUCTURES)}")
        return subset, structure

    def check(self, mode: str) -> None:
        """Refuse a whole-network Hessian the model cannot have (size, BatchNorm), and bad settings."""
        super().check(mode)
        subset, structure = self.structure()
        prior = self.settings.get("prior_optimization")
        if prior not in PRIOR_METHODS:
            raise MethodConfigError(f"methods.laplace.prior_optimization={prior!r}: expected one of {', '.join(PRIOR_METHODS)}")
        if subset != "all" or structure == "diag":
            return
        model = self.exp.model()
        n_params = sum(p.numel() for p in model.parameters())
        limit = int(self.settings.get("max_full_params", 100_000))
        has_bn = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
        reasons = []
        if structure == "full" and n_params > limit:
            reasons.append(f"its {n_params:,} x {n_params:,} Hessian does not fit (methods.laplace.max_full_params={limit:,})")
        if has_bn:
            reasons.append(f"the {structure} curvature backends do not handle its BatchNorm layers")
        if reasons:
            raise MethodConfigError(
                f"method=laplace on model={self.exp.cfg.model.name} with model.laplace.subset_of_weights=all "
                f"model.laplace.hessian_structure={structure}: {'; '.join(reasons)}. Use "
                f"model.laplace.subset_of_weights=last_layer model.laplace.hessian_structure=kron (appendix B)"
            )

    def fit(self, base: dict[str, torch.Tensor], seed: int) -> None:
        """Fit the Laplace approximation at ``base`` on the un-augmented train set and optimise
        its prior precision. A non-finite prior precision or posterior raises ``NonFiniteError``."""
        exp, s = self.exp, self.settings
        subset, structure = self.structure()
        self._la = None
        with seeded(seed):  # building a model draws from the global RNG; leave it as it was
            model = exp.model().to(exp.device)
        model.load_state_dict(base)
        model.eval()
        options = {"backend": PerSampleJacobianGGN} if (subset, structure) == ("all", "full") else {}
        if subset == "last_layer":
            options["last_layer_name"] = last_linear_name(model)
        la = Laplace(model, "classification", subset_of_weights=subset, hessian_structure=structure, **options)
        la.fit(DataLoader(TensorDataset(*exp.train_tensors), batch_size=int(s.get("fit_batch_size", 256))))
        with warnings.catch_warnings():  # link_approx only matters for the GLM predictive, which we do not use
            warnings.filterwarnings("ignore", message=".*link_approx.*")
            la.optimize_prior_precision(
                method=str(s["prior_optimization"]), prior_structure=str(s.get("prior_structure", "scalar")),
                n_steps=int(s.get("marglik_steps", 100)), lr=float(s.get("marglik_lr", 0.1)),
            )
        where = f"{exp.name} laplace seed {seed}"
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

    def _fitted(self) -> BaseLaplace:
        if self._la is None:
            raise RuntimeError("method=laplace: call fit() before sample() or predict_own()")
        return self._la

    def _device_generator(self, generator: torch.Generator) -> torch.Generator:
        """laplace-torch wants a generator on its device: one seeded from ``generator``."""
        seed = int(torch.randint(0, 2**62, (1,), generator=generator))
        return torch.Generator(device=self.exp.device).manual_seed(seed)

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
        probs = la.predictive_samples(images.to(self.exp.device), pred_type="nn", n_samples=n,
                                      generator=self._device_generator(generator))
        return probs.float().cpu()
