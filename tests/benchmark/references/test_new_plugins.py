"""What a new plug-in touches: a new reference is one module and one yaml (its typed settings
declared in the module reach it through the config), a new baseline one module, a new analysis one
module (its settings too), and no other file of the repository is edited. The test copies the packages and the
configs, writes the two plug-ins into the copy, runs the evaluate stage of the copy in a
subprocess on a tiny store, and checks their rows against the metrics called directly."""
from __future__ import annotations

import filecmp
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from benchmark.core.store import load_checkpoints_as_sample_set, load_sample_set
from benchmark.core.training.predict import predict_samples
from benchmark.results import read_metrics, read_repetitions, rows_against
from metrics.mmd import mmd
from metrics.predictive import predictive_metrics
from tests.benchmark.hmc_store import OVERRIDES, fill
from tests.conftest import REPO

pytestmark = pytest.mark.slow  # runs the evaluate stage of a copy of the repository in a subprocess

COPIED = ("benchmark", "methods", "metrics", "conf")
REFERENCE_MODULE = '''"""The first part of this store's reference zoo, held in memory."""
from __future__ import annotations

from dataclasses import dataclass

from benchmark.core.settings import require
from benchmark.core.store import load_checkpoints_as_sample_set, load_sample_set
from benchmark.core.training.predict import predict_samples
from benchmark.inventory import reference_seeds
from benchmark.references.base import Reference, files_key


@dataclass(frozen=True)
class FirstPartSettings:
    fraction: float = 0.5

    def __post_init__(self):
        require(0 < self.fraction <= 1, "fraction", self.fraction, "a fraction in (0, 1]")


class FirstPart(Reference):
    name = "first_part"
    Settings = FirstPartSettings
    needs = "the converged reference checkpoints of seeds.reference"

    def __init__(self, exp):
        seeds = reference_seeds(exp)
        self.seeds = seeds[: int(len(seeds) * self.settings(exp).fraction)]
        super().__init__(exp, {"files": files_key(exp.store.checkpoint_paths(self.seeds))})

    def weights(self):
        return self._remember("weights", lambda: load_checkpoints_as_sample_set(self.exp.store.checkpoint_paths(self.seeds)))

    def predictive(self):
        return self._remember("predictive", lambda: predict_samples(self.model, self.weights(),
                                                                    self.exp.test_tensors[0]).double().mean(0))
'''
REFERENCE_YAML = "defaults:\n  - base_first_part\n  - _self_\n\nname: first_part\nfraction: 0.5\n"
BASELINE_MODULE = '''"""The last reference checkpoints, as many as a method's sample set."""
from __future__ import annotations

from benchmark.baselines.base import Baseline
from benchmark.core.store import load_checkpoints_as_sample_set, load_sample_set


class LastCheckpoints(Baseline):
    name = "last_checkpoints"
    label = "Last checkpoints"
    about = "the last converged reference checkpoints"
    order = 10

    @classmethod
    def networks(cls, exp, repetition, n):
        return list(exp.reference)[-n:]

    @classmethod
    def draw(cls, exp, zoo, n, repetition):
        seeds = cls.networks(exp, repetition, n)
        return load_checkpoints_as_sample_set(exp.store.checkpoint_paths(seeds)), seeds
'''
ANALYSIS_MODULE = '''"""The total weight norm of the first converged reference checkpoints."""
from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import torch

from benchmark.analyses.inputs import figures_dir, require_reference
from benchmark.core.settings import require
from benchmark.core.store import load_checkpoints_as_sample_set

NAME = "weight_norms"
ORDER = 60
TITLE = "Weight norms of the first reference checkpoints"
CAPTION = "The L2 norm of all of a checkpoint's parameters."


@dataclass
class Settings:
    checkpoints: int = 2

    def __post_init__(self):
        require(self.checkpoints >= 1, "checkpoints", self.checkpoints, "a positive integer")


def needs(exp):
    return frozenset({"reference"})


def check(exp, made=frozenset()):
    require_reference(exp, NAME)


def applies(exp):
    return None


def run(exp):
    seeds = require_reference(exp, NAME)[: exp.config.analyze.weight_norms.checkpoints]
    weights = load_checkpoints_as_sample_set(exp.store.checkpoint_paths(seeds))
    norms = torch.cat([w.flatten(1).double() for w in weights.values()], dim=1).norm(dim=1)
    path = figures_dir(exp) / f"{NAME}.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame({"seed": seeds, "norm": norms.tolist()}).to_csv(path, index=False)
    return [path]
'''
ADDED = {"benchmark/references/first_part.py": REFERENCE_MODULE, "conf/reference/first_part.yaml": REFERENCE_YAML,
         "benchmark/baselines/last_checkpoints.py": BASELINE_MODULE, "benchmark/analyses/weight_norms.py": ANALYSIS_MODULE}


