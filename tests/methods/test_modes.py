"""The one/multi-mode protocol: counts, the runner over candidate bases, fit failures, NaN samples.
(Which seeds are the bases is the sample stage's: tests/benchmark/test_sample_stage.py.)"""
from __future__ import annotations

import pytest
import torch

from benchmark.core.training import NonFiniteError
from methods.base import MethodConfigError, MethodFitError
from methods.dropout import DropoutMethod
from methods.ensemble import EnsembleMethod
from methods.modes import ModePlan, plan_counts, run_mode


@pytest.mark.parametrize(
    ("cls", "mode", "expected"),
    [(DropoutMethod, "one", (1, 100)), (DropoutMethod, "multi", (10, 10)), (EnsembleMethod, "multi", (100, 1))],
)
def test_paper_counts(cls, mode, expected) -> None:
    assert plan_counts(cls, mode, 100, 10) == expected


def test_counts_that_do_not_split_evenly_are_refused() -> None:
    with pytest.raises(MethodConfigError, match="sample.per_method=100 is not a multiple of sample.modes_multi=7"):
        plan_counts(DropoutMethod, "multi", 100, 7)


class _FailingFirst(EnsembleMethod):
    """An ensemble whose fit refuses given seeds (as a non-converging retrained network would)."""

    refused: tuple[int, ...] = ()

    def fit(self, base, seed):
        if seed in self.refused:
            raise MethodFitError(f"seed {seed} did not converge")
        super().fit(base, seed)


def _load(tiny_bases):
    return dict(tiny_bases).__getitem__


@pytest.mark.slow  # the tiny held-out zoo is trained first
def test_a_failed_fit_moves_on_to_the_next_seed(tiny_exp, tiny_bases) -> None:
    seeds = [s for s, _ in tiny_bases]
    method = _FailingFirst(tiny_exp.model, tiny_exp.training_data, recipe=tiny_exp.recipe)
    method.refused = (seeds[0],)
    plan = ModePlan("multi", tuple(seeds), 2, 1)
    _, used, _ = run_mode(method, plan, _load(tiny_bases), progress=False)
    assert used == tuple(seeds[1:3])
    method.refused = tuple(seeds[:-1])
    with pytest.raises(MethodFitError, match=f"only 1 of 2 base networks.*seed {seeds[0]}: seed {seeds[0]} did not converge"):
        run_mode(method, plan, _load(tiny_bases), progress=False)


@pytest.mark.slow  # the tiny held-out zoo is trained first
def test_non_finite_samples_are_refused(tiny_exp, tiny_bases) -> None:
    class NaNSamples(EnsembleMethod):
        def sample(self, n, generator):
            out = super().sample(n, generator)
            out["fc1.bias"][:] = torch.nan
            return out

    plan = ModePlan("multi", (tiny_bases[0][0],), 1, 1)
    with pytest.raises(NonFiniteError, match=f"base seed {tiny_bases[0][0]}: sampled 'fc1.bias'"):
        run_mode(NaNSamples(tiny_exp.model, tiny_exp.training_data, recipe=tiny_exp.recipe), plan, _load(tiny_bases),
                 progress=False)
