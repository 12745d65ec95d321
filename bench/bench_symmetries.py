"""Bench of metrics.symmetries (run by ``make bench``; prints its figures, exits 0).

1. Min-mass on N OptuNets (default 1000): the batched torch Newton solver on all of them at
   once vs cvxpy (Clarabel, log-space form, compiled once) one network at a time on a subset,
   extrapolated linearly to N. Prints the speed ratio (goal >= 50x) and the worst objective gap.
2. Canonicalising ResNet-18 checkpoints streamed from the store: M random-init checkpoints
   (default 100, ~45 MB each) are written under bench/_work/, read back in batches with
   ``benchmark.core.store.iter_checkpoint_batches``, canonicalised and written as sample sets;
   prints wall time, peak RSS during the phase and the linear extrapolation to 1000. The files
   are deleted at the end.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import threading
import time
from pathlib import Path

import psutil
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmark.core.models import optunet, resnet18  # noqa: E402
from benchmark.core.store import iter_checkpoint_batches, save_checkpoint, save_sample_set, stack_state_dicts  # noqa: E402
from metrics.symmetries import canonicalize, min_mass, random_scales, rescale, spec_for_model  # noqa: E402
from bench.minmass_cvxpy import min_mass_cvxpy  # noqa: E402  (cvxpy: a test dependency, outside the packages)
from summary import record  # noqa: E402  (bench/summary.py, next to this file)

WORK = ROOT / "bench" / "_work" / "symmetries"


class PeakRss:
    """Samples this process's resident set size every ``interval`` seconds in a thread."""

    def __init__(self, interval: float = 0.02) -> None:
        self.interval, self.peak, self._stop = interval, 0, threading.Event()
        self._process = psutil.Process()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._process.memory_info().rss)
            time.sleep(self.interval)

    def __enter__(self) -> "PeakRss":
        self.peak = self._process.memory_info().rss
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def optunet_zoo(count: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """``count`` random-init OptuNets (float64), each rescaled by random log-normal factors
    ``exp(N(0, 1))`` per unit so that their scaling is far from the min-mass optimum."""
    states = []
    for i in range(count):
        torch.manual_seed(seed + i)
        states.append(optunet().double().state_dict())
    weights = stack_state_dicts(states)
    spec = spec_for_model(optunet())
    return rescale(weights, spec, random_scales(spec, count, 1.0, torch.Generator().manual_seed(seed)))


def bench_min_mass(count: int, subset: int) -> None:
    spec = spec_for_model(optunet())
    weights = optunet_zoo(count)
    min_mass({k: v[:2] for k, v in weights.items()}, spec)  # warm-up
    start = time.perf_counter()
    _, fast = min_mass(weights, spec)
    torch_s = time.perf_counter() - start
    part = {k: v[:subset] for k, v in weights.items()}
    start = time.perf_counter()
    _, exact = min_mass_cvxpy(part, spec)
    cvxpy_s = time.perf_counter() - start
    cvxpy_full_s = cvxpy_s * count / subset
    gap = (fast["mass_after"][:subset] - exact["mass_after"]) / exact["mass_after"]
    statuses = sorted(set(exact["status"]))
    print(f"min-mass on {count} OptuNets (random init, rescaled by exp(N(0,1)) per unit), float64")
    print(f"  torch batched Newton, all {count}: {torch_s:8.3f} s  ({fast['iterations']} iterations)")
    print(f"  cvxpy/Clarabel one by one, {subset}: {cvxpy_s:8.3f} s  -> {count}: {cvxpy_full_s:8.1f} s"
          + (" (extrapolated linearly from the subset)" if subset < count else ""))
    print(f"  speed ratio cvxpy/torch: {cvxpy_full_s / torch_s:8.1f}x  (goal >= 50x)")
    record("symmetries", f"min-mass on {count} OptuNets: batched Newton vs cvxpy", cvxpy_full_s / torch_s, 50.0)
    print(f"  worst relative objective gap |torch - cvxpy| / cvxpy on {subset}: {float(gap.abs().max()):.2e}"
          f"  (torch lower on {int((gap <= 0).sum())}/{subset}; cvxpy status {statuses})")
    print(f"  mass before -> after (mean): {float(fast['mass_before'].mean()):.3f} -> {float(fast['mass_after'].mean()):.3f}")


def bench_resnet_canonicalisation(count: int, batch: int, extrapolate_to: int = 1000) -> None:
    spec = spec_for_model(resnet18(num_classes=100))
    zoo, out = WORK / "zoo", WORK / "canonical"
    for folder in (zoo, out):
        folder.mkdir(parents=True, exist_ok=True)
    try:
        start = time.perf_counter()
        paths = []
        for i in range(count):
            torch.manual_seed(i)
            paths.append(zoo / f"seed_{i:04d}.safetensors")
            save_checkpoint(paths[-1], resnet18(num_classes=100).state_dict(), {"seed": i})
        write_s = time.perf_counter() - start
        size_mb = sum(p.stat().st_size for p in paths) / count / 2**20
        with PeakRss() as rss:
            base = rss.peak
            start = time.perf_counter()
            for b, sample_set in enumerate(iter_checkpoint_batches(paths, batch)):
                canonical, _ = canonicalize(sample_set, spec)
                save_sample_set(out / f"batch_{b:04d}.safetensors", canonical, {"steps": "scale,sort,softmax"})
            wall_s = time.perf_counter() - start
        print(f"canonicalising {count} ResNet-18 checkpoints ({size_mb:.1f} MB each, float32) streamed from the store, "
              f"batches of {batch}")
        print(f"  writing the random-init zoo: {write_s:.1f} s (not counted)")
        print(f"  read + canonicalise (scale, sort, softmax) + write: {wall_s:8.1f} s  = {wall_s / count:.3f} s/checkpoint")
        print(f"  peak RSS during the phase: {rss.peak / 2**20:8.0f} MiB  (process at start {base / 2**20:.0f} MiB); "
              f"bounded by the batch size, independent of the zoo size")
        record("symmetries", f"canonicalising ResNet-18 checkpoints streamed from the store (batches of {batch})",
               wall_s / count, unit="s/checkpoint", higher_is_better=False)
        if count < extrapolate_to:
            print(f"  {extrapolate_to} checkpoints: {wall_s * extrapolate_to / count / 60:.1f} min "
                  f"(extrapolated linearly from {count}; not measured: {extrapolate_to * size_mb / 1024:.0f} GB of disk)")
    finally:
        shutil.rmtree(WORK, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--optunets", type=int, default=1000)
    parser.add_argument("--cvxpy-subset", type=int, default=200)
    parser.add_argument("--resnets", type=int, default=100)
    parser.add_argument("--batch", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (DESIGN: one per core per job)")
    args = parser.parse_args()
    if not 1 <= args.cvxpy_subset <= args.optunets:
        parser.error("--cvxpy-subset must be between 1 and --optunets")
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), {psutil.cpu_count()} cores, "
          f"load average {psutil.getloadavg()[0]:.1f}")
    bench_min_mass(args.optunets, args.cvxpy_subset)
    bench_resnet_canonicalisation(args.resnets, args.batch)


if __name__ == "__main__":
    main()
