"""Sample stage: unit selection, written files, resume/validation, claims, failures and refusals."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import benchmark.stages.sample as sample_stage
from benchmark.cli import run
from benchmark.config import ConfigError
from benchmark.experiment import Experiment
from benchmark.core.models import predict_with_weights
from methods import selected as selected_units
from benchmark.design import Design, pool_size
from benchmark.stages.sample import MissingBasesError, SampleStageError, select_bases
from benchmark.stages.sample import jobs as prepare_units
from benchmark.stages.sample import draw, run as run_sample
from benchmark.stages.zoo import run_zoo
from benchmark.core.store import load_checkpoint, load_sample_set, read_metadata
from benchmark.core.training import NonFiniteError
from methods.base import MethodConfigError
from tests.conftest import one_thread
from tests.methods.conftest import compose_config

pytestmark = pytest.mark.slow  # runs stages end to end or trains networks: make test, not make test-fast


@pytest.fixture(scope="module")
def zoo_dir(tmp_path_factory) -> Path:
    """A trained tiny held-out zoo (digits/OptuNet, 2 epochs), copied into each test's store."""
    exp = Experiment(compose_config(tmp_path_factory.mktemp("sample_stage_zoo") / "store"))
    with one_thread(), exp.backends():
        run_zoo(exp, exp.heldout)
    return exp.store.zoo_dir


@pytest.fixture
def make_exp(zoo_dir, tmp_path):
    """``make_exp(*overrides)``: an experiment whose store (this test's) holds the tiny zoo."""
    store = tmp_path / "store"
    shutil.copytree(zoo_dir, store / "digits_optunet" / "zoo")

    def build(*overrides: str) -> Experiment:
        return Experiment(compose_config(store, *overrides))

    build.store = store
    with one_thread():
        yield build


def _written(exp: Experiment) -> list[str]:
    return sorted(p.name for d in (exp.store.samples_dir, exp.store.preds_dir) if d.is_dir() for p in d.iterdir())


def test_unit_selection() -> None:
    units = selected_units("all", "both")
    assert ("ensemble", "multi") in units and ("ensemble", "one") not in units
    assert ("sghmc", "one") in units and ("sghmc", "multi") not in units
    assert {("swag", "one"), ("swag", "multi"), ("laplace", "one"), ("dropout", "multi")} <= set(units)
    assert selected_units("all", "one") == [(m, "one") for m in ("dropout", "bnn", "bnn_ordered", "bnn_skip", "sghmc", "sghmc_sa", "swag",
                                                                  "laplace")]
    assert selected_units("ensemble", "one") == [("ensemble", "one")]  # kept so that check() refuses it
    with pytest.raises(ValueError, match="method=.mcmc.*dropout, bnn, bnn_ordered, bnn_skip, sghmc, sghmc_sa, swag, laplace, ensemble"):
        selected_units("mcmc", "both")


def test_bases_are_the_converged_heldout_seeds_in_order(make_exp) -> None:
    exp = make_exp("method=dropout", "mode=one")
    seeds = exp.store.converged_seeds(exp.heldout.start, exp.heldout.stop)
    assert seeds and not set(exp.store.failed_seeds()) & set(seeds) and all(s in exp.heldout for s in seeds)
    (unit,) = prepare_units(exp)
    # one base, and for a retrained method the rest of its repetition's block as spares: the converged seeds in order
    stride = exp.design.stride
    assert unit.plan.candidates == tuple(seeds[:stride]) and (unit.plan.bases, unit.plan.samples_per_base) == (1, 100)


def test_too_few_bases_in_a_trained_range_suggest_a_larger_range(make_exp) -> None:
    exp = make_exp()
    found = len(exp.store.converged_seeds(exp.heldout.start, exp.heldout.stop))
    with pytest.raises(MissingBasesError) as err:
        select_bases(exp, found + 3)
    message = str(err.value)
    assert f"{found + 3} converged held-out base checkpoints needed, {found} found" in message
    assert "seeds.heldout=[100000, 100008]" in message and "3 missing" in message
    stop = int(message.split("'seeds.heldout=[100000,")[1].split("]")[0])
    assert stop > 100008 and "python -m benchmark stage=zoo experiment=digits_optunet zoo.range=heldout" in message
    assert f"then pass 'seeds.heldout=[100000,{stop}]' to the sample stage too" in message


def test_untrained_range_suggests_training_it(tmp_path) -> None:
    exp = Experiment(compose_config(tmp_path / "store", "method=dropout", "mode=one"))
    with pytest.raises(MissingBasesError, match=r"8 of the 8 seeds of seeds.heldout=\[100000, 100008\] are not trained "
                                                r"yet.*stage=zoo experiment=digits_optunet zoo.range=heldout"):
        prepare_units(exp)


