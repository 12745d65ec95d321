"""The README's cluster path on a real SLURM (issue 38): a single-node SLURM from Debian's packages
(``make slurm-up``, ``.ci/slurm-up.sh``; CI starts one) runs the commands of README "On a cluster"
and ``make benchmark CLUSTER=slurm`` on a tiny digits configuration, 1 CPU per job, at most 2 jobs
at a time (the node's 2 CPUs, ``array_parallelism=2``):

- ``make benchmark CLUSTER=slurm``: the zoo as an array job, the sample sweep as another, then
  evaluate, report and analyze: the store and the results' CSVs byte-identical to one local process's;
- ``scancel`` of one array task on "node-a" (``$POSTERIOR_BENCH_HOST``), then the same command
  again on "node-b": the cancelled job released its claims on SIGTERM (``cli.stop_on_sigterm``), so
  the resubmitted job takes its seeds over at once, and finishes; nothing published is redone;
- ``scontrol requeue`` of a running job, then a time limit: submitit's USR2 before the limit
  requeues the job; the zoo is finished by its third run.

A requeued job waits SLURM's fixed 120 s before it may start again; the tests move its start to now
(``scontrol update StartTime=now``, as an administrator can) so that they last seconds, not minutes.
Without a SLURM here (no ``sbatch``/``sinfo``/``sacct``, no idle node, accounting not answering)
every test skips, naming why (and the setup's status when ``.ci/slurm-up.sh`` failed).
Marked ``slurm`` and ``slow`` (``make test-fast`` skips them)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.slurm]

SLURM_DIR = Path(os.environ.get("PB_SLURM_DIR", "/tmp/posterior-bench-slurm"))
TINY = ("train.epochs=2", "train.fail_rule.epoch=null", "seeds.reference=[0,8]", "seeds.heldout=[100000,100004]",
        "sample.per_method=2", "sample.modes_multi=2", "sample.repetitions=1", "sample.repetitions_per_method=null",
        "threads=1", "zoo.vectorize=1", "evaluate.reference_resamples=0", "evaluate.test_permutations=0",
        "evaluate.baselines=[]", "analysis=marginals")
JOB = ("hydra.launcher.gpus_per_node=0", "hydra.launcher.cpus_per_task=1", "hydra.launcher.mem_gb=1",
       "hydra.launcher.array_parallelism=2")
METHODS = "ensemble,dropout"


def slurm_problem() -> str | None:
    """Why the SLURM tests cannot run here, or ``None``."""
    status = (SLURM_DIR / "status").read_text().strip() if (SLURM_DIR / "status").is_file() else ""
    setup = f" (.ci/slurm-up.sh: {status})" if status else " (make slurm-up starts one: root, Debian's packages)"
    missing = [c for c in ("sbatch", "sinfo", "sacct", "scontrol", "scancel") if not shutil.which(c)]
    if missing:
        return f"no SLURM here: {', '.join(missing)} not found{setup}"
    try:
        states = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True, timeout=20)
        accounting = subprocess.run(["sacct", "-n", "-X", "-S", "now-1minute"], capture_output=True, text=True,
                                    timeout=20)
    except subprocess.TimeoutExpired as err:
        return f"SLURM does not answer: {err}{setup}"
    if states.returncode != 0 or not re.search(r"^(idle|mixed)", states.stdout, re.M):
        return f"no idle SLURM node: sinfo says {(states.stdout + states.stderr).strip()!r}{setup}"
    if accounting.returncode != 0:
        return f"sacct does not answer (submitit polls it): {accounting.stderr.strip()}{setup}"
    return None


@pytest.fixture(scope="module")
def slurm() -> None:
    problem = slurm_problem()
    if problem:
        pytest.skip(problem)


def benchmark_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "benchmark", *args]


def env_with(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
            **extra}


def submitit_logs(sweep: Path) -> str:
    """The jobs' own output (it never reaches the submitting process)."""
    return "\n".join(f"== {p}\n{p.read_text(errors='replace')}" for p in sorted(sweep.glob(".submitit/*/*_log.*")))


