"""``method=external``: a sample set produced elsewhere gets predictions, MMD, NS MMD, metrics and
its row in the tables; bad input is refused naming the key and the expected shape."""
from __future__ import annotations

import re

import pandas as pd
import pytest
import torch
from safetensors.torch import save_file

from benchmark.cli import run
from benchmark.stages import preflight
from benchmark.config import ConfigError
from benchmark.experiment import Experiment
from benchmark.core.models import predict_with_weights, resnet18
from benchmark.core.store import CheckpointError, load_sample_set, read_metadata
from benchmark.core.training import seeded
from metrics.mmd import mmd
from metrics.symmetries import canonicalize, spec_for_model
from tests.conftest import compose_config
from tests.benchmark.units import write_initial_checkpoints

pytestmark = pytest.mark.slow  # runs stages end to end or trains networks: make test, not make test-fast


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    """A store whose reference zoo holds 6 seeded initialisations (evaluation does not need trained ones)."""
    root = tmp_path_factory.mktemp("external")
    common = [f"store={root / 'store'}", f"results={root / 'results'}", "seeds.reference=[0,6]", "seeds.heldout=[100,106]"]
    exp = Experiment(compose_config(common))
    exp.store.ensure_writable()
    write_initial_checkpoints(exp, range(6))
    return root, common


def _samples(n: int = 5, seed: int = 50) -> dict[str, torch.Tensor]:
    """``n`` OptuNet weight samples ``{key: [n, ...]}`` as another framework would write them."""
    states = []
    for i in range(n):
        with seeded(seed + i):
            states.append(Experiment(compose_config([])).model().state_dict())
    return {k: torch.stack([s[k] for s in states]) for k in states[0]}


def _cfg(zoo, path, *extra):
    root, common = zoo
    return compose_config([*common, "stage=sample", "method=external", f"external.path={path}", *extra])


def test_external_samples_get_their_row_with_independent_numbers(zoo, tmp_path):
    samples = _samples()
    path = tmp_path / "hmc.safetensors"
    save_file(samples, str(path))
    run(_cfg(zoo, path, "external.name=numpyro_hmc", 'external.label="HMC (NumPyro)"', "mode=one"))
    exp = Experiment(_cfg(zoo, path, "external.name=numpyro_hmc", "mode=one", "stage=all"))
    stored = load_sample_set(exp.store.samples_path(exp.store.sample_unit("numpyro_hmc", "one")))
    assert all(torch.equal(stored[k], samples[k]) for k in samples)
    meta = read_metadata(exp.store.preds_path(exp.store.sample_unit("numpyro_hmc", "one")))
    assert (meta["method"], meta["label"], meta["mode"], meta["source"]) == ("numpyro_hmc", "HMC (NumPyro)", "one", str(path))
    preds = load_sample_set(exp.store.preds_path(exp.store.sample_unit("numpyro_hmc", "one")))
    torch.testing.assert_close(preds["id"], predict_with_weights(exp.model(), samples, exp.test_tensors[0]))

    run(compose_config([*zoo[1], "stage=evaluate"]))
    run(compose_config([*zoo[1], "stage=report"]))
    metrics = pd.read_csv(exp.results_dir / "metrics.csv").set_index(["method", "mode"])
    row = metrics.loc[("numpyro_hmc", "one")]
    reference = {k: torch.stack([load_sample_set(exp.store.checkpoint_path(s))[k] for s in range(6)]) for k in samples}
    assert row.status == "ok" and row.n_samples == 5 and row.method_label == "HMC (NumPyro)"
    assert row.mmd_median == pytest.approx(mmd(reference, samples).aggregate["median"], rel=1e-6)
    spec = spec_for_model(exp.model())
    steps = ("scale", "sort")  # evaluate.canonical_steps
    ns = mmd(canonicalize(reference, spec, steps)[0], canonicalize(samples, spec, steps)[0]).aggregate["median"]
    assert row.ns_mmd_median == pytest.approx(ns, rel=1e-6)
    assert re.search(r"\| HMC \(NumPyro\) +\|", (exp.results_dir / "table1.md").read_text())

    run(_cfg(zoo, path, "external.name=numpyro_hmc", 'external.label="HMC (NumPyro)"', "mode=one"))  # done: not redone
    assert read_metadata(exp.store.preds_path(exp.store.sample_unit("numpyro_hmc", "one"))) == meta