def test_ensemble_unit_is_written_validated_and_resumed(make_exp) -> None:
    cfg = compose_config(make_exp.store, "stage=sample", "method=ensemble", "sample.per_method=3")
    run(cfg)  # through the CLI: preflight, then the stage table
    exp = Experiment(cfg)
    samples_path, preds_path = exp.store.samples_path(exp.store.sample_unit("ensemble", "multi")), exp.store.preds_path(exp.store.sample_unit("ensemble", "multi"))
    meta = read_metadata(samples_path)
    seeds = json.loads(meta["base_seeds"])
    assert seeds == [s for s in exp.store.completed_seeds()][:3]
    assert (meta["method"], meta["mode"], meta["experiment"], meta["n_samples"]) == ("ensemble", "multi", "digits_optunet", "3")
    assert meta["config_hash"] == exp.config_hash and read_metadata(preds_path)["base_seeds"] == meta["base_seeds"]
    samples = load_sample_set(samples_path)
    first = load_checkpoint(exp.store.checkpoint_path(seeds[0]))[0]
    assert all(torch.equal(samples[k][0], first[k]) for k in first)
    preds = load_sample_set(preds_path)
    assert preds["id"].shape == (3, 360, 10) and preds["ood"].shape == (3, len(exp.ood_tensors[1]), 10)
    assert preds["id"].dtype == torch.float32
    torch.testing.assert_close(preds["ood"], predict_with_weights(exp.model(), samples, exp.ood_tensors[0]))
    torch.testing.assert_close(preds["id"].sum(-1), torch.ones(3, 360))

    mtime = preds_path.stat().st_mtime_ns
    assert run_sample(exp).skipped_done == ["ensemble/multi/r0"]
    assert preds_path.stat().st_mtime_ns == mtime
    preds_path.write_bytes(preds_path.read_bytes()[:100])  # truncated: redone
    assert run_sample(exp).written == ["ensemble/multi/r0"]
    def quarantined() -> set:
        return {p for d in (exp.store.samples_dir, exp.store.preds_dir) for p in d.glob("quarantine/*.safetensors")}

    before = quarantined()
    changed = make_exp("method=ensemble", "sample.per_method=2")  # other settings: redone
    assert run_sample(changed).written == ["ensemble/multi/r0"]
    assert load_sample_set(preds_path)["id"].shape[0] == 2
    # issue #30, item 7: the stale unit was quarantined, not deleted (sample.keep_stale=false: removed)
    kept = sorted(quarantined() - before)
    assert len(kept) == 2 and load_sample_set(kept[0])["id"].shape[0] == 3  # preds/ sorts first
    assert "stale: " in json.loads(kept[1].with_suffix(".json").read_text())["reason"]
    assert run_sample(make_exp("method=ensemble", "sample.per_method=3", "sample.keep_stale=false")).written == ["ensemble/multi/r0"]
    assert quarantined() - before == set(kept)
    # issue #30: a unit records the content digests of its bases; a base retrained since makes it stale
    from benchmark.core.store import save_checkpoint
    from benchmark.inventory import unit_state

    unit = exp.store.sample_unit("ensemble", "multi")
    base = exp.store.checkpoint_path(seeds[1])
    state, meta = load_checkpoint(base)
    assert unit_state(exp, unit).problem is None
    kept_meta = {k: v for k, v in meta.items() if k not in ("checksums", "format")}
    save_checkpoint(base, state, {**kept_meta, "test_accuracy": "0.5"})  # metadata only: the same network
    assert unit_state(exp, unit).problem is None
    save_checkpoint(base, {k: v + 1e-3 for k, v in state.items()}, kept_meta)  # retrained: other weights
    assert f"base checkpoint(s) [{seeds[1]}] changed since it was drawn" in unit_state(exp, unit).stale


def test_dropout_one_mode_unit(make_exp) -> None:
    exp = make_exp("method=dropout", "mode=one", "sample.per_method=4")
    with exp.backends():
        assert run_sample(exp).written == ["dropout/one/r0"]
    samples = load_sample_set(exp.store.samples_path(exp.store.sample_unit("dropout", "one")))
    assert samples["fc2.weight"].shape == (4, 10, 3)
    seeds = json.loads(read_metadata(exp.store.preds_path(exp.store.sample_unit("dropout", "one")))["base_seeds"])
    assert len(seeds) == 1 and seeds[0] in exp.store.completed_seeds()


def test_busy_unit_is_skipped(make_exp) -> None:
    exp = make_exp("method=ensemble", "sample.per_method=2")
    with exp.store.claim(exp.store.sample_unit("ensemble", "multi", 0)) as claim:
        assert claim is not None
        assert draw(exp).skipped_busy == ["ensemble/multi/r0"]  # one pass
    assert _written(exp) == []


