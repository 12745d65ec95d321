"""The methods that train their own networks, one round of K base seeds trained stacked
(``prefit``, the zoo trainer's packed kernels on a CPU) against one at a time (``fit`` alone),
side by side in one process on one thread, with a few epochs of the recipe, on digits/OptuNet or
(``--data mnist``) on MNIST-shaped data (``bench/mnist_shaped.py``: MNIST's files, sizes and
recipe, read by the MNIST loader). The cost per epoch does not depend on the schedule's length.

One function per method (``BENCHES``): it builds the method, times both ways for each stack size
(``side_by_side``) and returns the seconds keyed ``"K=<k> stacked"`` / ``"K=<k> one at a time"``;
``main`` prints them and records each K's speed-up (one at a time / stacked) with
``bench/summary.py``'s ``record``. A method is added with one more function in ``BENCHES``.

Usage: ``python bench/bench_methods_stacked.py [--methods dropout swag bnn bnn_ordered bnn_skip] [--networks 10] [--epochs 2]
[--repeats 3] [--data digits|mnist]`` (a few minutes on an idle core; MNIST: use ``--epochs 1 --repeats 1``). Each way runs ``--repeats`` times, alternating,
and its fastest run counts (the machine's neighbours slow single runs).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path
from typing import Callable

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from mnist_shaped import write_mnist_shaped  # noqa: E402  (bench/, next to this file)
from summary import record  # noqa: E402  (bench/summary.py, next to this file)
from benchmark import loader  # noqa: E402
from benchmark.core.training import seeded  # noqa: E402
from benchmark.experiment import Experiment  # noqa: E402
from methods.base import MethodFitError, PosteriorMethod  # noqa: E402

BENCH = "methods_stacked"
GOAL = 3.0  # K = --networks stacked against one at a time, per network (measured 5-7x on digits at K = 10)
FIRST_SEED = 1000  # the K seeds timed: FIRST_SEED ... FIRST_SEED + K - 1 (no zoo needed: these methods retrain)


def initial_state(seed: int) -> dict[str, torch.Tensor]:
    """A base for the methods that start from one: the network initialised under ``seed`` (the
    cost of a fit does not depend on the base's weights; these methods retrain or continue it)."""
    with seeded(seed):
        return EXPERIMENT.model().state_dict()


def fit_round(method: PosteriorMethod, seeds: list[int], stacked: bool) -> float:
    """Seconds to fit ``method`` around every seed of ``seeds``, as ``methods.modes.run_mode`` does
    for one round (``prefit`` then ``fit`` per seed), or with ``fit`` alone (one at a time)."""
    bases = {seed: initial_state(seed) for seed in seeds}
    began = time.perf_counter()
    if stacked:
        method.prefit(seeds, bases.__getitem__)
    for seed in seeds:
        try:
            method.fit(bases[seed], seed)
        except MethodFitError:  # a network failing the rule costs its training all the same
            pass
    return time.perf_counter() - began


def side_by_side(build: Callable[[], PosteriorMethod], counts: list[int], repeats: int) -> dict[str, float]:
    """For each K of ``counts``, the fastest of ``repeats`` alternating runs of K networks (seeds
    ``FIRST_SEED`` on) stacked and the same K one at a time, each with a fresh ``build()``."""
    fit_round(build(), list(range(FIRST_SEED, FIRST_SEED + max(counts))), stacked=True)  # loads the kernels: not timed
    ways = {}
    for k in counts:
        seeds = list(range(FIRST_SEED, FIRST_SEED + k))
        ways.update({f"K={k} stacked": (seeds, True), f"K={k} one at a time": (seeds, False)})
    best = {name: float("inf") for name in ways}
    for _ in range(repeats):
        for name, (chosen, stacked) in ways.items():
            best[name] = min(best[name], fit_round(build(), chosen, stacked))
    return best


@contextlib.contextmanager
def min_stack(module, value: int):
    """``module.MIN_STACK`` set to ``value`` inside the block (to time a stack its method would not build)."""
    saved, module.MIN_STACK = module.MIN_STACK, value
    try:
        yield
    finally:
        module.MIN_STACK = saved


def bench_dropout(exp: Experiment, networks: int, repeats: int) -> dict[str, float]:
    """MC Dropout (``methods.dropout``): K dropout networks trained from scratch; K = 2 (its
    ``MIN_STACK``) and a network stacked alone (K = 1, which ``prefit`` trains one at a time) too."""
    from methods import dropout

    assert exp.build_method("dropout").stacking_problem() is None, exp.build_method("dropout").stacking_problem()
    build = lambda: exp.build_method("dropout")  # noqa: E731
    with min_stack(dropout, 1):
        return side_by_side(build, sorted({networks, 2, 1}, reverse=True), repeats)


def bench_swag(exp: Experiment, networks: int, repeats: int) -> dict[str, float]:
    """SWAG (``methods.swag``): its SGD phase and snapshots from K bases (one run of the recipe's
    epochs, 4 snapshots); one at a time is its PyTorch loop (``fit`` with stacking refused)."""
    def build(stacked: bool):
        method = exp.build_method("swag")
        if not stacked:
            method._stacking = ("bench: one at a time",)
        return method

    assert build(True).stacking_problem() is None, build(True).stacking_problem()
    fit_round(build(True), list(range(FIRST_SEED, FIRST_SEED + 1)), stacked=True)  # loads the kernels: not timed
    seeds = list(range(FIRST_SEED, FIRST_SEED + networks))
    best = {f"K={networks} stacked": float("inf"), f"K={networks} one at a time": float("inf")}
    for _ in range(repeats):
        for stacked in (True, False):
            way = f"K={networks} {'stacked' if stacked else 'one at a time'}"
            best[way] = min(best[way], fit_round(build(stacked), seeds, stacked))
    return best


def vbnn(name: str) -> Callable[[Experiment, int, int], dict[str, float]]:
    """The vBNN ``name`` (``bnn``, or a symmetry-breaking variant ``bnn_ordered``, ``bnn_skip``):
    K vBNNs trained stacked (``methods.bnn_stacked``: the packed kernels, vmap for the skips)
    against the same seeds one at a time through BLiTZ's layers."""
    def bench(exp: Experiment, networks: int, repeats: int) -> dict[str, float]:
        problem = exp.build_method(name).stacking_problem()
        assert problem is None, problem
        return side_by_side(lambda: exp.build_method(name), [networks], repeats)

    bench.__doc__ = vbnn.__doc__.replace("``name``", name)
    return bench


BENCHES: dict[str, Callable[[Experiment, int, int], dict[str, float]]] = {
    "dropout": bench_dropout,
    "swag": bench_swag,
    **{name: vbnn(name) for name in ("bnn", "bnn_ordered", "bnn_skip")},
}
EXPERIMENT: Experiment  # set by main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--methods", nargs="+", choices=sorted(BENCHES), default=sorted(BENCHES))
    parser.add_argument("--networks", type=int, default=10, help="K, the base seeds of one round")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--data", choices=("digits", "mnist"), default="digits")
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = ["experiment=digits_optunet", "train.fail_rule.final_min_accuracy=null"]  # its end check is for the full recipe
    if args.data == "mnist":
        folder = Path("bench/_work/mnist_shaped")
        write_mnist_shaped(folder)
        data = ["experiment=mnist_optunet", f"dataset.data_dir={folder.resolve()}"]
    global EXPERIMENT
    exp = EXPERIMENT = Experiment(loader.compose_config([
        *data, "device=cpu", "store=bench/_work/methods_stacked_store", "results=bench/_work/methods_stacked_results",
        f"train.epochs={args.epochs}", "methods.swag.epochs_factor=1", "methods.swag.snapshots=4", "methods.swag.rank=3",
    ]))
    print(f"{args.data}/OptuNet, {args.epochs} epochs of {len(exp.train_tensors[1])} images per network, one thread, "
          f"fastest of {args.repeats} runs:")
    with exp.backends():
        for name in args.methods:
            seconds = BENCHES[name](exp, args.networks, args.repeats)
            for way, value in seconds.items():
                print(f"  {name:>10} {way:>24}: {value:7.2f} s")
            counts = [int(way.split()[0][2:]) for way in seconds if way.endswith(" stacked")]
            for k in counts:
                ratio = seconds[f"K={k} one at a time"] / seconds[f"K={k} stacked"]
                print(f"  {name:>10} K={k}: one at a time / stacked = {ratio:.2f}x")
                record(BENCH, f"{name}: K={k} stacked, speed-up over one at a time ({args.epochs} {args.data} epochs)",
                       ratio, goal=GOAL if k == args.networks else None)


if __name__ == "__main__":
    main()
