"""Bench of zoo training (run by ``make bench``): OptuNet on digits, vectorised vs one at a time.

1. Checkpoints per hour on ``--jobs`` cores (default 2, one torch thread per job, as ``make
   benchmark`` shards the zoo): the same ``--seeds`` seeds of the default recipe, trained by
   ``train_network`` one at a time and by ``train_networks`` (all of a job's seeds in one
   stack), each job timed from a common start after its set-up (imports, data, kernel
   compilation). Goal: >= 10x. Also: the largest weight difference between the two zoos and
   whether the same seeds failed the convergence rule.
2. Achieved GFLOP/s of both (FLOPs of forward + backward of OptuNet per image from
   ``torch.utils.flop_counter``, times the images each network processed, plus its evaluation
   passes) against the matmul peak of the same cores measured in the same run (float32
   2048 x 2048 ``torch.mm``, one thread per job, all jobs at once).
3. Side by side at one K (``--k``, default 64, one core, 2 epochs): time per network and step
   of the three ways to train K networks: one at a time, ``torch.func.vmap``, and the packed
   numba kernels.

Usage: ``python bench/bench_zoo.py [--seeds 128] [--jobs 2] [--k 64]``.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from summary import record  # noqa: E402  (bench/summary.py, next to this file)

GOAL = 10.0


def experiment(epochs: int | None = None):
    from benchmark.config import compose_config
    from benchmark.experiment import Experiment

    overrides = ["store=unused", "device=cpu"] + ([f"train.epochs={epochs}", "train.fail_rule.epoch=null"] if epochs else [])
    return Experiment(compose_config(overrides))


def build(exp, seeds):
    from benchmark.core.training import seeded

    models = []
    for seed in seeds:
        with seeded(seed):
            models.append(exp.model())
    return models


def train(exp, seeds, how: str) -> list:
    """Train ``seeds`` one at a time (``how="one"``) or stacked (``"packed"``, ``"vmap"``); outcomes in seed order."""
    from benchmark.core.training import NonFiniteError, train_network
    from benchmark.core.training.vectorised import train_networks

    data = exp.training_data
    if how != "one":
        return train_networks(build(exp, seeds), data, exp.recipe, seeds, [f"seed {s}" for s in seeds],
                              train_eval=data.train_tensors, implementation=how)
    out = []
    for seed, model in zip(seeds, build(exp, seeds)):
        try:
            out.append(train_network(model, data.train, data.check, exp.recipe, seed, where=f"seed {seed}",
                                     train_eval=data.train_tensors))
        except NonFiniteError as err:
            out.append(err)
    return out


def job(how: str, seeds: list[int], barrier, queue) -> None:
    """One worker process: set up (and compile the kernels on one warm-up network), wait for
    the others, train its seeds, report its wall time and outcomes."""
    torch.set_num_threads(1)
    exp = experiment()
    with exp.backends():
        if how != "one":
            train(experiment(epochs=1), seeds[:1], how)  # compiles the numba kernels
        barrier.wait()
        start = time.perf_counter()
        outcomes = train(exp, seeds, how)
        wall = time.perf_counter() - start
    # NumPy arrays: torch tensors would travel as shared memory that dies with this process.
    queue.put((how, wall, [(seed, {k: v.numpy() for k, v in o.state_dict.items()} if hasattr(o, "state_dict") else None,
                            getattr(o, "failure", str(o)), getattr(o, "epochs_run", 0)) for seed, o in zip(seeds, outcomes)]))


def run_jobs(how: str, seeds: list[int], jobs: int) -> tuple[float, list]:
    """Wall time (slowest job) and outcomes of ``seeds`` split over ``jobs`` processes (seed % jobs)."""
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(jobs), ctx.Queue()
    procs = [ctx.Process(target=job, args=(how, [s for s in seeds if s % jobs == j], barrier, queue)) for j in range(jobs)]
    for p in procs:
        p.start()
    results = [queue.get() for _ in procs]
    for p in procs:
        p.join()
        if p.exitcode:
            raise RuntimeError(f"{how} job exited with {p.exitcode}")
    return max(r[1] for r in results), sorted(sum((r[2] for r in results), []), key=lambda t: t[0])


def flops_per_image() -> tuple[float, float]:
    """``(forward + backward, forward)`` FLOPs of OptuNet per image (batch of 32)."""
    from torch.utils.flop_counter import FlopCounterMode

    from benchmark.core.models import optunet

    model, x, y = optunet(), torch.randn(32, 1, 28, 28), torch.randint(0, 10, (32,))
    with FlopCounterMode(display=False) as train_count:
        F.cross_entropy(model(x), y).backward()
    with FlopCounterMode(display=False) as eval_count, torch.no_grad():
        model(x)
    return train_count.get_total_flops() / 32, eval_count.get_total_flops() / 32


def peak_job(barrier, queue) -> None:
    torch.set_num_threads(1)
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    a @ b
    barrier.wait()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    queue.put(2 * 2048**3 / best)


def matmul_peak(jobs: int) -> float:
    """FLOP/s of float32 2048^2 matmuls, one thread per job, all jobs at once (sum)."""
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(jobs), ctx.Queue()
    procs = [ctx.Process(target=peak_job, args=(barrier, queue)) for _ in range(jobs)]
    for p in procs:
        p.start()
    rates = [queue.get() for _ in procs]
    for p in procs:
        p.join()
    return sum(rates)


def total_flops(outcomes, n_train: int, n_check: int, per_image: tuple[float, float]) -> float:
    """FLOPs spent on ``outcomes``: training images x fwd+bwd, evaluation images x fwd."""
    train, forward = per_image
    total = 0.0
    for _, state, failure, epochs in outcomes:
        total += epochs * n_train * train
        evaluated = n_check if (failure and "did not converge" in failure) else 2 * n_check + n_train
        total += evaluated * forward if state is not None else 0
    return total


def side_by_side(k: int) -> None:
    """Time per network and training step at K networks, one core, 2 epochs."""
    torch.set_num_threads(1)
    exp = experiment(epochs=2)
    steps = 2 * -(-len(exp.training_data.train) // exp.recipe.batch_size)
    seeds = list(range(1000, 1000 + k))
    times = {}
    with exp.backends():
        train(experiment(epochs=1), seeds[:2], "packed")
        for how in ("one", "vmap", "packed"):
            start = time.process_time()
            train(exp, seeds, how)
            times[how] = (time.process_time() - start) / k / steps
    print(f"[side by side] {k} networks, 2 epochs, 1 thread (CPU time per network and step)")
    for how, label in (("one", "one at a time (train_network)"), ("vmap", "torch.func.vmap (grouped conv)"),
                       ("packed", "packed numba kernels")):
        print(f"  {label:32s} {times[how] * 1e6:8.0f} us   {times['one'] / times[how]:5.1f}x")
    record("zoo", f"training step, {k} OptuNets at once: vmap vs one at a time", times["one"] / times["vmap"])
    record("zoo", f"training step, {k} OptuNets at once: packed kernels vs one at a time", times["one"] / times["packed"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=128)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--k", type=int, default=64)
    args = parser.parse_args()
    seeds = list(range(args.seeds))
    exp = experiment()
    n_train, n_check = len(exp.training_data.train), len(exp.training_data.check[1])
    print(f"torch {torch.__version__}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; "
          f"OptuNet on digits, default recipe ({exp.recipe.epochs} epochs), seeds 0-{args.seeds - 1}, "
          f"{args.jobs} jobs x 1 thread")
    peak = matmul_peak(args.jobs)
    per_image = flops_per_image()
    walls, zoos = {}, {}
    for how in ("one", "packed"):
        walls[how], zoos[how] = run_jobs(how, seeds, args.jobs)
    ratio = walls["one"] / walls["packed"]
    converged = sum(o[2] is None and o[1] is not None for o in zoos["one"])
    same_failures = [o[2] is None for o in zoos["one"]] == [o[2] is None for o in zoos["packed"]]
    diff = max((float(abs(a[1][k] - b[1][k]).max()) for a, b in zip(zoos["one"], zoos["packed"])
                if a[1] is not None and b[1] is not None for k in a[1]), default=0.0)
    print(f"[checkpoints/hour] {args.seeds} seeds, {converged} converged ({args.seeds - converged} failed the rule)")
    for how, label in (("one", "one at a time"), ("packed", "vectorised")):
        gflops = total_flops(zoos[how], n_train, n_check, per_image) / walls[how] / 1e9
        print(f"  {label:14s} wall {walls[how]:7.1f} s   {converged / walls[how] * 3600:9.0f} checkpoints/hour   "
              f"{gflops:6.2f} GFLOP/s = {100 * gflops / (peak / 1e9):5.2f}% of the matmul peak")
        record("zoo", f"zoo training, {label}: share of the matmul peak ({peak / 1e9:.0f} GFLOP/s on {args.jobs} cores)",
               100 * gflops / (peak / 1e9), unit="%")
    print(f"  speed-up vectorised / one at a time: {ratio:.1f}x (goal >= {GOAL:.0f}x: {'met' if ratio >= GOAL else 'NOT met'})")
    print(f"  same seeds failed: {same_failures}; largest weight difference between the zoos: {diff:.2e}")
    print(f"  matmul peak (float32 2048^2 mm, {args.jobs} x 1 thread): {peak / 1e9:.1f} GFLOP/s; OptuNet: "
          f"{per_image[0] / 1e3:.1f} kFLOP per training image, {per_image[1] / 1e3:.1f} kFLOP per evaluated image")
    record("zoo", f"zoo training, OptuNet digits, checkpoints/hour on {args.jobs} cores: vectorised / one at a time",
           ratio, GOAL)
    side_by_side(args.k)


if __name__ == "__main__":
    main()
