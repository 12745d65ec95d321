"""Deep Ensembles: members are the held-out checkpoints themselves; multi-mode only."""
from __future__ import annotations

import pytest
import torch

from benchmark.experiment import Experiment
from benchmark.core.models import predict_with_weights
from benchmark.stages.sample import jobs as prepare_units, load_base
from methods.base import MethodConfigError
from methods.modes import run_mode
from tests.methods.conftest import build

pytestmark = pytest.mark.slow  # trains networks (bases, vBNNs, chains): make test, not make test-fast


def test_one_mode_is_refused(tiny_exp) -> None:
    method = build(tiny_exp, "ensemble")
    with pytest.raises(MethodConfigError, match="use mode=multi"):
        method.check("one")
    method.check("multi")


def test_member_is_the_checkpoint_and_predictions_agree(tiny_exp, tiny_bases) -> None:
    seed, base = tiny_bases[2]
    method = build(tiny_exp, "ensemble")
    method.fit(base, seed)
    samples = method.sample(2, torch.Generator())
    assert all(torch.equal(samples[k][i], base[k]) for k in base for i in range(2))
    images = tiny_exp.test_tensors[0][:50]
    own = method.predict_own(images, 2, torch.Generator())
    torch.testing.assert_close(predict_with_weights(tiny_exp.model(), samples, images), own, rtol=0, atol=1e-5)


def test_multi_mode_takes_one_sample_from_each_of_the_first_converged_seeds(tiny_exp, tiny_bases, compose_tiny) -> None:
    exp = Experiment(compose_tiny(tiny_exp.store.root, "sample.per_method=3", "method=ensemble"))
    (unit,) = prepare_units(exp)
    assert (unit.plan.bases, unit.plan.samples_per_base) == (3, 1)
    samples, seeds, _ = run_mode(unit.method, unit.plan, lambda seed: load_base(exp, seed), progress=False)
    assert list(seeds) == [s for s, _ in tiny_bases[:3]]
    for i, (_, base) in enumerate(tiny_bases[:3]):
        assert all(torch.equal(samples[k][i], base[k]) for k in base)