def test_the_stage_waits_for_a_busy_unit_and_fails_naming_it_and_its_holder(make_exp) -> None:
    """Issue 38: the stage does not end successfully while a unit it was asked for is held elsewhere:
    it waits (claims.wait_s), then fails naming the unit and the holder; once the holder releases
    the claim, the stage draws the unit."""
    import threading

    from benchmark.core.store.claims import HeldElsewhereError, host_name

    exp = make_exp("method=ensemble", "sample.per_method=2", "claims.wait_s=0")
    with exp.store.claim(exp.store.sample_unit("ensemble", "multi", 0)) as claim:
        assert claim is not None
        with pytest.raises(HeldElsewhereError, match=rf"sample digits_optunet: 1 unit\(s\) .* ensemble/multi/r0: "
                                                     rf"{host_name()} pid {os.getpid()}, heartbeat"):
            run_sample(exp)
    waiting = make_exp("method=ensemble", "sample.per_method=2", "claims.wait_s=60", "claims.heartbeat_s=0.5",
                       "claims.timeout_s=60")
    held = waiting.store.claim(waiting.store.sample_unit("ensemble", "multi", 0))
    assert held.__enter__() is not None
    releaser = threading.Timer(1.5, lambda: held.__exit__(None, None, None))
    releaser.start()
    summary = run_sample(waiting)
    releaser.join()
    assert summary.written == ["ensemble/multi/r0"] and summary.skipped_busy == []


def test_nan_in_a_named_method_fails_at_once_and_writes_nothing(make_exp) -> None:
    exp = make_exp("method=swag", "mode=one", "methods.swag.lr=1e30", "methods.swag.epochs_factor=1",
                   "methods.swag.snapshots=4", "methods.swag.rank=3")
    with pytest.raises(NonFiniteError, match="swag seed"):
        run_sample(exp)
    assert _written(exp) == []


def test_all_methods_go_on_past_failures_and_list_them(make_exp, monkeypatch) -> None:
    monkeypatch.setattr("methods.registry.method_names", lambda: ("swag", "ensemble"))  # method=all runs these
    exp = make_exp("sample.per_method=2", "sample.modes_multi=2", "methods.swag.lr=1e30",
                   "methods.swag.epochs_factor=1", "methods.swag.snapshots=4", "methods.swag.rank=3")
    with pytest.raises(SampleStageError) as err:
        run_sample(exp)
    message = str(err.value)
    assert message.startswith("2 method/mode unit(s) failed")
    assert "swag/one/r0: NonFiniteError" in message and "swag/multi/r0: NonFiniteError" in message
    assert _written(exp) == ["ensemble_multi_r0.safetensors", "ensemble_multi_r0.safetensors"]


def test_refusals_and_missing_bases_come_before_any_training(make_exp) -> None:
    with pytest.raises(MethodConfigError, match="method=ensemble mode=one"):
        run_sample(make_exp("method=ensemble", "mode=one"))
    with pytest.raises(MissingBasesError, match=r"need 50 converged held-out seeds.*gives about 6 .*seeds.heldout=\[100000,\d+\]"):
        run_sample(make_exp("method=ensemble", "sample.per_method=50"))
    with pytest.raises(ConfigError, match="methods.dropout.p=0.0"):
        make_exp("method=dropout", "methods.dropout.p=0")
    exp = make_exp("method=swag", "methods.swag.snapshots=100000")
    with pytest.raises(MethodConfigError, match="2 method/mode unit.*refused before any work: swag/one: .*snapshots=100000"):
        run_sample(exp)
    assert _written(exp) == []


def test_repetitions_use_disjoint_blocks_of_bases_and_survive_a_change_of_their_number(make_exp) -> None:
    # per_method=2 (modes_multi=10 does not split it): the largest pool is a retrained method's
    # one-mode base with its 2 spares, so repetitions start 3 converged seeds apart for every method
    assert Design(1, 2, 10).stride == 3
    exp = make_exp("method=ensemble", "sample.per_method=2", "sample.repetitions=2")
    converged = exp.store.converged_seeds(exp.heldout.start, exp.heldout.stop)
    assert run_sample(exp).written == ["ensemble/multi/r0", "ensemble/multi/r1"]
    bases = [json.loads(read_metadata(exp.store.samples_path(exp.store.sample_unit("ensemble", "multi", r)))["base_seeds"]) for r in range(2)]
    assert bases == [converged[0:2], converged[3:5]]
    assert run_sample(make_exp("method=ensemble", "sample.per_method=2", "sample.repetitions=1")).skipped_done == [
        "ensemble/multi/r0"]
    with pytest.raises(MissingBasesError, match=r"need 11 converged held-out seeds"):
        run_sample(make_exp("method=ensemble", "sample.per_method=2", "sample.repetitions=4"))


