"""Base selection and the one/multi-mode runner: counts, held-out seeds only, missing bases, fit failures."""
from __future__ import annotations

import pytest
import torch

from benchmark.experiment import Experiment
from benchmark.training import NonFiniteError
from methods.base import MethodConfigError, MethodFitError
from methods.dropout import DropoutMethod
from methods.ensemble import EnsembleMethod
from methods.modes import MissingBasesError, ModePlan, converged_heldout_seeds, plan_counts, plan_mode, run_mode, select_bases


@pytest.mark.parametrize(
    ("cls", "mode", "expected"),
    [(DropoutMethod, "one", (1, 100)), (DropoutMethod, "multi", (10, 10)), (EnsembleMethod, "multi", (100, 1))],
)
def test_paper_counts(cls, mode, expected) -> None:
    assert plan_counts(cls, mode, 100, 10) == expected


@pytest.mark.parametrize(
    ("per_method", "modes_multi", "match"),
    [(100, 7, "not a multiple of sample.modes_multi=7"), (0, 10, "sample.per_method=0"), (100, "x", "sample.modes_multi")],
)
def test_bad_counts(per_method, modes_multi, match) -> None:
    with pytest.raises(MethodConfigError, match=match):
        plan_counts(DropoutMethod, "multi", per_method, modes_multi)


def test_bases_are_the_converged_heldout_seeds_in_order(tiny_exp, tiny_bases) -> None:
    failed = set(tiny_exp.store.failed_seeds())
    seeds = converged_heldout_seeds(tiny_exp)
    assert seeds == [s for s, _ in tiny_bases] and not failed & set(seeds)
    assert all(100000 <= s < 100008 for s in seeds)
    plan = plan_mode(tiny_exp, DropoutMethod, "one")
    assert (plan.candidates[: plan.bases], plan.samples_per_base) == ((seeds[0],), 100)


def test_too_few_bases_in_a_trained_range_suggest_a_larger_range(tiny_exp, tiny_bases) -> None:
    with pytest.raises(MissingBasesError) as err:
        select_bases(tiny_exp, len(tiny_bases) + 3)
    message = str(err.value)
    assert f"{len(tiny_bases) + 3} converged held-out base checkpoints needed, {len(tiny_bases)} found" in message
    assert "[100000, 100008)" in message and "3 missing" in message
    stop = int(message.split("zoo.stop=")[1].split()[0])
    assert stop > 100008 and f"heldout.stop={stop}" in message
    assert "python -m benchmark stage=zoo experiment=digits_optunet zoo.start=100000" in message


def test_untrained_range_suggests_training_it(compose_tiny, tmp_path) -> None:
    exp = Experiment(compose_tiny(tmp_path))
    with pytest.raises(MissingBasesError, match=r"8 not trained yet.*zoo.start=100000 zoo.stop=100008"):
        plan_mode(exp, DropoutMethod, "one")


class _FailingFirst(EnsembleMethod):
    """An ensemble whose fit refuses given seeds (as a non-converging retrained network would)."""

    refused: tuple[int, ...] = ()

    def fit(self, base, seed):
        if seed in self.refused:
            raise MethodFitError(f"seed {seed} did not converge")
        super().fit(base, seed)


def test_a_failed_fit_moves_on_to_the_next_seed(tiny_exp, tiny_bases) -> None:
    seeds = [s for s, _ in tiny_bases]
    method = _FailingFirst(tiny_exp, {})
    method.refused = (seeds[0],)
    plan = ModePlan("multi", tuple(seeds), 2, 1)
    _, used = run_mode(method, plan, progress=False)
    assert used == tuple(seeds[1:3])
    method.refused = tuple(seeds[:-1])
    with pytest.raises(MethodFitError, match=f"only 1 of 2 base networks.*seed {seeds[0]}: seed {seeds[0]} did not converge"):
        run_mode(method, plan, progress=False)


def test_non_finite_samples_are_refused(tiny_exp, tiny_bases) -> None:
    class NaNSamples(EnsembleMethod):
        def sample(self, n, generator):
            out = super().sample(n, generator)
            out["fc1.bias"][:] = torch.nan
            return out

    plan = ModePlan("multi", (tiny_bases[0][0],), 1, 1)
    with pytest.raises(NonFiniteError, match=f"base seed {tiny_bases[0][0]}: sampled 'fc1.bias'"):
        run_mode(NaNSamples(tiny_exp, {}), plan, progress=False)
