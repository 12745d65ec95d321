"""What does the paper's MNIST experiment cost on this machine? Measured per network-epoch of each stage's stacked work on real MNIST, priced at the paper's scale. Last result (2026-11-28, 2-core Xeon, shared): docs/performance.md, "The paper's MNIST experiment".

Each piece of work ``make benchmark EXPERIMENT=mnist_optunet`` does at the paper's scale (a zoo of
1,000 converged reference networks, 3 repetitions of every default method in both modes; the
held-out range of ``conf/experiment/mnist_optunet.yaml``) is timed here for one epoch (or one fit)
at the stack size the run uses, on one torch thread, on the real MNIST files, and multiplied by the
number of network-epochs the run needs: the zoo (K = 128, ``zoo.vectorize=auto``), SWAG's SGD phase
(every multi-mode base of the 3 repetitions in one stack: ``fit_together``), the stacked MC Dropout
and vBNN networks, the symmetry-breaking vBNNs (one-mode: 3 networks), SGHMC's 10 chains per unit,
the scale-adapted SGHMC's single chain, Laplace's fits, and the predictions every unit stores (100
networks on the test and OOD sets). Not timed: evaluate, report and analyze (MMD and the symmetry
engine work on the weights, whose number is the same as on digits: docs/performance.md gives their
digits time). The bases are networks at their initialisation (a fit's cost does not depend on where
it starts), so no zoo is needed.

Usage: ``python studies/mnist_scale.py --data-dir <folder with MNIST/raw and FashionMNIST/raw> [--cores 2]``
(about 10 minutes on one idle core).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmark import loader  # noqa: E402
from benchmark.core.models import predict_with_weights  # noqa: E402
from benchmark.core.store import stack_state_dicts  # noqa: E402
from benchmark.core.training import seeded  # noqa: E402
from benchmark.core.training.vectorised import train_networks  # noqa: E402
from benchmark.experiment import Experiment  # noqa: E402

REPETITIONS, BASES, SAMPLES = 3, 10, 100  # the paper's scale: sample.repetitions, modes_multi, per_method


def experiment(data_dir: str, *overrides: str) -> Experiment:
    return Experiment(loader.compose_config([
        "experiment=mnist_optunet", f"dataset.data_dir={data_dir}", "device=cpu", "store=studies/_work/mnist_scale",
        "results=studies/_work/mnist_scale_results", *overrides]))


def states(exp: Experiment, count: int) -> dict[int, dict[str, torch.Tensor]]:
    out = {}
    for seed in range(count):
        with seeded(seed):
            out[seed] = exp.model().state_dict()
    return out


def timed(work) -> float:
    began = time.perf_counter()
    work()
    return time.perf_counter() - began


def per_network_epoch(exp: Experiment, method: str, networks: int, epochs: float) -> float:
    """Seconds per network and epoch of ``method``'s stacked ``prefit`` of ``networks`` bases."""
    bases = states(exp, networks)
    fitted = exp.build_method(method)
    fitted.prefit([0], bases.__getitem__)  # loads the kernels: not timed
    fitted = exp.build_method(method)
    return timed(lambda: fitted.prefit(list(bases), bases.__getitem__)) / (networks * epochs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--cores", type=int, default=2, help="cores the run's jobs share (make benchmark's JOBS)")
    parser.add_argument("--fail-rate", type=float, default=0.057,
                        help="share of seeds the rule stops at epoch 3 (real MNIST: 8 of the first 140 held-out seeds)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    exp = experiment(args.data_dir, "train.epochs=1")
    recipe = experiment(args.data_dir).recipe
    seeds = exp.config.seeds
    fail_early = args.fail_rate
    zoo_seeds = 1000 / (1 - fail_early) + (seeds.heldout[1] - seeds.heldout[0])  # 1,000 converged reference networks
    rows = []
    with exp.backends():
        models = [exp.model() for _ in range(128)]
        train_networks(models[:1], exp.training_data, exp.recipe, [0], ["warm"])  # compiles the kernels: not timed
        zoo = timed(lambda: train_networks(models, exp.training_data, exp.recipe, list(range(128)),
                                           [f"seed {s}" for s in range(128)])) / 128
        epochs = (1 - fail_early) * recipe.epochs + fail_early * recipe.fail_rule.epoch
        rows.append(("zoo (K = 128)", zoo, zoo_seeds * epochs))
        stack = REPETITIONS * BASES  # one-mode's base is a multi-mode base of its repetition
        swag = experiment(args.data_dir, "train.epochs=1", "methods.swag.epochs_factor=1", "methods.swag.snapshots=4",
                          "methods.swag.rank=3")
        rows.append((f"SWAG (K = {stack})", per_network_epoch(swag, "swag", stack, 1), stack * 2 * recipe.epochs))
        for name in ("dropout", "bnn"):
            rows.append((f"{name} (K = {stack})", per_network_epoch(exp, name, stack, 1), stack * recipe.epochs))
        for name in ("bnn_ordered", "bnn_skip"):  # one-mode only: one network per repetition
            rows.append((f"{name} (K = {REPETITIONS})", per_network_epoch(exp, name, REPETITIONS, 1),
                         REPETITIONS * recipe.epochs))
        sghmc = experiment(args.data_dir, "methods.sghmc.burn_in_epochs=1")
        base = states(sghmc, 1)[0]
        method = sghmc.build_method("sghmc")
        seconds = timed(lambda: method.fit(base, 0))  # the pilot, then one epoch of burn-in of 10 chains
        full = experiment(args.data_dir).build_method("sghmc").settings
        per_unit = full.burn_in_epochs + math.ceil(SAMPLES / full.chains) * full.thinning_epochs
        rows.append((f"SGHMC ({full.chains} chains)", seconds / full.chains, REPETITIONS * full.chains * per_unit))
        sa = experiment(args.data_dir, "methods.sghmc_sa.epochs=2", "methods.sghmc_sa.burn_in_epochs=1",
                        "methods.sghmc_sa.thinning_epochs=1", "methods.sghmc_sa.kept_states=1")
        method = sa.build_method("sghmc_sa")
        seconds = timed(lambda: method.fit(base, 0)) / 2
        rows.append(("SGHMC scale-adapted (1 chain)", seconds, REPETITIONS * experiment(args.data_dir).build_method(
            "sghmc_sa").settings.epochs))
        method = exp.build_method("laplace")
        seconds = timed(lambda: (method.fit(base, 0), method.sample(SAMPLES // BASES, torch.Generator().manual_seed(0))))
        rows.append(("Laplace (one fit and its draws)", seconds, REPETITIONS * (1 + BASES)))
        sample_set = stack_state_dicts(list(states(exp, SAMPLES).values()))
        images = torch.cat([exp.test_tensors[0], exp.ood_tensors[0]])
        seconds = timed(lambda: predict_with_weights(exp.model(), sample_set, images))
        units = REPETITIONS * 13  # the default run's method x mode rows (Deep Ensembles' included)
        rows.append(("predictions (100 networks, test + OOD)", seconds, units))
    print(f"{'work':<42} {'s per unit':>11} {'units':>10} {'CPU h':>7} {f'h on {args.cores} cores':>12}")
    total = 0.0
    for name, seconds, count in rows:
        hours = seconds * count / 3600
        total += hours
        print(f"{name:<42} {seconds:>11.3f} {count:>10.0f} {hours:>7.2f} {hours / args.cores:>12.2f}")
    print(f"{'total (zoo and sample stage)':<42} {'':>11} {'':>10} {total:>7.2f} {total / args.cores:>12.2f}")


if __name__ == "__main__":
    main()
