"""``python -m benchmark stage=<stage> experiment=<name> ...``: run one stage or all of them."""
from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Callable

import hydra
import torch
from omegaconf import DictConfig

from benchmark.experiment import Experiment, threads_per_job

log = logging.getLogger("benchmark")
CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")


def _zoo(exp: Experiment) -> None:
    from benchmark.stages.zoo import run_zoo

    z = exp.cfg.zoo
    run_zoo(exp, z.start, z.stop, shard=int(z.shard), num_shards=int(z.num_shards))


def _zoo_all(exp: Experiment) -> None:
    """The pipeline's zoo step: the reference range, then the held-out range (bases, ensembles)."""
    from benchmark.stages.zoo import run_zoo

    z = exp.cfg.zoo
    for start, stop in ((z.start, z.stop), (exp.cfg.heldout.start, exp.cfg.heldout.stop)):
        run_zoo(exp, start, stop, shard=int(z.shard), num_shards=int(z.num_shards))


STAGES: dict[str, Callable[[Experiment], None]] = {"zoo": _zoo}
PIPELINE = ("zoo", "sample", "evaluate", "report")


def register_stage(name: str, runner: Callable[[Experiment], None]) -> None:
    """Make ``stage=name`` available (stages register themselves on import)."""
    STAGES[name] = runner


def _load_stages() -> None:
    import importlib

    for name in PIPELINE[1:]:
        try:
            importlib.import_module(f"benchmark.stages.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"benchmark.stages.{name}":
                raise


def valid_stages() -> list[str]:
    return [s for s in PIPELINE if s in STAGES] + ["all"]


def run(cfg: DictConfig) -> None:
    """Validate the stage option, set threads, and run the stage(s)."""
    _load_stages()
    stage = str(cfg.stage)
    if stage not in valid_stages():
        raise ValueError(f"stage={stage!r}: unknown stage; expected one of {', '.join(valid_stages())}")
    threads = threads_per_job(cfg.threads, int(cfg.cluster.parallel_jobs))
    torch.set_num_threads(threads)
    exp = Experiment(cfg)
    log.info("experiment %s, stage %s, device %s, %d torch thread(s)", exp.name, stage, exp.device, threads)
    with exp.backends():
        if stage != "all":
            STAGES[stage](exp)
            return
        for name in (s for s in PIPELINE if s in STAGES):
            (_zoo_all if name == "zoo" else STAGES[name])(exp)


@hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    try:
        run(cfg)
    except Exception as err:  # a clear one-line error and a non-zero exit, not a traceback
        if cfg.get("debug", False):
            raise
        log.error("%s: %s", type(err).__name__, err)
        sys.exit(1)
