"""The methods' fits stacked against one at a time: seconds per network of each method's own
training (SWAG's SGD phase and snapshots), K bases stacked (``prefit``, as the sample stage's
``fit_together`` runs them) against the same fit one base at a time, side by side in one process
on one thread, on digits and on MNIST-shaped data (``bench/mnist_shaped.py``: MNIST's files,
sizes and recipe), each fit cut to a few epochs (the cost per epoch does not depend on the
schedule's length).

Usage: ``python bench/bench_fits.py [--k 10,30] [--alone 2] [--sections digits,mnist]`` (a few minutes).
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

from mnist_shaped import write_mnist_shaped  # noqa: E402  (bench/, next to this file)
from summary import record  # noqa: E402  (bench/summary.py, next to this file)
from benchmark import config  # noqa: E402
from benchmark.core.training import seeded  # noqa: E402
from benchmark.experiment import Experiment  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
WORK = REPO / "bench" / "_work" / "fits"
GOAL = 5.0  # stacked / one at a time, per network: what makes the paper's scale fit one sitting


def experiment(section: str, *overrides: str) -> Experiment:
    """The section's experiment (digits, or MNIST-shaped files read by the MNIST loader)."""
    if section == "mnist":
        data = WORK / "mnist_shaped"
        write_mnist_shaped(data)
        base = ["experiment=mnist_optunet", f"dataset.data_dir={data}", "dataset.ood=mnist"]
    else:
        base = ["experiment=digits_optunet"]
    return Experiment(config.compose_config([*base, f"store={WORK / 'store'}", "device=cpu", *overrides]))


def initial_states(exp: Experiment, count: int) -> list[dict[str, torch.Tensor]]:
    """``count`` networks at their seeds' initialisation (the fits' cost does not depend on the weights)."""
    states = []
    for seed in range(count):
        with seeded(seed):
            states.append(exp.model().state_dict())
    return states


def swag(section: str, ks: list[int], alone: int) -> None:
    """SWAG's SGD phase and snapshots (one recipe epoch x epochs_factor 1, 4 snapshots)."""
    epochs = 1 if section == "mnist" else 3
    exp = experiment(section, f"train.epochs={epochs}", "methods.swag.epochs_factor=1", "methods.swag.snapshots=4",
                     "methods.swag.rank=3")
    states = initial_states(exp, max(ks))
    with exp.backends():
        method = exp.build_method("swag")
        method._stacking = ("bench: one at a time",)
        began = time.perf_counter()
        for seed in range(alone):
            method.fit(states[seed], seed)
        one = (time.perf_counter() - began) / alone
        warm = exp.build_method("swag")
        warm.prefit([0], states.__getitem__)  # compiles the packed kernels: not timed
        for k in ks:
            stacked = exp.build_method("swag")
            began = time.perf_counter()
            stacked.prefit(list(range(k)), states.__getitem__)
            per = (time.perf_counter() - began) / k
            print(f"[swag, {section}] {epochs} epoch(s): one at a time {one:.2f} s per network, K = {k} stacked "
                  f"{per:.3f} s per network: {one / per:.1f}x")
            record("fits", f"SWAG stacked K={k} / one at a time, {section}", one / per, GOAL)


BENCHES = {"swag": swag}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", default="10,30", help="stack sizes, comma-separated")
    parser.add_argument("--alone", type=int, default=2, help="networks fitted one at a time for the baseline")
    parser.add_argument("--sections", default="digits,mnist")
    parser.add_argument("--methods", default=",".join(BENCHES))
    args = parser.parse_args()
    torch.set_num_threads(1)
    ks = [int(k) for k in args.k.split(",")]
    for name in args.methods.split(","):
        for section in args.sections.split(","):
            BENCHES[name](section, ks, args.alone)


if __name__ == "__main__":
    main()
