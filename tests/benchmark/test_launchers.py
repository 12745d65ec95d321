"""Sweeps through Hydra launchers: a real multirun through submitit's local executor (the code
path of cluster=slurm without SLURM) shards the zoo over jobs, and the store it leaves (with the
samples drawn from it) is the store of one process doing all the work; the SLURM config composes.
Units shared by concurrent jobs are tested through the store's claims (tests/benchmark/core/store)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmark.core.store import ExperimentStore, load_checkpoint, load_sample_set
from benchmark.cli import run
from tests.conftest import REPO, compose_config

pytestmark = pytest.mark.slow  # launches jobs through Hydra launchers: make test, not make test-fast

COMMON = ("train.epochs=1", "train.fail_rule.epoch=null", "seeds.reference=[0,2]", "seeds.heldout=[100000,100004]",
          "sample.per_method=2", "sample.modes_multi=2", "sample.repetitions=1", "sample.repetitions_per_method=null",
          "threads=1", "zoo.vectorize=1")  # one network at a time: no numba compilation in every job
METHODS = ("ensemble",)  # its samples are the zoo's own checkpoints: any difference shows


def benchmark(*args: str, cwd: Path = REPO, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmark", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def submitit_logs(sweep: Path) -> str:
    """The jobs' own output (it never reaches the parent process)."""
    return "\n".join(f"== {p}\n{p.read_text()}" for p in sorted(sweep.glob(".submitit/*/*_log.*")))


def assert_same_store(a: ExperimentStore, b: ExperimentStore) -> None:
    assert a.completed_seeds() == b.completed_seeds() and a.failed_seeds().keys() == b.failed_seeds().keys()
    for seed in a.completed_seeds():
        x, y = load_checkpoint(a.checkpoint_path(seed))[0], load_checkpoint(b.checkpoint_path(seed))[0]
        assert all(torch.equal(x[k], y[k]) for k in x), f"seed {seed}"
    names = sorted(p.name for p in a.samples_dir.glob("*.safetensors"))
    assert names == sorted(p.name for p in b.samples_dir.glob("*.safetensors")) and len(names) == 1
    for folder in ("samples_dir", "preds_dir"):
        for name in names:
            x, y = load_sample_set(getattr(a, folder) / name), load_sample_set(getattr(b, folder) / name)
            assert all(torch.equal(x[k], y[k]) for k in x), f"{folder} {name}"


@pytest.mark.slow
def test_submitit_multirun_shards_give_the_single_process_store(tmp_path):
    saved = torch.get_num_threads()
    sweep, sharded, single = tmp_path / "sweep", tmp_path / "sharded", tmp_path / "single"
    launcher = ("cluster=submitit_local", f"hydra.sweep.dir={sweep}", "hydra.launcher.timeout_min=10")
    done = benchmark("-m", *launcher, "stage=zoo", "zoo.num_shards=2", "zoo.shard=range(2)", f"store={sharded}",
                     *COMMON)
    assert done.returncode == 0, done.stdout + done.stderr + submitit_logs(sweep)
    assert len(list(sweep.glob(".submitit/*/*_result.pkl"))) == 2, "the jobs did not go through submitit"
    run(compose_config(["stage=zoo", f"store={single}", *COMMON]))  # one process, in this one
    for store in (sharded, single):
        for method in METHODS:
            run(compose_config(["stage=sample", f"method={method}", f"store={store}", *COMMON]))
    torch.set_num_threads(saved)
    assert_same_store(ExperimentStore(sharded, "digits_optunet"), ExperimentStore(single, "digits_optunet"))


def launcher_config(*overrides: str):
    """The composed config with its ``hydra`` node (what the launcher receives)."""
    from hydra import compose, initialize_config_dir

    from benchmark.config import CONF_DIR
    from benchmark.loader import register

    register()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides), return_hydra_config=True)


def test_the_slurm_config_requeues_and_signals_before_the_limit():
    cfg = launcher_config("cluster=slurm", "experiment=cifar100_resnet18")
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher") and cfg.cluster.parallel_jobs == 1
    assert (launcher.max_num_timeout, launcher.signal_delay_s, launcher.gpus_per_node) == (10, 180, 1)
    assert launcher.additional_parameters == {"requeue": True, "open-mode": "append"}
    local = launcher_config("cluster=submitit_local").hydra.launcher
    assert local._target_.endswith("LocalLauncher") and local.gpus_per_node == 0


def test_the_gpu_node_starts_one_worker_per_gpu_each_on_its_own(monkeypatch):
    """cluster=gpu_node on a simulated 4-GPU node: 4 joblib workers, job j on cuda:(j mod 4)."""
    from benchmark.config import ConfigError
    from benchmark.experiment import Experiment, resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    cfg = launcher_config("cluster=gpu_node", "experiment=mnist_optunet")
    assert cfg.hydra.launcher._target_.endswith("JoblibLauncher") and cfg.hydra.launcher.n_jobs == 4
    assert cfg.cluster.parallel_jobs == 4 and cfg.device == "per_job"
    assert [resolve_device("per_job", job) for job in range(6)] == [torch.device("cuda", j % 4) for j in range(6)]
    assert launcher_config("cluster=gpu_node", "cluster.parallel_jobs=2").hydra.launcher.n_jobs == 2
    assert resolve_device("per_job") == torch.device("cuda", 0)  # outside a sweep: job 0
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ConfigError, match="device=per_job: one worker per GPU, but this machine has no CUDA device"):
        _ = Experiment(compose_config(["cluster=gpu_node"])).device


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_gpu_node_sweep_on_cuda_gives_the_single_process_store(tmp_path):
    """cluster=gpu_node on the GPUs here: the zoo sharded over one worker per GPU (each pinned),
    the same checkpoints as one process on cuda:0, the jobs' logs naming their device."""
    sweep, sharded, single = tmp_path / "sweep", tmp_path / "sharded", tmp_path / "single"
    done = benchmark("-m", "cluster=gpu_node", f"hydra.sweep.dir={sweep}", "stage=zoo", "zoo.num_shards=2",
                     "zoo.shard=range(2)", f"store={sharded}", *COMMON)
    assert done.returncode == 0, done.stdout + done.stderr
    logs = "\n".join(p.read_text() for p in sweep.rglob("*.log"))
    assert "device cuda:0" in logs, logs
    alone = benchmark("stage=zoo", f"store={single}", "device=cuda:0", *COMMON)
    assert alone.returncode == 0, alone.stdout + alone.stderr
    a, b = ExperimentStore(sharded, "digits_optunet"), ExperimentStore(single, "digits_optunet")
    assert a.completed_seeds() == b.completed_seeds() and a.completed_seeds()
    for seed in a.completed_seeds():
        x, y = load_checkpoint(a.checkpoint_path(seed))[0], load_checkpoint(b.checkpoint_path(seed))[0]
        assert all(torch.equal(x[k], y[k]) for k in x), f"seed {seed}"
