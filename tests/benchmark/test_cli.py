"""The command line: help, one-line refusals of bad values (sweeps too), and the checks that
refuse a configuration that cannot run before any work starts."""
from __future__ import annotations

import os

import subprocess
import sys

import numpy as np
import pytest

from benchmark.cli import check_command_line, run, stages_of, sweep_runs
from benchmark.stages import preflight
from benchmark.config import Stage
from benchmark.core.data import DatasetNotFoundError
from benchmark.experiment import Experiment
from methods import MethodConfigError, method_names
from tests.benchmark.core.data import formats
from tests.conftest import REPO, TINY_TRAIN, compose_config

pytestmark = pytest.mark.slow  # the command line through its stages: make test, not make test-fast


def test_help_introduces_the_suite(cli):
    code, out = cli("--help")
    assert code == 0 and out.startswith("posterior-bench:") and "powered by Hydra" not in out
    assert "zoo, sample, evaluate, report, analyze, all, finish, verify, import" in out
    assert "toy, min_mass, collapse, permutation_frequency, marginals, hmc, all" in out
    assert "cifar100_resnet18, digits_optunet, mnist_optunet, tinyimagenet_resnet18" in out
    assert all(f"{name} (" in out for name in method_names()) and "Deep Ensembles: mode=multi" in out
    assert out.count("python -m benchmark") >= 3


@pytest.mark.parametrize(
    "argv, message",
    [
        (["stage=train"], "stage: Invalid value 'train', expected one of [zoo, sample, evaluate, report, analyze, all, "
                          "finish, verify, import]"),
        (["analysis=hist"], "analysis: Invalid value 'hist', expected one of [toy, min_mass, collapse, "
                            "permutation_frequency, marginals, hmc, all]"),
        (["analyze.collapse.max_pairs=0"], "analyze.collapse.max_pairs=0: expected a positive integer"),
        (["methods.swag.scale=abc"], "methods.swag.scale: Value 'abc' of type 'str' could not be converted to Float"),
        (["methods.swag.scale=-1"], "methods.swag.scale=-1.0: expected a number >= 0"),
        (["methods.swag.pork=1"], "methods.swag.pork: Key 'pork' not in 'SWAGSettings'"),
        (["mode=two"], "mode: Invalid value 'two', expected one of [both, one, multi]"),
        (["experiment=cifar10"], "In 'config': Could not find 'experiment/cifar10' available options in 'experiment': "
                                 "cifar100_resnet18 digits_optunet mnist_optunet tinyimagenet_resnet18"),
        (["seeds.heldout=[100,300]"], "seeds.reference=[0, 1450] and seeds.heldout=[100, 300] overlap"),
        (["-m", "method=swag,mcmc"], "method: Invalid value 'mcmc', expected one of [all, dropout, bnn"),
        (["-m", "zoo.num_shards=2", "zoo.shard=range(3)"], "zoo.shard=2: expected an integer in [0, num_shards=2)"),
        (["store="], "store='': expected a folder path (empty is refused: pass store=. for the current directory)"),
        (["results="], "results='': expected a folder path"),
    ],
)
def test_bad_values_are_refused_in_one_line(argv, message):
    problem = check_command_line(argv)
    assert problem.startswith(message) and "\n" not in problem


def test_good_command_lines_pass():
    assert check_command_line(["stage=sample", "method=swag", "mode=one", "methods.swag.scale=0.5"]) is None
    assert check_command_line(["-m", "stage=zoo", "zoo.num_shards=2", "zoo.shard=range(2)", "hydra.launcher.n_jobs=2"]) is None
    assert check_command_line(["--cfg", "job"]) is None  # Hydra's own flags are Hydra's


@pytest.mark.slow
def test_the_cli_exits_with_the_one_line_error_before_hydra_starts(tmp_path):
    done = subprocess.run([sys.executable, "-m", "benchmark", "methods.laplace.hessian_structure=lowrank"],
                          cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "posterior-bench: error: methods.laplace.hessian_structure: Invalid value 'lowrank', "
        "expected one of [full, kron, diag]"]


SWEEPS = [
    ["stage=zoo", "zoo.num_shards=2", "zoo.shard=range(2)", "hydra.launcher.n_jobs=2"],
    ["method=swag,laplace", "mode=one,multi", "seeds.repetitions=1"],
    ["method=swag", "method=dropout,bnn", "+extra=a", "~zoo.shard", "experiment=choice(digits,mnist_optunet)"],
    ["zoo.shard=range(0,6,2)", "methods.swag.scale=0.5,1.0", "hydra.launcher.mem_gb=4"],
    [],
]