def test_a_layout_change_that_moves_a_repetitions_bases_makes_exactly_that_unit_stale(make_exp, monkeypatch) -> None:
    """The layout is part of a unit's key (``layout``): a registered method with a larger pool widens
    the stride (3 -> 4 at per_method=2), which moves repetition 1's block and leaves repetition 0's.
    Evaluate refuses repetition 1 naming it and why; the sample stage redraws it alone."""
    from benchmark.core.store import StoreError
    from benchmark.inventory import unit_state
    from benchmark.stages.evaluate import run as run_evaluate
    from methods import registry
    from methods.ensemble import EnsembleMethod

    overrides = ("method=ensemble", "sample.per_method=2", "sample.repetitions=2")
    exp = make_exp(*overrides)
    assert run_sample(exp).written == ["ensemble/multi/r0", "ensemble/multi/r1"]
    converged = exp.store.converged_seeds(exp.heldout.start, exp.heldout.stop)
    wide = type("Wide", (EnsembleMethod,), {"name": "wide", "fits_can_fail": True, "in_default_run": True})
    assert exp.design.stride == 3
    monkeypatch.setitem(registry.METHODS, "wide", wide)  # 2 bases + 2 spares: a pool of 4 (registered after
    moved = Experiment(exp.config)  # the config was composed: a new experiment's design reads the registry)
    assert moved.design.stride == 4
    units = [moved.store.sample_unit("ensemble", "multi", r) for r in range(2)]
    assert unit_state(moved, units[0]).problem is None  # its block [0, 2) did not move
    stale = unit_state(moved, units[1]).problem
    assert "metadata layout differ" in stale and "drawn from converged held-out seeds 3..4" in stale
    assert "now gives converged held-out seeds 4..5" in stale
    with pytest.raises(StoreError) as err:
        run_evaluate(moved)
    assert "ensemble/multi: repetition 1: " in str(err.value) and "repetition 0" not in str(err.value)
    summary = run_sample(moved)
    assert (summary.written, summary.skipped_done) == (["ensemble/multi/r1"], ["ensemble/multi/r0"])
    bases = json.loads(read_metadata(moved.store.samples_path(units[1]))["base_seeds"])
    assert bases == converged[4:6]
    monkeypatch.delitem(registry.METHODS, "wide")  # back to the stride of 3: r1 moves back, r0 stays
    back = make_exp(*overrides)
    assert back.design.stride == 3
    assert unit_state(back, units[0]).problem is None and "layout" in unit_state(back, units[1]).problem


def test_a_unit_written_before_units_recorded_their_layout_is_migrated_by_verify_when_drawn_in_its_block(make_exp) -> None:
    """A unit without ``layout`` (an older version's) is stale for the sample stage, naming the
    migration; ``stage=verify`` reports it, and with ``verify.repair=true`` records the layout of a
    unit whose recorded bases lie in the block the design gives it (its predictions bound again to
    the rewritten sample set), so that it is current; one drawn elsewhere, or without recorded
    bases, is left stale and is drawn again."""
    from benchmark.config import Repair
    from benchmark.core.store import save_sample_set
    from benchmark.inventory import unit_state
    from benchmark.stages import verify

    from benchmark.inventory.migrations import drawn_in_block

    exp = make_exp("method=ensemble", "sample.per_method=2", "sample.repetitions=2")
    assert run_sample(exp).written == ["ensemble/multi/r0", "ensemble/multi/r1"]
    converged = exp.store.converged_seeds(exp.heldout.start, exp.heldout.stop)
    layout = read_metadata(exp.store.samples_path(exp.store.sample_unit("ensemble", "multi", 0)))["layout"]

    def rewrite(unit, **changes) -> None:  # both files' metadata as an older version wrote them
        samples_path, preds_path = exp.store.samples_path(unit), exp.store.preds_path(unit)
        meta = {k: v for k, v in read_metadata(samples_path).items() if k not in ("checksums", "format", "layout")}
        meta = {k: v for k, v in {**meta, **changes}.items() if v is not None}
        digest = save_sample_set(samples_path, load_sample_set(samples_path), meta)
        save_sample_set(preds_path, load_sample_set(preds_path), {**meta, "samples_digest": digest})

    r0, r1 = (exp.store.sample_unit("ensemble", "multi", r) for r in range(2))
    rewrite(r0)
    rewrite(r1, base_seeds=json.dumps(converged[2:4]))  # bases outside its block [3, 5)
    unrecorded = {k: v for k, v in read_metadata(exp.store.samples_path(r0)).items() if k != "base_seeds"}
    assert not drawn_in_block(exp, r0, unrecorded)  # no recorded bases: not known to be drawn in its block
    assert "layout: unrecorded, written by an older version" in unit_state(exp, r0).problem
    report = verify.ExperimentHealth(exp.name, "this test")
    verify.migrate(exp, exp.store, exp.results_dir, report, Repair.off)  # reported, nothing changed
    assert [(m.unit, a) for m, a in report.migrations] == [(r0, "python -m benchmark stage=verify verify.repair=true migrates it")]
    assert "layout" not in read_metadata(exp.store.samples_path(r0))
    repaired = verify.ExperimentHealth(exp.name, "this test")
    verify.migrate(exp, exp.store, exp.results_dir, repaired, Repair.corrupt)
    assert [(m.unit, a) for m, a in repaired.migrations] == [(r0, "migrated")]
    assert all(read_metadata(p)["layout"] == layout for p in exp.store.unit_paths(r0))
    assert unit_state(exp, r0).problem is None  # current, its predictions bound to the rewritten sample set
    assert "layout" in unit_state(exp, r1).problem
    assert run_sample(exp).written == ["ensemble/multi/r1"]


