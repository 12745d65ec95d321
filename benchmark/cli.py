"""``python -m benchmark stage=<stage> experiment=<name> ...``: run one stage or all of them.

The command line is checked before Hydra starts (every combination of a ``-m`` sweep too), so
a bad value is refused with one line naming the key, the value and what is allowed; then the
configuration is checked as a whole (data on disk, OOD pairing, every selected method's
settings and mode) before any work starts.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Iterator, Sequence

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from benchmark.config import CONF_DIR, ConfigError, Stage, one_line
from benchmark.loader import analysis_names, compose_config, register
from benchmark.experiment import Experiment, threads_per_job
from benchmark.stages import PIPELINE, STAGES, preflight
from methods import registry

log = logging.getLogger("benchmark")
MAX_CHECKED_SWEEP = 256  # sweep combinations composed up front; larger sweeps are checked by Hydra per job


def stages_of(stage: Stage) -> tuple[str, ...]:
    """The stages ``stage=<value>`` runs, in order."""
    if stage == Stage.finish:
        return tuple(name for name in PIPELINE if name not in ("zoo", "sample"))
    return PIPELINE if stage == Stage.all else (stage.value,)


def sweep_job() -> bool:
    """Whether this process runs one job of a multirun sweep (``-m``: Hydra's run mode is
    ``MULTIRUN``, in the launcher's worker too), whose ``cluster.parallel_jobs`` jobs share the
    machine's cores; false for a single run and outside Hydra (``run(cfg)`` from Python)."""
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def run(cfg: DictConfig) -> None:
    """Resolve the config, set threads (``threads_per_job``: ``auto`` shares the cores among the
    jobs of a sweep only, ``sweep_job``), check every selected stage (``preflight``: each stage's
    ``check``, before any work) and run the stage(s)."""
    exp = Experiment(cfg)
    stages = stages_of(exp.config.stage)
    threads = threads_per_job(exp.config.threads, exp.config.cluster.parallel_jobs, sweep_job())
    torch.set_num_threads(threads)
    if exp.device.type == "cuda" and exp.device.index is not None:
        torch.cuda.set_device(exp.device)  # pinned: what a library puts on "cuda" goes to this worker's GPU
    log.info("experiment %s, stage %s, device %s, %d torch thread(s)", exp.name, exp.config.stage.value, exp.device, threads)
    with exp.backends(), stop_on_sigterm():
        preflight(exp, stages)
        for name in stages:
            STAGES[name].run(exp)


@contextlib.contextmanager
def stop_on_sigterm():
    """In a SLURM job (``SLURM_JOB_ID``), SIGTERM stops the stage at once: ``scancel``, ``scontrol
    requeue`` and preemption send it, submitit's own handler ignores it, and SLURM SIGKILLs the job
    ``KillWait`` later, which would leave the claims of the units in flight to go stale
    (``claims.timeout_s``) before a job on another host could take them over. Raising ``SystemExit``
    unwinds the stage, which releases its claims (what was published stays; a unit in flight is
    redone by the next job). Elsewhere, and off the main thread, nothing changes."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job or threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        log.warning("SIGTERM in SLURM job %s: stopping, releasing the claims of the units in flight (another job takes "
                    "them over at once)", job)
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    try:
        run(cfg)
    except Exception as err:  # a clear one-line error and a non-zero exit, not a traceback
        if cfg.get("debug", False):
            raise
        log.error("%s: %s", type(err).__name__, " ".join(str(err).split()))
        sys.exit(1)


def sweep_runs(overrides: Sequence[Override]) -> Iterator[list[str]]:
    """The overrides of each job of a ``-m`` sweep of the parsed command-line ``overrides``, in
    the order Hydra's basic sweeper runs them: the cartesian product of every key's values (a
    discrete sweep, ``a=1,2`` or ``range(2)``, gives one per value; a key given twice keeps its
    place and its last value), lazily. Built on Hydra's public ``Override`` API (what the basic
    sweeper itself expands a sweep with), so no private Hydra module is imported. An interval
    sweep, which the basic sweeper cannot run, raises ``HydraException``."""
    per_key: dict[str, list[str]] = {}
    for override in overrides:
        key = override.get_key_element()
        if not override.is_sweep_override():
            per_key[key] = [f"{key}={override.get_value_element_as_str()}"]
        elif override.is_discrete_sweep():
            per_key[key] = [f"{key}={value}" for value in override.sweep_string_iterator()]
        else:
            raise HydraException(f"BasicSweeper does not support sweep type : {override.value_type.name}")
    return (list(run) for run in itertools.product(*per_key.values()))


def check_command_line(argv: Sequence[str]) -> str | None:
    """Compose the config of every run the command line asks for; the first problem as one line.

    Runs with Hydra's own flags other than ``-m`` are left to Hydra.
    """
    multirun = any(a in ("-m", "--multirun") for a in argv)
    if any(a.startswith("-") and a not in ("-m", "--multirun") for a in argv):
        return None
    overrides = [a for a in argv if not a.startswith("-")]
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
        runs = itertools.islice(sweep_runs(parsed), MAX_CHECKED_SWEEP) if multirun else [overrides]
        for run_overrides in runs:
            Experiment(compose_config(run_overrides))
    except (HydraException, OmegaConfBaseException) as err:
        return one_line(err)
    except ConfigError as err:
        return str(err)
    return None


def check_slurm_request(argv: Sequence[str]) -> str | None:
    """A ``-m`` sweep through the SLURM launcher whose job size fits no node of its partition (as
    ``sinfo`` reports them) would pend forever without a word: refused with the request, the largest
    node and the overrides that fit. Nothing is checked without ``sinfo`` (a submit host without the
    SLURM client, which submitit needs anyway) or with ``hydra.launcher.additional_parameters``
    naming other resources."""
    if not any(a in ("-m", "--multirun") for a in argv) or not shutil.which("sinfo"):
        return None
    overrides = [a for a in argv if not a.startswith("-")]
    try:
        from hydra import compose, initialize_config_dir

        register()
        first = next(sweep_runs(OverridesParser.create().parse_overrides(overrides)))
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            launcher = compose(config_name="config", overrides=list(first), return_hydra_config=True).hydra.launcher
    except Exception:  # noqa: BLE001 (Hydra reports a bad command line itself)
        return None
    if not str(launcher.get("_target_", "")).endswith("SlurmLauncher"):
        return None
    cpus = (launcher.get("cpus_per_task") or 1) * (launcher.get("tasks_per_node") or 1)
    mem_gb, gpus, partition = launcher.get("mem_gb"), launcher.get("gpus_per_node") or 0, launcher.get("partition")
    command = ["sinfo", "-h", "-N", "-o", "%N|%c|%m|%G", *(["-p", str(partition)] if partition else [])]
    try:
        listed = subprocess.run(command, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    nodes = []
    for line in listed.stdout.splitlines():
        name, node_cpus, memory, gres = (line.split("|") + ["", "", "", ""])[:4]
        try:
            node_gpus = sum(int(g.split("(")[0].split(":")[-1]) for g in gres.split(",") if g.startswith("gpu"))
            nodes.append((name, int(node_cpus), int(memory.rstrip("+")), node_gpus))
        except ValueError:
            continue
    where = f"partition {partition}" if partition else "any partition"
    if listed.returncode != 0 or not nodes:
        return None if listed.returncode != 0 else f"cluster=slurm: sinfo lists no node in {where} ({' '.join(command)})"
    mem_mb = mem_gb * 1024 if mem_gb else 0
    if any(c >= cpus and m >= mem_mb and g >= gpus for _, c, m, g in nodes):
        return None
    most = (max(n[1] for n in nodes), max(n[2] for n in nodes) // 1024, max(n[3] for n in nodes))
    fits = [f"hydra.launcher.cpus_per_task={max(1, most[0] // (launcher.get('tasks_per_node') or 1))}"
            if cpus > most[0] else "", f"hydra.launcher.mem_gb={most[1]}" if mem_mb > most[1] * 1024 else "",
            f"hydra.launcher.gpus_per_node={most[2]}" if gpus > most[2] else ""]
    return (f"cluster=slurm: each job asks for {cpus} CPU(s), {mem_gb or 0} GB and {gpus} GPU(s) "
            f"(hydra.launcher.cpus_per_task x tasks_per_node, mem_gb, gpus_per_node), but no node of {where} has as much "
            f"(sinfo: at most {most[0]} CPUs, {most[1]} GB, {most[2]} GPUs per node): the jobs would pend forever. "
            f"Size them to fit, e.g. {' '.join(f for f in fits if f)}, or choose another hydra.launcher.partition")


def _help(what: str) -> str:
    """Text for the help template (``${bench:<what>}``)."""
    if what == "stages":
        return ", ".join([*PIPELINE, "all", "finish", *(name for name in STAGES if name not in PIPELINE)])
    if what == "methods":
        return ", ".join(f"{name} ({cls.label}: mode={'|'.join(cls.modes)})" for name, cls in registry.METHODS.items())
    if what == "analyses":
        return ", ".join([*analysis_names(), "all"])
    if what == "experiments":
        return ", ".join(sorted(p.stem for p in (Path(CONF_DIR) / "experiment").glob("*.yaml")))
    raise ValueError(f"help: unknown entry {what!r}")


def main(argv: Sequence[str] | None = None) -> None:
    """The command-line entry point (``python -m benchmark``)."""
    register()
    if not OmegaConf.has_resolver("bench"):
        OmegaConf.register_new_resolver("bench", _help)
    argv = sys.argv[1:] if argv is None else argv
    problem = check_command_line(argv) or check_slurm_request(argv)
    if problem:
        print(f"posterior-bench: error: {problem}", file=sys.stderr)
        sys.exit(2)
    _hydra_main()