@pytest.mark.parametrize("overrides", SWEEPS)
def test_a_sweep_expands_as_hydras_basic_sweeper_expands_it(overrides):
    """``sweep_runs`` expands a ``-m`` sweep with Hydra's public ``Override`` API; Hydra offers no
    public function for the whole expansion, so its own basic sweeper (a private module, imported
    here and nowhere in ``benchmark/``) is the reference. hydra-core is pinned (``==1.3.8``,
    pyproject.toml): an upgrade that moves ``BasicSweeper`` fails here, and this import is the one
    to update, after checking that the expansion still agrees."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    assert list(sweep_runs(parsed)) == BasicSweeper.split_arguments(parsed, max_batch_size=None)[0]


def test_an_interval_sweep_is_refused_in_one_line():
    problem = check_command_line(["-m", "methods.swag.scale=interval(0.1,1.0)"])
    assert "does not support sweep type" in problem and "\n" not in problem


def test_the_command_line_imports_no_private_hydra_module():
    import ast

    tree = ast.parse((REPO / "benchmark" / "cli.py").read_text())
    imported = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names] + \
        [node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module]
    assert not [name for name in imported if name.split(".")[0] == "hydra" and any(p.startswith("_") for p in name.split("."))]


def test_stage_all_is_the_pipeline_in_order():
    assert stages_of(Stage.all) == ("zoo", "sample", "evaluate", "report", "analyze")
    assert stages_of(Stage.evaluate) == ("evaluate",)
    assert stages_of(Stage.finish) == ("evaluate", "report", "analyze")  # make benchmark CLUSTER=slurm's last job


def test_a_slurm_job_size_that_fits_no_node_is_refused_before_submitting(tmp_path, monkeypatch):
    """Issue 38: the README's sample command asked for 8 CPUs, 32 GB and a GPU per job and pended
    forever on a smaller node. The request is checked against sinfo's nodes (a fake sinfo here)."""
    from benchmark.cli import check_slurm_request

    sinfo = tmp_path / "sinfo"
    sinfo.write_text("#!/bin/sh\necho 'vm|2|21694|(null)'\necho 'gpu1|16|64000|gpu:a100:2(S:0-1)'\n")
    sinfo.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    readme = ["-m", "cluster=slurm", "stage=sample", "method=swag,laplace"]
    assert check_slurm_request(readme) is None  # 8 CPUs, 32 GB, 1 GPU: fits gpu1
    assert check_slurm_request([*readme, "hydra.launcher.mem_gb=100"]) == (
        "cluster=slurm: each job asks for 8 CPU(s), 100 GB and 1 GPU(s) (hydra.launcher.cpus_per_task x tasks_per_node, "
        "mem_gb, gpus_per_node), but no node of any partition has as much (sinfo: at most 16 CPUs, 62 GB, 2 GPUs per "
        "node): the jobs would pend forever. Size them to fit, e.g. hydra.launcher.mem_gb=62, or choose another "
        "hydra.launcher.partition")
    sinfo.write_text("#!/bin/sh\necho 'vm|2|21694|(null)'\n")
    problem = check_slurm_request([*readme, "hydra.launcher.gpus_per_node=0"])
    assert "asks for 8 CPU(s), 32 GB and 0 GPU(s)" in problem and "at most 2 CPUs, 21 GB, 0 GPUs" in problem
    assert problem.endswith("e.g. hydra.launcher.cpus_per_task=2 hydra.launcher.mem_gb=21, or choose another "
                            "hydra.launcher.partition")
    assert check_slurm_request([*readme, "hydra.launcher.gpus_per_node=0", "hydra.launcher.cpus_per_task=1",
                                "hydra.launcher.mem_gb=1"]) is None
    assert check_slurm_request(readme[1:]) is None and check_slurm_request(["-m", "stage=zoo"]) is None  # no sweep; joblib


def _nothing_written(root):
    return not any(p.is_file() for p in root.rglob("*")) if root.exists() else True


