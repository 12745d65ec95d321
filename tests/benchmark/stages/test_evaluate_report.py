import dataclasses
import logging
import math

import pandas as pd
import pytest
import torch
from scipy import stats

from benchmark.experiment import Experiment
from benchmark.core.models import predict_with_weights
from benchmark.results import COLUMNS, REPETITION_COLUMNS, read_repetitions
from benchmark.report.diagnostics import collect as collect_diagnostics
from benchmark.stages.evaluate import run as run_evaluate
from benchmark.stages.report import run as run_report
from benchmark.core.store import StoreError, load_checkpoints_as_sample_set, save_checkpoint, save_sample_set
from benchmark.core.training import seeded
from benchmark.inventory import MissingInputsError, StaleSamplesError
from benchmark.inventory import unit_expectations
from metrics.mmd import ReferenceResampling, mmd, reference_bandwidths
from metrics.predictive import predictive_metrics
from metrics.symmetries import canonicalize, normalize_scales, spec_for_model, weight_matching
from metrics.uncertainty import interval
from tests.benchmark.units import write_unit as _write_unit
from tests.conftest import compose_config

pytestmark = pytest.mark.slow  # runs stages end to end or trains networks: make test, not make test-fast


@pytest.fixture(scope="module")
def filled(tmp_path_factory):
    """A zoo of seeded initialisations (reference seeds 0-11) and an 'ensemble' of held-out seeds
    in 2 repetitions of 3 members. Evaluation does not care whether the networks were trained, and untrained ones keep
    this fixture fast."""
    root = tmp_path_factory.mktemp("eval")
    cfg = compose_config([f"store={root / 'store'}", f"results={root / 'results'}", "seeds.reference=[0,12]",
                          "seeds.heldout=[100000,100006]", "sample.repetitions=2", "evaluate.reference_resamples=6",
                          "evaluate.test_permutations=100",
                          "evaluate.baselines=[second_zoo]"])  # left out at once: its cost-free path (test_baselines.py scores them)
    exp = Experiment(cfg)
    store = exp.store
    store.ensure_writable()
    for seed in [*range(12), *range(100000, 100006)]:
        with seeded(seed):
            state = exp.model().state_dict()
        save_checkpoint(store.checkpoint_path(seed), state, {"seed": seed, "experiment": exp.name, "test_accuracy": 0.1})
    members = [s for s in store.completed_seeds() if s >= 100000]
    model = exp.model()
    reps = []
    for r in range(2):
        ensemble = load_checkpoints_as_sample_set(store.checkpoint_paths(members[3 * r : 3 * r + 3]))
        preds = {"id": predict_with_weights(model, ensemble, exp.test_tensors[0]),
                 "ood": predict_with_weights(model, ensemble, exp.ood_tensors[0])}
        _write_unit(exp, "ensemble", "multi", r, ensemble, preds, base_seeds=members[3 * r : 3 * r + 3])
        reps.append((ensemble, preds))
    return exp, reps


