"""Study: which HMC settings bring the chains that share a start together on digits (within-start R-hat of the test log-likelihood < 1.1 in every start, bulk ESS >= 50 per chain, at most 5% of the trajectories cut by the leapfrog cap), and at what CPU cost? Last result: not the CPU defaults with 2 chains per start; R-hat 1.1-2.8 per start (median 1.5-1.7) after 10 to 60 draws, not falling; steps 0.001-0.08, the cap of 32 cutting 13 of 16 chains every time (8 starts x 2 chains, 2026-11-28; docs/hmc.md "Within a start, against time").

The chains of a multi-mode unit of ``make hmc`` as the sample stage starts them (``start_chains``
of seeds 100000, 100001, ... with ``methods.hmc.chains_per_start`` k, so that consecutive groups of k
chains share a descended start and its ``M^-1``), here ``starts`` x k chains in one stack, run under the
configured ``methods.hmc.*`` settings (``key=value`` overrides) to ``draws`` kept draws, and measured at
each checkpoint of ``--every`` kept draws: the CPU time of this process so far (one thread), then on the
test split the within-start convergence of ``benchmark.report.hmc`` (``start_groups``,
``summarised``: median over starts) and each start's own R-hat and chains' bulk ESS
(``metrics.mcmc.predictive_convergence``, what the report computes per start), and per chain the
share of sampling iterations the leapfrog cap cut (``ChainState.summary``), its step size and its
leapfrog steps. The last line extrapolates the CPU time to ``make hmc``'s HMC stage (5 units of
``sample.modes_multi`` chains; a unit's chains in one stack, so a unit costs about what this stack
costs scaled by the lanes: 16 lanes of the packed kernels hold up to 16 chains).

Not run by ``make bench`` (minutes to hours). Usage:
``OMP_NUM_THREADS=1 python studies/hmc_within_start.py STARTS DRAWS [--every 10] [--first-seed 100000]
[key=value ...]``, e.g. ``... 1 60 methods.hmc.chains_per_start=2 methods.hmc.adapt_mass=true
methods.hmc.warmup=150 methods.hmc.thinning=1 methods.hmc.max_leapfrog_steps=256``.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmark import loader  # noqa: E402
from benchmark.experiment import Experiment  # noqa: E402
from benchmark.report.hmc import start_groups, summarised  # noqa: E402
from metrics.mcmc import predictive_convergence  # noqa: E402

UNITS = 5  # make hmc's multi-mode repetitions of HMC


def checkpoint(method, chains, seeds, per_start: int, images, labels) -> dict:
    """Convergence and cost of ``chains`` (all with the same number of draws) at this point."""
    probs = method.chain_predictions(chains, images)
    groups = start_groups(seeds, per_start)
    each = [predictive_convergence(probs[group], labels) for group in groups]
    pooled = summarised(probs, labels, groups, each)
    summaries = [c.summary() for c in chains]
    return {
        "draws": int(probs.shape[1]),
        "within_rhat_median": pooled["within_rhat_loglik"],
        "within_rhat_per_start": [round(w["rhat_loglik"], 3) for w in each],
        "softmax_rhat_below_1.1": round(pooled["within_softmax_converged"], 3),
        "ess_per_chain": [round(float(e), 1) for w in each for e in w["ess_loglik"]],
        "truncated_fraction_max": max(s["truncated_fraction"] for s in summaries),
        "step_sizes": [round(s["step_size"], 4) for s in summaries],
        "leapfrog_per_chain": [s["n_leapfrog"] for s in summaries],
        "accept_prob": [round(s["accept_prob"], 2) for s in summaries],
        "divergences": sum(len(s["divergences"]) for s in summaries),
    }


def main() -> None:
    args = sys.argv[1:]
    options = {"--every": 10, "--first-seed": 100000}
    for option in options:
        if option in args:
            at = args.index(option)
            options[option] = int(args[at + 1])
            del args[at : at + 2]
    if len(args) < 2:
        raise SystemExit(__doc__)
    starts, draws, overrides = int(args[0]), int(args[1]), args[2:]
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    exp = Experiment(loader.compose_config(["store=bench/_work/hmc_store", "results=bench/_work/hmc_results", *overrides]))
    with exp.backends():
        method = exp.build_method("hmc")
        per_start = method.settings.chains_per_start
        print(method.settings, flush=True)
        seeds = list(range(options["--first-seed"], options["--first-seed"] + starts * per_start))
        images, labels = exp.test_tensors
        began, wall = time.process_time(), time.perf_counter()
        chains = method.start_chains(seeds)
        start_cpu = time.process_time() - began
        print(f"starts: {start_cpu:.0f} CPU s (descent and M^-1 of {starts} start(s))", flush=True)
        kernel, rows = method.kernel(), []
        for target in range(options["--every"], draws + 1, options["--every"]):
            kernel.run(chains, target)
            if any(c.phase != "sampling" for c in chains):
                print(f"chains not all sampling: {[c.phase for c in chains]}", flush=True)
                break
            row = checkpoint(method, chains, seeds, per_start, images, labels)
            row |= {"cpu_s": round(time.process_time() - began, 1), "wall_s": round(time.perf_counter() - wall, 1)}
            rows.append(row)
            print(json.dumps(row), flush=True)
        if not rows:
            return
        last = rows[-1]
        lanes = math.ceil(exp.config.sample.modes_multi / 16) * 16
        stack = math.ceil(len(chains) / 16) * 16
        unit_s = (last["cpu_s"] - start_cpu) * lanes / stack + start_cpu * exp.config.sample.modes_multi / len(chains)
        met = (max(last["within_rhat_per_start"]) < 1.1 and min(last["ess_per_chain"]) >= 50
               and last["truncated_fraction_max"] <= 0.05)
        print(f"targets met at {last['draws']} draws: {met} (within-start R-hat per start {last['within_rhat_per_start']}, "
              f"smallest bulk ESS {min(last['ess_per_chain'])}, cap cut {100 * last['truncated_fraction_max']:.0f}%); "
              f"make hmc's HMC stage at these settings, extrapolated: {UNITS} units x {unit_s / 60:.1f} CPU min = "
              f"{UNITS * unit_s / 60 / 2:.0f} min on 2 cores (stack cost scales with its lanes; starts with the chains)",
              flush=True)
        print("median ESS per chain per CPU minute of sampling:",
              round(float(np.median(last["ess_per_chain"])) / max(1e-9, (last["cpu_s"] - start_cpu) / 60), 2), flush=True)


if __name__ == "__main__":
    main()