def test_a_heldout_range_grown_at_its_end_keeps_every_unit_drawn(make_exp) -> None:
    """Issue 37: a unit is keyed on the held-out seeds it read (``read_seeds``), not on the range's
    bounds. Growing ``seeds.heldout`` at its end keeps every unit current, before the new seeds are
    trained too (the seeds a unit read are judged on the trained prefix), and the sample stage
    redraws nothing; the settings hash and the chains' key do not hold the range."""
    from benchmark.inventory import chain_key, sample_settings_hash, unit_state

    overrides = ("method=ensemble", "sample.per_method=2", "sample.repetitions=2")
    exp = make_exp(*overrides)
    assert run_sample(exp).written == ["ensemble/multi/r0", "ensemble/multi/r1"]
    converged = exp.store.converged_seeds(exp.heldout.start, exp.heldout.stop)
    units = [exp.store.sample_unit("ensemble", "multi", r) for r in range(2)]
    assert [json.loads(read_metadata(exp.store.samples_path(u))["read_seeds"]) for u in units] == [
        converged[0:2], converged[3:5]]
    grown = make_exp(*overrides, "seeds.heldout=[100000,100016]")  # 100008.. not trained
    assert sample_settings_hash(grown, "ensemble") == sample_settings_hash(exp, "ensemble")
    assert [unit_state(grown, u).problem for u in units] == [None, None]
    hmc = exp.build_method("hmc")
    assert chain_key(grown, hmc, converged[:2]) == chain_key(exp, hmc, converged[:2])
    assert chain_key(exp, hmc, converged[1:3]) != chain_key(exp, hmc, converged[:2])  # other bases
    assert len(converged) >= exp.design.reach  # the blocks lie before the first untrained seed: the stage runs
    assert run_sample(grown).skipped_done == ["ensemble/multi/r0", "ensemble/multi/r1"]
    assert [unit_state(grown, u).problem for u in units] == [None, None]


def test_a_heldout_range_that_moves_the_seeds_a_unit_read_makes_exactly_that_unit_stale(make_exp) -> None:
    """Issue 37: a range cut before the seeds a unit read, or whose start moves, puts other seeds
    at its block's positions: that unit is stale, named with the seeds it read and those there now;
    a unit whose seeds did not move stays current, and so does one that read fewer seeds of its
    block than are left (a method whose fits can fail reads its block only up to its last base)."""
    from benchmark.core.store import save_sample_set
    from benchmark.inventory import read_seeds, unit_state

    overrides = ("method=ensemble", "sample.per_method=2", "sample.repetitions=2")
    exp = make_exp(*overrides)
    assert run_sample(exp).written == ["ensemble/multi/r0", "ensemble/multi/r1"]
    converged = exp.store.converged_seeds(exp.heldout.start, exp.heldout.stop)
    r0, r1 = (exp.store.sample_unit("ensemble", "multi", r) for r in range(2))

    cut = make_exp(*overrides, f"seeds.heldout=[100000,{converged[4]}]")  # r1's block [3, 5) loses its second seed
    assert unit_state(cut, r0).problem is None
    stale = unit_state(cut, r1).problem
    assert f"drawn from held-out seeds {converged[3:5]}" in stale, stale
    assert f"seeds.heldout=[100000, {converged[4]}] are now {converged[3:4]}" in stale and "other base networks" in stale

    moved = make_exp(*overrides, f"seeds.heldout=[{converged[0] + 1},100008]")  # every position moves by one
    for unit, first in ((r0, 0), (r1, 3)):
        stale = unit_state(moved, unit).problem
        assert f"position 0 of the block: seed {converged[first]} then, {converged[first + 1]} now" in stale, stale

    # a unit that read only the first seed of its block (the rest spares it never reached) is
    # judged on that seed alone: current under the cut range too
    assert read_seeds((5, 6, 7, 8), (5,)) == [5] and read_seeds((5, 6, 7, 8), (5, 7)) == [5, 6, 7]
    assert read_seeds((5, 6), (5, 6)) == [5, 6]
    samples_path, preds_path = exp.store.samples_path(r1), exp.store.preds_path(r1)
    meta = {k: v for k, v in read_metadata(samples_path).items() if k not in ("checksums", "format")}
    meta["read_seeds"] = json.dumps(converged[3:4])
    digest = save_sample_set(samples_path, load_sample_set(samples_path), meta)
    save_sample_set(preds_path, load_sample_set(preds_path), {**meta, "samples_digest": digest})
    assert unit_state(cut, r1).problem is None


