"""Bring your own method: the README's worked example (one module, one yaml, one registration)
runs through the sample, evaluate and report stages and gets its rows in the tables."""
from __future__ import annotations

import importlib.util
import re
import sys

import pandas as pd
import pytest
import torch

import methods.registry as registry
from benchmark.cli import check_command_line, run
from benchmark.loader import compose_config
from benchmark.experiment import Experiment
from benchmark.core.store import load_sample_set, save_checkpoint
from benchmark.core.training import seeded
from methods import register_method
from tests.conftest import REPO
from tests.methods.conftest import HELDOUT, TINY_OVERRIDES

pytestmark = pytest.mark.slow  # runs stages end to end or trains networks: make test, not make test-fast


def _readme_block(language: str, first_line: str) -> str:
    text = (REPO / "README.md").read_text()
    match = re.search(rf"```{language}\n({re.escape(first_line)}\n.*?)```", text, flags=re.S)
    assert match, f"README.md has no {language} block starting with {first_line!r}"
    return match.group(1)


@pytest.fixture
def noise_method(tmp_path, monkeypatch):
    """The README's example module imported from a temp folder, its yaml in a temp config folder on
    Hydra's search path, and the class registered (the registry restored afterwards)."""
    module_path = tmp_path / "noise_example.py"
    module_path.write_text(_readme_block("python", "# methods/noise.py"))
    spec = importlib.util.spec_from_file_location("noise_example", module_path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "noise_example", module)
    spec.loader.exec_module(module)
    conf = tmp_path / "conf" / "methods"
    conf.mkdir(parents=True)
    (conf / "noise.yaml").write_text(_readme_block("yaml", "# conf/methods/noise.yaml"))
    register_method(module.NoiseMethod)
    yield module, f"hydra.searchpath=[file://{tmp_path / 'conf'}]"
    del registry.METHODS["noise"]


def test_a_new_method_gets_its_rows_in_the_tables(noise_method, tiny_exp, tmp_path):
    module, searchpath = noise_method
    store = tmp_path / "store"
    overrides = [*TINY_OVERRIDES, f"store={store}", f"results={tmp_path / 'results'}", "seeds.reference=[0,4]",
                 "sample.per_method=4", "sample.modes_multi=2", searchpath]
    exp = Experiment(compose_config(overrides))
    assert exp.method_settings("noise") == module.NoiseSettings(sigma=0.01)
    (store / exp.name).mkdir(parents=True)
    for path in tiny_exp.store.zoo_dir.rglob("*"):  # the trained held-out bases
        target = store / exp.name / "zoo" / path.relative_to(tiny_exp.store.zoo_dir)
        target.parent.mkdir(parents=True, exist_ok=True)
        if path.is_file():
            target.write_bytes(path.read_bytes())
    for seed in range(4):  # a reference zoo of initialisations is enough to evaluate
        with seeded(seed):
            save_checkpoint(exp.store.checkpoint_path(seed), exp.model().state_dict(), {"seed": seed})

    with exp.backends():
        run(compose_config([*overrides, "stage=sample", "method=noise"]))
        run(compose_config([*overrides, "stage=evaluate"]))
        run(compose_config([*overrides, "stage=report"]))
    samples = load_sample_set(exp.store.samples_path(exp.store.sample_unit("noise", "multi")))
    base = load_sample_set(exp.store.checkpoint_path(exp.store.converged_seeds(*HELDOUT)[0]))
    spread = (samples["fc2.weight"][:2] - base["fc2.weight"]).std()
    assert 0.005 < float(spread) < 0.02, "the samples are the base plus N(0, sigma^2) noise"
    metrics = pd.read_csv(exp.results_dir / "metrics.csv").set_index(["method", "mode"])
    assert {("noise", "one"), ("noise", "multi")} <= set(metrics.index)
    assert set(metrics.loc["noise", "method_label"]) == {"Weight noise"}
    table = (exp.results_dir / "table1.md").read_text()
    assert table.count("| Weight noise ") == 2


def test_its_settings_are_checked_by_the_schema(noise_method, tmp_path):
    _, searchpath = noise_method
    assert check_command_line([searchpath, "methods.noise.sigma=-1", f"store={tmp_path}"]) == (
        "methods.noise.sigma=-1.0: expected a positive number")
    assert "methods.noise.sigma: Value 'x'" in check_command_line([searchpath, "methods.noise.sigma=x"])


def test_registration_refuses_what_cannot_be_a_method(noise_method):
    module, _ = noise_method
    with pytest.raises(ValueError, match="already registered"):
        register_method(type("Other", (module.NoiseMethod,), {}))
    with pytest.raises(TypeError, match="PosteriorMethod subclass"):
        register_method(dict)
    with pytest.raises(ValueError, match="other than 'all' and 'external'"):
        register_method(type("All", (module.NoiseMethod,), {"name": "all"}))
    method = module.NoiseMethod(lambda **k: torch.nn.Linear(2, 1), None, recipe=None)
    method.fit({"weight": torch.zeros(1, 2), "bias": torch.zeros(1)}, 0)
    drawn = method.sample(3, torch.Generator().manual_seed(0))
    assert drawn["weight"].shape == (3, 1, 2) and not torch.equal(drawn["weight"][0], drawn["weight"][1])