def until(condition, timeout: float, what: str, poll: float = 0.2):
    """Poll ``condition()`` until it returns something truthy (returned), at most ``timeout`` s."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = condition()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


def exited(process: subprocess.Popen) -> None:
    """Fail with its output when ``process`` (a sweep waited for) has already ended."""
    if process.poll() is not None:
        raise AssertionError(f"the sweep ended (exit {process.returncode}) before it was expected to:\n"
                             f"{process.communicate()[0][-3000:]}")


def squeue(job: str) -> list[tuple[str, str, str]]:
    """``(job id, state, reason)`` of each task of ``job`` in the queue."""
    out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%i|%T|%r"], capture_output=True, text=True).stdout
    return [tuple(line.split("|")) for line in out.split()]


def start_requeued_now(job: str) -> None:
    """SLURM holds a requeued job for 120 s (BeginTime); let it start now."""
    for task, state, reason in squeue(job):
        if state == "PENDING" and reason == "BeginTime":
            subprocess.run(["scontrol", "update", f"JobId={task}", "StartTime=now"], capture_output=True)


def job_ids(sweep: Path) -> list[str]:
    """The SLURM ids of the sweep's jobs (submitit's folders: ``<array id>_<task>``, ``<id>`` for a single job)."""
    names = {p.name for p in sweep.glob(".submitit/*") if p.is_dir()}
    arrays = {n.split("_")[0] for n in names if "_" in n}
    return sorted((n for n in names if n not in arrays), key=lambda n: [int(x) for x in n.split("_")])


def store_files(root: Path) -> dict[str, bytes]:
    """Every file of the experiment's zoo, failure records, sample sets and predictions, by path."""
    base = root / "digits_optunet"
    return {str(p.relative_to(base)): p.read_bytes() for folder in ("zoo", "samples", "preds")
            for p in sorted((base / folder).rglob("*")) if p.is_file() and not p.name.startswith(".")}


def csv_files(results: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((results / "digits_optunet").glob("*.csv"))}


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The same work done by one local process (in this one, one torch thread): the store and results."""
    from benchmark.cli import run
    from tests.conftest import compose_config, one_thread

    if slurm_problem():
        pytest.skip("no SLURM")
    root = tmp_path_factory.mktemp("single")
    where = [f"store={root / 'store'}", f"results={root / 'results'}", *TINY]
    started = time.monotonic()
    with one_thread():
        run(compose_config(["stage=zoo", *where]))
        for method in METHODS.split(","):
            run(compose_config(["stage=sample", f"method={method}", *where]))
        for stage in ("evaluate", "report", "analyze"):
            run(compose_config([f"stage={stage}", *where]))
    print(f"single process: {time.monotonic() - started:.0f} s")
    return root


def test_make_benchmark_on_slurm_gives_the_single_process_store_and_results(slurm, single, tmp_path):
    """``make benchmark CLUSTER=slurm``: zoo and sample array jobs, then evaluate, report and analyze,
    each step waited for; every store file and results CSV byte-identical to one process's."""
    stamp = tmp_path / "installed"
    stamp.touch()  # make's install step is not this test's business
    args = " ".join(TINY + (f"store={tmp_path / 'store'}", f"results={tmp_path / 'results'}",
                            f"hydra.sweep.dir={tmp_path / 'sweep'}"))
    started = time.monotonic()
    done = subprocess.run(["make", "--no-print-directory", "benchmark", "CLUSTER=slurm", "SHARDS=2", f"METHODS={METHODS}",
                           f"PY={sys.executable}", f"STAMP={stamp}", f"ARGS={args}", f"SLURM_ARGS={' '.join(JOB)} "
                           "hydra.launcher.timeout_min=10"], cwd=REPO, env=env_with(), capture_output=True, text=True,
                          timeout=900)
    took = time.monotonic() - started
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-5000:] + submitit_logs(tmp_path / "sweep")
    print(f"make benchmark CLUSTER=slurm: {took:.0f} s")
    ids = job_ids(tmp_path / "sweep")
    assert len(ids) == 2 + 2 + 1 and len({i.split("_")[0] for i in ids}) == 1 + 1 + 1, f"not the jobs expected: {ids}"
    assert store_files(tmp_path / "store") == store_files(single / "store")
    assert csv_files(tmp_path / "results") == csv_files(single / "results") and csv_files(single / "results")
    from benchmark.cli import run
    from tests.conftest import compose_config

    for method in METHODS.split(","):  # complete for what was asked: stage=verify passes (raises otherwise)
        run(compose_config(["stage=verify", f"method={method}", f"store={tmp_path / 'store'}",
                            f"results={tmp_path / 'results'}", *TINY]))


def zoo_sweep(tmp_path: Path, *extra: str) -> list[str]:
    return benchmark_command("-m", "cluster=slurm", *JOB, "hydra.launcher.timeout_min=10", "stage=zoo",
                             "zoo.num_shards=2", "zoo.shard=range(2)", f"store={tmp_path / 'store'}",
                             f"hydra.sweep.dir={tmp_path / 'sweep'}", *TINY, *extra)


def seed_of(name: str) -> int:
    return int(re.search(r"seed_(\d+)", name).group(1))


