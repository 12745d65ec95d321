"""Reliability of the store under kills, concurrency and damage (``make reliability``; prints counts).

1. Kills: the zoo and the sample stages are killed with SIGKILL at random moments of their working
   window (after the run's first claim, before the time an uninterrupted run takes to end; 10 kills
   by default, ``--kills``) and resumed; every checkpoint, failure record, sample set and prediction file must be
   byte-identical to an uninterrupted run, with no temp file and no claim left behind.
2. Concurrency: 4 processes, pretending to be 4 hosts, train overlapping seed ranges of one store;
   every seed must be trained exactly once.
3. Damage: checkpoints and sample sets are damaged in 7 ways (truncate, garbage, bit flip, NaN with
   valid checksums, wrong shape, another experiment's, a digit of the metadata); evaluate must refuse the damaged reference
   naming the file and the healing command, and one zoo run / one sample run must detect,
   quarantine and redo each one, byte-identical to the original (seven damaged files at once each).
4. Store content (in process, seconds each): one byte of every metadata entry's value and name,
   a NaN with valid checksums, verify.repair=true during a concurrent heal, a code change between
   two evaluate runs, an imported store verified, a predictions/sample-set pair mixed from two
   writers.
   Provenance (same form): a code edit in a module no import of the forms' code reaches (a symmetry
   spec), a reference zoo of another recipe, a damaged streamed reference cache, a dangling
   symlink and a loop in place of checkpoints, a stale HMC unit's chains, ``store=`` empty.

5. Fenced publication and claims: a SIGSTOP'ed worker resumed after its claim was taken
   over (its late copy dropped, the new holder's file published once); takeover races of three
   processes on one stale claim (old and new claim format); a seed that diverges in every run
   (recorded as failed, reason ``diverged``, in run ``zoo.max_attempts``); litter of killed
   processes counted and reaped while a live claim survives.

Each scenario prints one line; the last line is ``N scenarios, N held``.
Tiny digits/OptuNet configs (3 epochs), one torch thread per process; 3 min 17 s on an idle 2-core
machine (the kill cycles, 21 stage runs of ~9 s, take two thirds of it; each --kills 2 more adds ~40 s).
Usage: ``python bench/reliability.py [--kills 10] [--seed 0]``. Exit status 1 if any check fails.
"""
from __future__ import annotations

import argparse
import functools
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
from bench.corruptions import CORRUPTIONS, corrupt, nan_files  # noqa: E402

WORK = REPO / "bench" / "_work" / "reliability"  # bench/_work is shared with other benches: only this folder is ours
EXP = "digits_optunet"
TINY = ["threads=1", "train.epochs=3", "train.milestones=[2]", "train.fail_rule.epoch=3",
        "train.fail_rule.final_min_accuracy=null",  # 3-epoch networks: the paper's rule only, not digits' 50% end check
        "seeds.reference=[0,10]", "seeds.heldout=[100000,100008]", "sample.per_method=4", "sample.modes_multi=2",
        "sample.repetitions=2", "sample.repetitions_per_method=null",  # every method at 2 (not digits' 8 for some)
        "methods.swag.snapshots=4", "methods.swag.rank=3", "methods.swag.epochs_factor=1",
        "evaluate.baseline_repetitions=1"]  # the drills are about the store, not the baseline rows
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


def wait_for_claim(store: Path, proc: subprocess.Popen) -> float:
    """Poll until ``proc`` holds its first claim in ``store`` (or ends); the seconds it took."""
    start, claims = time.time(), store / EXP / ".claims"
    while proc.poll() is None and not (claims.is_dir() and any(p.suffix == ".claim" for p in claims.iterdir())):
        time.sleep(0.02)
    return time.time() - start


def baseline() -> tuple[Path, dict[str, tuple[float, float]]]:
    """An uninterrupted run of both stages; per stage, the seconds to its first claim (start-up:
    imports, data) and from there to its end (the working window, where the kills aim)."""
    store = WORK / "baseline" / "store"
    times = {}
    for stage, extra in (("zoo", []), ("sample", SAMPLE)):
        start = time.time()
        proc = cli(store, f"stage={stage}", *extra)
        startup = wait_for_claim(store, proc)
        code, out = finish(proc)
        times[stage] = (startup, time.time() - start - startup)
        if code != 0:
            sys.exit(f"the uninterrupted {stage} run failed:\n{out}")
    return store, times


def kills(expected: dict[str, str], times: dict[str, tuple[float, float]], total: int, rng: random.Random) -> None:
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
            wait_for_claim(store, proc)  # kill while it works: after its first claim, before it would end
            time.sleep(rng.uniform(0.0, 1.0) * times[stage][1])
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                counts[stage] += 1
            proc.communicate()
            for path in leftovers(store / EXP):
                left["claims" if path.endswith(".claim") else "temp files"] += 1
        code, out = finish(cli(store, f"stage={stage}", *extra))
        base = store / EXP
        got = digests(base)
        wanted = {k: v for k, v in expected.items() if k.startswith(("zoo", "samples", "preds") if stage == "sample" else "zoo")}
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