def _refused(zoo, tmp_path, samples, *extra):
    path = tmp_path / "bad.safetensors"
    save_file(samples, str(path))
    exp = Experiment(_cfg(zoo, path, "mode=one", *extra))
    preflight(exp, ("sample",))


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda s: {k: v for k, v in s.items() if k != "fc1.bias"}, r"missing key 'fc1.bias' \(expected shape \(3,\)\)"),
        (lambda s: {**s, "fc2.weight": s["fc2.weight"][:, :, :2].contiguous()}, r"key 'fc2.weight' has shape \(10, 2\), expected \(10, 3\)"),
        (lambda s: {**s, "conv1.weight": s["conv1.weight"].index_fill(0, torch.tensor([2]), float("nan"))},
         r"tensor 'conv1.weight' contains NaN or Inf"),
        (lambda s: {k: v[:1] for k, v in s.items()}, r"the same number S >= 2 of samples"),
        (lambda s: {f"model.{k}": v for k, v in s.items()}, r"missing key 'conv1.weight'"),
    ],
)
def test_bad_external_input_names_the_key_and_the_expected_shape(zoo, tmp_path, change, message):
    with pytest.raises(CheckpointError, match=message):
        _refused(zoo, tmp_path, change(_samples(3)))


def test_another_architecture_is_refused(zoo, tmp_path):
    other = {k: torch.stack([v, v]) for k, v in resnet18(num_classes=10, in_channels=1).state_dict().items()}
    with pytest.raises(CheckpointError, match=r"missing key 'conv2.weight' \(expected shape \(10, 1, 5, 5\)\)"):
        _refused(zoo, tmp_path, other)


def test_bad_external_options_are_refused(zoo, tmp_path):
    path = tmp_path / "s.safetensors"
    save_file(_samples(2), str(path))
    with pytest.raises(ConfigError, match="mode=both: method=external needs mode=one or mode=multi"):
        run(_cfg(zoo, path))
    with pytest.raises(ConfigError, match="external.path=.*nowhere.safetensors: no such file"):
        run(_cfg(zoo, tmp_path / "nowhere.safetensors", "mode=one"))
    with pytest.raises(ConfigError, match="external.name='swag': expected a name"):
        Experiment(_cfg(zoo, path, "external.name=swag", "mode=one"))


def test_external_samples_are_written_under_a_claim_and_not_after_losing_it(zoo, tmp_path, monkeypatch, caplog):
    """A live claim elsewhere: skipped. A claim taken over while scoring: nothing written, one line."""
    import json

    from benchmark.stages import sample

    path = tmp_path / "late.safetensors"
    save_file(_samples(3, seed=70), str(path))
    exp = Experiment(_cfg(zoo, path, "external.name=late", "mode=one"))
    unit = exp.store.sample_unit("late", "one")
    with exp.store.claim(unit) as held:
        assert held is not None and sample.run_external(exp).skipped_busy == ["late/one/r0"]
    real = sample.predictions

    def taken_over_meanwhile(*args, **kwargs):
        out = real(*args, **kwargs)
        claim_path = exp.store.claim_path(unit)
        claim_path.unlink()
        claim_path.write_text(json.dumps({"host": "node-z", "pid": 1, "started": 0, "token": "theirs"}))
        return out

    monkeypatch.setattr(sample, "predictions", taken_over_meanwhile)
    summary = sample.run_external(exp)
    assert summary.skipped_busy == ["late/one/r0"] and summary.written == []
    assert not exp.store.samples_path(unit).exists() and not exp.store.preds_path(unit).exists()
    assert "taken over while scoring" in caplog.text
