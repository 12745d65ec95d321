"""Reliability of the store under kills, concurrency and damage (``make reliability``; prints counts).

1. Kills: the zoo and the sample stages are killed with SIGKILL at random moments (>= 20 kills in
   all) and resumed; every checkpoint, failure record, sample set and prediction file must be
   byte-identical to an uninterrupted run, with no temp file and no claim left behind.
2. Concurrency: 4 processes, pretending to be 4 hosts, train overlapping seed ranges of one store;
   every seed must be trained exactly once.
3. Damage: checkpoints and sample sets are damaged in 6 ways (truncate, garbage, bit flip, NaN with
   valid checksums, wrong shape, another experiment's); evaluate must refuse the damaged reference
   naming the file and the healing command, and the zoo / sample stage must detect, quarantine and
   redo each one, byte-identical to the original.

Tiny digits/OptuNet configs (3 epochs), one torch thread per process; a few minutes on 2 cores.
Usage: ``python bench/reliability.py [--kills 20] [--seed 0]``. Exit status 1 if any check fails.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmark.core.store.claims import HOST_ENV  # noqa: E402
from bench.corruptions import CORRUPTIONS, corrupt  # noqa: E402

WORK = REPO / "bench" / "_work" / "reliability"  # bench/_work is shared with other benches: only this folder is ours
EXP = "digits_optunet"
TINY = ["threads=1", "train.epochs=3", "train.milestones=[2]", "train.fail_rule.epoch=3", "seeds.reference=[0,10]",
        "seeds.heldout=[100000,100008]", "sample.per_method=4", "sample.modes_multi=2",
        "methods.swag.snapshots=4", "methods.swag.rank=3", "methods.swag.epochs_factor=1"]
SAMPLE = ["method=swag"]
FAILURES: list[str] = []


def cli(store: Path, *args: str, host: str | None = None) -> subprocess.Popen:
    env = {**os.environ, **({HOST_ENV: host} if host else {})}
    run_dir = WORK / "hydra" / f"{time.time_ns()}"
    return subprocess.Popen([sys.executable, "-m", "benchmark", f"store={store}", f"results={store.parent / 'results'}",
                             *TINY, *args, f"hydra.run.dir={run_dir}"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=600)
    return proc.returncode, out


def check(ok: bool, what: str) -> bool:
    if not ok:
        FAILURES.append(what)
        print(f"  FAILED: {what}", flush=True)
    return ok


def digests(base: Path) -> dict[str, str]:
    """Relative path -> sha256 of every result file (zoo, failure records, samples, predictions)."""
    out = {}
    for folder in ("zoo", "zoo/failed", "samples", "preds"):
        for path in sorted((base / folder).glob("*")) if (base / folder).is_dir() else ():
            if path.is_file() and not path.name.startswith("."):
                out[f"{folder}/{path.name}"] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def leftovers(base: Path) -> list[str]:
    """Temp files of killed writes and claims still in the store."""
    found = [str(p) for folder in ("zoo", "zoo/failed", "samples", "preds") if (base / folder).is_dir()
             for p in (base / folder).iterdir() if p.name.startswith(".")]
    claims = base / ".claims"
    return found + ([str(p) for p in claims.iterdir()] if claims.is_dir() else [])


def baseline() -> tuple[Path, dict[str, float]]:
    """An uninterrupted run of both stages; their wall times."""
    store = WORK / "baseline" / "store"
    times = {}
    for stage, extra in (("zoo", []), ("sample", SAMPLE)):
        start = time.time()
        code, out = finish(cli(store, f"stage={stage}", *extra))
        times[stage] = time.time() - start
        if code != 0:
            sys.exit(f"the uninterrupted {stage} run failed:\n{out}")
    return store, times


def kills(reference: dict[str, str], times: dict[str, float], total: int, rng: random.Random) -> None:
    """Kill each stage at random moments, resume, and compare with the uninterrupted run."""
    counts = {"zoo": 0, "sample": 0}
    left = {"temp files": 0, "claims": 0}  # what the kills left behind for the next run to clean up
    cycles = 0
    zoo_done = WORK / "zoo_done"
    while sum(counts.values()) < total:
        stage = "zoo" if counts["zoo"] <= counts["sample"] else "sample"
        store = WORK / f"kills{cycles}" / "store"
        if stage == "sample":  # start from the finished zoo of a kill cycle
            shutil.copytree(zoo_done, store)
        extra = SAMPLE if stage == "sample" else []
        for _ in range(2):
            proc = cli(store, f"stage={stage}", *extra)
            time.sleep(rng.uniform(0.4, 1.0) * times[stage])
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                counts[stage] += 1
            proc.communicate()
            for path in leftovers(store / EXP):
                left["claims" if path.endswith(".claim") else "temp files"] += 1
        code, out = finish(cli(store, f"stage={stage}", *extra))
        base = store / EXP
        got = digests(base)
        wanted = {k: v for k, v in reference.items() if k.startswith(("zoo", "samples", "preds") if stage == "sample" else "zoo")}
        check(code == 0, f"kill cycle {cycles} ({stage}): the resumed run failed: {out[-2000:]}")
        check(got == wanted, f"kill cycle {cycles} ({stage}): files differ from the uninterrupted run: "
                             f"{sorted(k for k in set(got) | set(wanted) if got.get(k) != wanted.get(k))}")
        check(not leftovers(base), f"kill cycle {cycles} ({stage}): left behind {leftovers(base)}")
        if stage == "zoo" and not zoo_done.exists():
            shutil.copytree(store, zoo_done)
        cycles += 1
        print(f"  cycle {cycles}: {stage}, kills so far zoo {counts['zoo']}, sample {counts['sample']}", flush=True)
    print(f"(1) kills: {sum(counts.values())} SIGKILLs (zoo {counts['zoo']}, sample {counts['sample']}) in {cycles} "
          f"cycles; every resumed store byte-identical to the uninterrupted run: "
          f"{'yes' if not FAILURES else 'NO'}; the kills left {left['temp files']} temp file(s) of interrupted writes and "
          f"{left['claims']} claim(s) of dead processes, all cleaned up or taken over by the next run; left after the "
          f"resumed runs: {'none' if not FAILURES else 'see above'}")


def concurrency() -> None:
    """4 pretend hosts on overlapping seed ranges: each seed trained exactly once."""
    store = WORK / "concurrent" / "store"
    ranges = [(0, 8), (2, 10), (4, 12), (6, 14)]
    procs = [cli(store, "stage=zoo", "zoo.range=reference", f"seeds.reference=[{a},{b}]", host=f"node-{i}")
             for i, (a, b) in enumerate(ranges)]
    outs = [finish(p) for p in procs]
    worked = 0
    for code, out in outs:
        check(code == 0, f"concurrent run failed: {out[-2000:]}")
        line = next((l for l in out.splitlines() if "this run trained" in l), "")
        if line:
            worked += int(line.split("this run trained ")[1].split(",")[0])
            worked += int(line.split("recorded ")[1].split(" failures")[0])
    zoo = store / EXP / "zoo"
    names = [p.stem for p in zoo.glob("seed_*.safetensors")] + [p.stem for p in (zoo / "failed").glob("seed_*.json")]
    check(sorted(names) == [f"seed_{s:06d}" for s in range(14)], f"concurrency: seeds in the store {sorted(names)}")
    check(worked == 14, f"concurrency: {worked} trainings for 14 seeds")
    print(f"(2) concurrency: 4 processes on 4 pretend hosts, seeds 0-13 in overlapping ranges: {worked} trainings "
          f"for {len(set(names))} seeds stored (each seed trained once: {'yes' if worked == 14 else 'NO'})")


def damage(source: Path, reference: dict[str, str]) -> None:
    """Six kinds of damage to reference checkpoints and to a sample set: refused, quarantined, redone."""
    store = WORK / "damage" / "store"
    shutil.copytree(source, store)
    base = store / EXP
    converged = sorted(p for p in (base / "zoo").glob("seed_*.safetensors"))
    kinds = sorted(CORRUPTIONS)
    victims = dict(zip(kinds, converged))
    check(len(victims) == len(kinds), f"damage: only {len(converged)} checkpoints for {len(kinds)} kinds of damage")
    for kind, path in victims.items():
        corrupt(path, kind)
    code, out = finish(cli(store, "stage=evaluate"))
    refused = code != 0 and "stage=zoo experiment=digits_optunet" in out
    named = sum(str(p) in out for p in victims.values() if p.name < "seed_100000")
    check(refused, f"damage: evaluate did not refuse the damaged reference: {out[-2000:]}")
    code, out = finish(cli(store, "stage=zoo"))
    quarantined = sorted(p.name for p in (base / "zoo" / "quarantine").glob("*.safetensors"))
    lines = [l for l in out.splitlines() if "moved to" in l and "will be trained again" in l]
    redone = {k: v for k, v in digests(base).items() if k.startswith("zoo")} == \
        {k: v for k, v in reference.items() if k.startswith("zoo")}
    check(code == 0 and quarantined == sorted(p.name for p in victims.values()) and len(lines) == len(kinds) and redone,
          f"damage: zoo stage quarantined {quarantined}, {len(lines)} log lines, byte-identical {redone}: {out[-2000:]}")
    print(f"(3a) damage to checkpoints: {len(kinds)} kinds ({', '.join(kinds)}); evaluate refused, naming "
          f"{named} damaged reference file(s) and the command: {'yes' if refused else 'NO'}; zoo stage detected and "
          f"quarantined {len(quarantined)}, one log line each: {len(lines)}, retrained byte-identical: "
          f"{'yes' if redone else 'NO'}")
    healed = 0
    for i, kind in enumerate(kinds):
        target = base / ("samples" if i % 2 == 0 else "preds") / "swag_one_r0.safetensors"
        corrupt(target, kind)
        code, out = finish(cli(store, "stage=sample", *SAMPLE, "mode=one"))
        ok = code == 0 and "moved to" in out and digests(base) == reference
        healed += ok
        check(ok, f"damage to {target.name} ({kind}) was not healed: {out[-2000:]}")
    moved = len(list((base / "samples" / "quarantine").glob("*.safetensors"))) + \
        len(list((base / "preds" / "quarantine").glob("*.safetensors")))
    print(f"(3b) damage to sample sets and predictions: {len(kinds)} kinds; detected, quarantined ({moved} files) "
          f"and redrawn byte-identical: {healed} of {len(kinds)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    start = time.time()
    store, times = baseline()
    reference = digests(store / EXP)
    print(f"baseline: uninterrupted zoo {times['zoo']:.1f} s and sample {times['sample']:.1f} s; "
          f"{sum(k.startswith('zoo/seed') for k in reference)} checkpoints, "
          f"{sum(k.startswith('zoo/failed') for k in reference)} failure records, "
          f"{sum(k.startswith(('samples', 'preds')) for k in reference)} sample/prediction files", flush=True)
    kills(reference, times, args.kills, random.Random(args.seed))
    concurrency()
    damage(store, reference)
    print(f"reliability: {len(FAILURES)} failed check(s) in {time.time() - start:.0f} s")
    if not FAILURES:
        shutil.rmtree(WORK, ignore_errors=True)
    sys.exit(1 if FAILURES else 0)


if __name__ == "__main__":
    main()