def damage(source: Path, expected: dict[str, str]) -> None:
    """Every kind of damage of ``CORRUPTIONS`` to reference checkpoints and to a sample set: refused, quarantined, redone."""
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
        {k: v for k, v in expected.items() if k.startswith("zoo")}
    check(code == 0 and quarantined == sorted(p.name for p in victims.values()) and len(lines) == len(kinds) and redone,
          f"damage: zoo stage quarantined {quarantined}, {len(lines)} log lines, byte-identical {redone}: {out[-2000:]}")
    print(f"(3a) damage to checkpoints: {len(kinds)} kinds ({', '.join(kinds)}); evaluate refused, naming "
          f"{named} damaged reference file(s) and the command: {'yes' if refused else 'NO'}; zoo stage detected and "
          f"quarantined {len(quarantined)}, one log line each: {len(lines)}, retrained byte-identical: "
          f"{'yes' if redone else 'NO'}")
    # One kind of damage per file, 7 of the 8 sample/prediction files at once, healed by one run.
    files = sorted(p for folder in ("samples", "preds") for p in (base / folder).glob("*.safetensors"))
    check(len(files) >= len(kinds), f"damage: only {len(files)} sample/prediction files for {len(kinds)} kinds of damage")
    targets = dict(zip(kinds, files))
    for kind, target in targets.items():
        corrupt(target, kind)
    code, out = finish(cli(store, "stage=sample", *SAMPLE))
    moved = sorted(p.name for folder in ("samples", "preds") for p in (base / folder / "quarantine").glob("*.safetensors"))
    healed = sum(target.name in moved and f"{target.parent.name}/{target.name}" in digests(base) for target in targets.values())
    ok = code == 0 and digests(base) == expected and healed == len(kinds)
    check(ok, f"damage to sample sets: quarantined {moved}, {healed} of {len(kinds)} healed, store byte-identical "
              f"{digests(base) == expected}: {out[-2000:]}")
    print(f"(3b) damage to sample sets and predictions: {len(kinds)} kinds on {len(targets)} files at once; detected, "
          f"quarantined ({len(moved)} files) and redrawn byte-identical by one sample run: {healed} of {len(kinds)}")


# ---- covered metadata, validated reads, verify that judges without destroying, complete inputs ----
# Scripted in process on a tiny store of untrained (seeded) networks, a few seconds each; each
# returns (held, one line saying what it tried and what survived). tests/bench runs them as they are.


def _tiny_experiment(work: Path, *overrides: str):
    """A digits/OptuNet experiment in ``work`` whose zoo (reference 0-5, held-out 100000-100003)
    holds seeded initialisations, and one ensemble unit written as the sample stage writes it."""
    import torch

    from benchmark.loader import compose_config
    from benchmark.core.store import CheckpointMetadata, save_checkpoint
    from benchmark.core.training import seeded
    from benchmark.experiment import Experiment

    torch.set_num_threads(1)
    exp = Experiment(compose_config([f"store={work / 'store'}", f"results={work / 'results'}", "device=cpu",
                                     "seeds.reference=[0,6]", "seeds.heldout=[100000,100004]", "sample.repetitions=1",
                                     "sample.repetitions_per_method=null",
                                     "evaluate.reference_resamples=0", "evaluate.test_permutations=0",
                                     "evaluate.baseline_repetitions=1", *overrides]))
    exp.store.ensure_writable()
    for role, seeds in (("reference", exp.reference), ("heldout", exp.heldout)):
        for seed in seeds:
            with seeded(seed):
                state = exp.model().state_dict()
            meta = CheckpointMetadata(experiment=exp.name, seed=seed, role=role, config_hash=exp.config_hash,
                                      config=exp.recipe_config, test_accuracy=0.1, train_accuracy=0.1,
                                      validation_accuracy=0.1, epochs=0)
            save_checkpoint(exp.store.checkpoint_path(seed), state, meta.encode())
    _write_ensemble(exp)
    return exp


def _write_ensemble(exp) -> None:
    """The ensemble unit of the held-out seeds of ``exp``'s store, written as the sample stage writes it."""
    from benchmark.core.models import predict_with_weights
    from benchmark.core.store import load_checkpoints_as_sample_set, save_sample_set
    from benchmark.inventory import unit_expectations

    unit = exp.store.sample_unit("ensemble", "multi", 0)
    members = load_checkpoints_as_sample_set(exp.store.checkpoint_paths(list(exp.heldout)))
    model = exp.model()
    preds = {"id": predict_with_weights(model, members, exp.test_tensors[0]),
             "ood": predict_with_weights(model, members, exp.ood_tensors[0])}
    meta = {**unit_expectations(exp, unit), "n_samples": len(exp.heldout)}
    digest = save_sample_set(exp.store.samples_path(unit), members, meta)
    save_sample_set(exp.store.preds_path(unit), preds, {**meta, "samples_digest": digest})


def _with_verify(exp, **changes):
    import dataclasses

    from benchmark.experiment import Experiment

    return Experiment(dataclasses.replace(exp.config, verify=dataclasses.replace(exp.config.verify, **changes)))