def published(store: Path) -> dict[str, int]:
    """The zoo's published files and their inodes."""
    zoo = store / "digits_optunet" / "zoo"
    return {p.name: p.stat().st_ino for p in zoo.rglob("seed_*") if p.is_file() and "quarantine" not in p.parts}


def test_scancel_of_one_task_on_one_host_then_the_same_command_on_another_resumes(slurm, tmp_path):
    """Task 0 of the zoo array, on "node-a", is cancelled mid-training; the same command on "node-b"
    (claims of node-a judged by their heartbeat only, claims.timeout_s=600) finishes at once: the
    cancelled job released its claims on SIGTERM. Before issue 38 the resubmitted job skipped the
    seeds "in progress elsewhere" and ended COMPLETED with them untrained. Without the release, SLURM
    SIGKILLs the job KillWait=10 s after the SIGTERM submitit ignores; a claim it then holds keeps the
    resubmitted job waiting until claims.wait_s, then failing, naming it (the log of the cancelled
    job must show the release: whether the SIGKILL lands while a claim is held depends on timing)."""
    from benchmark.core.store import ExperimentStore
    from benchmark.experiment import Experiment, SeedRange
    from benchmark.stages.zoo import run_zoo
    from tests.conftest import compose_config, one_thread

    seeds = ("seeds.reference=[0,40]",)  # 22 seeds a task, ~1 s each: still training KillWait after the SIGTERM
    claims = ("claims.timeout_s=600", "claims.heartbeat_s=2", "claims.wait_s=120", *seeds)
    first = subprocess.Popen(zoo_sweep(tmp_path, *claims), cwd=REPO, env=env_with(POSTERIOR_BENCH_HOST="node-a"),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    store = tmp_path / "store"
    claimed = store / "digits_optunet" / ".claims"

    def task_0_trains() -> list[int]:  # a seed of shard 0 (even) published, another claimed: task 0 is in its stage
        held = [seed_of(p.name) for p in claimed.glob("*seed_*.claim") if seed_of(p.name) % 2 == 0]  # zoo-seed_…
        return held if any(seed_of(n) % 2 == 0 for n in published(store)) else []

    try:
        task = until(lambda: next((i for i in job_ids(tmp_path / "sweep") if i.endswith("_0")), None), 300, "task 0")
        in_flight = until(task_0_trains, 300, "task 0 training")
        subprocess.run(["scancel", task], check=True)
        out, _ = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode != 0, "the launcher did not see the cancelled task"
    logs = submitit_logs(tmp_path / "sweep")
    assert "SIGTERM in SLURM job" in logs, logs
    before = published(store)
    assert 2 <= len(before) < 44, f"cancelled too late to test anything: {sorted(before)}"
    started = time.monotonic()
    again = subprocess.run(zoo_sweep(tmp_path, *claims), cwd=REPO, env=env_with(POSTERIOR_BENCH_HOST="node-b"),
                           capture_output=True, text=True, timeout=600)
    print(f"resubmitted on node-b: {time.monotonic() - started:.0f} s")
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:] + submitit_logs(tmp_path / "sweep")
    after = published(store)
    assert all(after[name] == inode for name, inode in before.items()), "a published seed was redone"
    zoo = ExperimentStore(store, "digits_optunet")
    assert sorted([*zoo.completed_seeds(), *zoo.failed_seeds()]) == [*range(40), *range(100000, 100004)]
    assert not list(claimed.glob("*.claim")), "claims left behind"
    seed = in_flight[0]  # cancelled while node-a trained it, trained by node-b: as one process trains it
    exp = Experiment(compose_config([f"store={tmp_path / 'here'}", *TINY, *seeds]))
    with one_thread(), exp.backends():
        run_zoo(exp, SeedRange("reference" if seed < 40 else "heldout", seed, seed + 1))
    ours = next(p for p in (exp.store.checkpoint_path(seed), exp.store.failed_path(seed)) if p.exists())
    assert ours.read_bytes() == (zoo.zoo_dir if ours.suffix == ".safetensors" else zoo.failed_dir).joinpath(
        ours.name).read_bytes()


HOLD_CLAIM = """
import sys
from benchmark.core.store import ExperimentStore
from pathlib import Path
store = ExperimentStore(Path(sys.argv[1]), "digits_optunet", claim_timeout_s=600, claim_heartbeat_s=2)
with store.claim(store.seed_unit(int(sys.argv[2]))) as claim:
    print("held" if claim else "not held", flush=True)
    sys.stdin.read()
"""