def test_hmc_chains_are_keyed_on_their_bases_content(make_exp) -> None:
    """The chains of an HMC unit read their bases only: their key (``chain_key``) holds the bases
    and the content digests of their checkpoints, so a base retrained to other weights discards
    the chains run from the old one (the unit itself is stale by ``base_digests``)."""
    from benchmark.core.store import save_checkpoint
    from benchmark.inventory import chain_key

    exp = make_exp("method=hmc", "mode=multi")
    hmc = exp.build_method("hmc")
    seeds = exp.store.converged_seeds(exp.heldout.start, exp.heldout.stop)[:2]
    before = chain_key(exp, hmc, seeds)
    path = exp.store.checkpoint_path(seeds[1])
    state, meta = load_checkpoint(path)
    kept = {k: v for k, v in meta.items() if k not in ("checksums", "format")}
    save_checkpoint(path, state, {**kept, "test_accuracy": "0.5"})  # metadata only: the same network
    assert chain_key(exp, hmc, seeds) == before
    save_checkpoint(path, {k: v + 1e-3 for k, v in state.items()}, kept)  # retrained: other weights
    assert chain_key(exp, hmc, seeds) != before


def test_repetition_k_of_every_row_starts_at_the_same_base(make_exp) -> None:
    # the pairing the findings' paired tests rely on: one-mode bases are the first of the multi-mode
    # and ensemble bases of the same repetition, whichever methods a run selects
    exp = make_exp("method=all", "mode=both", "sample.per_method=2", "sample.modes_multi=2", "sample.repetitions=2")
    stride = Design(2, 2, 2).stride
    assert stride == 4  # a retrained method's multi-mode pool: 2 bases, 2 spares
    converged = exp.store.converged_seeds(exp.heldout.start, exp.heldout.stop)
    units = prepare_units(exp)
    for unit in units:
        r = int(unit.unit.repetition)
        assert unit.plan.candidates[0] == converged[r * stride], unit.unit
        assert set(unit.plan.candidates) <= set(converged[r * stride : (r + 1) * stride])
    alone = prepare_units(make_exp("method=swag", "mode=one", "sample.per_method=2", "sample.modes_multi=2",
                                   "sample.repetitions=2"))
    assert [u.plan.candidates for u in alone] == [(converged[0],), (converged[stride],)]


def test_a_retrained_method_reserves_spare_bases_per_repetition(make_exp) -> None:
    exp = make_exp("method=dropout", "mode=multi", "sample.per_method=4", "sample.modes_multi=2", "sample.repetitions=2")
    units = prepare_units(exp)
    converged = exp.store.converged_seeds(exp.heldout.start, exp.heldout.stop)
    pool = pool_size(units[0].method, 2)
    assert pool == 4 and [u.plan.candidates for u in units] == [tuple(converged[:4]), tuple(converged[4:8])]


def test_a_pair_mixed_from_two_writers_is_refused_and_redrawn(make_exp, caplog) -> None:
    """Writer A's predictions beside writer B's sample set (same settings, other draws): the
    predictions' ``samples_digest`` names A's sample set, so the unit is not done; the stage
    quarantines the predictions and redraws the unit."""
    from benchmark.core.store import content_digest, save_sample_set
    from benchmark.inventory import unit_state

    exp = make_exp("method=ensemble", "sample.per_method=2")
    assert run_sample(exp).written == ["ensemble/multi/r0"]
    unit = exp.store.sample_unit("ensemble", "multi", 0)
    samples_path, preds_path = exp.store.samples_path(unit), exp.store.preds_path(unit)
    assert read_metadata(preds_path)["samples_digest"] == content_digest(read_metadata(samples_path))
    assert unit_state(exp, unit).problem is None
    meta = {k: v for k, v in read_metadata(samples_path).items() if k not in ("checksums", "format")}
    other = {k: v + 1e-3 for k, v in load_sample_set(samples_path).items()}
    save_sample_set(samples_path, other, meta)  # writer B's sample set replaces A's
    problem = unit_state(exp, unit).problem
    assert problem is not None and "computed from another sample set" in problem and "mixed from two writers" in problem
    assert run_sample(exp).written == ["ensemble/multi/r0"]
    assert any("quarantine" in r.getMessage() and "mixed" in r.getMessage() for r in caplog.records)
    assert unit_state(exp, unit).problem is None


