"""The one-mode and multi-mode protocols: which base networks a method is fitted around, and
the runner that fits it around each of them and gathers the weight samples.

Base networks are the converged checkpoints of the held-out seed range
``[heldout.start, heldout.stop)`` (never reference seeds), first seeds first:

- one-mode: the first one, ``sample.per_method`` samples around it;
- multi-mode: the first ``sample.modes_multi``, ``per_method / modes_multi`` samples each;
- a method with a fixed ``samples_per_base`` (Deep Ensembles: 1) uses ``per_method / samples_per_base``.

A fit that fails on a base (``MethodFitError``: a retrained dropout or BNN network that does not
converge) moves on to the next converged held-out seed; the seeds used are returned.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from benchmark.experiment import Experiment
from benchmark.store import SampleSet, StoreError, load_checkpoint
from benchmark.training import NonFiniteError
from methods.base import MethodConfigError, MethodFitError, PosteriorMethod

log = logging.getLogger(__name__)
ASSUMED_CONVERGENCE = 0.5  # for the suggested zoo range when no held-out seed was trained yet


class MissingBasesError(StoreError):
    """Too few converged held-out checkpoints for a mode; the message gives the zoo command."""


@dataclass(frozen=True)
class ModePlan:
    """One (method, mode) run: ``bases`` base networks, taken in order from ``candidates`` (the
    converged held-out seeds, at least ``bases`` of them), and the samples drawn around each."""

    mode: str
    candidates: tuple[int, ...]
    bases: int
    samples_per_base: int

    @property
    def n_samples(self) -> int:
        return self.bases * self.samples_per_base


def _positive_int(value: object, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MethodConfigError(f"{key}={value!r}: expected a positive integer")
    return value


def plan_counts(method: type[PosteriorMethod] | PosteriorMethod, mode: str, per_method: int, modes_multi: int) -> tuple[int, int]:
    """``(number of base networks, samples per base)`` of ``method`` in ``mode``.

    ``per_method`` = ``sample.per_method`` (total samples), ``modes_multi`` = ``sample.modes_multi``.
    Raises ``MethodConfigError`` when the total does not split evenly.
    """
    per_method = _positive_int(per_method, "sample.per_method")
    modes_multi = _positive_int(modes_multi, "sample.modes_multi")
    fixed = method.samples_per_base
    if fixed is not None:
        bases, per_base, divisor = per_method // fixed, fixed, f"{method.name}'s samples per base network ({fixed})"
    elif mode == "one":
        return 1, per_method
    else:
        bases, per_base, divisor = modes_multi, per_method // modes_multi, f"sample.modes_multi={modes_multi}"
    if bases * per_base != per_method or bases < 1:
        raise MethodConfigError(
            f"sample.per_method={per_method} is not a multiple of {divisor}: every base network must give the "
            f"same number of samples"
        )
    return bases, per_base


def converged_heldout_seeds(exp: Experiment) -> list[int]:
    """Seeds of ``[heldout.start, heldout.stop)`` with a checkpoint in the store (sorted; failed seeds have none)."""
    return exp.store.converged_seeds(int(exp.cfg.heldout.start), int(exp.cfg.heldout.stop))


def select_bases(exp: Experiment, count: int) -> list[int]:
    """All converged held-out seeds, checking there are at least ``count``.

    Raises ``MissingBasesError`` naming the missing count, the seed range and the zoo command
    that trains them (a larger ``zoo.stop``/``heldout.stop`` when the range is exhausted).
    """
    seeds = converged_heldout_seeds(exp)
    if len(seeds) >= count:
        return seeds
    start, stop = int(exp.cfg.heldout.start), int(exp.cfg.heldout.stop)
    failed = sum(start <= s < stop for s in exp.store.failed_seeds())
    tried = len(seeds) + failed
    missing = count - len(seeds)
    message = (
        f"{exp.store.zoo_dir}: {count} converged held-out base checkpoints needed, {len(seeds)} found in the "
        f"held-out seed range [{start}, {stop}) ({failed} failed, {stop - start - tried} not trained yet); "
        f"{missing} missing."
    )
    if tried < stop - start:
        command = f"python -m benchmark stage=zoo experiment={exp.name} zoo.start={start} zoo.stop={stop}"
        extra = " (if that is still too few, raise zoo.stop and heldout.stop together)"
    else:
        rate = len(seeds) / tried if seeds else ASSUMED_CONVERGENCE
        new_stop = stop + math.ceil(1.25 * missing / rate)
        command = (f"python -m benchmark stage=zoo experiment={exp.name} zoo.start={start} zoo.stop={new_stop} "
                   f"heldout.stop={new_stop}")
        extra = f", then pass heldout.stop={new_stop} to the sample stage too"
    raise MissingBasesError(f"{message} Train them with: {command}{extra}")


def plan_mode(exp: Experiment, method: type[PosteriorMethod] | PosteriorMethod, mode: str) -> ModePlan:
    """The ``ModePlan`` of ``method`` in ``mode`` under ``cfg.sample`` (raises if bases are missing)."""
    bases, per_base = plan_counts(method, mode, exp.cfg.sample.per_method, exp.cfg.sample.modes_multi)
    return ModePlan(mode, tuple(select_bases(exp, bases)), bases, per_base)


def load_base(exp: Experiment, seed: int) -> dict[str, torch.Tensor]:
    """The validated plain state dict of held-out checkpoint ``seed``."""
    path = exp.store.checkpoint_path(seed)
    state_dict, metadata = load_checkpoint(path, exp.model())
    trained_with = metadata.get("config_hash")
    if trained_with is not None and trained_with != exp.config_hash:
        log.warning("%s was trained with config hash %s, this run's is %s (model/data/recipe changed since)",
                    path, trained_with, exp.config_hash)
    return state_dict


def run_mode(method: PosteriorMethod, plan: ModePlan, progress: bool = True) -> tuple[SampleSet, tuple[int, ...]]:
    """Fit ``method`` around ``plan.bases`` base networks and draw their samples.

    Returns ``({key: [plan.n_samples, ...]}, base seeds used)``. Base ``seed`` is fitted with
    ``fit(weights, seed)`` and sampled with a generator seeded with ``seed`` (reproducible);
    samples are grouped by base, in seed order. A ``MethodFitError`` skips to the next
    candidate seed (raised again when candidates run out); non-finite samples raise
    ``NonFiniteError`` naming the base seed.
    """
    parts: list[SampleSet] = []
    used: list[int] = []
    skipped: dict[int, str] = {}
    bar = tqdm(total=plan.bases, desc=f"{method.name} {plan.mode}-mode", unit="base", dynamic_ncols=True,
               disable=not progress)
    for seed in plan.candidates:
        if len(used) == plan.bases:
            break
        try:
            method.fit(load_base(method.exp, seed), seed)
        except MethodFitError as err:
            log.warning("method=%s: base seed %d skipped: %s", method.name, seed, err)
            skipped[seed] = str(err)
            continue
        samples = method.sample(plan.samples_per_base, torch.Generator().manual_seed(seed))
        for key, value in samples.items():
            if value.is_floating_point() and not bool(torch.isfinite(value).all()):
                raise NonFiniteError(f"method={method.name} base seed {seed}: sampled {key!r} contains NaN/Inf")
        parts.append({k: v.detach().cpu() for k, v in samples.items()})
        used.append(seed)
        bar.update()
    bar.close()
    if len(used) < plan.bases:
        details = "; ".join(f"seed {s}: {m}" for s, m in skipped.items())
        raise MethodFitError(
            f"method={method.name} mode={plan.mode}: only {len(used)} of {plan.bases} base networks could be fitted "
            f"from the {len(plan.candidates)} converged held-out seeds ({details})"
        )
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}, tuple(used)
