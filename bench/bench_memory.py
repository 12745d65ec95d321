"""Peak resident memory of every stage on MNIST, measured on a reduced store and stated for the
paper's scale (issue 49: every stage's peak RSS on MNIST at 8 GB or less).

Each stage runs as its own process (``python -m benchmark experiment=mnist_optunet stage=<s>``
through a wrapper that prints the process's ``ru_maxrss`` at exit, so a figure is one stage's own
peak, never another's), on the real MNIST files (``--data-dir``, default ``../shared/data`` next to
the checkout; without them the bench says so and records nothing). What is reduced is what sets
time, not memory: 2 training epochs for the zoo and the methods, short SGHMC chains (the scale-adapted
one keeps its 100 states over 101 epochs), one repetition; the sample counts (100 per method, 10
multi-mode bases, the ensemble's 100 members), the model, the data and the stacks are the paper's.
The baseline rows are left out (the second zoo needs a held-out zoo as large as the reference).

The zoo's size is what the evaluate, report and analyze stages scale with: they are measured with
``--small`` and ``--large`` reference networks and their peak is stated at the paper's 1,000 by the
line through the two (an upper bound where a stage caps what it reads, as the shared bandwidths'
500 x 500 checkpoints). The zoo stage's peak is set by its stack (128 networks), the sample stage's
by the held-out bases: both are stated as measured.

Usage: ``python bench/bench_memory.py [--data-dir DIR] [--small 32 --large 64] [--work DIR]``.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from summary import record  # noqa: E402  (bench/summary.py, next to this file)

PAPER_ZOO = 1000
GOAL_GB = 8.0
WRAPPER = ("import atexit, resource, runpy, sys; "
           "atexit.register(lambda: print('PEAK_RSS_KB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "
           "file=sys.stderr)); sys.argv = ['benchmark', *sys.argv[1:]]; runpy.run_module('benchmark', run_name='__main__')")
REDUCED = [
    "train.epochs=2", "train.milestones=[1]", "train.fail_rule.epoch=2",
    "methods.sghmc.burn_in_epochs=0.2", "methods.sghmc.thinning_epochs=0.05",
    "methods.sghmc_sa.epochs=101", "methods.sghmc_sa.burn_in_epochs=1", "methods.sghmc_sa.thinning_epochs=1",
    "sample.repetitions=1", "evaluate.baselines=[]",
]
HELDOUT = "seeds.heldout=[100000,100150]"  # the ensemble's 100 members and spares (73% passed the rule at epoch 1 of 2)


def run_stage(stage: str, overrides: list[str], log: Path) -> tuple[float, float]:
    """``(peak RSS in GB, seconds)`` of one stage run as its own process; raises with the log's tail on failure."""
    start = time.perf_counter()
    with open(log, "w", encoding="utf-8") as out:
        done = subprocess.run([sys.executable, "-c", WRAPPER, "experiment=mnist_optunet", f"stage={stage}", *overrides],
                              cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(REPO)})
    if done.returncode != 0:
        text = log.read_text(encoding="utf-8", errors="replace")
        raise RuntimeError(f"stage={stage} failed (exit {done.returncode}); the end of {log}:\n{text[-3000:]}")
    return peak_gb(log), time.perf_counter() - start


def peak_gb(log: Path) -> float:
    """A stage's peak RSS (GB) from its log's ``PEAK_RSS_KB`` line."""
    peak = re.findall(r"PEAK_RSS_KB (\d+)", log.read_text(encoding="utf-8", errors="replace"))
    if not peak:
        raise RuntimeError(f"no PEAK_RSS_KB line in {log}")
    return int(peak[-1]) / 1024 ** 2