def test_bases_are_refused_while_a_heldout_seed_they_could_read_is_untrained(make_exp) -> None:
    """The bases come from the prefix of the range holding every block a repetition can read
    (repetitions x stride converged seeds): a seed after it that is not trained changes nothing
    (an imported pool of exactly the seeds needed is complete); one inside it (its file moved
    away) makes the stage refuse rather than pick bases that depend on which seeds are finished."""
    exp = make_exp("method=ensemble", "sample.per_method=2")
    seeds = exp.store.converged_seeds(exp.heldout.start, exp.heldout.stop)
    reach = exp.design.reach
    assert 2 <= reach < len(seeds)  # the tiny zoo has converged seeds after the prefix
    assert select_bases(exp, 2) == seeds[:reach]
    after = exp.store.checkpoint_path(seeds[-1])
    after.rename(after.with_name("elsewhere"))
    assert select_bases(exp, 2) == seeds[:reach]
    first = exp.store.checkpoint_path(seeds[0])
    first.rename(first.with_name("elsewhere-too"))
    with pytest.raises(MissingBasesError, match=rf"{reach} converged seeds needed, 0 before the first seed not trained "
                                                rf"yet; 2 of the 8 seeds of seeds.heldout=\[100000, 100008\] are not "
                                                rf"trained yet \({seeds[0]}, {seeds[-1]}\); train them with python -m "
                                                r"benchmark stage=zoo experiment=digits_optunet zoo.range=heldout"):
        prepare_units(exp)


def test_a_late_sample_writer_never_replaces_a_published_unit(tiny_cfg):
    """A worker whose claim was taken over publishes after the new holder: its sample set is
    dropped (``AlreadyPublishedError``), the published pair stands; one that loses its claim
    between the two files stops before the predictions."""
    import torch

    from benchmark.core.store import AlreadyPublishedError, load_sample_set
    from benchmark.stages.sample import ClaimLostError, publish_unit

    exp = Experiment(tiny_cfg)
    exp.store.ensure_writable()
    unit = exp.store.sample_unit("swag", "one", 0)
    first = ({"w": torch.ones(2, 3)}, {"id": torch.ones(2, 4, 10)})
    publish_unit(exp, unit, *first, {"experiment": exp.name})
    published = [p.read_bytes() for p in exp.store.unit_paths(unit)]
    with pytest.raises(AlreadyPublishedError):
        publish_unit(exp, unit, {"w": torch.zeros(2, 3)}, {"id": torch.zeros(2, 4, 10)}, {"experiment": exp.name})
    assert [p.read_bytes() for p in exp.store.unit_paths(unit)] == published

    class Lost:
        lost = True

    other = exp.store.sample_unit("swag", "one", 1)
    with pytest.raises(ClaimLostError):
        publish_unit(exp, other, *first, {"experiment": exp.name}, Lost())
    assert exp.store.samples_path(other).exists() and not exp.store.preds_path(other).exists()
    assert torch.equal(load_sample_set(exp.store.samples_path(unit))["w"], torch.ones(2, 3))


HMC_TINY = ("method=hmc", "mode=multi", "sample.per_method=8", "sample.modes_multi=2", "methods.hmc.warmup=6",
            "methods.hmc.max_leapfrog_steps=3", "methods.hmc.trajectory_length=0.3", "methods.hmc.save_every=1",
            "methods.hmc.forward=loop", "methods.hmc.descent_steps=20", "methods.hmc.start_min_accuracy=null")


def _hmc_exp(make_exp, store_name: str) -> Experiment:
    """The tiny HMC unit (2 chains x 4 draws) on the first 64 training images, scored on 16 test
    and OOD images (the chain mechanics, not the network's or ArviZ's cost, are under test here)."""
    exp = Experiment(compose_config(make_exp.store.parent / store_name, *HMC_TINY))
    if store_name != "store":
        shutil.copytree(make_exp.store / "digits_optunet" / "zoo", exp.store.zoo_dir)
    images, labels = exp.train_tensors
    exp.__dict__["train_tensors"] = (images[:64], labels[:64])
    for split in ("test_tensors", "ood_tensors"):
        images, labels = getattr(exp, split)
        exp.__dict__[split] = (images[:16], labels[:16])
    return exp


