"""Study: what does training the digits zoo to convergence (train.until_plateau) change? Last result (issue 31, seeds 0-63): almost nothing. Every one of the 47 networks that pass the rule plateaus within 45-59 epochs (median 47: at the recipe's end U already falls by less than 1% over 5 epochs at its last rate); the training potential spread stays (p05/median/p95 346/522/897 nats -> 360/540/891), median training accuracy 88.3% -> 87.4%, median test accuracy 84.4% -> 84.7%, member spread +0.6% (pairwise L2 27.53 -> 27.70), and MMD finds no layer that differs (0 of 4 rejected, raw and NS). The spread of U is between the minima the seeds reach, not unfinished training.

The zoo is an SGD ensemble, not a T = 1 posterior (issue 31): its checkpoints' training potential
U (summed training cross-entropy plus the recipe's L2 term: ``benchmark.core.training.potential``)
spreads over hundreds of nats. This study trains the same seeds of the digits reference range
twice with the vectorised zoo trainer (``train_networks``, as the zoo stage does), once under the
recipe (45 epochs) and once with ``train.until_plateau`` on (``benchmark.core.training.Plateau``:
on past epoch 45 at the schedule's last rate until U falls by less than 1% over 5 epochs and the
training accuracy rises by at most 0.5 point over them, at most 200 epochs), and reports for the
networks that pass the convergence rule in each: epochs taken, training accuracy, the 5th/50th/95th
percentiles of U, test accuracy, the spread between members (mean pairwise L2 distance of the
weight vectors; per-layer variance, mean over entries) and the per-layer MMD between the two zoos
(the project's MMD, ``metrics.mmd.mmd``, raw and symmetry-free form, MMDAgg test) next to the MMD
between two halves of the standard zoo (what two draws of one zoo give).

    OMP_NUM_THREADS=1 nice -n 10 python studies/zoo_convergence.py --seeds 0 96

Not part of ``make bench``; a few minutes on a 2-core CPU (the time is printed).

Result (2026-11-27, ``OMP_NUM_THREADS=1 nice -n 10 python studies/zoo_convergence.py --seeds 0 64``; 2-core
machine shared with other jobs: 2 min 48 s wall, 69 s CPU; both zoos trained in 53-54 s):

    standard (45 epochs): 47 of 64 seeds pass the convergence rule
      epochs: median 45, max 45, min 45
      training accuracy: median 0.8834
      training potential U (nats): p05 346, median 522, p95 897 (p95 - p05 552)
      test accuracy: median 0.8444, mean 0.8257
      spread: mean pairwise L2 distance 27.530; weight norm median 20.074
      per-layer variance (mean over entries): conv1.weight 0.6809, conv2.weight 0.5803, fc1.weight 1.0676, fc1.bias 0.9724, fc2.weight 2.5361, fc2.bias 10.4255
    until plateau: 47 of 64 seeds pass the convergence rule
      epochs: median 47, max 59, min 45; plateaued 47, stopped at max_epochs 0
      training accuracy: median 0.8741
      training potential U (nats): p05 360, median 540, p95 891 (p95 - p05 531)
      test accuracy: median 0.8472, mean 0.8214
      spread: mean pairwise L2 distance 27.697; weight norm median 20.241
      per-layer variance (mean over entries): conv1.weight 0.6992, conv2.weight 0.5840, fc1.weight 1.0895, fc1.bias 1.0200, fc2.weight 2.5630, fc2.bias 10.5800
    MMD between the zoos (their networks that pass the rule):
      standard (45 epochs) vs until plateau [raw]: aggregate median -0.0257; rejected in 0% of layers; per layer (median): conv1 -0.0252, conv2 -0.0256, fc1 -0.0252, fc2 -0.0269
      standard (45 epochs) vs until plateau [NS]: aggregate median -0.0246; rejected in 0% of layers; per layer (median): conv1 -0.0260, conv2 -0.0245, fc1 -0.0246, fc2 -0.0246
      standard (45 epochs), first half vs second half [raw]: aggregate median -0.0006; rejected in 0% of layers; per layer (median): conv1 0.0001, conv2 -0.0012, fc1 0.0002, fc2 0.0019
      standard (45 epochs), first half vs second half [NS]: aggregate median 0.0010; rejected in 25% of layers; per layer (median): conv1 -0.0034, conv2 -0.0011, fc1 0.0189, fc2 0.0030

Reading: 47 of the 64 seeds pass the rule in both runs. The criterion stops every network 0-14 epochs
after the recipe's end: at the last rate (0.0125, momentum 0.9, batches of 32) U is at SGD's noise
floor, where it moves up as well as down (median U +18 nats, median training accuracy -0.9 point:
a fluctuation, not a trend), so "trained to a plateau" and "trained 45 epochs" are the same zoo to
within that noise. The MMD between the two zoos is negative, most likely because they are paired
(each network is its own continuation, closer to its partner than two independent members are, and
the U-statistic's cross term includes those pairs; the two halves of one zoo, unpaired, give ~0):
no layer's test rejects. What is NOT measured here: a plateau of
a decaying rate (e.g. going on at a tenth of the last one), which would lower U further; the
criterion as built measures convergence at the recipe's own final rate.
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def percentiles(values: torch.Tensor) -> tuple[float, float, float]:
    levels = torch.tensor([0.05, 0.5, 0.95], dtype=torch.float64)
    return tuple(float(q) for q in torch.quantile(values.double(), levels))


def describe(exp, results: dict[int, object], label: str) -> dict[str, torch.Tensor]:
    """Print one zoo's numbers; return its converged members as a sample set ``{key: [R, ...]}``."""
    from benchmark.core.models import fit_with_weights
    from benchmark.core.training import squared_norm, training_potential

    kept = {s: r for s, r in results.items() if not isinstance(r, Exception) and r.failure is None}
    keys = list(next(iter(kept.values())).state_dict)
    zoo = {k: torch.stack([r.state_dict[k] for r in kept.values()]) for k in keys}
    model = exp.model()
    images, labels = exp.train_tensors
    nll, correct = fit_with_weights(model, zoo, images, labels)
    names = [n for n, _ in model.named_parameters()]
    potential = training_potential(nll, squared_norm(zoo, names), len(labels), exp.recipe.weight_decay)
    _, test_correct = fit_with_weights(model, zoo, *exp.test_tensors)
    epochs = [r.epochs_run for r in kept.values()]
    plateaued = [r.plateaued for r in kept.values()]
    flat = torch.cat([zoo[k].flatten(1) for k in names], 1).double()
    pairwise = torch.pdist(flat)
    low, mid, high = percentiles(potential)
    print(f"\n{label}: {len(kept)} of {len(results)} seeds pass the convergence rule")
    print(f"  epochs: median {statistics.median(epochs):.0f}, max {max(epochs)}, min {min(epochs)}"
          + (f"; plateaued {sum(bool(p) for p in plateaued)}, stopped at max_epochs {sum(p is False for p in plateaued)}"
             if any(p is not None for p in plateaued) else ""))
    print(f"  training accuracy: median {float((correct.double() / len(labels)).median()):.4f}")
    print(f"  training potential U (nats): p05 {low:.0f}, median {mid:.0f}, p95 {high:.0f} (p95 - p05 {high - low:.0f})")
    print(f"  test accuracy: median {float((test_correct.double() / len(exp.test_tensors[1])).median()):.4f}, "
          f"mean {float((test_correct.double() / len(exp.test_tensors[1])).mean()):.4f}")
    print(f"  spread: mean pairwise L2 distance {float(pairwise.mean()):.3f}; weight norm median "
          f"{float(flat.norm(dim=1).median()):.3f}")
    print("  per-layer variance (mean over entries): " + ", ".join(
        f"{k} {float(zoo[k].double().var(0).mean()):.4f}" for k in names))
    return zoo


