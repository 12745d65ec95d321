"""Bench of zoo training (run by ``make bench``): OptuNet zoos, vectorised vs one at a time.

1. End to end on ``--jobs`` cores (default 2, one torch thread per job, as ``make benchmark``
   shards the zoo), each job timed from a common start after its set-up (imports, data, kernels):
   a. digits, the default recipe: ``--seeds`` seeds trained by ``train_networks`` (a job's seeds in
      one stack: 128, the K of ``zoo.vectorize=auto``), the first ``--baseline`` of them also by
      ``train_network`` one at a time. Also: on
      how many of those the two trainers' convergence verdicts differ, and the largest weight
      difference between the two zoos.
   b. MNIST-shaped (``bench/mnist_shaped.py``: 60,000 28x28 images in MNIST's files, read by the
      suite's MNIST loader; the mnist_optunet recipe: batch 64, random crops, the rule at epoch 3)
      for ``--mnist-epochs`` epochs: ``--mnist-seeds`` seeds stacked, the first ``--mnist-baseline``
      of them one at a time (a throughput: every seed trains the same epochs).
   Speed-up = training work per second (FLOPs of forward + backward per training image from
   ``torch.utils.flop_counter``, forward per evaluated image) stacked / one at a time; share of
   peak = that work per second / the float32 matmul peak of the same cores, measured by each job
   just before and just after its training (2048 x 2048 ``torch.mm``, one thread, best of 5; the
   mean of the two, summed over the jobs: this machine's speed drifts with its neighbours, so the
   peak is taken at the moment of the run). Goals: >= 10x, >= 35%.
2. Side by side, one core, K = ``--k`` networks: seconds per network and step of every way to
   train K networks (``bench/zoo_candidates.py``), at digits' batch (32) and MNIST's (64).
3. The cost of the paper's 1,000-checkpoint MNIST zoo, from 1b's measured work per second.
4. Side by side, one core: the batch gather of an MNIST training step (128 networks x 64 random crops
   from uint8 codes), the tiled ``gather_batch`` against the per-pixel loop it replaced
   (``bench/gather_candidates.py``).

Usage: ``python bench/bench_zoo.py [--seeds 256] [--baseline 64] [--jobs 2] [--k 64] [--mnist-seeds 256]
[--mnist-baseline 16] [--mnist-epochs 3] [--sections digits,mnist,side,gather]``.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from mnist_shaped import write_mnist_shaped  # noqa: E402  (bench/, next to this file)
from summary import record  # noqa: E402

GOAL_SPEEDUP, GOAL_PEAK = 10.0, 35.0
NATIVE_WITHIN = 1.5  # a PyTorch-native way is preferred where it is at most this much slower than the packed kernels
MNIST_DATA = REPO / "bench" / "_work" / "mnist_shaped"
MNIST_ZOO = 1000  # the paper's reference zoo


def experiment(overrides: list[str]):
    from benchmark.loader import compose_config
    from benchmark.experiment import Experiment

    return Experiment(compose_config(["store=unused", "device=cpu", *overrides]))


def build(exp, seeds):
    from benchmark.core.training import seeded

    models = []
    for seed in seeds:
        with seeded(seed):
            models.append(exp.model())
    return models


def train(exp, seeds, how: str) -> list:
    """Train ``seeds`` as the zoo stage does, one at a time (``how="one"``) or stacked (``"packed"``)."""
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


def job(how: str, overrides: list[str], seeds: list[int], barrier, queue) -> None:
    """One worker process: set up (and load the kernels on a one-epoch warm-up), wait for the others,
    train its seeds; report its wall time, its core's matmul peak measured just before and just after
    (the share of the peak is then taken at the machine's speed of the moment), and its outcomes."""
    torch.set_num_threads(1)
    exp = experiment(overrides)
    with exp.backends():
        _ = exp.training_data
        if how != "one":
            warm = experiment([*overrides, "train.epochs=1", "train.fail_rule.epoch=null", "train.fail_rule.final_min_accuracy=null"])
            train(warm, seeds[:1], how)
        barrier.wait()
        before = core_peak()
        start = time.perf_counter()
        outcomes = train(exp, seeds, how)
        wall = time.perf_counter() - start
        peak = (before + core_peak()) / 2
    # NumPy arrays: torch tensors would travel as shared memory that dies with this process.
    queue.put((wall, peak, [(seed, {k: v.numpy() for k, v in o.state_dict.items()} if hasattr(o, "state_dict") else None,
                             getattr(o, "failure", str(o)), getattr(o, "epochs_run", 0)) for seed, o in zip(seeds, outcomes)]))


def run_jobs(how: str, overrides: list[str], seeds: list[int], jobs: int) -> tuple[float, float, list]:
    """Wall time (slowest job), matmul peak (sum over the jobs, around their training) and outcomes
    (seed order) of ``seeds`` split over ``jobs`` processes."""
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(jobs), ctx.Queue()
    procs = [ctx.Process(target=job, args=(how, overrides, seeds[j::jobs], barrier, queue)) for j in range(jobs)]
    for p in procs:
        p.start()
    results = [queue.get() for _ in procs]
    for p in procs:
        p.join()
        if p.exitcode:
            raise RuntimeError(f"{how} job exited with {p.exitcode}")
    return (max(r[0] for r in results), sum(r[1] for r in results),
            sorted(sum((r[2] for r in results), []), key=lambda t: t[0]))


def flops_per_image() -> tuple[float, float]:
    """``(forward + backward, forward)`` FLOPs of OptuNet per 28x28 image (batch of 32)."""
    from torch.utils.flop_counter import FlopCounterMode

    from benchmark.core.models import optunet

    model, x, y = optunet(), torch.randn(32, 1, 28, 28), torch.randint(0, 10, (32,))
    with FlopCounterMode(display=False) as train_count:
        F.cross_entropy(model(x), y).backward()
    with FlopCounterMode(display=False) as eval_count, torch.no_grad():
        model(x)
    return train_count.get_total_flops() / 32, eval_count.get_total_flops() / 32


def core_peak(repeats: int = 5) -> float:
    """FLOP/s of float32 2048^2 matmuls on this process's thread (the best of ``repeats``)."""
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * 2048**3 / best


def peak_job(barrier, queue) -> None:
    torch.set_num_threads(1)
    core_peak(1)
    barrier.wait()
    queue.put(core_peak())


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


@dataclass
class Sizes:
    """The data sizes the FLOPs are counted on: training images per epoch, validation images (the
    convergence rule), the per-image FLOPs ``(train, forward)``."""

    train: int
    check: int
    per_image: tuple[float, float]
    rule_epoch: int | None

    def flops(self, outcomes) -> float:
        """FLOPs spent on ``outcomes``: each network's training images x fwd+bwd, its evaluated
        images x fwd (the validation set at the rule's epoch; at the end the validation and train sets)."""
        train, forward = self.per_image
        total = 0.0
        for _, state, failure, epochs in outcomes:
            total += epochs * self.train * train
            if state is None:
                continue
            stopped = failure is not None and "did not converge" in failure
            rule = self.check if self.rule_epoch is not None and epochs >= self.rule_epoch else 0
            total += (rule + (0 if stopped else self.check + self.train)) * forward
        return total


@dataclass
class EndToEnd:
    """One end-to-end comparison: work per second (FLOP/s) of each trainer and its outcomes."""

    name: str
    rate: dict[str, float]
    outcomes: dict[str, list]

    @property
    def speedup(self) -> float:
        return self.rate["packed"] / self.rate["one"]


def end_to_end(name: str, overrides: list[str], seeds: list[int], baseline: list[int], jobs: int, peak: float,
               per_image: tuple[float, float]) -> EndToEnd:
    """Both trainers on ``name``'s data, printed and recorded; one at a time on ``baseline``."""
    exp = experiment(overrides)
    sizes = Sizes(len(exp.training_data.train), len(exp.training_data.check[1]), per_image, exp.recipe.fail_rule.epoch)
    rate, outcomes, wall, peaks = {}, {}, {}, {}
    for how, chosen in (("one", baseline), ("packed", seeds)):
        wall[how], peaks[how], outcomes[how] = run_jobs(how, overrides, chosen, jobs)
        rate[how] = sizes.flops(outcomes[how]) / wall[how]
    result = EndToEnd(name, rate, outcomes)
    print(f"[{name}] {exp.recipe.epochs} epochs of batch {exp.recipe.batch_size} on {sizes.train} images, {jobs} jobs x 1 thread")
    for how, label in (("one", "one at a time"), ("packed", "vectorised")):
        done = outcomes[how]
        converged = sum(o[2] is None and o[1] is not None for o in done)
        print(f"  {label:14s} {len(done):4d} seeds ({converged} converged) in {wall[how]:7.1f} s: "
              f"{len(done) / wall[how] * 3600:9.0f} seeds/hour, {rate[how] / 1e9:6.2f} GFLOP/s = "
              f"{100 * rate[how] / peaks[how]:5.2f}% of the matmul peak around it ({peaks[how] / 1e9:.0f} GFLOP/s; "
              f"{100 * rate[how] / peak:.2f}% of the one at the start)")
    share = 100 * rate["packed"] / peaks["packed"]
    print(f"  speed-up (work per second) {result.speedup:.1f}x (goal >= {GOAL_SPEEDUP:.0f}x: "
          f"{'met' if result.speedup >= GOAL_SPEEDUP else 'NOT met'}); vectorised at {share:.1f}% of the peak "
          f"(goal >= {GOAL_PEAK:.0f}%: {'met' if share >= GOAL_PEAK else 'NOT met'})")
    record("zoo", f"zoo training, OptuNet {name}, work per second on {jobs} cores: vectorised / one at a time",
           result.speedup, GOAL_SPEEDUP)
    record("zoo", f"zoo training, OptuNet {name}, vectorised: share of the matmul peak ({peaks['packed'] / 1e9:.0f} GFLOP/s)",
           share, GOAL_PEAK, unit="%")
    return result


def verdicts(result: EndToEnd) -> None:
    """Convergence verdicts and weights of the seeds both trainers trained."""
    one = {o[0]: o for o in result.outcomes["one"]}
    both = [(one[o[0]], o) for o in result.outcomes["packed"] if o[0] in one]
    differ = [a[0] for a, b in both if (a[2] is None) != (b[2] is None)]
    diff = max((float(abs(a[1][k] - b[1][k]).max()) for a, b in both
                if a[1] is not None and b[1] is not None for k in a[1]), default=0.0)
    print(f"  convergence verdicts differ on {len(differ)} of {len(both)} seeds {differ[:10]}; "
          f"largest weight difference between the zoos {diff:.2e}")
    record("zoo", f"zoo training, OptuNet {result.name}: seeds whose convergence verdict differs between the trainers "
           f"(of {len(both)})", len(differ), unit="")


def side_by_side(k: int, batch: int, label: str, candidates: tuple[str, ...], steps: int) -> dict[str, float]:
    """Seconds per network and step of every candidate at ``k`` networks, printed and recorded."""
    from zoo_candidates import seconds_per_network_step

    exp = experiment([])
    torch.set_num_threads(1)
    data = exp.training_data
    times = seconds_per_network_step(build(exp, range(1000, 1000 + k)), data.train_tensors[0], data.train_tensors[1],
                                     batch, steps, candidates)
    packed = times["packed"]
    print(f"[side by side] {k} OptuNets, batch {batch} ({label}), 1 thread: CPU time per network and step")
    for name, seconds in times.items():
        print(f"  {name:22s} {seconds * 1e6:8.1f} us   {times['one'] / seconds:6.1f}x one at a time   "
              f"{seconds / packed:6.1f}x the packed kernels' time")
    native = min((s for n, s in times.items() if n not in ("one", "packed")), default=float("inf"))
    print(f"  fastest PyTorch-native way: {native / packed:.1f}x the packed kernels' time (preferred within "
          f"{NATIVE_WITHIN}x: {'yes' if native <= NATIVE_WITHIN * packed else 'no, the packed kernels stay on the CPU'})")
    for name, seconds in times.items():
        if name != "one":
            record("zoo", f"training step, {k} OptuNets at once, batch {batch}: {name} vs one at a time", times["one"] / seconds)
    return times


def gather_side_by_side() -> None:
    """Section 4: milliseconds per MNIST training batch of each gather, printed and recorded."""
    from gather_candidates import seconds_per_batch

    times = seconds_per_batch()
    print("[gather] 128 networks x 64 random 28x28 crops (padding 4) of 55,000 uint8 images, 1 thread, best of 3:")
    for name, seconds in times.items():
        print(f"  {name:10s} {seconds * 1e3:7.2f} ms per batch   {times['per pixel'] / seconds:5.2f}x the per-pixel gather")
    record("zoo", "MNIST batch gather, 128 networks: tiled vs per pixel", times["per pixel"] / times["tiled"])


def mnist_estimate(result: EndToEnd, exp, jobs: int) -> None:
    """The paper's 1,000-checkpoint MNIST zoo (the full recipe) priced from 1b's measured work per second."""
    recipe = exp.recipe
    convergence = exp.config.seeds.expected_convergence
    seeds = round(MNIST_ZOO / convergence)
    n_train = len(exp.training_data.train)
    sizes = Sizes(n_train, len(exp.training_data.check[1]), flops_per_image(), recipe.fail_rule.epoch)
    rule = recipe.fail_rule.epoch or recipe.epochs
    # Counted as the end-to-end runs count their outcomes: converged networks the whole recipe and the
    # final evaluations, the others stopped at the rule's epoch.
    flops = sizes.flops([(None, True, None, recipe.epochs)] * MNIST_ZOO
                        + [(None, True, "did not converge", rule)] * (seeds - MNIST_ZOO))
    print(f"[cost of a {MNIST_ZOO}-checkpoint MNIST zoo] {seeds} seeds at {convergence:.0%} convergence, {recipe.epochs} "
          f"epochs of {n_train} images (failures stop at epoch {rule}): {flops / 1e15:.2f} PFLOP")
    per_core = {how: result.rate[how] / jobs for how in result.rate}
    for how, label in (("one", "one at a time"), ("packed", "vectorised")):
        here = flops / result.rate[how] / 3600
        node = flops / (16 * per_core[how]) / 3600
        print(f"  {label:14s} this machine ({jobs} cores, measured rate): {here:7.2f} h;   16-core node "
              f"(estimated: this machine's rate per core x 16): {node:6.2f} h")
        record("zoo", f"{MNIST_ZOO}-checkpoint MNIST zoo on this machine ({jobs} cores), {label}", here, unit="h",
               higher_is_better=False)
    print("  one GPU: estimated, not measured (no GPU here): the vmap path's grouped convolutions are memory-bound; "
          "see README, On a cluster")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=256, help="digits seeds stacked: K = seeds / jobs = 128, the zoo's K")
    parser.add_argument("--baseline", type=int, default=64, help="of the digits seeds, how many also one at a time")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--k", type=int, default=64)
    parser.add_argument("--mnist-seeds", type=int, default=256)
    parser.add_argument("--mnist-baseline", type=int, default=16)
    parser.add_argument("--mnist-epochs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20, help="training steps timed per side-by-side candidate")
    parser.add_argument("--sections", default="digits,mnist,side,gather",
                        help="any of digits, mnist (with the cost estimate), side, gather")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
    peak = matmul_peak(args.jobs)
    per_image = flops_per_image()
    print(f"matmul peak (float32 2048^2 mm, {args.jobs} x 1 thread): {peak / 1e9:.1f} GFLOP/s; OptuNet: "
          f"{per_image[0] / 1e3:.1f} kFLOP per training image, {per_image[1] / 1e3:.1f} kFLOP per evaluated image")
    sections = set(args.sections.split(","))
    if "digits" in sections:
        seeds = list(range(args.seeds))
        verdicts(end_to_end("digits", [], seeds, seeds[: args.baseline], args.jobs, peak, per_image))
    if "mnist" in sections:
        mnist_base = ["experiment=mnist_optunet", f"dataset.data_dir={write_mnist_shaped(MNIST_DATA)}"]
        mnist_overrides = [*mnist_base, f"train.epochs={args.mnist_epochs}"]
        mnist_seeds = list(range(args.mnist_seeds))
        mnist = end_to_end("MNIST-shaped", mnist_overrides, mnist_seeds, mnist_seeds[: args.mnist_baseline], args.jobs,
                           peak, per_image)
        mnist_estimate(mnist, experiment(mnist_base), args.jobs)  # the full recipe
    if "side" in sections:
        everything = ("one", "packed", "vmap", "vmap mkldnn off", "grouped", "grouped mkldnn off", "compiled")
        side_by_side(args.k, 32, "digits' recipe", everything, args.steps)
        side_by_side(args.k, 64, "MNIST's recipe", ("one", "packed", "vmap", "grouped"), args.steps)
    if "gather" in sections:
        torch.set_num_threads(1)
        gather_side_by_side()


if __name__ == "__main__":
    main()
