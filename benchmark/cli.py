"""``python -m benchmark stage=<stage> experiment=<name> ...``: run one stage or all of them.

The command line is checked before Hydra starts (every combination of a ``-m`` sweep too), so
a bad value is refused with one line naming the key, the value and what is allowed; then the
configuration is checked as a whole (data on disk, OOD pairing, every selected method's
settings and mode) before any work starts.
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Sequence

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from benchmark.config import ANALYSIS_NAMES, CONF_DIR, ConfigError, Stage, compose_config, one_line, register_configs
from benchmark.experiment import Experiment, threads_per_job
from benchmark.stages import PIPELINE, STAGES, preflight
from methods import registry

log = logging.getLogger("benchmark")
MAX_CHECKED_SWEEP = 256  # sweep combinations composed up front; larger sweeps are checked by Hydra per job


def stages_of(stage: Stage) -> tuple[str, ...]:
    """The stages ``stage=<value>`` runs, in order."""
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
    with exp.backends():
        preflight(exp, stages)
        for name in stages:
            STAGES[name].run(exp)


@hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    try:
        run(cfg)
    except Exception as err:  # a clear one-line error and a non-zero exit, not a traceback
        if cfg.get("debug", False):
            raise
        log.error("%s: %s", type(err).__name__, " ".join(str(err).split()))
        sys.exit(1)


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
        if multirun:
            from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

            runs = BasicSweeper.split_arguments(parsed, max_batch_size=None)[0][:MAX_CHECKED_SWEEP]
        else:
            runs = [overrides]
        for run_overrides in runs:
            Experiment(compose_config(run_overrides))
    except (HydraException, OmegaConfBaseException) as err:
        return one_line(err)
    except ConfigError as err:
        return str(err)
    return None


def _help(what: str) -> str:
    """Text for the help template (``${bench:<what>}``)."""
    if what == "stages":
        return ", ".join([*PIPELINE, "all", *(name for name in STAGES if name not in PIPELINE)])
    if what == "methods":
        return ", ".join(f"{name} ({cls.label}: mode={'|'.join(cls.modes)})" for name, cls in registry.METHODS.items())
    if what == "analyses":
        return ", ".join([*ANALYSIS_NAMES, "all"])
    if what == "experiments":
        return ", ".join(sorted(p.stem for p in (Path(CONF_DIR) / "experiment").glob("*.yaml")))
    raise ValueError(f"help: unknown entry {what!r}")


def main(argv: Sequence[str] | None = None) -> None:
    """The command-line entry point (``python -m benchmark``)."""
    register_configs()
    if not OmegaConf.has_resolver("bench"):
        OmegaConf.register_new_resolver("bench", _help)
    problem = check_command_line(sys.argv[1:] if argv is None else argv)
    if problem:
        print(f"posterior-bench: error: {problem}", file=sys.stderr)
        sys.exit(2)
    _hydra_main()