def changed_files(copy: Path) -> set[str]:
    """The files of ``copy`` that are new or differ from the repository's (``COPIED`` folders)."""
    out = set()
    for folder in COPIED:
        for path in (copy / folder).rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts:
                rel = path.relative_to(copy)
                if not (REPO / rel).is_file() or not filecmp.cmp(path, REPO / rel, shallow=False):
                    out.add(rel.as_posix())
    return out


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    """A copy of the repository with the new reference and baseline, and its evaluate stage run with
    ``reference=first_part reference.fraction=0.75 evaluate.baselines=[last_checkpoints]`` on the
    tiny HMC store (the fraction, a setting the new reference declares, reaches it through the
    config); the experiment, the copy."""
    root = tmp_path_factory.mktemp("plugins")
    copy = root / "repo"
    for folder in COPIED:
        shutil.copytree(REPO / folder, copy / folder, ignore=shutil.ignore_patterns("__pycache__"))
    for rel, text in ADDED.items():
        (copy / rel).write_text(text)
    exp, _ = fill(root)
    command = [sys.executable, "-m", "benchmark", "stage=evaluate", "reference=first_part", "reference.fraction=0.75",
               "evaluate.baselines=[last_checkpoints]", "evaluate.baseline_repetitions=1", f"store={root / 'store'}",
               f"results={root / 'results'}", *OVERRIDES, "evaluate.reference_resamples=0",
               "evaluate.test_permutations=0", "sample.repetitions_per_method=null", "threads=1",
               "hydra.run.dir=" + str(root / "hydra")]
    env = {**os.environ, "PYTHONPATH": str(copy)}
    done = subprocess.run(command, cwd=copy, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    analyze = [sys.executable, "-m", "benchmark", "stage=analyze", "analysis=weight_norms",
               "analyze.weight_norms.checkpoints=5", *command[4:]]
    done = subprocess.run(analyze, cwd=copy, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return exp, copy


def test_a_new_reference_is_one_module_and_one_yaml(evaluated):
    exp, copy = evaluated
    assert changed_files(copy) == set(ADDED)
    rows = rows_against(read_repetitions(exp.results_dir / "repetitions.csv"), "first_part").set_index(
        ["method", "mode", "repetition"])
    part = load_checkpoints_as_sample_set(exp.store.checkpoint_paths(range(9)))  # seeds 0-11: reference.fraction=0.75
    predictive = predict_samples(exp.model(), part, exp.test_tensors[0]).double().mean(0)
    for r in range(2):
        unit = exp.store.sample_unit("swag", "one", r)
        samples = load_sample_set(exp.store.samples_path(unit))
        preds = load_sample_set(exp.store.preds_path(unit), ["id", "ood"])
        got = rows.loc[("swag", "one", r)]
        assert got["mmd_median"] == pytest.approx(mmd(part, samples).aggregate["median"], rel=1e-6)
        expected = predictive_metrics(preds["id"], exp.test_tensors[1], preds["ood"], reference_id=predictive)
        assert got["agreement"] == pytest.approx(expected["agreement"], abs=1e-9)
    metrics = rows_against(read_metrics(exp.results_dir / "metrics.csv"), "first_part")
    assert set(metrics["n_reference"]) == {9}


def test_a_new_baseline_is_one_module(evaluated):
    exp, copy = evaluated
    assert {rel for rel in changed_files(copy) if rel.startswith("benchmark/baselines/")} == {
        "benchmark/baselines/last_checkpoints.py"}
    reps = rows_against(read_repetitions(exp.results_dir / "repetitions.csv"), "zoo").set_index(
        ["method", "mode", "repetition"])
    got = reps.loc[("last_checkpoints", "baseline", 0)]
    zoo = load_checkpoints_as_sample_set(exp.store.checkpoint_paths(range(12)))
    last = load_checkpoints_as_sample_set(exp.store.checkpoint_paths(range(8, 12)))  # sample.per_method=4
    assert got["mmd_median"] == pytest.approx(mmd(zoo, last).aggregate["median"], rel=1e-6)
    assert got["base_seeds"] == "8 9 10 11"
    assert torch.isfinite(torch.tensor(got["acc"]))


def test_a_new_analysis_is_one_module(evaluated):
    """Its settings, declared in the module, reach it through the config (``analyze.weight_norms``)."""
    exp, copy = evaluated
    assert {rel for rel in changed_files(copy) if rel.startswith("benchmark/analyses/")} == {
        "benchmark/analyses/weight_norms.py"}
    got = pd.read_csv(exp.results_dir / "figures" / "weight_norms.csv")
    weights = load_checkpoints_as_sample_set(exp.store.checkpoint_paths(range(5)))  # checkpoints=5: seeds 0-4
    expected = [math.sqrt(sum(float((w[i].double() ** 2).sum()) for w in weights.values())) for i in range(5)]
    assert got["seed"].tolist() == [0, 1, 2, 3, 4]
    assert got["norm"].tolist() == pytest.approx(expected, rel=1e-12)