def test_metrics_csv_matches_independent_computation(filled):
    exp, reps = filled
    df = run_evaluate(exp)
    assert list(df.columns) == COLUMNS
    row = df.set_index(["method", "mode"]).loc[("ensemble", "multi")]
    assert row.status == "ok" and row.n_samples == 3 and row.n_repetitions == 2 and row.ns_steps == "scale+sort"
    ref = load_checkpoints_as_sample_set(exp.store.checkpoint_paths(range(12)))
    by_rep = [mmd(ref, ensemble).aggregate["median"] for ensemble, _ in reps]
    halves = mmd(ref, reps[0][0], resampling=ReferenceResampling(count=6)).resampled["median"]
    mean, hw = interval(by_rep, float(halves.std()))
    assert row.mmd_median == pytest.approx(mean, rel=1e-6) and row.mmd_median_hw == pytest.approx(hw, rel=1e-6)
    assert 0 <= row.mmd_reject <= 1 and 0 <= row.ns_mmd_reject <= 1
    ref_pred = predict_with_weights(exp.model(), ref, exp.test_tensors[0]).double().mean(0)
    metrics = [predictive_metrics(p["id"], exp.test_tensors[1], p["ood"], reference_id=ref_pred) for _, p in reps]
    for key in ("acc", "ece", "brier", "aupr", "fpr95", "id_mi", "ood_mi", "agreement", "tv"):
        mean, hw = interval([m[key] for m in metrics])
        assert row[key] == pytest.approx(mean, rel=1e-6, abs=1e-9), key
        assert row[f"{key}_hw"] == pytest.approx(hw, rel=1e-6, abs=1e-9), key
    assert not math.isnan(row.ns_mmd_median)
    # WM MMD: scaling removed, then every network weight-matched to the scaled anchor (the lowest reference seed)
    assert row.wm_anchor == "seed 0"
    spec = spec_for_model(exp.model())
    scaled_ref = normalize_scales(ref, spec)[0]
    anchor = {k: v[:1] for k, v in scaled_ref.items()}
    matched_ref = weight_matching(scaled_ref, anchor, spec)[0]
    by_rep = [mmd(matched_ref, weight_matching(normalize_scales(e, spec)[0], anchor, spec)[0]).aggregate["median"]
              for e, _ in reps]
    halves = mmd(matched_ref, weight_matching(normalize_scales(reps[0][0], spec)[0], anchor, spec)[0],
                 resampling=ReferenceResampling(count=6)).resampled["median"]
    mean, hw = interval(by_rep, float(halves.std()))
    assert row.wm_mmd_median == pytest.approx(mean, rel=1e-6) and row.wm_mmd_median_hw == pytest.approx(hw, rel=1e-6)
    on_disk = pd.read_csv(exp.results_dir / "metrics.csv")
    assert list(on_disk["mode"]) == ["multi"]  # second_zoo left out: 6 held-out networks, not 100


def test_repetitions_csv_and_shared_bandwidth_columns_match_independent_computation(filled):
    """repetitions.csv holds each repetition's own numbers and base seeds (metrics.csv is their
    mean); the shared-bandwidth MMD uses one grid from the zoo alone (raw, and NS on the NS zoo)."""
    exp, reps = filled
    df = run_evaluate(exp).set_index(["method", "mode"])
    per_rep = read_repetitions(exp.results_dir / "repetitions.csv")
    assert list(per_rep.columns) == REPETITION_COLUMNS
    mine = per_rep[(per_rep.method == "ensemble") & (per_rep["mode"] == "multi")].set_index("repetition").sort_index()
    members = [s for s in exp.store.completed_seeds() if s >= 100000]
    assert list(mine.index) == [0, 1] and (mine.status == "ok").all()
    assert list(mine.base_seeds) == [" ".join(map(str, members[3 * r : 3 * r + 3])) for r in range(2)]
    ref = load_checkpoints_as_sample_set(exp.store.checkpoint_paths(range(12)))
    for r, (ensemble, _) in enumerate(reps):
        assert mine.loc[r, "mmd_median"] == pytest.approx(mmd(ref, ensemble).aggregate["median"], rel=1e-6)
    row = df.loc[("ensemble", "multi")]
    for column in ("mmd_median", "acc", "nll", "mmd_shared_median", "ns_mmd_shared_median"):
        assert row[column] == pytest.approx(mine[column].mean(), rel=1e-6), column
    # the reference's standard error is recorded for the first repetition only
    assert math.isfinite(mine.loc[0, "mmd_median_ref_sd"]) and math.isnan(mine.loc[1, "mmd_median_ref_sd"])
    assert math.isfinite(mine.loc[0, "mmd_shared_median_ref_sd"])
    # shared bandwidths: MMDAgg's grid from two halves of the zoo; the statistic with it, recomputed here
    spec = spec_for_model(exp.model())
    ns_ref = canonicalize(ref, spec, ["scale", "sort"])[0]
    grids = {"mmd": reference_bandwidths(ref), "ns_mmd": reference_bandwidths(ns_ref)}
    for r, (ensemble, _) in enumerate(reps):
        raw = mmd(ref, ensemble, shared_bandwidths=grids["mmd"]).shared.aggregate["median"]
        ns = mmd(ns_ref, canonicalize(ensemble, spec, ["scale", "sort"])[0],
                 shared_bandwidths=grids["ns_mmd"]).shared.aggregate["median"]
        assert mine.loc[r, "mmd_shared_median"] == pytest.approx(raw, rel=1e-6)
        assert mine.loc[r, "ns_mmd_shared_median"] == pytest.approx(ns, rel=1e-6)
        # the grid is not the row's own: with per-row bandwidths the value differs
        assert raw != pytest.approx(mmd(ref, ensemble).aggregate["median"], rel=1e-3)
    _, hw = interval(list(mine["mmd_shared_median"]), float(mine.loc[0, "mmd_shared_median_ref_sd"]))
    assert row.mmd_shared_median_hw == pytest.approx(hw, rel=1e-6)


