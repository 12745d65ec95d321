"""``from benchmark import score``: the README's example runs as written, and its numbers are, bit
for bit, the evaluate stage's scoring of one repetition (``Reference.score_samples``; both call
``metrics.row.score_row``, tested against loops in tests/metrics/test_row.py) on a tiny store."""
from __future__ import annotations

import math
import re

import pytest
import torch

from benchmark import Score, score, store_zoo
from benchmark.core.models import optunet
from benchmark.core.training.predict import predict_samples
from benchmark.core.store import save_sample_set, stack_state_dicts
from benchmark.core.training import seeded
from benchmark.experiment import Experiment
from benchmark.references import ZooReference
from benchmark.stages import import_zoo
from tests.conftest import REPO, compose_config, one_thread

pytestmark = pytest.mark.slow  # runs stages end to end or trains networks: make test, not make test-fast

REFERENCE_SEEDS = range(6)


def nets(seeds) -> list[dict[str, torch.Tensor]]:
    out = []
    for seed in seeds:
        with seeded(seed):
            out.append(optunet().state_dict())
    return out


@pytest.fixture
def tiny_store(tmp_path, monkeypatch):
    """``tmp_path/store/digits_optunet/zoo`` holding 6 OptuNets (imported, at their initialisation)
    as seeds 0-5; the working folder is ``tmp_path``."""
    folder = tmp_path / "made_elsewhere"
    folder.mkdir()
    for seed, state in zip(REFERENCE_SEEDS, nets(REFERENCE_SEEDS)):
        torch.save(state, folder / f"net_{seed}.pt")
    import_zoo.run(Experiment(compose_config([f"store={tmp_path / 'store'}", f"zoo_import.source={folder}",
                                              "zoo_import.evaluate=false", "seeds.reference=[0,6]"])))
    monkeypatch.chdir(tmp_path)
    with one_thread():
        yield tmp_path


def readme_example() -> str:
    text = (REPO / "README.md").read_text()
    match = re.search(r"```python\n(from benchmark import score.*?)```", text, re.S)
    assert match, "README.md has no python block starting with 'from benchmark import score'"
    return match.group(1)


def evaluate_stage_row(samples: dict[str, torch.Tensor], *overrides: str) -> dict:
    """The evaluate stage's numbers of one repetition with these samples (``Reference.score_samples``),
    its predictions made as the sample stage makes them."""
    exp = Experiment(compose_config(["store=store", "results=results", *overrides]))
    model = exp.model()
    preds = {"id": predict_samples(model, samples, exp.test_tensors[0]),
             "ood": predict_samples(model, samples, exp.ood_tensors[0])}
    return ZooReference(exp).score_samples(samples, preds, full=True)


def assert_same_numbers(ours: dict, theirs: dict) -> None:
    shared = [k for k in theirs if k in ours]
    assert {"mmd_median", "ns_mmd_max", "mmd_median_ref_sd", "mmd_reject", "ns_mmd_reject", "acc", "ece",
            "agreement", "tv", "n_samples", "mmd_shared_median", "ns_mmd_shared_median"} <= set(shared)
    for key in shared:
        if isinstance(theirs[key], float) and math.isnan(theirs[key]):
            assert math.isnan(ours[key]), key
        else:
            assert ours[key] == theirs[key], key


def test_the_readme_example_runs_and_gives_the_evaluate_stages_numbers(tiny_store, capsys):
    namespace: dict = {}
    exec(compile(readme_example(), "README.md", "exec"), namespace)
    result = namespace["result"]
    assert isinstance(result, Score)
    printed = capsys.readouterr().out
    assert f"MMD {100 * result.mmd:.1f}" in printed and "ns_mmd" in printed  # the per-layer table is printed
    samples = stack_state_dicts(namespace["samples"])
    theirs = evaluate_stage_row(samples, "evaluate.weight_matching=false")
    assert_same_numbers(result.row, theirs)
    assert result.mmd == theirs["mmd_median"] and result.ns_mmd == theirs["ns_mmd_median"]
    # per layer: 4 layers x (raw, NS); the weighted mean of the layers' medians is the row's MMD
    layers = result.layers
    assert sorted(layers["layer"].unique()) == ["conv1", "conv2", "fc1", "fc2"] and len(layers) == 8
    raw = layers[layers["form"] == "mmd"]
    assert (raw["median"] * raw["n_params"]).sum() / raw["n_params"].sum() == pytest.approx(result.mmd, rel=1e-12)
    assert raw["n_params"].sum() == sum(v.numel() for v in optunet().state_dict().values())
    assert result.row["mmd_reject"] == layers[layers["form"] == "mmd"]["reject"].mean()


def test_lists_files_and_weight_matching_give_the_same_numbers(tiny_store):
    """Reference and samples as lists of state dicts or as a sample-set file, with the model by
    name and the data passed in: the same numbers as the store's zoo; WM MMD as the evaluate stage."""
    samples = nets(range(100, 108))
    exp = Experiment(compose_config(["store=store"]))
    data = (*exp.test_tensors, exp.ood_tensors[0])
    save_sample_set(tiny_store / "samples.safetensors", stack_state_dicts(samples), {"experiment": "mine"})
    from_lists = score(samples, nets(REFERENCE_SEEDS), model="optunet", data=data, weight_matching=True,
                       test_permutations=100)
    from_store = score("samples.safetensors", store_zoo(), weight_matching=True, test_permutations=100)
    assert from_lists.row == from_store.row
    theirs = evaluate_stage_row(stack_state_dicts(samples), "evaluate.test_permutations=100")
    assert_same_numbers(from_lists.row, theirs)
    assert not math.isnan(theirs["wm_mmd_median"]) and from_lists.row["wm_mmd_median"] == theirs["wm_mmd_median"]


def test_the_reference_against_itself_is_not_rejected_and_bad_samples_are_refused(tiny_store):
    zoo = nets(REFERENCE_SEEDS)
    same = score(zoo, zoo, model=optunet(), reference_resamples=0, test_permutations=100)
    assert same.row["mmd_reject"] == 0.0 and "mmd_median_ref_sd" not in same.row and "acc" not in same.row
    bad = nets([7, 8])
    bad[1]["fc1.weight"] = torch.zeros(4, 10)
    with pytest.raises(ValueError, match=r"samples.*fc1.weight"):
        score(bad, zoo, model="optunet")
    stacked = stack_state_dicts(nets([7, 8]))
    with pytest.raises(ValueError, match=r"samples.*fc1.bias"):  # checked against the model, as evaluate does
        score({k: v for k, v in stacked.items() if k != "fc1.bias"}, zoo, model="optunet")
    with pytest.raises(ValueError, match="model is needed"):
        score(bad, zoo)
    with pytest.raises(TypeError, match="samples must be a list of state dicts"):
        score(3, zoo, model="optunet")