def test_an_ood_set_that_cannot_pair_is_refused_before_training(tmp_path):
    cfg = compose_config(["experiment=mnist_optunet", "dataset.ood=digits_ood", f"store={tmp_path / 'store'}", "stage=zoo"])
    with pytest.raises(ValueError, match="dataset.ood=digits_ood: cannot serve as OOD set of 'mnist'"):
        run(cfg)
    assert _nothing_written(tmp_path / "store")


def test_a_missing_ood_dataset_is_refused_before_training(tmp_path):
    rng = np.random.default_rng(0)
    images, labels = rng.integers(0, 256, (4, 28, 28), dtype=np.uint8), np.arange(4, dtype=np.uint8)
    formats.write_mnist_like(tmp_path / "data", "MNIST", {"train": (images, labels), "t10k": (images, labels)})
    cfg = compose_config(["experiment=mnist_optunet", f"dataset.data_dir={tmp_path / 'data'}",
                          f"store={tmp_path / 'store'}", "stage=zoo"])
    with pytest.raises(DatasetNotFoundError, match="dataset 'fashionmnist' not found.*FashionMNIST/raw"):
        run(cfg)
    assert _nothing_written(tmp_path / "store")


def test_a_method_the_sample_stage_would_refuse_stops_the_zoo_before_training(tmp_path):
    cfg = compose_config([*TINY_TRAIN, f"store={tmp_path / 'store'}", "stage=zoo", "model=resnet18",
                          "methods.laplace.subset_of_weights=all", "methods.laplace.hessian_structure=full"])
    with pytest.raises(MethodConfigError, match="laplace/one: method=laplace on CifarResNet18 with subset_of_weights=all"):
        run(cfg)
    assert _nothing_written(tmp_path / "store")


def test_the_sample_stage_alone_checks_its_bases_first(tmp_path):
    from benchmark.stages.sample import MissingBasesError

    exp = Experiment(compose_config([f"store={tmp_path / 'store'}", "stage=sample", "method=swag"]))
    with pytest.raises(MissingBasesError, match=r"\d+ of the \d+ seeds of seeds.heldout=.* are not trained yet"):
        preflight(exp, ("sample",))
    preflight(exp, ("zoo", "sample"))  # with the zoo stage first, the bases will be there


def test_stage_all_refuses_an_analysis_that_does_not_apply_before_training(tmp_path):
    from benchmark.analyses import NotApplicableError

    cfg = compose_config([*TINY_TRAIN, f"store={tmp_path / 'store'}", f"results={tmp_path / 'results'}", "stage=all",
                          "model=resnet18", "method=ensemble", "analysis=min_mass"])
    with pytest.raises(NotApplicableError, match="analysis=min_mass: .*BatchNorm"):
        run(cfg)
    assert _nothing_written(tmp_path / "store") and _nothing_written(tmp_path / "results")
    skipping = Experiment(compose_config([f"store={tmp_path / 'store'}", "model=resnet18", "method=ensemble",
                                          "analysis=all"]))
    preflight(skipping, stages_of(Stage.all))  # analysis=all skips it (at the analyze stage, with its reason)


def test_stage_all_checks_the_store_only_for_inputs_no_earlier_stage_writes(tmp_path):
    from benchmark.analyses import MissingInputsError

    empty = [f"store={tmp_path / 'store'}", "method=ensemble", "analysis=marginals"]
    preflight(Experiment(compose_config(empty)), stages_of(Stage.all))  # zoo and sample stages write the inputs
    with pytest.raises(MissingInputsError, match="stage=evaluate needs the reference zoo.*zoo.range=reference"):
        preflight(Experiment(compose_config([*empty, "zoo.range=heldout"])), stages_of(Stage.all))
    with pytest.raises(MissingInputsError, match="analysis=marginals needs the reference zoo"):
        preflight(Experiment(compose_config(empty)), ("analyze",))
    preflight(Experiment(compose_config([*empty, "analysis=toy"])), ("analyze",))  # the toy reads nothing