def test_findings_test_the_repetitions_the_evaluate_stage_wrote(filled, tmp_path):
    """Two rows end to end: findings.md's tests of Deep Ensembles against a second row (dropout, which
    trains its own networks: independent samples) are scipy's Welch test and permutation test on the
    two rows' per-repetition MMD."""
    exp, reps = filled
    other = Experiment(dataclasses.replace(exp.config, results=str(tmp_path / "results")))
    members = [s for s in exp.store.completed_seeds() if s >= 100000]
    for r in range(2):  # a broader 'dropout' row: the reference's first checkpoints, scaled
        wide = {k: v * (1.5 + r) for k, v in load_checkpoints_as_sample_set(exp.store.checkpoint_paths(range(r, r + 3))).items()}
        preds = {"id": predict_with_weights(exp.model(), wide, exp.test_tensors[0]),
                 "ood": predict_with_weights(exp.model(), wide, exp.ood_tensors[0])}
        _write_unit(exp, "dropout", "one", r, wide, preds, base_seeds=members[3 * r : 3 * r + 1])
    try:
        run_evaluate(other)
        run_report(other)
    finally:
        for r in range(2):
            exp.store.samples_path(exp.store.sample_unit("dropout", "one", r)).unlink()
            exp.store.preds_path(exp.store.sample_unit("dropout", "one", r)).unlink()
    per_rep = read_repetitions(other.results_dir / "repetitions.csv").set_index(["method", "mode", "repetition"])
    a, b = per_rep.loc[("ensemble", "multi")]["mmd_median"], per_rep.loc[("dropout", "one")]["mmd_median"]
    expected = stats.ttest_ind(a.to_numpy(), b.to_numpy(), equal_var=False)
    exact = stats.permutation_test((a.to_numpy(), b.to_numpy()), lambda x, y, axis: x.mean(axis) - y.mean(axis),
                                   permutation_type="independent", vectorized=True).pvalue
    text = (other.results_dir / "findings.md").read_text()
    assert "Welch's t-test" in text and "sign-flip" in text and "Holm" in text
    line = next(line for line in text.splitlines() if line.startswith("| Deep Ensembles (multi) <"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[1] == "mmd_median" and cells[5:7] == ["unpaired: dropout not from the base", "2 + 2"]
    assert float(cells[7]) == pytest.approx(expected.pvalue, abs=5e-5)  # one comparison: Holm p = p
    assert float(cells[8]) == pytest.approx(expected.pvalue, abs=5e-5)
    assert float(cells[9]) == float(cells[10]) == pytest.approx(exact, abs=5e-5) and cells[-1] == "underpowered"
    diff = (a.to_numpy().mean() - b.to_numpy().mean()) * 100
    assert cells[4].startswith(f"{diff:.1f} ± ")


def test_report_without_repetitions_csv_names_the_command(filled, tmp_path):
    exp = filled[0]
    other = Experiment(dataclasses.replace(exp.config, results=str(tmp_path / "results")))
    run_evaluate(other)
    (other.results_dir / "repetitions.csv").unlink()
    with pytest.raises(MissingInputsError, match=r"stage=report needs .*repetitions.csv .*rerun python -m benchmark "
                                                 r"stage=evaluate experiment=digits_optunet"):
        run_report(other)


def test_the_stages_that_write_results_reap_temp_files_of_killed_writers(filled, tmp_path, caplog):
    import os
    import time

    exp = filled[0]
    other = Experiment(dataclasses.replace(exp.config, results=str(tmp_path / "results")))
    other.results_dir.mkdir(parents=True)
    killed, live = other.results_dir / ".metrics.csv.tmp-12-abcdef01", other.results_dir / ".table1.md.tmp-9-01234567"
    for path in (killed, live):
        path.write_bytes(b"")
    os.utime(killed, (time.time() - 600, time.time() - 600))
    with caplog.at_level(logging.INFO, logger="benchmark.inventory.actions"):
        run_evaluate(other)
    assert not killed.exists() and live.exists()  # a young one may be a live writer's
    assert f"{other.results_dir}: removed 1 temp file(s) left by killed writers" in caplog.text


def test_damaged_predictions_are_named_with_the_command_that_redraws_them(filled):
    exp, reps = filled
    ensemble, preds = reps[0]
    bad = {k: v.clone() for k, v in preds.items()}
    bad["id"][0, 5] = float("nan")
    for r in range(2):
        _write_unit(exp, "dropout", "one", r, ensemble, bad if r == 0 else preds, damaged=r == 0)
    try:
        with pytest.raises(StaleSamplesError, match=r"dropout/one: repetition 0: .*dropout_one_r0.safetensors: tensor 'id' "
                                                    r"contains NaN.*stage=sample experiment=digits_optunet method=dropout"):
            run_evaluate(exp)
    finally:
        for r in range(2):
            exp.store.samples_path(exp.store.sample_unit("dropout", "one", r)).unlink()
            exp.store.preds_path(exp.store.sample_unit("dropout", "one", r)).unlink()


def test_a_missing_or_stale_repetition_is_named_never_mixed(filled, tmp_path):
    exp = filled[0]
    more = dataclasses.replace(exp.config, sample=dataclasses.replace(exp.config.sample, repetitions=3),
                               results=str(tmp_path / "results"))
    with pytest.raises(StaleSamplesError, match=r"ensemble/multi: repetition 2: not written yet\. Redo them with: "
                                                r"python -m benchmark stage=sample experiment=digits_optunet method=ensemble mode=multi"):
        run_evaluate(Experiment(more))
    ensemble, preds = filled[1][0]
    for r in range(2):
        _write_unit(exp, "dropout", "one", r, ensemble, preds)
    other = dataclasses.replace(exp.config, methods=dataclasses.replace(exp.config.methods, dropout=dataclasses.replace(
        exp.config.methods.dropout, p=0.3)), results=str(tmp_path / "results"))
    try:
        with pytest.raises(StaleSamplesError, match=r"dropout/one: repetition 0: .*metadata settings_hash differ"):
            run_evaluate(Experiment(other))
    finally:
        for r in range(2):
            exp.store.samples_path(exp.store.sample_unit("dropout", "one", r)).unlink()
            exp.store.preds_path(exp.store.sample_unit("dropout", "one", r)).unlink()


def test_second_run_reuses_cached_rows_and_gives_identical_tables(filled):
    exp = filled[0]
    first = run_evaluate(exp)
    tables = run_report(exp)
    contents = {p: p.read_text() for p in tables}
    second = run_evaluate(exp)
    pd.testing.assert_frame_equal(first, second)
    run_report(exp)
    assert {p: p.read_text() for p in tables} == contents
    names = sorted(p.name for p in tables)
    assert names == ["diagnostics.csv", "diagnostics.md", "findings.md", "table1.csv", "table1.md", "table1.tex",
                     "table2.csv", "table2.md", "table2.tex", "table3.csv", "table3.md", "table3.tex", "zoo.md"]
    assert "the reference checkpoint of seed 0" in (tables[0].parent / "table3.md").read_text()
    diagnostics = pd.read_csv(tables[0].parent / "diagnostics.csv").set_index(["method", "mode"])
    members = filled[1][0][1]["id"]  # repetition 0's predictions
    per_sample = (members.argmax(-1) == exp.test_tensors[1]).double().mean(1)
    row = diagnostics.loc[("ensemble", "multi")]
    assert row.repetitions == 2 and row.sample_acc_min == pytest.approx(float(per_sample.min()))
    assert row.sample_acc_max == pytest.approx(float(per_sample.max()))
    from benchmark.core.store import CheckpointMetadata, SampleSetMetadata, read_metadata
    seeds = [s for r in range(2) for s in SampleSetMetadata.decode(read_metadata(
        exp.store.samples_path(exp.store.sample_unit("ensemble", "multi", r)))).base_seeds]
    accuracies = [CheckpointMetadata.decode(read_metadata(exp.store.checkpoint_path(s))).test_accuracy for s in seeds]
    assert row.n_bases == len(seeds) > 0 and row.base_acc_min == pytest.approx(min(accuracies))
    assert row.base_acc_max == pytest.approx(max(accuracies))
    found = (tables[0].parent / "findings.md").read_text()
    assert "No claim can be checked" in found
    assert "Deep Ensembles" in (tables[0].parent / "table1.md").read_text()


def test_evaluate_refuses_an_empty_store_and_foreign_samples(tmp_path):
    exp = Experiment(compose_config([f"store={tmp_path / 's'}", f"results={tmp_path / 'r'}"]))
    exp.store.ensure_writable()
    with pytest.raises(StoreError, match="nothing to evaluate for digits_optunet.*0 zoo checkpoints"):
        run_evaluate(exp)


def test_foreign_experiment_samples_are_refused(filled, tmp_path):
    exp, reps = filled
    store = exp.store
    path = store.samples_path(store.sample_unit("numpyro_hmc", "one"))
    save_sample_set(path, {k: v[:2] for k, v in reps[0][0].items()}, {"experiment": "mnist_optunet"})
    save_sample_set(store.preds_path(store.sample_unit("numpyro_hmc", "one")), {k: v[:2] for k, v in reps[0][1].items()}, {"experiment": "mnist_optunet"})
    try:
        with pytest.raises(StoreError, match="experiment 'mnist_optunet', expected 'digits_optunet'.*the store holds"):
            run_evaluate(exp)
    finally:
        path.unlink()
        store.preds_path(store.sample_unit("numpyro_hmc", "one")).unlink()


def test_report_without_metrics_names_the_command(tmp_path):
    exp = Experiment(compose_config([f"results={tmp_path}"]))
    with pytest.raises(MissingInputsError, match="stage=report needs the metrics: no .*metrics.csv; run "
                                                 "python -m benchmark stage=evaluate experiment=digits_optunet"):
        run_report(exp)


def test_streamed_reference_gives_the_in_memory_numbers(filled, tmp_path):
    """A memory limit below the zoo's size switches to the store-streamed path; same figures."""
    exp = filled[0]
    in_memory = run_evaluate(exp)
    streamed_cfg = dataclasses.replace(exp.config, evaluate=dataclasses.replace(exp.config.evaluate, max_in_memory_gb=1e-6),
                                       results=str(tmp_path / "results"))
    for cached in (exp.store.base / "eval").glob("*.json"):
        cached.unlink()
    streamed = run_evaluate(Experiment(streamed_cfg))
    cols = ["mmd_median", "mmd_mean", "mmd_max", "ns_mmd_median", "ns_mmd_mean", "ns_mmd_max", "wm_mmd_median",
            "wm_mmd_mean", "wm_mmd_max", "mmd_shared_median", "ns_mmd_shared_median", "acc", "agreement", "tv"]
    pd.testing.assert_frame_equal(in_memory[cols], streamed[cols], rtol=1e-6, atol=1e-10)


def test_a_damaged_streamed_reference_cache_is_named_and_rebuilt(filled, tmp_path, caplog):
    """Issue #30, items 4 and 5: a canonical form file of a streamed reference with NaN under valid
    checksums, or a bit flip, blocked evaluate for good and the error named the folder's first
    file; a directory or a dangling symlink in place of a cache file raised. Each is named and
    rebuilt; the numbers are those of a sound cache."""
    import logging

    from bench.corruptions import corrupt

    exp = filled[0]
    streamed = Experiment(dataclasses.replace(exp.config, evaluate=dataclasses.replace(
        exp.config.evaluate, max_in_memory_gb=1e-6, reference_resamples=0, test_permutations=0),
        results=str(tmp_path / "results")))
    first = run_evaluate(streamed)
    folder = next(exp.store.reference_dir.glob("canonical-*"))
    files = sorted(folder.glob("seed_*.safetensors"))
    corrupt(files[3], "nan")
    corrupt(files[5], "bitflip")
    files[7].unlink()
    files[7].mkdir()
    files[8].unlink()
    files[8].symlink_to(tmp_path / "nowhere")
    numbers = sorted(exp.store.eval_dir.glob("*.json"))
    for cached in numbers:
        cached.unlink()
    numbers[0].mkdir()
    with caplog.at_level(logging.WARNING):
        second = run_evaluate(streamed)
    pd.testing.assert_frame_equal(first, second)
    log = caplog.text
    for damaged in (files[3], files[5], files[7], files[8], numbers[0]):
        assert f"{damaged}" in log, f"{damaged.name} not named"
    assert "NaN" in log and "checksum" in log and numbers[0].is_file()


def test_weight_matching_off_leaves_the_wm_columns_empty(filled, tmp_path):
    exp = filled[0]
    off = dataclasses.replace(exp.config, evaluate=dataclasses.replace(exp.config.evaluate, weight_matching=False),
                              results=str(tmp_path / "results"))
    frame = run_evaluate(Experiment(off)).set_index(["method", "mode"])
    row = frame.loc[("ensemble", "multi")]
    assert row.wm_anchor == "" and math.isnan(row.wm_mmd_median) and math.isnan(row.wm_mmd_median_hw)
    assert not math.isnan(row.ns_mmd_median)


def test_a_damaged_number_cache_is_recomputed_with_one_log_line(filled, caplog):
    """A digit changed in an ``eval/*.json`` cache is caught by its checksum and recomputed,
    never copied into metrics.csv."""
    import json
    import logging

    exp = filled[0]
    first = run_evaluate(exp)
    cached = sorted((exp.store.base / "eval").glob("*.json"))[0]
    data = json.loads(cached.read_text())
    assert data["checksum"].startswith("xxh3_64:")
    text = cached.read_text()
    column = "mmd_median"
    value = repr(data["numbers"][column])
    from bench.reliability import flip_middle_digit

    damaged = flip_middle_digit(value)
    assert text.count(value) >= 1 and float(damaged) != data["numbers"][column]
    cached.write_text(text.replace(value, damaged, 1))
    with caplog.at_level(logging.WARNING, logger="benchmark.stages.evaluate"):
        second = run_evaluate(exp)
    warnings = [r.getMessage() for r in caplog.records if "recomputing" in r.getMessage()]
    assert len(warnings) == 1 and cached.name in warnings[0] and "checksum mismatch" in warnings[0]
    pd.testing.assert_frame_equal(first, second)
    assert json.loads(cached.read_text())["numbers"][column] == data["numbers"][column]  # rewritten sound


def test_a_reference_range_with_untrained_seeds_is_refused_unless_partial_is_allowed(filled, tmp_path):
    """seeds.reference=[0,14] with seeds 12 and 13 not trained: refused, naming how many and the
    command; with evaluate.allow_partial=true, scored against the 12 present, and metrics.csv and
    the captions say 12."""
    from benchmark.inventory import MissingInputsError
    from benchmark.stages.evaluate import check as check_evaluate

    exp = filled[0]
    wider = dataclasses.replace(exp.config, seeds=dataclasses.replace(exp.config.seeds, reference=[0, 14]),
                                results=str(tmp_path / "results"))
    message = (r"stage=evaluate needs the whole reference zoo: 2 of the 14 seeds of seeds.reference=\[0, 14\] are not "
               r"trained yet \(12, 13\); train them with python -m benchmark stage=zoo experiment=digits_optunet "
               r"zoo.range=reference; or pass evaluate.allow_partial=true to evaluate with the 12 converged")
    with pytest.raises(MissingInputsError, match=message):
        check_evaluate(Experiment(wider))
    with pytest.raises(MissingInputsError, match=message):
        run_evaluate(Experiment(wider))
    partial = dataclasses.replace(wider, evaluate=dataclasses.replace(wider.evaluate, allow_partial=True))
    df = run_evaluate(Experiment(partial))
    assert set(df["n_reference"]) == {12}
    tables = run_report(Experiment(partial))
    table1 = (tables[0].parent / "table1.md").read_text()
    assert "the reference zoo (an SGD ensemble) of 12 converged checkpoints" in table1
    assert "the reference zoo (an SGD ensemble) of 12 converged checkpoints" in (tables[0].parent / "table3.md").read_text()


def test_an_older_metrics_csv_without_n_reference_still_reads(filled, tmp_path):
    from benchmark.results import read_metrics

    exp = filled[0]
    frame = run_evaluate(exp).drop(columns=["n_reference"])
    path = tmp_path / "metrics.csv"
    frame.to_csv(path, index=False)
    assert read_metrics(path)["n_reference"].isna().all()


def test_a_markov_chain_rows_effective_sample_size_reaches_metrics_csv(tmp_path):
    """``ess``: the mean over repetitions of the ESS the sampler recorded in its samples' metadata
    (Table 1's caption prints it); NaN for a row whose sampler records none."""
    cfg = compose_config([f"store={tmp_path / 'store'}", f"results={tmp_path / 'results'}", "seeds.reference=[0,4]",
                          "sample.repetitions=2", "evaluate.reference_resamples=0", "evaluate.test_permutations=0",
                          "evaluate.weight_matching=false"])
    exp = Experiment(cfg)
    exp.store.ensure_writable()
    states = []
    for seed in range(8):
        with seeded(seed):
            states.append(exp.model().state_dict())
    for seed in range(4):
        save_checkpoint(exp.store.checkpoint_path(seed), states[seed], {"seed": seed, "experiment": exp.name})
    model = exp.model()
    for method, ess in (("sghmc", (40.0, 61.0)), ("swag", (None, None))):
        for r in range(2):
            samples = {k: torch.stack([s[k] for s in states[4 + 2 * r : 6 + 2 * r]]) for k in states[0]}
            preds = {"id": predict_with_weights(model, samples, exp.test_tensors[0]),
                     "ood": predict_with_weights(model, samples, exp.ood_tensors[0])}
            _write_unit(exp, method, "one", r, samples, preds)
            if ess[r] is not None:  # the sampler's diagnostics, as the sample stage records them
                path = exp.store.samples_path(exp.store.sample_unit(method, "one", r))
                meta = {**unit_expectations(exp, exp.store.sample_unit(method, "one", r)), "n_samples": 2,
                        "diagnostics": {"ess": ess[r], "lr": 0.2, "chains": 1.0, "states_per_chain": 2.0}}
                path.unlink()
                save_sample_set(path, samples, meta)
    df = run_evaluate(exp).set_index("method")
    assert df.loc["sghmc", "ess"] == pytest.approx(50.5) and math.isnan(df.loc["swag", "ess"])
    diagnostics = collect_diagnostics(exp).set_index("method")  # diagnostics.md's ESS column: the same number
    assert diagnostics.loc["sghmc", "ess"] == pytest.approx(50.5) and math.isnan(diagnostics.loc["swag", "ess"])
    # The chain figures read the stored samples as their chains: one chain of 2 states (too short for any figure).
    assert diagnostics.loc["sghmc", "draws_per_chain"] == 2 and math.isnan(diagnostics.loc["sghmc", "chain_ess_of_mean"])
    assert math.isnan(diagnostics.loc["swag", "draws_per_chain"])


def test_a_reference_of_another_recipe_is_refused_naming_the_fields_unless_allowed_and_recorded(filled, tmp_path):
    """Issue #30, item 2: a zoo trained with ``train.epochs=3`` and evaluate run with
    ``train.epochs=4`` exited 0 with nothing said. Refused, naming the field, the command and the
    override, in the same message as every other class of problem (a missing repetition);
    ``evaluate.allow_other_recipe=true`` scores it and metrics.csv records it."""
    import shutil

    from benchmark.core.store import read_metadata
    from benchmark.stages.evaluate import OtherRecipeError
    from benchmark.stages.evaluate import check as check_evaluate

    exp = filled[0]
    shutil.copytree(exp.store.base, tmp_path / "store" / exp.name)
    overrides = {"store": str(tmp_path / "store"), "results": str(tmp_path / "results"),
                 "evaluate": dataclasses.replace(exp.config.evaluate, reference_resamples=0, test_permutations=0,
                                                 weight_matching=False)}
    older = Experiment(dataclasses.replace(exp.config, train=dataclasses.replace(exp.config.train, epochs=3), **overrides))
    for seed in range(12):  # the reference trained under train.epochs=3, as the zoo stage records it
        path = older.store.checkpoint_path(seed)
        state = load_checkpoints_as_sample_set([path])
        meta = {**read_metadata(path), "config_hash": older.config_hash, "config": older.recipe_config}
        save_checkpoint(path, {k: v[0] for k, v in state.items()}, {k: v for k, v in meta.items() if k not in ("checksums", "format")})
    current = dataclasses.replace(exp.config, train=dataclasses.replace(exp.config.train, epochs=4),
                                  sample=dataclasses.replace(exp.config.sample, repetitions=3), **overrides)
    members = [s for s in older.store.completed_seeds() if s >= 100000]
    for r, (ensemble, preds) in enumerate(filled[1]):  # drawn under train.epochs=4, as in the issue
        _write_unit(Experiment(current), "ensemble", "multi", r, ensemble, preds, base_seeds=members[3 * r : 3 * r + 3])
    with pytest.raises(OtherRecipeError, match=r"12 reference checkpoint\(s\) of digits_optunet .* trained under another "
                                               r"recipe .*: train\.epochs: 3 -> 4; retrain them with python -m benchmark "
                                               r"stage=zoo experiment=digits_optunet zoo.range=reference .*evaluate\.allow_other_recipe=true"):
        check_evaluate(Experiment(current))
    with pytest.raises(OtherRecipeError) as refused:
        run_evaluate(Experiment(current))
    assert "train.epochs: 3 -> 4" in str(refused.value) and "ensemble/multi: repetition 2: not written yet" in str(refused.value)
    allowed = dataclasses.replace(current, sample=exp.config.sample, evaluate=dataclasses.replace(
        current.evaluate, allow_other_recipe=True))
    row = run_evaluate(Experiment(allowed)).iloc[0]
    assert row["reference_config_hash"] == older.config_hash
    assert row["reference_recipe"].startswith("other recipe accepted (evaluate.allow_other_recipe=true): 12 checkpoint(s), "
                                              "train.epochs: 3 -> 4")
    assert run_evaluate(exp)["reference_config_hash"].iloc[0] == "unrecorded"  # imported-like: no recipe recorded
