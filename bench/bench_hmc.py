"""Full-batch HMC on OptuNet/digits: milliseconds per chain-step (one leapfrog step of one chain: one
full-batch potential and gradient over the N training images) of the stacked kernel of
``methods.hmc_kernel`` (C chains in one pass through the packed kernels' fused step,
``methods.hmc.NetworkPotential``), next to the zoo trainer's cost of the same work (its
``Stack.step`` of ``AUTO_NETWORKS`` stacked OptuNets on the recipe's batches, per network and
image, times N), side by side in one process, one thread, in alternating rounds; then Pyro's HMC
kernel (one chain; the plain model through ``functional_call``), and the stacked cost at a larger
training set (random images) to extrapolate to MNIST's 55,000.

Times are this process's CPU time (``time.process_time``): the machine may be shared, and the
ratio of the two costs, measured round by round, is what the goal reads (HMC within 1.5x of the zoo).

Usage: ``python bench/bench_hmc.py [--rounds 3] [--steps 10] [--chains 10 16 32] [--large 5500]
[--pyro]`` (about 2-4 minutes on an idle core).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from summary import record  # noqa: E402  (bench/summary.py, next to this file)
from benchmark import loader  # noqa: E402
from benchmark.core.training import TrainingData, seeded  # noqa: E402
from benchmark.core.training.objective import CrossEntropyObjective  # noqa: E402
from benchmark.core.training.vectorised import AUTO_NETWORKS, Lane, Stack  # noqa: E402
from benchmark.experiment import Experiment  # noqa: E402
from methods.hmc import HMCMethod  # noqa: E402
from methods.hmc_kernel import KernelSettings, StackedHMC, new_chain  # noqa: E402

STEP = 1e-3  # small enough that every proposal is accepted: the cost does not depend on it
GOAL = 1.5  # a chain-step at most this many times the zoo's cost of one network's pass over the N images


def zoo_step(exp: Experiment, method: HMCMethod, networks: int):
    """``(step, images per call)``: one call of ``step()`` is one ``Stack.step`` of the zoo trainer
    on ``networks`` stacked OptuNets (``CrossEntropyObjective``, the recipe's SGD), each on its own
    batch of ``recipe.batch_size`` training images in its own order, cycling through the epoch."""
    stacked = method.potential.net
    models = []
    for seed in range(networks):
        with seeded(seed):
            models.append(exp.model())
    objective = CrossEntropyObjective(stacked, models)
    stack = Stack(objective, objective.initial(), exp.recipe, [Lane(i, f"seed {i}", torch.Generator()) for i in range(networks)])
    images, labels = exp.train_tensors
    source = stacked.source(images, torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    order = torch.stack([torch.randperm(len(labels), generator=generator) for _ in range(networks)])
    size = exp.recipe.batch_size
    at = {"start": 0}

    def step() -> None:
        start = at["start"]
        at["start"] = (start + size) % (len(labels) - size + 1)
        index = order[:, start : start + size]
        stack.step(lambda copies: stacked.batch(source, index.repeat(copies, 1), None, 0, 0.0), labels[index])

    return step, networks * size


def chain_step(method: HMCMethod, chains: int, steps: int):
    """``(iterate, chain-steps per call)``: one call is one HMC iteration of ``chains`` stacked chains of
    ``steps`` leapfrog steps each (a fixed step, no adaptation: every chain takes all its steps)."""
    states = [new_chain(f"c{seed}", method.chain_start(seed), seed) for seed in range(chains)]  # no descent: not timed
    kernel = StackedHMC(method.potential, KernelSettings(trajectory_length=steps * STEP, warmup=0, initial_step_size=STEP))
    kernel._evaluate(states)
    for state in states:  # a fixed step: no step search
        state.step_size, state.adaptation = STEP, {"prox_center": 0.0}
    return (lambda: kernel.iterate(states)), chains * steps


def cpu_seconds(call, repeats: int) -> float:
    """CPU seconds of this process per call of ``call`` (after one call not timed)."""
    call()
    began = time.process_time()
    for _ in range(repeats):
        call()
    return (time.process_time() - began) / repeats


def pyro_cost(method: HMCMethod, iterations: int, steps: int) -> float:
    """CPU seconds per leapfrog step of Pyro's HMC (fixed step, no adaptation) on one chain."""
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
    began = time.process_time()
    mcmc.run()
    return (time.process_time() - began) / ((iterations + 1) * steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of every measurement")
    parser.add_argument("--steps", type=int, default=10, help="leapfrog steps per HMC iteration")
    parser.add_argument("--chains", type=int, nargs="+", default=[10, 16, 32],
                        help="stacked chains (10: a unit of make hmc, sample.modes_multi)")
    parser.add_argument("--zoo-steps", type=int, default=20, help="zoo trainer steps per round")
    parser.add_argument("--pyro", action="store_true", help="also time Pyro's HMC on one chain")
    parser.add_argument("--large", type=int, default=5500, help="training images of the extrapolation run (0: skip)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    exp = Experiment(loader.compose_config(["store=bench/_work/hmc_store", "results=bench/_work/hmc_results"]))
    with exp.backends():
        method = exp.build_method("hmc")
        n = len(exp.train_tensors[1])
        zoo, zoo_images = zoo_step(exp, method, AUTO_NETWORKS)
        hmc = {c: chain_step(method, c, args.steps) for c in args.chains}
        zoo_ms, chain_ms = [], {c: [] for c in args.chains}
        for _ in range(args.rounds):  # alternating, so that both see the machine's speed of the moment
            zoo_ms.append(1e3 * n * cpu_seconds(zoo, args.zoo_steps) / zoo_images)
            for c, (call, per_call) in hmc.items():
                chain_ms[c].append(1e3 * cpu_seconds(call, 1) / per_call)
        print(f"OptuNet / digits ({n} training images), CPU ms per chain and full-batch gradient, one thread, "
              f"{args.rounds} alternating rounds (median; ratio = median of each round's ratio):")
        zoo_median = statistics.median(zoo_ms)
        print(f"  zoo trainer ({AUTO_NETWORKS} networks, batch {exp.recipe.batch_size}) x {n} images: {zoo_median:8.2f}")
        for c, values in chain_ms.items():
            ratio = statistics.median(v / z for v, z in zip(values, zoo_ms))
            print(f"  HMC chain-step, {c:3d} chains stacked: {statistics.median(values):8.2f}  = {ratio:.2f}x the zoo's "
                  f"(goal <= {GOAL})")
            record("hmc", f"chain-step / zoo per {n} images, {c} chains", ratio, goal=GOAL, unit="x", higher_is_better=False)
        if args.pyro:
            pyro = 1e3 * pyro_cost(method, 3, args.steps)
            best = min(statistics.median(v) for v in chain_ms.values())
            print(f"  Pyro HMC, 1 chain: {pyro:8.2f}  ({pyro / best:.1f}x the best stacked)")
            record("hmc", "chain-step: Pyro HMC (1 chain) / stacked (best C)", pyro / best)
        if args.large:
            generator = torch.Generator().manual_seed(0)
            images = torch.rand(args.large, *exp.train_tensors[0].shape[1:], generator=generator)
            labels = torch.randint(0, 10, (args.large,), generator=generator)
            large = HMCMethod(exp.model, TrainingData(None, (images, labels), None), method.settings, recipe=exp.recipe)
            chains = max(args.chains)
            call, per_call = chain_step(large, chains, args.steps)
            seconds = cpu_seconds(call, 1) / per_call
            print(f"{args.large} images, {chains} chains: {1e3 * seconds:.2f} ms per chain-step; MNIST (55,000 images) "
                  f"extrapolated: {55_000 * seconds / args.large * 1e3:.0f} ms per chain-step")
            record("hmc", "MNIST OptuNet chain-step, extrapolated (ms)", 55_000 * seconds / args.large * 1e3, unit="ms",
                   higher_is_better=False)


if __name__ == "__main__":
    main()
