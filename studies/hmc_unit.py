"""Study: do full-batch HMC's chains on digits converge (R-hat), and do longer chains or trajectories help? Last result (docs/hmc.md): no; R-hat of the test log-likelihood 4.0 for 8 chains x 80 draws and 2.7 for 4 x 30 with trajectory length 3, 1.5-2.1 even among 4 chains sharing a start (3.05 across 3 starts; 2026-11-26), and 1.62 among 8 chains of one start with un-truncated trajectories of length 1 and a windowed mass (100 warm-up, 100 draws; 2026-11-27).

Wall time and convergence of one HMC unit on an experiment: ``chains`` chains started as the
sample stage starts them (seeds 100000, 100001, ...; ``start=init``), each run to ``draws`` kept
draws under the configured ``methods.hmc.*`` settings, in one process and one thread; then each
chain's summary, the predictive R-hat on the test split (Izmailov et al. 2021, by ArviZ) of the
first 10, 20, 40, draws / 2 draws and of all of them, the per-chain ESS, E-BFMI, and the test
accuracy of each chain's and of all chains' predictive.

``--per-start R`` runs ``R`` chains from each of the ``chains`` starts instead of one (the same
descended start and ``M^-1``, each chain with a random stream of its own: seeds 200000 + 100 x start
+ r), and also prints the R-hat among the chains of each start: whether the chains agree within
the region they start in, apart from any differences between modes.

Not run by ``make bench`` (minutes to hours). Usage:
``OMP_NUM_THREADS=1 python studies/hmc_unit.py 10 10 [key=value ...]`` (a multi-mode unit of the
default run: 10 chains x 10 draws; ``1 100`` is a one-mode unit);
``python studies/hmc_unit.py 3 40 --per-start 4`` (3 starts x 4 chains x 40 draws);
``--first-seed S``: the starts' seeds begin at ``S`` instead of 100000 (one start of a given seed).
Each chain's summary includes ``truncated_fraction``: the share of its sampling iterations whose
trajectory ``max_leapfrog_steps`` cut short (0: every trajectory had its full length).
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmark import loader  # noqa: E402
from benchmark.experiment import Experiment  # noqa: E402
from methods.hmc import sampling_seed  # noqa: E402
from methods.hmc_kernel import new_chain  # noqa: E402
from metrics.mcmc import bfmi, predictive_convergence  # noqa: E402


def chains_per_start(method, starts: int, per_start: int, first: int = 100000) -> list:
    """``per_start`` new chains at each of ``starts`` starts (seeds ``first``, ``first + 1``, ...), as
    ``start_chains`` starts them, the chains of a start differing only in their random streams."""
    chains = []
    for i, begun in enumerate(method.start_chains(list(range(first, first + starts)))):
        for r in range(per_start):
            seed = 200000 + 100 * i + r
            chain = new_chain(f"start{i}_chain{r}", begun.start, seed, sampling_seed(seed), begun.initial_inverse_mass)
            chain.origin = dict(begun.origin)
            chains.append(chain)
    return chains


def convergence_line(probs: torch.Tensor, labels: torch.Tensor) -> str:
    """One line: R-hat of the test log-likelihood and of the softmax outputs of ``probs [chains, draws, N, classes]``."""
    r = predictive_convergence(probs, labels)
    return (f"R-hat test log-lik. {r['rhat_loglik']:.2f}, softmax median {r['rhat_softmax_median']:.2f}, "
            f"softmax R-hat < 1.1 on {100 * r['softmax_converged']:.1f}%, ESS log-lik. per chain "
            f"{[round(float(e), 1) for e in r['ess_loglik']]}")


def main() -> None:
    args = sys.argv[1:]
    options = {"--per-start": 1, "--first-seed": 100000}
    for option in options:
        if option in args:
            at = args.index(option)
            options[option] = int(args[at + 1])
            del args[at : at + 2]
    per_start, first = options["--per-start"], options["--first-seed"]
    if len(args) < 2 or per_start < 1:
        raise SystemExit(__doc__)
    chains_n, draws, overrides = int(args[0]), int(args[1]), args[2:]
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    exp = Experiment(loader.compose_config(["store=bench/_work/hmc_store", "results=bench/_work/hmc_results", *overrides]))
    with exp.backends():
        method = exp.build_method("hmc")
        print(method.settings, flush=True)
        began = time.perf_counter()
        if per_start == 1:
            chains = method.start_chains(list(range(first, first + chains_n)))
        else:
            chains = chains_per_start(method, chains_n, per_start, first)
        chains = method.run_chains(chains, draws, progress=True)
        print(f"wall {time.perf_counter() - began:.1f} s for {len(chains)} chains x {draws} draws", flush=True)
        for chain in chains:
            summary = chain.summary()
            summary["divergences"] = len(summary["divergences"])
            print(json.dumps(summary), flush=True)
        images, labels = exp.test_tensors
        probs = method.chain_predictions(chains, images)
        for n in sorted({n for n in (10, 20, 40, 80, 160, draws // 2) if 4 <= n < draws}):  # does R-hat fall as the chains grow?
            print(f"first {n} draws: {convergence_line(probs[:, :n], labels)}", flush=True)
        if per_start > 1:  # within each start's chains, then across starts (the first chain of each)
            by_start = probs.reshape(chains_n, per_start, *probs.shape[1:])
            for i in range(chains_n):
                print(f"the {per_start} chains of start {i}: {convergence_line(by_start[i], labels)}", flush=True)
            if chains_n > 1:
                print(f"across the {chains_n} starts (their first chains): {convergence_line(by_start[:, 0], labels)}", flush=True)
        report = predictive_convergence(probs, labels)
        report["ess_loglik"] = report["ess_loglik"].tolist()
        print(json.dumps(report))
        print("E-BFMI per chain", bfmi([c.energies for c in chains]).tolist())
        per_chain = (probs.mean(1).argmax(-1) == labels).float().mean(-1)
        print("test accuracy of each chain's predictive", [round(float(a), 3) for a in per_chain],
              "of all chains", round(float((probs.mean((0, 1)).argmax(-1) == labels).float().mean()), 3))


if __name__ == "__main__":
    main()
