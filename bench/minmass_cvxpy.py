"""``min_mass_cvxpy``: the exact min-mass solution with cvxpy, the reference the batched Newton
solver of ``metrics.symmetries.min_mass`` must match (tests/metrics/symmetries/test_minmass.py,
tests/benchmark/analyses/test_analyses.py, bench/bench_symmetries.py).

It lives here, outside the runtime packages, because cvxpy is a test dependency (the ``test``
extra of pyproject.toml): no module of ``benchmark``, ``methods`` or ``metrics`` imports it. The
problem and the prescaling are those of ``metrics/symmetries/minmass.py`` (its docstring).
"""
from __future__ import annotations

from typing import Mapping

import cvxpy as cp
import numpy as np
import scipy.sparse
import torch

from metrics.symmetries.engine import SampleSet
from metrics.symmetries.minmass import MassTerms, _finish, _prepared, fixed_variables
from metrics.symmetries.spec import SymmetrySpec


def _cvxpy_problem(terms: MassTerms, fixed_row: np.ndarray):
    """The log-space problem ``min sum(c * exp(A x))`` over the free log-scales, with the
    coefficients as a non-negative parameter so one compiled problem serves many samples."""
    n = terms.num_vars
    column = np.full(n + 1, -1)
    free = np.flatnonzero(~fixed_row)
    column[free] = np.arange(free.size)
    first, second = column[terms.first.numpy()], column[terms.second.numpy()]
    variable_terms = np.flatnonzero((first >= 0) | (second >= 0))
    rows, cols, vals = [], [], []
    for sign, col in ((2.0, first), (-2.0, second)):
        keep = col[variable_terms] >= 0
        rows.append(np.flatnonzero(keep))
        cols.append(col[variable_terms][keep])
        vals.append(np.full(int(keep.sum()), sign))
    a = scipy.sparse.csr_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(variable_terms.size, free.size))
    x = cp.Variable(free.size)
    c = cp.Parameter(variable_terms.size, nonneg=True)
    problem = cp.Problem(cp.Minimize(cp.sum(cp.multiply(c, cp.exp(a @ x)))))
    return problem, x, c, variable_terms, free


def min_mass_cvxpy(
    sample_set: Mapping[str, torch.Tensor], spec: SymmetrySpec, solver: str = "CLARABEL"
) -> tuple[SampleSet, dict]:
    """The exact min-mass solution with cvxpy (log space, one solve per sample; the compiled
    problem is reused across samples with the same fixed units). Same return as ``min_mass``
    plus ``"status": [str]`` per sample; raises ``RuntimeError`` naming a sample cvxpy could
    not solve. A reference solver: it runs on the CPU whatever the device of ``sample_set``."""
    sample_set = {k: v.cpu() for k, v in sample_set.items()}
    prescale, terms = _prepared(sample_set, spec)
    fixed = fixed_variables(terms)
    total = terms.coef.sum(dim=1)
    coef = (terms.coef / torch.where(total > 0, total, 1.0)[:, None]).numpy()
    x_all = torch.zeros(fixed.shape, dtype=torch.float64)
    cache: dict[bytes, tuple] = {}
    statuses = []
    for s in range(fixed.shape[0]):
        row = fixed[s].numpy()
        if row.tobytes() not in cache:
            cache[row.tobytes()] = _cvxpy_problem(terms, row)
        problem, x, c, variable_terms, free = cache[row.tobytes()]
        if free.size:
            c.value = coef[s, variable_terms]
            problem.solve(solver=solver)
            if problem.status not in ("optimal", "optimal_inaccurate"):
                raise RuntimeError(f"min-mass with cvxpy/{solver}: sample {s} ended with status {problem.status!r}")
            x_all[s, torch.from_numpy(free)] = torch.from_numpy(np.asarray(x.value, dtype=np.float64))
        statuses.append(problem.status if free.size else "optimal")
    return _finish(sample_set, spec, prescale, terms, x_all, fixed, {"status": statuses})
