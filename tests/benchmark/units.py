"""Sample units written as the sample stage writes them, for tests of the stages that read them."""
from __future__ import annotations

from safetensors.torch import save_file

from benchmark.core.store import save_checkpoint, save_sample_set
from benchmark.core.training import seeded
from benchmark.inventory import unit_expectations


def write_unit(exp, method, mode, repetition, samples, preds, damaged=False, base_seeds=None):
    """A unit's files as the sample stage writes them (metadata included); ``damaged``: the
    predictions hold a NaN (written directly: the store refuses NaN)."""
    store = exp.store
    n = next(iter(samples.values())).shape[0]
    meta = {**unit_expectations(exp, store.sample_unit(method, mode, repetition)), "n_samples": n}
    if base_seeds is not None:
        meta["base_seeds"] = list(base_seeds)
    save_sample_set(store.samples_path(store.sample_unit(method, mode, repetition)), samples, meta)
    if damaged:
        save_file({k: v.contiguous() for k, v in preds.items()}, str(store.preds_path(store.sample_unit(method, mode, repetition))),
                  metadata={k: str(v) for k, v in meta.items()})
    else:
        save_sample_set(store.preds_path(store.sample_unit(method, mode, repetition)), preds, meta)


def write_initial_checkpoints(exp, seeds) -> None:
    """Zoo checkpoints of ``seeds``: each the model's initialisation under its seed (what the
    scoring tests need of a zoo is its shapes and spread, not training)."""
    for seed in seeds:
        with seeded(seed):
            state = exp.model().state_dict()
        save_checkpoint(exp.store.checkpoint_path(seed), state, {"seed": seed, "experiment": exp.name})
