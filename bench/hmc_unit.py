"""Wall time and convergence of one HMC unit on an experiment: ``chains`` chains started as the
sample stage starts them (seeds 100000, 100001, ...; ``start=init``), each run to ``draws`` kept
draws under the configured ``methods.hmc.*`` settings, in one process and one thread; then each
chain's summary, the predictive R-hat on the test split (Izmailov et al. 2021, by ArviZ) of the
first 10, 20, 40, draws / 2 draws and of all of them, the per-chain ESS, E-BFMI, and the test
accuracy of each chain's and of all chains' predictive.

Not run by ``make bench`` (minutes to hours). Usage:
``OMP_NUM_THREADS=1 python bench/hmc_unit.py 10 10 [key=value ...]`` (a multi-mode unit of the
default run: 10 chains x 10 draws; ``1 100`` is a one-mode unit).
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

from benchmark import config  # noqa: E402
from benchmark.experiment import Experiment  # noqa: E402
from metrics.mcmc import bfmi, predictive_convergence  # noqa: E402


def main() -> None:
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    chains_n, draws, overrides = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    torch.set_num_threads(1)
    exp = Experiment(config.compose_config(["store=bench/_work/hmc_store", "results=bench/_work/hmc_results", *overrides]))
    with exp.backends():
        method = exp.build_method("hmc")
        print(method.settings, flush=True)
        began = time.perf_counter()
        chains = method.run_chains(method.start_chains(list(range(100000, 100000 + chains_n))), draws, progress=True)
        print(f"wall {time.perf_counter() - began:.1f} s for {chains_n} chains x {draws} draws", flush=True)
        for chain in chains:
            summary = chain.summary()
            summary["divergences"] = len(summary["divergences"])
            print(json.dumps(summary), flush=True)
        images, labels = exp.test_tensors
        probs = method.chain_predictions(chains, images)
        for n in sorted({n for n in (10, 20, 40, draws // 2) if 4 <= n < draws}):  # does R-hat fall as the chains grow?
            early = predictive_convergence(probs[:, :n], labels)
            print(f"first {n} draws: R-hat test log-lik. {early['rhat_loglik']:.2f}, softmax median "
                  f"{early['rhat_softmax_median']:.2f}, softmax R-hat < 1.1 on {100 * early['softmax_converged']:.1f}%", flush=True)
        report = predictive_convergence(probs, labels)
        report["ess_loglik"] = report["ess_loglik"].tolist()
        print(json.dumps(report))
        print("E-BFMI per chain", bfmi([c.energies for c in chains]).tolist())
        per_chain = (probs.mean(1).argmax(-1) == labels).float().mean(-1)
        print("test accuracy of each chain's predictive", [round(float(a), 3) for a in per_chain],
              "of all chains", round(float((probs.mean((0, 1)).argmax(-1) == labels).float().mean()), 3))


if __name__ == "__main__":
    main()
