"""Bench of the vBNNs' stacked training (run by ``make bench``): each vBNN of ``methods.bnn`` (the plain
one and its symmetry-breaking variants ``bnn_ordered`` and ``bnn_skip``) trained for ``--k`` seeds
stacked (``prefit``: ``methods.bnn_stacked.VariationalObjective`` through ``train_networks``, the packed
kernels or ``torch.func.vmap``) against the same seeds one at a time through BLiTZ's layers (``fit``
without ``prefit``), side by side in one process on one torch thread, on digits for ``--epochs``
epochs (the vBNN's recipe otherwise, no convergence rule so that every network trains every epoch).

Speed-up = time one at a time / time stacked, for the same networks (each stacked network follows
its BLiTZ training to float rounding: ``tests/methods/test_bnn_stacked.py``). ``--repeats`` runs of
each, alternating, the best time of each kept (this machine's neighbours make timings vary). A
variant whose stacked form is refused (``stacking_problem``) is reported and skipped.

Usage: ``python bench/bench_bnn_variants.py [--k 10] [--epochs 2] [--repeats 2] [--methods bnn,bnn_ordered,bnn_skip]``.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from summary import record  # noqa: E402  (bench/, next to this file)

METHODS = ("bnn", "bnn_ordered", "bnn_skip")
FIRST_SEED = 100


def experiment():
    from benchmark.config import compose_config
    from benchmark.experiment import Experiment

    return Experiment(compose_config(["store=unused", "device=cpu"]))


def method(exp, name: str, epochs: int):
    """Method ``name`` built as the sample stage builds it, its recipe cut to ``epochs`` epochs without a rule."""
    from benchmark.core.training import FailRule, RecipeOverrides
    from methods import method_class

    settings = exp.method_settings(name)
    train: RecipeOverrides = settings.train
    settings = dataclasses.replace(settings, train=dataclasses.replace(train, epochs=epochs, milestones=[], fail_rule=FailRule()))
    return method_class(name)(exp.model, exp.training_data, settings, recipe=exp.recipe, device=exp.device)


def time_fits(exp, name: str, seeds: list[int], epochs: int, stacked: bool) -> float:
    """Seconds to fit ``seeds`` (a fresh method: stacked through ``prefit``, or one at a time)."""
    m = method(exp, name, epochs)
    start = time.perf_counter()
    if stacked:
        m.prefit(seeds, lambda seed: {})
    for seed in seeds:
        m.fit({}, seed)
    return time.perf_counter() - start


def speedup(exp, name: str, k: int, epochs: int, repeats: int) -> tuple[float, float] | None:
    """``(best seconds one at a time, best seconds stacked)`` for ``k`` seeds of method ``name``,
    alternating ``repeats`` times; None if the method is not stacked (the reason printed)."""
    problem = method(exp, name, epochs).stacking_problem()
    if problem is not None:
        print(f"{name}: not stacked ({problem})")
        return None
    seeds = list(range(FIRST_SEED, FIRST_SEED + k))
    time_fits(exp, name, seeds[:2], 1, stacked=True)  # warm-up: kernels, vmap's first trace
    one, together = float("inf"), float("inf")
    for _ in range(repeats):
        together = min(together, time_fits(exp, name, seeds, epochs, stacked=True))
        one = min(one, time_fits(exp, name, seeds, epochs, stacked=False))
    return one, together


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--methods", default=",".join(METHODS))
    args = parser.parse_args()
    torch.set_num_threads(1)
    exp = experiment()
    print(f"digits, {args.epochs} epochs, K = {args.k}, 1 thread, best of {args.repeats}")
    print(f"{'method':<12} {'one at a time':>14} {'stacked':>10} {'speed-up':>9}")
    with exp.backends():
        _ = exp.training_data
        for name in args.methods.split(","):
            times = speedup(exp, name, args.k, args.epochs, args.repeats)
            if times is None:
                continue
            one, together = times
            print(f"{name:<12} {one:>12.2f} s {together:>8.2f} s {one / together:>8.2f}x", flush=True)
            record("bnn_variants", f"{name}: K={args.k} stacked / one at a time (digits, 1 thread)", one / together)


if __name__ == "__main__":
    main()
