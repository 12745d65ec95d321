"""A chain unit's ArviZ ``InferenceData`` (``samples/<unit>.nc``, ``core/store/inference_data.py``):
its layout and numbers against diagnostics.md's chain figures, on small stores written by hand,
its names in the store (``stage=verify`` and the litter reaper know it), and the sample stage
writing it for the tiny HMC unit of ``test_sample.py``."""
from __future__ import annotations

import json
import os
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from benchmark.core.store import ExperimentStore, SampleSetMetadata, load_sample_set, read_metadata, save_sample_set
from benchmark.core.store.inference_data import write_inference_data
from benchmark.report.diagnostics import chain_figures
from methods import method_class
from benchmark.stages import verify
from tests.benchmark.stages.test_sample import _hmc_exp, make_exp, zoo_dir  # noqa: F401 (fixtures)

N, C = 20, 4


def layout(unit):
    """The unit's method's chain layout (what the sample stage hands ``write_inference_data``)."""
    return method_class(str(unit.method)).chain_layout


@pytest.fixture(scope="module")
def az():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        import arviz

    return arviz


def _unit(store: ExperimentStore, method: str, chains: int, per: int, diagnostics_: dict | None = None, seed: int = 0):
    """A published unit of ``method``: ``chains`` x ``per`` draws that drift within each chain (so
    that R-hat is not about 1), stored chain after chain as the chain methods store them; with its
    test labels ``[N]``."""
    n = chains * per
    g = torch.Generator().manual_seed(seed)
    drift = torch.randn(chains, per, generator=g).cumsum(1).reshape(n, 1)
    samples = {"fc.weight": torch.randn(n, C, 5, generator=g) + drift[:, :, None], "fc.bias": torch.randn(n, C, generator=g),
               "steps": torch.zeros(n, dtype=torch.int64)}
    logits = torch.randn(n, N, C, generator=g) + drift[:, :, None] * torch.arange(C)
    preds = {"id": logits.softmax(-1), "ood": logits[:, :5].softmax(-1)}
    unit = store.sample_unit(method, "one", 0)
    meta = SampleSetMetadata(experiment=store.experiment, method=method, mode="one", repetition=0, n_samples=n,
                             diagnostics=diagnostics_ if diagnostics_ is not None else
                             {"chains": float(chains), "states_per_chain": float(per)}).encode()
    digest = save_sample_set(store.samples_path(unit), samples, meta, exclusive=True)
    save_sample_set(store.preds_path(unit), preds, {**meta, "samples_digest": digest}, exclusive=True)
    return unit, torch.randint(0, C, (N,), generator=g)


@pytest.fixture
def store(tmp_path) -> ExperimentStore:
    store = ExperimentStore(tmp_path / "store", "exp", claim_timeout_s=60, claim_heartbeat_s=30)
    store.ensure_writable()
    return store


def _figures(store: ExperimentStore, unit, method: str, labels: torch.Tensor) -> dict[str, float]:
    preds = load_sample_set(store.preds_path(unit), ["id"])["id"].numpy()
    return chain_figures(SimpleNamespace(store=store), unit, method, preds, labels.numpy())


def test_an_sghmc_unit_is_written_as_chains_and_draws_with_the_report_s_rhat(store, az):
    unit, labels = _unit(store, "sghmc", chains=3, per=8)
    path = write_inference_data(store, unit, labels, layout(unit))
    assert path == store.inference_data_path(unit) == store.samples_dir / "sghmc_one_r0.nc"
    assert sorted(p.name for p in store.samples_dir.iterdir()) == ["sghmc_one_r0.nc", "sghmc_one_r0.safetensors"]
    data = az.from_netcdf(path)
    assert dict(data.posterior.sizes) == {"chain": 3, "draw": 8, "tensor": 2, "coordinate": 8}
    assert dict(data.sample_stats.sizes) == {"chain": 3, "draw": 8}
    samples = load_sample_set(store.samples_path(unit))
    norms = data.posterior["layer_norm"].sel(tensor="fc.weight").values  # draw d of chain c: sample c * 8 + d
    assert np.allclose(norms, samples["fc.weight"].reshape(3, 8, -1).double().norm(dim=-1).numpy(), rtol=1e-12)
    for label, value in zip(data.posterior["coordinate"].values, data.posterior["weight"].values[1, 2]):
        key, index = str(label)[:-1].split("[")
        assert value == float(samples[key][8 + 2].reshape(-1)[int(index)])
    # ArviZ's rank-normalised split R-hat of the test log-likelihood is the report's (metrics.mcmc.split_rhat: ArviZ's)
    expected = _figures(store, unit, "sghmc", labels)["chain_split_rhat_test_loglik"]
    assert expected > 1.05  # drifting chains: not a trivial 1
    assert float(az.rhat(data.sample_stats, method="rank")["test_loglik"]) == pytest.approx(expected, rel=1e-12, abs=0)
    table = az.summary(data, group="sample_stats", round_to="none")
    assert table.loc["test_loglik", "r_hat"] == pytest.approx(expected, rel=1e-12, abs=0)
    rows = az.summary(data, round_to="none").index
    assert "layer_norm[fc.bias]" in rows and len(rows) == 2 + 8  # two float tensors (the int one left out), 8 weights
    preds_meta = read_metadata(store.preds_path(unit))
    assert data.posterior.attrs["samples_digest"] == preds_meta["samples_digest"]
    assert (data.posterior.attrs["method"], int(data.posterior.attrs["chains"]), int(data.posterior.attrs["draws_per_chain"])) \
        == ("sghmc", 3, 8)