@pytest.mark.parametrize("experiment", ["digits_optunet", "mnist_optunet", "cifar100_resnet18", "tinyimagenet_resnet18"])
def test_each_experiments_heldout_range_supplies_its_repetitions(tmp_path, experiment):
    from benchmark.inventory import heldout_shortfall

    exp = Experiment(compose_config([f"experiment={experiment}", f"store={tmp_path / 'store'}"]))
    sample, seeds, design = exp.config.sample, exp.config.seeds, exp.design
    assert design.stride == sample.per_method  # the Deep Ensemble's members: the largest pool
    needed = (design.most - 1) * design.stride + sample.per_method  # the largest count of any method
    assert heldout_shortfall(exp, sample.per_method) is None
    assert round(len(exp.heldout) * seeds.expected_convergence) >= needed
    # the ranges of the last round (150 seeds) could not: refused with the numbers and the range to use
    small = Experiment(compose_config([f"experiment={experiment}", f"store={tmp_path / 'store'}",
                                       "seeds.heldout=[100000,100150]"]))
    problem = heldout_shortfall(small, sample.per_method)
    assert f"need {needed} converged held-out seeds" in problem and "150 not trained yet" in problem
    stop = int(problem.split("'seeds.heldout=[100000,")[1].split("]")[0])
    assert round((stop - 100000) * seeds.expected_convergence) >= needed


def test_stage_all_refuses_a_heldout_range_too_small_for_the_repetitions_before_training(tmp_path):
    from benchmark.stages.sample import MissingBasesError

    cfg = compose_config([*TINY_TRAIN, f"store={tmp_path / 'store'}", f"results={tmp_path / 'results'}", "stage=all",
                          "seeds.reference=[0,2]", "seeds.heldout=[100000,100008]", "method=ensemble",
                          "sample.per_method=4", "sample.repetitions=3"])
    # 8 held-out seeds at 0.72: about 6 converged; 3 repetitions 4 apart need (3 - 1) x 4 + 4 = 12
    with pytest.raises(MissingBasesError, match=r"need 12 converged held-out seeds .* gives about 6 .*"
                                                r"use 'seeds.heldout=\[100000,\d+\]'"):
        run(cfg)
    assert _nothing_written(tmp_path / "store")


def test_threads_auto_takes_every_core_unless_the_process_is_one_job_of_a_sweep(cli, tmp_path, monkeypatch):
    """``threads=auto``: a single run (``python -m benchmark ...``) uses every available core; each
    job of a multirun sweep (``-m``, Hydra's ``RunMode.MULTIRUN``) its share, cores //
    ``cluster.parallel_jobs``; outside Hydra (``run(cfg)`` from Python) a process runs alone. (The
    sweep runs through the joblib launcher with one worker, in this process.)"""
    import torch
    from hydra.core.hydra_config import HydraConfig

    from benchmark.cli import sweep_job

    monkeypatch.setattr(HydraConfig.instance(), "cfg", None)  # outside Hydra; the runs below leave theirs set
    assert not sweep_job()
    monkeypatch.setattr("benchmark.experiment.available_cores", lambda: 8)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # the count is what is tested, not this machine's
    # verify of an empty store: it logs the threads, then exits 1 (the store is incomplete)
    common = ("stage=verify", f"store={tmp_path / 'store'}", "threads=auto", "cluster.parallel_jobs=2")
    code, out = cli(*common)
    assert code == 1 and "8 torch thread(s)" in out and "StoreIncompleteError" in out, out
    code, out = cli("-m", *common, "hydra.launcher.n_jobs=1", f"hydra.sweep.dir={tmp_path / 'sweep'}")
    assert code == 1 and "4 torch thread(s)" in out, out
    code, out = cli("-m", *common, "threads=3", "hydra.launcher.n_jobs=1", f"hydra.sweep.dir={tmp_path / 'sweep'}")
    assert code == 1 and "3 torch thread(s)" in out, out


def test_sigterm_in_a_slurm_job_stops_the_stage_and_releases_its_claims_at_once(tmp_path, monkeypatch):
    """scancel, scontrol requeue and preemption send SIGTERM, which submitit ignores (SLURM
    SIGKILLs the job later, leaving its claims to go stale): in a SLURM job the stage stops at once
    and its claims are released. Outside SLURM the handler is not touched."""
    import signal
    import time

    from benchmark.cli import stop_on_sigterm
    from benchmark.core.store.claims import try_claim

    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with stop_on_sigterm():
        assert signal.getsignal(signal.SIGTERM) is before
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    path = tmp_path / "seed_000001.claim"
    with pytest.raises(SystemExit) as stopped:
        with stop_on_sigterm(), try_claim(path) as claim:
            assert claim is not None and path.exists()
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(10)  # interrupted by the handler
    assert stopped.value.code == 128 + signal.SIGTERM and not path.exists()
    assert signal.getsignal(signal.SIGTERM) is before