def test_hmc_chains_resume_bit_for_bit_after_a_kill_and_are_shared_under_claims(make_exp, monkeypatch) -> None:
    from methods.hmc_kernel import StackedHMC

    reference = _hmc_exp(make_exp, "uninterrupted")
    assert run_sample(reference).written == ["hmc/multi/r0"]
    unit = reference.store.sample_unit("hmc", "multi", 0)
    expected = load_sample_set(reference.store.samples_path(unit))
    metadata = read_metadata(reference.store.samples_path(unit))
    diagnostics = json.loads(metadata["diagnostics"])
    assert {"rhat_loglik", "rhat_softmax_median", "ess_loglik_min", "accept_prob", "step_size"} <= set(diagnostics)
    seeds = json.loads(metadata["base_seeds"])
    import warnings

    import numpy as np
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        import arviz as az
    probs = load_sample_set(reference.store.preds_path(unit))["id"].double().numpy().reshape(2, 4, 16, 10)
    labels = reference.test_tensors[1].numpy()
    loglik = np.log(np.take_along_axis(probs, labels[None, None, :, None], 3)[..., 0]).mean(-1)  # [chains, draws]
    assert diagnostics["rhat_loglik"] == az.rhat(loglik, method="rank")  # ArviZ's, on the stored chains
    assert diagnostics["ess_loglik_min"] == min(az.ess(loglik[c : c + 1], method="bulk") for c in range(2))
    assert sorted(p.name for p in reference.store.chains_dir(unit).iterdir()) == [reference.store.chain_files(unit).path(s).name for s in seeds]

    exp = _hmc_exp(make_exp, "store")
    original, calls = StackedHMC.iterate, {"n": 0}

    def iterate_then_die(self, chains):
        calls["n"] += 1
        if calls["n"] > 9:  # past the warm-up (6), draws kept already
            raise KeyboardInterrupt
        original(self, chains)

    monkeypatch.setattr(StackedHMC, "iterate", iterate_then_die)
    with pytest.raises(KeyboardInterrupt):
        run_sample(exp)
    monkeypatch.setattr(StackedHMC, "iterate", original)
    assert _written(exp) == []
    from methods.hmc_kernel import ChainState

    saved = ChainState.load(exp.store.chain_files(unit).path(seeds[0]))
    assert saved.phase == "sampling" and 0 < len(saved.draws) < 4, "killed mid-sampling"
    with exp.store.chain_claim(unit, seeds[1]) as claim:  # another job runs the second chain
        assert claim is not None
        summary = draw(exp)  # one pass
        assert summary.skipped_busy == ["hmc/multi/r0"] and _written(exp) == []
    assert run_sample(exp).written == ["hmc/multi/r0"]
    resumed = load_sample_set(exp.store.samples_path(unit))
    assert all(torch.equal(resumed[k], expected[k]) for k in expected)


def test_swag_units_fitted_in_one_stack_equal_units_drawn_one_by_one(make_exp, monkeypatch) -> None:
    """Both modes x 2 repetitions of SWAG go through one stack (fit_together: 4 distinct bases, the
    one-mode bases shared with the multi-mode ones); each unit's samples are those of its mode run
    alone, bit for bit."""
    small = ("method=swag", "sample.per_method=2", "sample.modes_multi=2", "sample.repetitions=2",
             "methods.swag.epochs_factor=1", "methods.swag.snapshots=4", "methods.swag.rank=3")
    import methods.swag

    stacks = []
    real = methods.swag.continue_networks
    monkeypatch.setattr(methods.swag, "continue_networks", lambda *a, **k: stacks.append(list(a[4])) or real(*a, **k))
    together = make_exp(*small, "mode=both")
    with together.backends():
        run_sample(together)
    assert len(stacks) == 1 and len(stacks[0]) == len(set(stacks[0])) == 4  # one stack, every base once
    monkeypatch.setattr(methods.swag, "continue_networks", real)
    for mode in ("one", "multi"):
        other = Experiment(compose_config(make_exp.store.parent / f"alone_{mode}", *small, f"mode={mode}"))
        shutil.copytree(together.store.zoo_dir, other.store.zoo_dir)
        with other.backends():
            run_sample(other)
        for r in range(2):
            ours = load_sample_set(together.store.samples_path(together.store.sample_unit("swag", mode, r)))
            theirs = load_sample_set(other.store.samples_path(other.store.sample_unit("swag", mode, r)))
            assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours), (mode, r)
