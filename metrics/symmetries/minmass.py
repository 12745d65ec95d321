"""The minimum scaled network mass problem (paper section 3.6, appendix C.7).

Minimise the mass (sum of squared weights, biases excluded, BatchNorm gammas included) over
the positive scalings of the spec. With ``x = log s`` every weight ``w`` between an
incoming unit ``u`` and an outgoing unit ``v`` contributes ``w^2 exp(2 x_u - 2 x_v)``, so the
problem is ``min_x sum_t c_t exp(a_t . x)``: smooth and convex, strictly convex and with a
unique minimiser when it is non-degenerate. Two solvers:

- ``min_mass``: batched damped Newton in torch over all samples at once;
- ``min_mass_cvxpy`` (``bench/minmass_cvxpy.py``, outside the runtime packages: cvxpy is a test
  dependency): the same log-space problem in cvxpy (exponential cones, Clarabel), one sample at a
  time: the reference the Newton solver must match in the tests and benches.

Both start from the unit-norm scaling (``normalize_scales``, an exact symmetry, so the same
problem), which keeps the log-scales near 0 and the exponential terms well scaled.

Degeneracy. A conv feeding a BatchNorm has a scale that the running statistics absorb: it
only multiplies weights, so shrinking it lowers the mass without bound and no minimum
exists; such specs raise ``DegenerateMinMassError``. A unit whose incoming (or outgoing)
weights are all zero in a sample has no minimum either; it is *left* at scale 1 (reported
in ``fixed``) and the rest of the network is minimised.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np
import torch

from metrics.symmetries.engine import SampleSet, rescale
from metrics.symmetries.scaling import unit_norm_scaling
from metrics.symmetries.spec import Axis, SymmetrySpec, check_sample_set, topological


QUADRATIC_STEPS = 3


class DegenerateMinMassError(ValueError):
    """The min-mass problem of a spec has no unique minimiser."""


@dataclass(frozen=True)
class MassTerms:
    """``mass(x)[s] = sum_t coef[s, t] * exp(2 x[s, first[t]] - 2 x[s, second[t]])``.

    ``x [S, num_vars + 1]`` are log-scales, the last column a dummy fixed at 0 (for weights with
    no incoming or no outgoing unit); ``variables[name] = (start, size)`` locates each scaling.
    """

    coef: torch.Tensor
    first: torch.Tensor
    second: torch.Tensor
    variables: dict[str, tuple[int, int]]

    @property
    def num_vars(self) -> int:
        return sum(size for _, size in self.variables.values())


def mass(sample_set: Mapping[str, torch.Tensor], spec: SymmetrySpec) -> torch.Tensor:
    """The mass ``[S]``: sum of squares of the spec's mass tensors (weights and gammas)."""
    return sum(sample_set[k].flatten(1).square().sum(dim=1) for k in spec.mass_keys)


def check_min_mass_defined(spec: SymmetrySpec) -> None:
    """Raise ``DegenerateMinMassError`` when the spec's min-mass problem has no unique minimiser
    whatever the weights: a scaling absorbed by BatchNorm statistics, a scaling missing from
    the mass on its incoming or outgoing side, or a cycle among scalings."""
    for g, sc in spec.scalings():
        if sc.stats is not None:
            raise DegenerateMinMassError(
                f"{spec.architecture}: min-mass is degenerate: the scale of {sc.name!r} is absorbed by BatchNorm "
                f"{sc.stats.batchnorm!r}, so shrinking it lowers the mass without bound (no minimum exists)"
            )
        for side, axes in (("incoming", sc.incoming), ("outgoing", sc.outgoing)):
            if not any(ax.key in spec.mass_keys for ax in axes):
                raise DegenerateMinMassError(
                    f"{spec.architecture}: min-mass is degenerate: scaling {sc.name!r} has no {side} weight in the mass"
                )
    edges = [
        (a.name, b.name)
        for _, a in spec.scalings() for _, b in spec.scalings()
        if {ax.key for ax in a.outgoing} & {ax.key for ax in b.incoming} & set(spec.mass_keys)
    ]
    try:
        topological([sc.name for _, sc in spec.scalings()], edges, spec.architecture)
    except ValueError as err:
        raise DegenerateMinMassError(f"min-mass needs a feed-forward spec: {err}") from None