def test_the_chains_whose_every_state_is_stored_and_one_chain_judged_by_its_halves(store, az):
    unit, labels = _unit(store, "sghmc", chains=3, per=8, diagnostics_={"chains": 4.0, "states_per_chain": 8.0})
    data = az.from_netcdf(write_inference_data(store, unit, labels, layout(unit)))
    assert dict(data.sample_stats.sizes) == {"chain": 3, "draw": 8}  # 4 chains asked for, 3 stored whole
    one = ExperimentStore(store.root, "one")
    one.ensure_writable()
    unit, labels = _unit(one, "sghmc_sa", chains=1, per=20, diagnostics_={})
    data = az.from_netcdf(write_inference_data(one, unit, labels, layout(unit)))
    loglik = data.sample_stats["test_loglik"].values
    assert loglik.shape == (1, 20)
    # One chain: split_rhat takes its two halves as two chains (ArviZ splits each again); so compare that.
    assert float(az.rhat(loglik[0].reshape(2, 10), method="rank")) == pytest.approx(
        _figures(one, unit, "sghmc_sa", labels)["chain_split_rhat_test_loglik"], rel=1e-12, abs=0)


def test_no_file_for_a_method_that_runs_no_chains_or_a_unit_of_unknown_layout(store):
    swag, labels = _unit(store, "swag", chains=2, per=4)
    assert write_inference_data(store, swag, labels, layout(swag)) is None
    old = ExperimentStore(store.root, "old")
    old.ensure_writable()
    sghmc, labels = _unit(old, "sghmc", chains=2, per=4, diagnostics_={"ess": 3.0})  # before it recorded its layout
    assert write_inference_data(old, sghmc, labels, layout(sghmc)) is None
    assert not list(store.samples_dir.glob("*.nc")) and not list(old.samples_dir.glob("*.nc"))


def test_the_store_names_the_file_and_verify_and_the_reaper_know_it(store, tmp_path):
    unit, labels = _unit(store, "sghmc", chains=2, per=4)
    path = write_inference_data(store, unit, labels, layout(unit))
    first = path.read_bytes()
    time.sleep(1.1)
    write_inference_data(store, unit, labels, layout(unit))  # again: replaced, atomically (no temp file left), the same bytes
    assert path.read_bytes() == first
    assert sorted(p.name for p in store.samples_dir.iterdir()) == ["sghmc_one_r0.nc", "sghmc_one_r0.safetensors"]
    temp = path.with_name(f".{path.name}.tmp-12-abcdef01")  # a writer killed mid-write
    temp.write_bytes(b"")
    assert store.unit_of(path) == unit == store.unit_of(temp)
    health = verify.ExperimentHealth("exp", "test")
    verify.check_samples(None, store, health)
    verify.check_leftovers(store, health, tmp_path / "results")
    assert health.samples["complete"] == 1 and not health.problems and health.temp_files == [temp]
    verify.remove_temp_files(store, health)  # under the unit's claim
    assert not temp.exists() and health.temp_files == [] and path.is_file()
    temp.write_bytes(b"")
    long_ago = time.time() - 600
    os.utime(temp, (long_ago, long_ago))
    assert store.litter() == [temp]  # a killed writer's temp file of it is litter, reaped with the rest
    store.reap_litter()
    assert not temp.exists() and path.is_file()


@pytest.mark.slow
def test_the_sample_stage_writes_a_chain_unit_s_inference_data(make_exp, az):
    from benchmark.stages.sample import run as run_sample

    exp = _hmc_exp(make_exp, "store")
    assert run_sample(exp).written == ["hmc/multi/r0"]
    unit = exp.store.sample_unit("hmc", "multi", 0)
    path = exp.store.inference_data_path(unit)
    data = az.from_netcdf(path)
    assert dict(data.sample_stats.sizes) == {"chain": 2, "draw": 4}  # one chain per base
    labels = exp.test_tensors[1]
    figures = chain_figures(exp, unit, "hmc", load_sample_set(exp.store.preds_path(unit), ["id"])["id"].numpy(),
                            labels.numpy())
    rhat = float(az.rhat(data.sample_stats, method="rank")["test_loglik"])
    assert rhat == pytest.approx(figures["chain_split_rhat_test_loglik"], rel=1e-12, abs=0)
    # and the sampler's own (sample stage, chain_convergence) R-hat of the same test log-likelihood
    assert rhat == pytest.approx(json.loads(read_metadata(exp.store.samples_path(unit))["diagnostics"])["rhat_loglik"],
                                 rel=1e-12, abs=0)
    assert "r_hat" in az.summary(data).columns
    reports = verify.run(exp)  # the file is not flagged: nothing corrupt, stale or missing
    assert reports[0].samples["complete"] == 1 and not reports[0].problems and not reports[0].temp_files
    assert Path(path).is_file()
