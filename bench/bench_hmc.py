"""Full-batch HMC on OptuNet/digits: the cost of one leapfrog step per chain, Pyro's HMC kernel
(one chain; the plain model through ``functional_call``) against the stacked kernel of
``methods.hmc_kernel`` (C chains in one pass through the zoo trainer's stacked networks), side by
side in one process, one thread; and the stacked cost at a larger training set (random images) to
extrapolate to MNIST's 55,000.

Usage: ``python bench/bench_hmc.py [--iterations 3] [--steps 10]`` (about 2-4 minutes on an idle core).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from summary import record  # noqa: E402  (bench/summary.py, next to this file)
from benchmark import config  # noqa: E402
from benchmark.core.training import TrainingData  # noqa: E402
from benchmark.experiment import Experiment  # noqa: E402
from methods.hmc import HMCMethod  # noqa: E402
from methods.hmc_kernel import KernelSettings, StackedHMC, new_chain  # noqa: E402

STEP = 1e-3  # small enough that every proposal is accepted: the cost does not depend on it


def pyro_cost(method: HMCMethod, iterations: int, steps: int) -> float:
    """Seconds per leapfrog step of Pyro's HMC (fixed step, no adaptation) on one chain."""
    from pyro.infer.mcmc import HMC, MCMC

    potential = method.potential
    images, labels, model = potential.images, potential.labels, potential.model

    def potential_fn(params):
        w = params["w"]
        state = dict(zip(potential.keys, (v.reshape(s) for v, s in zip(w.split(potential.sizes), potential.shapes))))
        logits = torch.func.functional_call(model, state, (images,))
        return F.cross_entropy(logits, labels, reduction="sum") + 0.5 * method.prior_precision * (w * w).sum()

    start = method.chain_start(0)  # an initialisation: the cost does not depend on where the chain is
    kernel = HMC(potential_fn=potential_fn, step_size=STEP, num_steps=steps, adapt_step_size=False, adapt_mass_matrix=False)
    mcmc = MCMC(kernel, num_samples=iterations, warmup_steps=1, initial_params={"w": start}, disable_progbar=True)
    began = time.perf_counter()
    mcmc.run()
    return (time.perf_counter() - began) / ((iterations + 1) * steps)


def stacked_cost(method: HMCMethod, chains: int, iterations: int, steps: int) -> float:
    """Seconds per leapfrog step per chain of the stacked kernel with ``chains`` chains at once."""
    states = [new_chain(f"c{seed}", method.chain_start(seed), seed) for seed in range(chains)]  # no descent: not timed
    kernel = StackedHMC(method.potential, KernelSettings(trajectory_length=steps * STEP, warmup=0, initial_step_size=STEP))
    kernel._evaluate(states)  # the first pass compiles the numba kernels: not timed
    for state in states:  # a fixed step: no step search
        state.step_size, state.adaptation = STEP, {"prox_center": 0.0}
    began = time.perf_counter()
    for _ in range(iterations):
        kernel.iterate(states)
    return (time.perf_counter() - began) / (iterations * steps * chains)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--chains", type=int, nargs="+", default=[1, 16, 32])
    parser.add_argument("--large", type=int, default=5500, help="training images of the extrapolation run (0: skip)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    exp = Experiment(config.compose_config(["store=bench/_work/hmc_store", "results=bench/_work/hmc_results"]))
    with exp.backends():
        method = exp.build_method("hmc")
        n = len(exp.train_tensors[1])
        costs = {f"stacked C={c}": stacked_cost(method, c, args.iterations, args.steps) for c in args.chains}
        costs["pyro C=1"] = pyro_cost(method, args.iterations, args.steps)
        print(f"OptuNet / digits ({n} training images), ms per leapfrog step per chain, one thread:")
        for name, seconds in costs.items():
            print(f"  {name:>14}: {1e3 * seconds:8.2f}")
        best = min(v for k, v in costs.items() if k.startswith("stacked"))
        print(f"  Pyro / best stacked: {costs['pyro C=1'] / best:.1f}x")
        record("hmc", "chain-step: Pyro HMC (1 chain) / stacked (best C)", costs["pyro C=1"] / best)
        if args.large:
            generator = torch.Generator().manual_seed(0)
            images = torch.rand(args.large, *exp.train_tensors[0].shape[1:], generator=generator)
            labels = torch.randint(0, 10, (args.large,), generator=generator)
            large = HMCMethod(exp.model, TrainingData(None, (images, labels), None), method.settings, recipe=exp.recipe)
            chains = max(args.chains)
            seconds = stacked_cost(large, chains, 1, args.steps)
            per_image = seconds / args.large
            print(f"{args.large} images, C={chains}: {1e3 * seconds:.2f} ms per chain-step; "
                  f"MNIST (55,000 images) extrapolated: {55_000 * per_image * 1e3:.0f} ms per chain-step")
            record("hmc", "MNIST OptuNet chain-step, extrapolated (ms)", 55_000 * per_image * 1e3, unit="ms",
                   higher_is_better=False)


if __name__ == "__main__":
    main()