def _element_units(shape: tuple[int, ...], axis: Axis, size: int, device: torch.device) -> torch.Tensor:
    """Unit index of every entry of an unbatched tensor of ``shape`` along ``axis``, flattened."""
    if axis.groups:
        rows, b = shape[0], shape[1]
        unit = (torch.arange(rows, device=device)[:, None] // (rows // axis.groups)) * b + torch.arange(b, device=device)
        return unit.reshape(rows, b, *([1] * (len(shape) - 2))).expand(shape).reshape(-1)
    view = [1] * len(shape)
    view[axis.axis] = shape[axis.axis]
    return (torch.arange(shape[axis.axis], device=device) // axis.inner).reshape(view).expand(shape).reshape(-1)


def mass_terms(sample_set: Mapping[str, torch.Tensor], spec: SymmetrySpec) -> MassTerms:
    """The log-space min-mass objective of every sample, entries with the same (incoming,
    outgoing) unit pair aggregated (e.g. a conv kernel is one term)."""
    check_min_mass_defined(spec)
    variables: dict[str, tuple[int, int]] = {}
    for g, sc in spec.scalings():
        variables[sc.name] = (sum(size for _, size in variables.values()), g.size)
    dummy = sum(size for _, size in variables.values())
    device = next(iter(sample_set.values())).device
    coefs, firsts, seconds = [], [], []
    for key in spec.mass_keys:
        shape = spec.shapes[key]
        slots = {1: torch.full((int(np.prod(shape, dtype=np.int64)),), dummy, device=device), -1: None}
        slots[-1] = slots[1].clone()
        seen = {1: [], -1: []}
        for g, sc in spec.scalings():
            for ax, power in sc.axes():
                if ax.key == key:
                    seen[power].append(sc.name)
                    slots[power] = variables[sc.name][0] + _element_units(shape, ax, g.size, device)
        if len(seen[1]) > 1 or len(seen[-1]) > 1:
            raise ValueError(f"{spec.architecture}: mass tensor {key!r} is scaled by several scalings on one side: {seen}")
        pair = slots[1] * (dummy + 1) + slots[-1]
        unique, inverse = torch.unique(pair, return_inverse=True)
        squares = sample_set[key].flatten(1).to(torch.float64).square()
        coefs.append(squares.new_zeros(squares.shape[0], unique.numel()).index_add_(1, inverse, squares))
        firsts.append(unique // (dummy + 1))
        seconds.append(unique % (dummy + 1))
    return MassTerms(torch.cat(coefs, dim=1), torch.cat(firsts), torch.cat(seconds), variables)


def fixed_variables(terms: MassTerms) -> torch.Tensor:
    """``[S, num_vars]`` true for log-scales with no non-zero term on one side (dead units):
    the mass has no minimum along them, they stay at 0 (scale 1)."""
    s, n = terms.coef.shape[0], terms.num_vars
    active = (terms.coef > 0).to(torch.float64)
    grows = active.new_zeros(s, n + 1).index_add_(1, terms.first, active)
    shrinks = active.new_zeros(s, n + 1).index_add_(1, terms.second, active)
    return ((grows == 0) | (shrinks == 0))[:, :n]


def _objective(x: torch.Tensor, terms: MassTerms, coef: torch.Tensor, derivatives: bool = True):
    """Objective ``[S]`` (and gradient ``[S, n]``, Hessian ``[S, n, n]``) at log-scales ``x``."""
    s, n = x.shape
    padded = torch.cat([x, x.new_zeros(s, 1)], dim=1)
    e = coef * torch.exp(2 * (padded[:, terms.first] - padded[:, terms.second]))
    f = e.sum(dim=1)
    if not derivatives:
        return f
    grad = x.new_zeros(s, n + 1).index_add_(1, terms.first, 2 * e).index_add_(1, terms.second, -2 * e)
    flat = x.new_zeros(s, (n + 1) ** 2)
    for a, b, sign in ((terms.first, terms.first, 4), (terms.second, terms.second, 4), (terms.first, terms.second, -4), (terms.second, terms.first, -4)):
        flat.index_add_(1, a * (n + 1) + b, sign * e)
    return f, grad[:, :n], flat.reshape(s, n + 1, n + 1)[:, :n, :n]


def _newton_direction(grad: torch.Tensor, hess: torch.Tensor) -> torch.Tensor:
    chol, info = torch.linalg.cholesky_ex(hess)
    step = -torch.cholesky_solve(grad[:, :, None], chol)[:, :, 0]
    bad = info != 0
    if bool(bad.any()):
        step[bad] = -(torch.linalg.pinv(hess[bad], hermitian=True) @ grad[bad][:, :, None])[:, :, 0]
    return step


def solve_log_scales(terms: MassTerms, tol: float = 1e-20, max_iter: int = 200) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Minimise every sample's objective by damped Newton (Armijo backtracking), batched.

    Returns log-scales ``x [S, n]`` (0 on fixed variables), the fixed mask ``[S, n]`` and the
    number of iterations. A sample is done when its Newton decrement ``g^T H^-1 g`` is at most
    ``tol`` times the objective, or after ``QUADRATIC_STEPS`` full Newton steps taken in the
    quadratic regime (decrement <= 1e-12 of the objective, where float64 rounding hides the
    Armijo decrease): the log-scales are then accurate to rounding. Raises ``RuntimeError``
    naming the samples not done after ``max_iter`` iterations.
    """
    fixed = fixed_variables(terms)
    total = terms.coef.sum(dim=1)
    coef = terms.coef / torch.where(total > 0, total, 1.0)[:, None]
    free = (~fixed).to(torch.float64)
    s, n = fixed.shape
    x = torch.zeros(s, n, dtype=torch.float64, device=fixed.device)
    active = torch.ones(s, dtype=torch.bool, device=fixed.device)
    quadratic_steps = torch.zeros(s, dtype=torch.long, device=fixed.device)
    for iteration in range(max_iter):
        f, grad, hess = _objective(x, terms, coef)
        grad = grad * free
        hess = hess * free[:, :, None] * free[:, None, :] + torch.diag_embed(1.0 - free)
        step = _newton_direction(grad, hess)
        decrement = -(grad * step).sum(dim=1)
        active &= (decrement > tol * f) & (quadratic_steps < QUADRATIC_STEPS)
        if not bool(active.any()):
            return x, fixed, iteration
        quadratic = active & (decrement <= 1e-12 * f)
        quadratic_steps += quadratic.long()
        searching = active & ~quadratic
        t = active.to(torch.float64)
        for _ in range(60):
            trial = _objective(x + t[:, None] * step, terms, coef, derivatives=False)
            ok = trial <= f - 0.25 * t * decrement
            if bool((ok | ~searching).all()):
                break
            t = torch.where(ok | ~searching, t, t / 2)
        x = x + t[:, None] * step
    raise RuntimeError(
        f"min-mass Newton did not converge in {max_iter} iterations for samples {active.nonzero().flatten().tolist()[:10]}"
    )


def _prepared(sample_set: Mapping[str, torch.Tensor], spec: SymmetrySpec) -> tuple[dict, MassTerms]:
    """The unit-norm prescaling and the objective's terms around it. Without it cvxpy's Clarabel
    stops up to 7% above the minimum, reporting "optimal", on OptuNets rescaled by e^+-3."""
    check_sample_set(spec, sample_set)
    check_min_mass_defined(spec)
    normalized, prescale = unit_norm_scaling(sample_set, spec)
    return prescale, mass_terms(normalized, spec)


def _finish(sample_set, spec, prescale, terms, x, fixed, extra) -> tuple[SampleSet, dict]:
    """Apply the unit-norm prescaling times ``exp(x)`` to the original sample set."""
    dtype = next(v for v in sample_set.values() if v.is_floating_point()).dtype
    scales = {
        name: (prescale[name].to(torch.float64) * torch.exp(x[:, a : a + size])).to(dtype)
        for name, (a, size) in terms.variables.items()
    }
    info = {
        "scales": scales,
        "mass_before": mass(sample_set, spec).to(torch.float64),
        "mass_after": _objective(x, terms, terms.coef, derivatives=False),
        "fixed": fixed,
        **extra,
    }
    return rescale(sample_set, spec, scales), info


def min_mass(
    sample_set: Mapping[str, torch.Tensor], spec: SymmetrySpec, tol: float = 1e-20, max_iter: int = 200
) -> tuple[SampleSet, dict]:
    """Rescale every sample to its minimum mass (batched Newton, float64 internally).

    Returns the rescaled sample set (same function) and ``{"scales": {scaling: [S, n]},
    "mass_before": [S], "mass_after": [S], "fixed": [S, num_vars] bool, "iterations": int}``.
    Raises ``DegenerateMinMassError`` for specs with BatchNorm (see module docstring).
    """
    prescale, terms = _prepared(sample_set, spec)
    x, fixed, iterations = solve_log_scales(terms, tol, max_iter)
    return _finish(sample_set, spec, prescale, terms, x, fixed, {"iterations": iterations})