def compare(exp, a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], label: str) -> None:
    """Per-layer MMD (median of the 20 kernels) of ``a`` against ``b``, raw and symmetry-free, with MMDAgg's test."""
    from metrics.mmd import PermutationTestConfig, mmd
    from metrics.symmetries import canonicalize, spec_for_model

    spec = spec_for_model(exp.model())
    steps = [s.value for s in exp.config.evaluate.canonical_steps]
    test = PermutationTestConfig(b1=500, b2=500)
    for form, (x, y) in (("raw", (a, b)), ("NS", (canonicalize(a, spec, steps)[0], canonicalize(b, spec, steps)[0]))):
        result = mmd(x, y, permutation_test=test)
        layers = ", ".join(f"{row.layer} {row.median:.4f}" for row in result.per_layer.itertuples())
        print(f"  {label} [{form}]: aggregate median {result.aggregate['median']:.4f}; rejected in "
              f"{result.reject_fraction:.0%} of layers; per layer (median): {layers}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", nargs=2, type=int, default=[0, 96], metavar=("START", "STOP"))
    parser.add_argument("overrides", nargs="*", help="config overrides (the plateau settings: train.until_plateau.*)")
    args = parser.parse_args()

    from benchmark.loader import compose_config
    from benchmark.core.training import seeded
    from benchmark.core.training.vectorised import train_networks
    from benchmark.experiment import Experiment

    torch.set_num_threads(1)
    base = ["store=unused", *args.overrides]
    standard = Experiment(compose_config(base))
    converged = Experiment(compose_config([*base, "train.until_plateau.enabled=true"]))
    seeds = list(range(*args.seeds))
    print(f"seeds [{args.seeds[0]}, {args.seeds[1]}) of {standard.name}; plateau settings: {converged.recipe.until_plateau}")
    zoos = {}
    for label, exp in (("standard (45 epochs)", standard), ("until plateau", converged)):
        started = time.perf_counter()
        with exp.backends():
            models = []
            for seed in seeds:
                with seeded(seed):
                    models.append(exp.model())
            data = exp.training_data
            outcomes = train_networks(models, data, exp.recipe, seeds, [f"seed {s}" for s in seeds],
                                      train_eval=data.train_tensors)
        print(f"\n[{label}: trained in {time.perf_counter() - started:.0f} s]")
        zoos[label] = describe(exp, dict(zip(seeds, outcomes)), label)
    (first, a), (second, b) = zoos.items()
    print("\nMMD between the zoos (their networks that pass the rule):")
    compare(standard, a, b, f"{first} vs {second}")
    half = len(next(iter(a.values()))) // 2
    compare(standard, {k: v[:half] for k, v in a.items()}, {k: v[half:] for k, v in a.items()},
            f"{first}, first half vs second half")


if __name__ == "__main__":
    main()
