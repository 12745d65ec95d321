"""A tiny store for ``reference=hmc``: zoo seeds 0-11 and held-out seeds, and per repetition an HMC
multi-mode unit (2 chains x 2 draws near seeded initialisations: HMC's numbers do not matter to
the scoring, which is what the tests test), an ensemble and a one-mode 'swag'."""
from __future__ import annotations

import torch

from benchmark.core.models import predict_with_weights
from benchmark.core.store import load_checkpoints_as_sample_set, save_sample_set
from benchmark.core.training import seeded
from benchmark.experiment import Experiment
from benchmark.inventory import unit_expectations
from tests.conftest import compose_config
from tests.benchmark.units import write_initial_checkpoints

OVERRIDES = ["seeds.reference=[0,12]", "seeds.heldout=[100000,100012]", "sample.repetitions=2", "sample.per_method=4",
             "sample.modes_multi=2", "evaluate.reference_resamples=4", "evaluate.test_permutations=100",
             "evaluate.weight_matching=false"]


def draws_near(seed: int, n: int, exp) -> dict[str, torch.Tensor]:
    """``n`` networks near the seeded initialisation of ``seed`` (a chain's draws: HMC's numbers do
    not matter to the scoring, which is what is tested)."""
    with seeded(seed):
        start = exp.model().state_dict()
    generator = torch.Generator().manual_seed(seed)
    return {k: v[None] + 0.05 * torch.randn(n, *v.shape, generator=generator) for k, v in start.items()}


def write_unit(exp, method, mode, repetition, samples, bases):
    store, model = exp.store, exp.model()
    unit = store.sample_unit(method, mode, repetition)
    meta = {**unit_expectations(exp, unit), "n_samples": next(iter(samples.values())).shape[0],
            "base_seeds": list(bases), "diagnostics": {"rhat_loglik": 1.5 + repetition, "accept_prob": 0.9}}
    preds = {"id": predict_with_weights(model, samples, exp.test_tensors[0]),
             "ood": predict_with_weights(model, samples, exp.ood_tensors[0])}
    save_sample_set(store.samples_path(unit), samples, meta)
    save_sample_set(store.preds_path(unit), preds, meta)
    return samples, preds


def fill(root):
    """Zoo seeds 0-11, and per repetition: an HMC multi-mode unit (2 chains x 2 draws), an ensemble
    (2 held-out members) and a one-mode 'swag' (4 draws near one base)."""
    exp = Experiment(compose_config([f"store={root / 'store'}", f"results={root / 'results'}", "reference=hmc",
                                     *OVERRIDES]))
    exp.store.ensure_writable()
    write_initial_checkpoints(exp, [*range(12), *range(100000, 100012)])
    units = {}
    for r in range(2):
        chains = [draws_near(500 + 2 * r + c, 2, exp) for c in range(2)]
        units[("hmc", r)] = write_unit(exp, "hmc", "multi", r, {k: torch.cat([c[k] for c in chains]) for k in chains[0]},
                                  [100000 + 4 * r, 100001 + 4 * r])
        members = [100002 + 4 * r, 100003 + 4 * r]
        units[("ensemble", r)] = write_unit(exp, "ensemble", "multi", r,
                                       load_checkpoints_as_sample_set(exp.store.checkpoint_paths(members)), members)
        units[("swag", r)] = write_unit(exp, "swag", "one", r, draws_near(100000 + 4 * r, 4, exp), [100000 + 4 * r])
    return exp, units