def zoo_stack_gb(work: Path, data_dir: Path) -> tuple[int, float]:
    """``(K, GB)``: the largest stack the reduced zoo trained (its logs' "<K> seeds stacked") and what
    the paper's stacks add to it: ``AUTO_NETWORKS`` networks in each of the 2 stacks trained at once
    (one per core), at the trainer's own estimate per network (``vectorised.network_bytes``)."""
    from benchmark.loader import compose_config
    from benchmark.core.training.vectorised import AUTO_NETWORKS, network_bytes
    from benchmark.experiment import Experiment

    stacked = [int(k) for log in work.glob("zoo_*.log")
               for k in re.findall(r"(\d+) seeds stacked", log.read_text(encoding="utf-8", errors="replace"))]
    k = max(stacked, default=0)
    exp = Experiment(compose_config(["experiment=mnist_optunet", f"dataset.data_dir={data_dir}", "store=unused"]))
    per = network_bytes(exp.model(), exp.training_data.input_shape, exp.recipe.batch_size)
    return k, 2 * max(0, AUTO_NETWORKS - k) * per / 1024 ** 3


def summarise(work: Path, data_dir: Path) -> str:
    """The table of every stage's peak from the logs in ``work`` (``<stage>_<reference seeds>.log``), each
    stated at the paper's scale, and each recorded with the goal (``GOAL_GB``)."""
    measured: dict[str, dict[int, float]] = {}
    for log in sorted(work.glob("*_*.log")):
        stage, size = log.stem.rsplit("_", 1)
        measured.setdefault(stage, {})[int(size)] = peak_gb(log)
    rows = ["| stage | peak RSS, reduced store | stated at the paper's scale | how |", "|---|---|---|---|"]
    for stage in ("zoo", "sample", "evaluate", "report", "analyze"):
        by_size = measured.get(stage)
        if not by_size:
            continue
        shown = ", ".join(f"{gb:.2f} GB ({n} seeds)" for n, gb in sorted(by_size.items()))
        if stage == "zoo":
            k, extra = zoo_stack_gb(work, data_dir)
            stated = max(by_size.values()) + extra
            how = f"set by the stacks, not the zoo's size: the largest measured (K = {k}) + {extra:.2f} GB for 2 stacks of 128"
        elif stage == "sample":
            stated = max(by_size.values())
            how = "as measured: set by the held-out bases and the sample counts, not the zoo's size"
        else:
            (n1, m1), (n2, m2) = sorted(by_size.items())[:1] + sorted(by_size.items())[-1:]
            stated = m2 + (m2 - m1) / max(1, n2 - n1) * (PAPER_ZOO - n2)
            how = f"the line through {n1} and {n2} reference seeds, at {PAPER_ZOO}"
        rows.append(f"| {stage} | {shown} | {stated:.2f} GB | {how} |")
        record("memory", f"peak RSS of stage={stage} on MNIST, at the paper's scale", stated, GOAL_GB, unit="GB",
               higher_is_better=False)
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--data-dir", type=Path, default=REPO.parent / "shared" / "data")
    parser.add_argument("--small", type=int, default=32, help="reference seeds of the first measurement")
    parser.add_argument("--large", type=int, default=64, help="reference seeds of the second measurement")
    parser.add_argument("--work", type=Path, default=REPO / "bench" / "_work" / "memory")
    parser.add_argument("--summarise", action="store_true", help="only the table, from the logs of an earlier run in --work")
    args = parser.parse_args()
    if not (args.data_dir / "MNIST").is_dir():
        print(f"bench_memory: no MNIST files under {args.data_dir} (--data-dir): skipped, nothing recorded")
        return
    if not args.summarise:
        shutil.rmtree(args.work, ignore_errors=True)
        args.work.mkdir(parents=True)
        common = [f"dataset.data_dir={args.data_dir}", f"store={args.work / 'store'}", f"results={args.work / 'results'}",
                  HELDOUT, *REDUCED]
        for size in (args.small, args.large):
            overrides = [*common, f"seeds.reference=[0,{size}]"]
            stages = ["zoo", "sample", "evaluate", "report", "analyze"] if size == args.small else \
                ["zoo", "evaluate", "report", "analyze"]
            for stage in stages:
                gb, seconds = run_stage(stage, overrides, args.work / f"{stage}_{size}.log")
                print(f"stage={stage} with {size} reference seeds: peak RSS {gb:.2f} GB ({seconds:.0f} s)", flush=True)
    print(summarise(args.work, args.data_dir))


if __name__ == "__main__":
    main()
