"""The one-mode and multi-mode protocols: how many base networks a method is fitted around,
how many samples each gives, and the loop that fits it around each of them in turn.

- one-mode: one base, ``per_method`` samples around it;
- multi-mode: ``modes_multi`` bases, ``per_method / modes_multi`` samples each;
- a method with a fixed ``samples_per_base`` (Deep Ensembles: 1) uses ``per_method / samples_per_base``.

Which seeds are the bases is the runner's business (the held-out range of the experiment);
``run_mode`` takes them as candidates, in order, and a ``load_base(seed)`` callback. A fit that
fails on a base (``MethodFitError``: a retrained dropout or BNN network that does not
converge) moves on to the next candidate; the seeds used are returned.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch
from tqdm.auto import tqdm

from benchmark.core.store import SampleSet
from benchmark.core.training import NonFiniteError
from methods.base import MethodConfigError, MethodFitError, PosteriorMethod

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModePlan:
    """One (method, mode) run: ``bases`` base networks, taken in order from ``candidates`` (seeds
    of trained networks, at least ``bases`` of them), and the samples drawn around each."""

    mode: str
    candidates: tuple[int, ...]
    bases: int
    samples_per_base: int

    @property
    def n_samples(self) -> int:
        return self.bases * self.samples_per_base


def plan_counts(method: type[PosteriorMethod] | PosteriorMethod, mode: str, per_method: int, modes_multi: int) -> tuple[int, int]:
    """``(number of base networks, samples per base)`` of ``method`` in ``mode``.

    ``per_method`` = ``sample.per_method`` (total samples), ``modes_multi`` = ``sample.modes_multi``.
    Raises ``MethodConfigError`` when the total does not split evenly.
    """
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


def run_mode(
    method: PosteriorMethod,
    plan: ModePlan,
    load_base: Callable[[int], dict[str, torch.Tensor]],
    progress: bool = True,
    diagnostic_data: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[SampleSet, tuple[int, ...], dict[str, float]]:
    """Fit ``method`` around ``plan.bases`` base networks and draw their samples.

    Returns ``({key: [plan.n_samples, ...]}, base seeds used, diagnostics)``, the last the mean
    over bases of ``method.diagnostics(*diagnostic_data)`` (empty without ``diagnostic_data``). Base ``seed`` is fitted with
    ``fit(load_base(seed), seed)`` and sampled with a generator seeded with ``seed`` (reproducible);
    samples are grouped by base, in seed order. Candidates are taken in rounds of as many as
    bases are still missing, each announced to ``method.prefit`` first (a method may fit them
    together). A ``MethodFitError`` skips to the next candidate seed (raised again when candidates
    run out); non-finite samples raise
    ``NonFiniteError`` naming the base seed.
    """
    parts: list[SampleSet] = []
    used: list[int] = []
    skipped: dict[int, str] = {}
    diagnostics: dict[str, list[float]] = {}
    bar = tqdm(total=plan.bases, desc=f"{method.name} {plan.mode}-mode", unit="base", dynamic_ncols=True,
               disable=not progress)
    pending = list(plan.candidates)
    while len(used) < plan.bases and pending:  # rounds of as many candidates as bases are missing
        take, pending = pending[: plan.bases - len(used)], pending[plan.bases - len(used) :]
        method.prefit(take, load_base)
        for seed in take:
            try:
                method.fit(load_base(seed), seed)
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
            if diagnostic_data is not None:
                for name, value in method.diagnostics(*diagnostic_data).items():
                    diagnostics.setdefault(name, []).append(float(value))
            bar.update()
    bar.close()
    if len(used) < plan.bases:
        details = "; ".join(f"seed {s}: {m}" for s, m in skipped.items())
        raise MethodFitError(
            f"method={method.name} mode={plan.mode}: only {len(used)} of {plan.bases} base networks could be fitted "
            f"from the {len(plan.candidates)} candidate seeds ({details})"
        )
    means = {name: sum(values) / len(values) for name, values in diagnostics.items()}
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}, tuple(used), means