def scenario_metadata_damage(work: Path) -> tuple[bool, str]:
    """One byte of each metadata entry's value, and of its name (the checksums and format keys
    included), changed in a checkpoint: every reader must refuse every damaged copy."""
    import torch

    from bench.corruptions import damage_metadata
    from benchmark.core.models import optunet
    from benchmark.core.store import CheckpointError, CheckpointMetadata, check_file, load_checkpoint, read_metadata, save_checkpoint
    from benchmark.core.store.checksum import forget_all

    work.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    state = optunet().state_dict()
    source = work / "seed_000003.safetensors"
    meta = CheckpointMetadata(experiment=EXP, seed=3, role="reference", config_hash="0123abcd4567", train_accuracy=0.97,
                              validation_accuracy=0.95, test_accuracy=0.9437, epochs=12, trainer="vectorised",
                              versions={"torch": torch.__version__})
    save_checkpoint(source, state, meta.encode())
    keys = sorted(read_metadata(source))
    tried = refused = 0
    for key in keys:
        for part in ("value", "key"):
            path = work / f"{key}-{part}.safetensors"
            shutil.copyfile(source, path)
            damage_metadata(path, key, part)
            tried += 1
            readers = [lambda: check_file(path), lambda: load_checkpoint(path)]
            if key != "checksums" or part == "key":  # a tensor digest changed shows when the tensor is read
                readers.append(lambda: read_metadata(path))
            caught = 0
            for read in readers:
                forget_all()
                try:
                    read()
                except CheckpointError:
                    caught += 1
            refused += caught == len(readers)
    forget_all()
    intact = torch.equal(load_checkpoint(source, optunet())[0]["fc1.weight"], state["fc1.weight"])
    held = refused == tried and intact
    return held, (f"metadata damage: {len(keys)} metadata entries ({', '.join(keys)}) x value and name, {tried} "
                  f"damaged copies: {refused} refused by every reader (check_file, load_checkpoint, read_metadata); "
                  f"the undamaged original read back: {'yes' if intact else 'NO'}")


def scenario_nan_with_valid_checksums(work: Path) -> tuple[bool, str]:
    """A NaN written with valid checksums (a buggy writer), in a sample set and a checkpoint: every
    reader, whole or streamed, must refuse it."""
    from benchmark.core.store import (
        CheckpointError, check_file, iter_checkpoint_batches, iter_column_chunks, iter_layer_column_chunks,
        load_checkpoint, load_layer, load_sample_set,
    )
    from benchmark.core.store.checksum import forget_all

    work.mkdir(parents=True, exist_ok=True)
    samples, single = nan_files(work)
    readers = {
        "check_file": lambda: check_file(samples), "load_sample_set": lambda: load_sample_set(samples),
        "load_checkpoint": lambda: load_checkpoint(single), "iter_column_chunks": lambda: list(iter_column_chunks(samples, "w", 4)),
        "iter_layer_column_chunks": lambda: list(iter_layer_column_chunks([single], "w", 4)),
        "load_layer": lambda: load_layer([single], "w"), "iter_checkpoint_batches": lambda: list(iter_checkpoint_batches([single], 1)),
    }
    passed = []
    for name, read in readers.items():
        forget_all()
        try:
            read()
            passed.append(name)
        except CheckpointError:
            pass
    return not passed, (f"NaN with valid checksums: {len(readers)} readers (whole and streamed) tried, "
                        f"{len(readers) - len(passed)} refused it{'' if not passed else '; PASSED: ' + ', '.join(passed)}")


def scenario_heal_during_repair(work: Path) -> tuple[bool, str]:
    """verify.repair=true while another run heals a damaged checkpoint: the file is replaced by a good
    one after verify read it (a hook at that point plays the other run); the healed file must stay,
    and an undisturbed damaged file must be quarantined."""
    from benchmark.core.store import CheckpointError, load_checkpoint
    from benchmark.stages import verify

    exp = _tiny_experiment(work)
    healed, damaged = exp.store.checkpoint_path(1), exp.store.checkpoint_path(2)
    good = work / "good-copy"
    shutil.copyfile(healed, good)
    corrupt(healed, "bitflip")
    corrupt(damaged, "truncate")
    real = verify.seed_problem

    def check_then_heal(target, seed, shapes=None):
        problem = real(target, seed, shapes)
        if seed == 1:
            os.replace(good, healed)  # the other run's retrained file takes the name
        return problem

    verify.seed_problem = check_then_heal
    try:
        try:
            verify.run(_with_verify(exp, repair=True))
        except verify.StoreIntegrityError:
            pass
    finally:
        verify.seed_problem = real
    moved = sorted(p.name for p in exp.store.zoo_dir.glob("quarantine/*.safetensors"))
    try:
        load_checkpoint(healed, exp.model())
        kept = healed.exists()
    except CheckpointError:
        kept = False
    held = kept and moved == [damaged.name]
    return held, (f"verify.repair=true during a concurrent heal: the file healed after verify read it kept: "
                  f"{'yes' if kept else 'NO'}; quarantined {moved or 'nothing'} (only the undisturbed damaged one "
                  f"expected: {'yes' if moved == [damaged.name] else 'NO'})")