def test_scontrol_requeue_then_a_time_limit_resume_the_job_until_the_zoo_is_done(slurm, tmp_path):
    """One zoo job, three runs. ``scontrol requeue`` (SIGTERM, then back to the queue): the next run
    skips what was published and goes on. Then its time limit comes near: submitit's USR2
    (``signal_delay_s`` before the limit) makes submitit requeue it (counted against
    ``max_num_timeout``), and the third run finishes the zoo: complete, nothing published redone.
    The limit is cut to 2 min once the second run trains (``scontrol update TimeLimit``): a limit
    short from the start would signal the job while Python still imports, before submitit's handler
    exists (USR2 then kills it), and slurmctld checks limits only every 30 s. So that no run can
    finish before its signal, however fast the machine, a process on "node-z" holds the claim of the
    last seed: the runs wait for it (``claims.wait_s``) until the third one has started; then it lets
    go and the third run trains that seed, byte-identical to one trained here."""
    from benchmark.core.store import ExperimentStore
    from benchmark.stages.zoo import run_zoo
    from benchmark.experiment import Experiment, SeedRange
    from tests.conftest import compose_config, one_thread

    seeds = ("seeds.reference=[0,60]", "zoo.range=reference")
    claims = ("claims.timeout_s=600", "claims.heartbeat_s=2", "claims.wait_s=600")
    command = benchmark_command("-m", "cluster=slurm", *JOB, "hydra.launcher.timeout_min=10",
                                "hydra.launcher.signal_delay_s=100", "stage=zoo", f"store={tmp_path / 'store'}",
                                f"hydra.sweep.dir={tmp_path / 'sweep'}", *TINY, *seeds, *claims)
    store = ExperimentStore(tmp_path / "store", "digits_optunet", claim_timeout_s=600, claim_heartbeat_s=2)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_CLAIM, str(tmp_path / "store"), "59"], cwd=REPO,
                              env=env_with(POSTERIOR_BENCH_HOST="node-z"), stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held", "the claim of seed 59 on node-z"
    sweep = subprocess.Popen(command, cwd=REPO, env=env_with(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    restarted = []

    def restart_requeued(job: str) -> bool:
        for task, state, reason in squeue(job):
            if state == "PENDING" and reason in ("BeginTime", "None", "Priority"):
                subprocess.run(["scontrol", "update", f"JobId={task}", "StartTime=now", "TimeLimit=10"],
                               capture_output=True)
                restarted.append(task)
        return sweep.poll() is not None

    started = time.monotonic()
    try:
        job = until(lambda: next(iter(job_ids(tmp_path / "sweep")), None) or exited(sweep), 300, "the job")
        until(lambda: len(published(tmp_path / "store")) >= 2, 300, "training under way")
        subprocess.run(["scontrol", "requeue", job], check=True)
        until(lambda: any(state == "PENDING" for _, state, _ in squeue(job)), 120, "the job back in the queue")
        first = published(tmp_path / "store")
        until(lambda: (restart_requeued(job), len(published(tmp_path / "store")) >= len(first) + 2)[1], 300,
              "the requeued run training")
        # restarted counts every poll that saw the job pending (one requeue can be seen several times): the
        # time-limited run's requeue is a pending job seen after this point, while the second run trains
        before_limit = len(restarted)
        subprocess.run(["scontrol", "update", f"JobId={job}", "TimeLimit=2"], check=True)  # 100 s or less left
        until(lambda: (restart_requeued(job), len(restarted) > before_limit)[1], 300, "the time-limited run requeued")
        holder.communicate("")  # node-z lets go of seed 59: the third run takes it
        until(lambda: restart_requeued(job), 300, "the sweep to end", poll=1)
        out, _ = sweep.communicate()
    finally:
        for process in (sweep, holder):
            if process.poll() is None:
                process.kill()
    print(f"requeued, then time-limited zoo: {time.monotonic() - started:.0f} s")
    logs = submitit_logs(tmp_path / "sweep")
    assert sweep.returncode == 0, out[-3000:] + logs
    assert "DUE TO JOB REQUEUE" in logs, logs
    assert "Caught signal SIGUSR2" in logs and "this job is timed-out" in logs and len(restarted) > before_limit, logs
    after = published(tmp_path / "store")
    assert all(after[name] == inode for name, inode in first.items()), "a published seed was redone"
    assert sorted([*store.completed_seeds(), *store.failed_seeds()]) == list(range(60))
    exp = Experiment(compose_config([f"store={tmp_path / 'here'}", *TINY, *seeds]))
    with one_thread(), exp.backends():
        run_zoo(exp, SeedRange("reference", 59, 60))
    ours = next(p for p in (exp.store.checkpoint_path(59), exp.store.failed_path(59)) if p.exists())
    assert ours.read_bytes() == (store.zoo_dir if ours.suffix == ".safetensors" else store.failed_dir).joinpath(
        ours.name).read_bytes()