def flip_middle_digit(number: str) -> str:
    """``number`` (a float's repr) with its middle significant digit changed: another value."""
    digits = [i for i, c in enumerate(number) if c.isdigit()]
    at = digits[len(digits) // 2]
    return number[:at] + str((int(number[at]) + 1) % 10) + number[at + 1:]


def scenario_code_change_between_evaluates(work: Path) -> tuple[bool, str]:
    """Evaluate runs with a change to the scoring code between them (played by changing the code
    fingerprint the caches are keyed by), then with the change reverted, then with a digit flipped
    in a number cache: every cache recomputed at each change, the damaged one caught by its
    checksum; metrics.csv the same each time."""
    import json

    import benchmark.references.base as reference
    from benchmark.stages import evaluate

    exp = _tiny_experiment(work)
    first = evaluate.run(exp)
    caches = sorted((exp.store.base / "eval").glob("*.json"))
    before = {p: p.read_text() for p in caches}
    real = reference.source_fingerprint
    reference.source_fingerprint = lambda: real() + "-edited"
    try:
        second = evaluate.run(exp)
    finally:
        reference.source_fingerprint = real
    recomputed = sum(p.read_text() != before[p] for p in caches)
    reverted = evaluate.run(exp)  # the code back as it was: recomputed again, under the first keys
    recomputed = min(recomputed, sum(p.read_text() == before[p] for p in caches))
    text = caches[0].read_text()
    numbers = json.loads(text)["numbers"]
    value = repr(numbers["mmd_median"])
    damaged = flip_middle_digit(value)
    caches[0].write_text(text.replace(value, damaged, 1))
    third = evaluate.run(exp)
    restored = float(damaged) != numbers["mmd_median"] and \
        json.loads(caches[0].read_text())["numbers"]["mmd_median"] == numbers["mmd_median"]
    same = all(first.equals(df) for df in (second, reverted, third))
    held = caches and recomputed == len(caches) and restored and same
    return bool(held), (f"code change between two evaluate runs: {recomputed} of {len(caches)} number cache(s) "
                        f"recomputed; a digit flipped in a cache caught by its checksum and recomputed: "
                        f"{'yes' if restored else 'NO'}; metrics.csv identical each time: {'yes' if same else 'NO'}")


def scenario_imported_store_verifies_clean(work: Path) -> tuple[bool, str]:
    """A zoo imported from plain state-dict files (no config_hash) must verify clean, and
    verify.repair=stale must move nothing."""
    import torch

    from benchmark.loader import compose_config
    from benchmark.core.training import seeded
    from benchmark.experiment import Experiment
    from benchmark.stages import import_zoo, verify

    torch.set_num_threads(1)
    folder = work / "released"
    folder.mkdir(parents=True)
    exp = Experiment(compose_config([f"store={work / 'store'}", f"results={work / 'results'}", "device=cpu",
                                     f"zoo_import.source={folder}", "zoo_import.evaluate=false",
                                     "seeds.reference=[0,4]", "seeds.heldout=[100000,100000]"]))
    for i in range(4):
        with seeded(1000 + i):
            torch.save(exp.model().state_dict(), folder / f"net_{i}.pt")
    imported = import_zoo.run(exp).imported
    try:
        reports = verify.run(_with_verify(exp, repair="stale"))
        clean = not any(h.bad for h in reports)
    except verify.StoreIncompleteError:  # nothing corrupt or stale; only the sample units not drawn: incomplete, not damaged
        clean = True
    except verify.StoreIntegrityError:
        clean = False
    moved = len(list(exp.store.zoo_dir.glob("quarantine/*")))
    held = len(imported) == 4 and clean and moved == 0
    return held, (f"imported store: {len(imported)} checkpoints imported without config_hash; verify "
                  f"(repair=stale) clean: {'yes' if clean else 'NO'}, {moved} quarantined")


def scenario_mixed_pair_refused(work: Path) -> tuple[bool, str]:
    """Writer B's sample set beside writer A's predictions (same settings, other draws): the unit
    must count as corrupt (predictions from another sample set) and evaluate must refuse it."""
    from benchmark.core.store import load_sample_set, read_metadata, save_sample_set
    from benchmark.inventory import StaleSamplesError, unit_state
    from benchmark.stages import evaluate

    exp = _tiny_experiment(work)
    unit = exp.store.sample_unit("ensemble", "multi", 0)
    path = exp.store.samples_path(unit)
    sound = unit_state(exp, unit).problem is None
    meta = {k: v for k, v in read_metadata(path).items() if k not in ("checksums", "format")}
    save_sample_set(path, {k: v + 1e-3 for k, v in load_sample_set(path).items()}, meta)
    problem = unit_state(exp, unit).problem or ""
    try:
        evaluate.run(exp)
        refused = False
    except StaleSamplesError as err:
        refused = "mixed from two writers" in str(err)
    held = sound and "mixed from two writers" in problem and refused
    return held, (f"mixed pair (writer B's sample set, writer A's predictions): the pair as written accepted: "
                  f"{'yes' if sound else 'NO'}; the mixed pair refused as corrupt by the store: "
                  f"{'yes' if 'mixed' in problem else 'NO'}, by evaluate: {'yes' if refused else 'NO'}")


def _edited_source(work: Path, module: str, old: str, new: str) -> Path:
    """A copy of the computational source in ``work`` with ``old`` replaced by ``new`` in ``module``
    (a path under the repository): what the keys read once ``fingerprint.SOURCE_ROOT`` points at it."""
    copy = work / "source"
    for package in ("methods", "metrics", "benchmark"):
        shutil.copytree(REPO / package, copy / package, ignore=shutil.ignore_patterns("__pycache__", "_work"))
    path = copy / module
    text = path.read_text()
    assert old in text, f"{module} no longer holds {old!r}"
    path.write_text(text.replace(old, new, 1))
    return copy


def scenario_spec_edit_rebuilds_the_forms(work: Path) -> tuple[bool, str]:
    """An edit of ``chain_spec`` (metrics/symmetries/architectures.py), reached through
    ``spec_for_model`` and not through the imports of the canonical form's code: the canonical and
    aligned caches must be rebuilt."""
    import benchmark.core.fingerprint as fingerprint
    from benchmark.core.store import read_metadata
    from benchmark.references import ZooReference

    exp = _tiny_experiment(work)
    ZooReference(exp).canonical(), ZooReference(exp).aligned()
    keys = {name: read_metadata(exp.store.reference_dir / f"{name}.safetensors")["key"] for name in ("canonical", "aligned")}
    copy = _edited_source(work, "metrics/symmetries/architectures.py", "def chain_spec(", "EDITED = 1\n\n\ndef chain_spec(")
    real = fingerprint.SOURCE_ROOT
    fingerprint.SOURCE_ROOT = copy
    try:
        again = ZooReference(exp)
        again.canonical(), again.aligned()
        rebuilt = [name for name in keys
                   if read_metadata(exp.store.reference_dir / f"{name}.safetensors")["key"] not in (keys[name],)]
    finally:
        fingerprint.SOURCE_ROOT = real
    held = rebuilt == ["canonical", "aligned"]
    return held, (f"code edit outside every import of the forms' code (chain_spec in metrics/symmetries/architectures.py): "
                  f"rebuilt {rebuilt or 'NOTHING'} of the canonical and aligned caches")


def scenario_reference_of_another_recipe(work: Path) -> tuple[bool, str]:
    """A reference zoo trained under train.epochs=3, evaluated with train.epochs=4: refused in one
    line naming the field and the override; with evaluate.allow_other_recipe=true scored, and
    metrics.csv records the zoo's config hash and the acceptance."""
    import dataclasses

    from benchmark.experiment import Experiment
    from benchmark.stages import evaluate

    older = _tiny_experiment(work, "train.epochs=3")
    newer = Experiment(dataclasses.replace(older.config, train=dataclasses.replace(older.config.train, epochs=4)))
    _write_ensemble(newer)  # samples drawn under the new recipe: only the reference is of another one
    try:
        evaluate.run(newer)
        message = ""
    except evaluate.OtherRecipeError as err:
        message = str(err)
    refused = "train.epochs: 3 -> 4" in message and "evaluate.allow_other_recipe=true" in message and "\n" not in message
    allowed = Experiment(dataclasses.replace(newer.config, evaluate=dataclasses.replace(newer.config.evaluate,
                                                                                          allow_other_recipe=True)))
    row = evaluate.run(allowed).iloc[0]
    recorded = row["reference_config_hash"] == older.config_hash and "train.epochs: 3 -> 4" in row["reference_recipe"]
    return refused and recorded, (f"reference of another recipe (zoo train.epochs=3, evaluate train.epochs=4): refused "
                                  f"naming the field: {'yes' if refused else 'NO'}; accepted with "
                                  f"evaluate.allow_other_recipe=true and recorded in metrics.csv: "
                                  f"{'yes' if recorded else 'NO'}")


def scenario_damaged_streamed_cache(work: Path) -> tuple[bool, str]:
    """Two canonical form files of a streamed reference damaged (NaN under valid checksums, a bit
    flip): the next evaluate must name and rebuild each, with the numbers of a sound cache (item 4)."""
    import logging

    from benchmark.core.store import check_file
    from benchmark.stages import evaluate

    exp = _tiny_experiment(work, "evaluate.max_in_memory_gb=1e-6")
    first = evaluate.run(exp)
    (folder,) = exp.store.reference_dir.glob("canonical-*")
    damaged = sorted(folder.glob("seed_*.safetensors"))[1:3]
    corrupt(damaged[0], "nan"), corrupt(damaged[1], "bitflip")
    for cached in exp.store.eval_dir.glob("*.json"):
        cached.unlink()
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("benchmark.references.zoo").addHandler(handler)
    try:
        second = evaluate.run(exp)
    finally:
        logging.getLogger("benchmark.references.zoo").removeHandler(handler)
    named = sum(any(str(p) in line for line in lines) for p in damaged)
    sound = all(check_file(p) is not None for p in damaged)
    same = first.equals(second)
    return named == 2 and sound and same, (f"damaged streamed reference cache (NaN with valid checksums, a bit flip in "
                                           f"canonical-<key>/): {named} of 2 named exactly, rebuilt sound: "
                                           f"{'yes' if sound else 'NO'}, metrics.csv the same: {'yes' if same else 'NO'}")


def scenario_symlinks(work: Path) -> tuple[bool, str]:
    """A dangling symlink and a symlink loop in place of two checkpoints: verify must report both
    in one line each (no traceback), repair quarantine the links, and the zoo retrain both (item 5)."""
    from benchmark.core.store import check_file
    from benchmark.stages import verify
    from benchmark.stages.zoo import run_zoo

    exp = _tiny_experiment(work, *TINY[1:4], "train.fail_rule.final_min_accuracy=null", "train.fail_rule.epoch=null")
    dangling, loop = exp.store.checkpoint_path(1), exp.store.checkpoint_path(2)
    dangling.unlink(), loop.unlink()
    dangling.symlink_to(work / "gone.safetensors")
    loop.symlink_to(loop)
    try:
        verify.run(exp)
        reported = False
    except verify.StoreIntegrityError as err:
        reported = "2 corrupt" in str(err)
    except OSError:
        reported = False
    try:
        verify.run(_with_verify(exp, repair=True))
    except verify.StoreIntegrityError:
        pass
    summary = run_zoo(exp, exp.reference)
    healed = sorted(summary.trained + summary.failed) == [1, 2] and all(
        check_file(exp.store.checkpoint_path(s)) is not None for s in summary.trained)
    return reported and healed, (f"a dangling symlink and a symlink loop in place of two checkpoints: verify reported "
                                 f"both without a traceback: {'yes' if reported else 'NO'}; after verify.repair=true "
                                 f"the zoo retrained both: {'yes' if healed else 'NO'}")


def scenario_stale_hmc_unit(work: Path) -> tuple[bool, str]:
    """Chain states of an HMC unit run before a fix to methods/hmc_kernel.py: under the new key
    they must not count as finished, and the sample stage's clearing must remove them (item 3)."""
    import benchmark.core.fingerprint as fingerprint
    from benchmark.inventory import chain_key
    from benchmark.stages.sample import clear_stale_chains, load_base

    exp = _tiny_experiment(work, "methods.hmc.warmup=3", "methods.hmc.descent_steps=3", "methods.hmc.max_leapfrog_steps=3",
                           "methods.hmc.initial_mass=identity", "methods.hmc.start_min_accuracy=null",
                           "methods.hmc.forward=loop")
    images, labels = exp.train_tensors
    exp.__dict__["train_tensors"] = (images[:64], labels[:64])
    unit = exp.store.sample_unit("hmc", "multi", 0)
    method = exp.build_method("hmc")
    files = exp.store.chain_files(unit, chain_key(exp, method, [100000]))
    ran = method.run_chains_in(files, [100000], lambda seed: load_base(exp, seed), 2, lambda: False)
    finished = method.chain_finished(files, 100000, 2)
    copy = _edited_source(work, "methods/hmc_kernel.py", "def new_chain(", "FIXED = 1\n\n\ndef new_chain(")
    real = fingerprint.SOURCE_ROOT
    fingerprint.SOURCE_ROOT = copy
    try:
        fixed = exp.build_method("hmc")
        new_files = exp.store.chain_files(unit, chain_key(exp, fixed, [100000]))
        accepted = fixed.chain_finished(new_files, 100000, 2)
        removed = clear_stale_chains(new_files, unit)
    finally:
        fingerprint.SOURCE_ROOT = real
    held = ran and finished and not accepted and removed == [files.path(100000)] and not files.path(100000).exists()
    return held, (f"stale HMC unit (a fix to methods/hmc_kernel.py after its chains ran): the old chain state accepted "
                  f"under the new key: {'YES' if accepted else 'no'}; removed by the sample stage's clearing: "
                  f"{'yes' if removed else 'NO'}")


def scenario_empty_store_refused(work: Path) -> tuple[bool, str]:
    """``store=`` (empty) meant the current directory: refused in one line (item 6)."""
    from benchmark.cli import check_command_line

    problem = check_command_line(["store=", "stage=verify"]) or ""
    held = problem.startswith("store=''") and "\n" not in problem
    return held, f"store= (empty) refused in one line: {'yes' if held else 'NO'} ({problem or 'accepted'})"


SCENARIOS_PROVENANCE = [
    ("spec_edit_rebuilds_the_forms", scenario_spec_edit_rebuilds_the_forms),
    ("reference_of_another_recipe", scenario_reference_of_another_recipe),
    ("damaged_streamed_cache", scenario_damaged_streamed_cache),
    ("symlinks", scenario_symlinks),
    ("stale_hmc_unit", scenario_stale_hmc_unit),
    ("empty_store_refused", scenario_empty_store_refused),
]
"""The provenance scenarios (code keys, the zoo's recipe, healing caches, symlinks); in process,
seconds each. Their behaviours are tested in the suite; ``make reliability`` runs them end to end."""


SCENARIOS_STORE_CONTENT = [
    ("metadata_damage", scenario_metadata_damage),
    ("nan_with_valid_checksums", scenario_nan_with_valid_checksums),
    ("heal_during_repair", scenario_heal_during_repair),
    ("code_change_between_evaluates", scenario_code_change_between_evaluates),
    ("imported_store_verifies_clean", scenario_imported_store_verifies_clean),
    ("mixed_pair_refused", scenario_mixed_pair_refused),
]


def store_content_scenario(name: str, scenario) -> None:
    """Run one of ``SCENARIOS_STORE_CONTENT`` in its own folder, printing its line."""
    held, line = scenario(WORK / name)
    check(held, line)
    print(f"(4) {line}", flush=True)

# ---- end of the covered-metadata block --------------------------------------------------------------


# ---- fenced publication, claims, divergence, litter ----
# Each returns True when it held; each prints one line with what it tried and what survived.
# ``rounds``/``short`` give the short forms the test suite runs (tests/bench/test_reliability.py).

def _fork(target, *args):
    import multiprocessing
    process = multiprocessing.get_context("fork").Process(target=target, args=args)
    process.start()
    return process


def _paused_writer(path, claim_path, ready, result):
    """Worker A: claim, pass the ``claim.lost`` check, stop itself (SIGSTOP) before publishing."""
    import torch
    from benchmark.core.store import AlreadyPublishedError, save_checkpoint, try_claim
    with try_claim(claim_path, timeout_s=1.0, heartbeat_s=0.25) as claim:
        assert claim is not None and not claim.lost
        ready.set()
        os.kill(os.getpid(), signal.SIGSTOP)  # paused here until the parent resumes it
        try:
            save_checkpoint(path, {"w": torch.zeros(4)}, {"writer": "A"}, exclusive=True)
            result.put("published")
        except AlreadyPublishedError:
            result.put("dropped")


def scenario_paused_worker(rounds: int = 3) -> bool:
    """A worker SIGSTOP'ed after its claim check, resumed after B took its timed-out claim over
    and published: A's copy is dropped, B's file stands, published once."""
    import multiprocessing
    import torch
    from benchmark.core.store import load_checkpoint, read_claim_info, save_checkpoint, try_claim
    held = 0
    for r in range(rounds):
        folder = WORK / "paused" / f"r{r}"
        folder.mkdir(parents=True, exist_ok=True)
        path, claim_path = folder / "seed_000001.safetensors", folder / ".claims" / "zoo-seed_000001.claim"
        context = multiprocessing.get_context("fork")
        ready, result = context.Event(), context.Queue()
        a = _fork(_paused_writer, path, claim_path, ready, result)
        ready.wait(30)
        while (info := read_claim_info(claim_path)) is not None and info.heartbeat_age_s <= 1.0:
            time.sleep(0.05)  # A is stopped: its heartbeat ages past the timeout
        with try_claim(claim_path, timeout_s=1.0, heartbeat_s=0.25) as b:
            took_over = b is not None
            save_checkpoint(path, {"w": torch.ones(4)}, {"writer": "B"}, exclusive=True)
        os.kill(a.pid, signal.SIGCONT)
        outcome = result.get(timeout=30)
        a.join(30)
        tensors, meta = load_checkpoint(path)
        held += took_over and outcome == "dropped" and meta["writer"] == "B" and torch.equal(tensors["w"], torch.ones(4)) \
            and os.stat(path).st_nlink == 1 and not [p for p in folder.iterdir() if p.name.startswith(".seed")]
    ok = check(held == rounds, f"paused worker: {held} of {rounds} rounds held")
    print(f"(5.1) paused worker: {rounds} SIGSTOP'ed writers resumed after their claim timed out and was taken over; "
          f"the new holder's file stood, published once, the late copy dropped: {held} of {rounds}", flush=True)
    return ok


def scenario_takeover_races(rounds: int = 10, takers: int = 3) -> bool:
    """``takers`` processes race for one stale claim, ``rounds`` times: one winner each round,
    never lost while it holds, and nothing left after its release."""
    import multiprocessing
    from benchmark.core.store.claims import acquire
    context = multiprocessing.get_context("fork")
    held = 0
    for r in range(rounds):
        path = WORK / "races" / f"r{r}" / "u.claim"
        path.parent.mkdir(parents=True, exist_ok=True)
        unique = path.with_name(path.name + ".x") if r % 2 else path  # old- and new-format stale claims
        unique.write_text('{"host": "node-dead", "pid": 9, "started": 0, "token": "x"}')
        os.utime(unique, (time.time() - 100, time.time() - 100))
        if r % 2:
            os.link(unique, path)
        start, stop, results = context.Event(), context.Event(), context.Queue()

        def race(i, start=start, stop=stop, results=results, path=path):
            os.environ[HOST_ENV] = f"node-{i}"
            start.wait(30)
            claim = acquire(path, timeout_s=30, heartbeat_s=0.1)
            results.put(claim is not None)
            if claim is not None:
                stop.wait(30)
                results.put(not claim.lost)
                claim.release()

        procs = [_fork(race, i) for i in range(takers)]
        start.set()
        wins = [results.get(timeout=30) for _ in procs]
        stop.set()
        kept = [results.get(timeout=30) for _ in range(sum(wins))]
        for p in procs:
            p.join(30)
        held += sum(wins) == 1 and all(kept) and not list(path.parent.iterdir())
    ok = check(held == rounds, f"takeover races: {held} of {rounds} rounds with exactly one holder")
    print(f"(5.2) takeover races: {rounds} rounds of {takers} processes on one stale claim (old and new format): "
          f"exactly one holder, never lost, nothing left after release: {held} of {rounds}", flush=True)
    return ok


def scenario_diverging_seed(max_attempts: int = 3) -> bool:
    """A seed that diverges (NaN) in every run: recorded as failed (``diverged``) in run ``max_attempts``."""
    from benchmark.loader import compose_config
    from benchmark.experiment import Experiment, SeedRange
    from benchmark.stages.zoo import TrainingDivergedError, run_zoo
    store = WORK / "diverging" / "store"
    cfg = compose_config([f"store={store}", f"results={store.parent / 'results'}", "train.epochs=2",
                          "train.milestones=[1]", "train.fail_rule.epoch=1", "train.lr=1e9", "zoo.vectorize=1",
                          f"zoo.max_attempts={max_attempts}"])
    exp, one = Experiment(cfg), SeedRange("reference", 0, 1)
    raised = 0
    for _ in range(max_attempts - 1):
        try:
            run_zoo(exp, one)
        except TrainingDivergedError:
            raised += 1
    summary = run_zoo(exp, one)
    record = exp.store.failed_seeds().get(0, {})
    ok = check(raised == max_attempts - 1 and summary.failed == [0] and record.get("reason") == "diverged"
               and run_zoo(exp, one).skipped_done == [0], f"diverging seed: record {record}")
    print(f"(5.3) diverging seed: NaN in each of {max_attempts} runs; the first {raised} exited with the error, run "
          f"{max_attempts} recorded it as failed (reason {record.get('reason')!r}) and the next run skipped it", flush=True)
    return ok


def scenario_litter_reaped() -> bool:
    """Litter of killed processes (claim tickets, orphaned claim names, probes, old temp files) is
    counted by the store (verify's count) and removed by the next stage run; live claims survive."""
    from benchmark.core.store import ExperimentStore, try_claim
    store = ExperimentStore(WORK / "litter" / "store", EXP, claim_timeout_s=60, claim_heartbeat_s=30)
    store.ensure_writable()
    store.eval_dir.mkdir(parents=True, exist_ok=True)
    store.reference_dir.mkdir(parents=True, exist_ok=True)
    old = [store.claims_dir / "zoo-seed_000001.claim.stale-0123456789ab", store.claims_dir / "zoo-seed_000003.claim.0f0f",
           store.claims_dir / ".clock-node-1-7-deadbeef", store.claims_dir / ".write-probe-node-1-7-deadbeef",
           store.reference_dir / ".canonical.safetensors.tmp-12-abcdef01", store.eval_dir / ".swag_one_r0.json.tmp-1-ab",
           store.samples_dir / ".swag_one_r0.safetensors.tmp-12-abcdef01"]
    for path in old:
        path.write_bytes(b"")
        os.utime(path, (time.time() - 600, time.time() - 600))
    with try_claim(store.claim_path(store.seed_unit(9)), timeout_s=60, heartbeat_s=30) as live:
        counted = len(store.litter())
        store.reap_stale_claims()  # what the next zoo or sample run does first
        survived = store.claim_path(store.seed_unit(9)).exists() and not live.lost
    left = [p for p in old if p.exists()]
    ok = check(counted == len(old) and not left and survived, f"litter: counted {counted}, left {left}")
    print(f"(5.4) litter: {len(old)} files of killed processes planted; counted {counted}, reaped "
          f"{len(old) - len(left)}, a live claim kept: {'yes' if survived else 'NO'}", flush=True)
    return ok


SCENARIOS_FENCED_PUBLICATION = [scenario_paused_worker, scenario_takeover_races, scenario_diverging_seed, scenario_litter_reaped]
# ---- end of the fenced-publication block ----


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=10, help="SIGKILLs in all (zoo and sample alternately); each costs a stage run of ~9 s")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    start = time.time()
    store, times = baseline()
    expected = digests(store / EXP)
    print(f"baseline: uninterrupted zoo {sum(times['zoo']):.1f} s ({times['zoo'][1]:.1f} s after its first claim) and "
          f"sample {sum(times['sample']):.1f} s ({times['sample'][1]:.1f} s); "
          f"{sum(k.startswith('zoo/seed') for k in expected)} checkpoints, "
          f"{sum(k.startswith('zoo/failed') for k in expected)} failure records, "
          f"{sum(k.startswith(('samples', 'preds')) for k in expected)} sample/prediction files", flush=True)

    def held(scenario) -> bool:
        before, began = len(FAILURES), time.time()
        scenario()
        print(f"  ({time.time() - began:.0f} s)", flush=True)
        return len(FAILURES) == before

    scenarios = [lambda: kills(expected, times, args.kills, random.Random(args.seed)), concurrency,
                 lambda: damage(store, expected),
                 *[functools.partial(store_content_scenario, name, scenario) for name, scenario in SCENARIOS_STORE_CONTENT],
                 *[functools.partial(store_content_scenario, name, scenario) for name, scenario in SCENARIOS_PROVENANCE],
                 *SCENARIOS_FENCED_PUBLICATION]
    results = [held(scenario) for scenario in scenarios]
    print(f"reliability: {len(FAILURES)} failed check(s) in {time.time() - start:.0f} s")
    print(f"{len(results)} scenarios, {sum(results)} held")
    if not FAILURES:
        shutil.rmtree(WORK, ignore_errors=True)
    sys.exit(1 if FAILURES else 0)


if __name__ == "__main__":
    main()
