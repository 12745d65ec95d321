"""``analysis=hmc``: drawn with reference=hmc from the zoo, HMC's pooled draws and the closest
method (histograms as analysis=marginals computes them); skipped under reference=zoo."""
from __future__ import annotations

import pandas as pd
import pytest

from benchmark.analyses import NotApplicableError, marginals
from benchmark.analyses import hmc
from benchmark.experiment import Experiment
from benchmark.references import ZooReference
from benchmark.references.hmc import HMCReference
from benchmark.results import read_metrics, rows_against
from benchmark.stages import evaluate
from tests.benchmark.hmc_store import OVERRIDES, fill
from tests.conftest import compose_config

pytestmark = pytest.mark.slow  # runs stages end to end or trains networks: make test, not make test-fast


def test_the_hmc_figures_plot_the_zoo_hmc_and_the_method_closest_to_hmc(tmp_path):
    exp, _ = fill(tmp_path)
    evaluate.run(exp)
    hmc.check(exp)
    written = hmc.run(exp)
    assert {p.name for p in written} >= {"hmc.png", "hmc.pdf", "hmc.csv", "hmc_agreement.png", "hmc_agreement.csv"}
    against = rows_against(read_metrics(exp.results_dir / "metrics.csv"), "hmc")
    ranked = against[~against["method"].isin(["hmc", "zoo"]) & against["mode"].ne("baseline")]
    best = ranked.loc[ranked["ns_mmd_median"].idxmin()]
    assert hmc.closest(against) == (best["method"], best["mode"])
    frame = pd.read_csv(exp.results_dir / "figures" / "hmc.csv")
    assert set(frame["source"]) == {"zoo", "HMC", f"{best['method_label']} [{best['mode']}]"}
    layer = frame[(frame["layer"] == "fc2.weight") & (frame["form"] == "raw") & (frame["source"] == "HMC")]
    pooled = HMCReference(exp).weights()["fc2.weight"].reshape(-1).numpy()
    zoo = ZooReference(exp).weights()["fc2.weight"].reshape(-1).numpy()
    edges = marginals.bin_edges(zoo, exp.config.analyze.marginals.bins)
    expected = marginals.histogram("HMC", "fc2.weight", "raw", pooled, edges, pooled.size)
    assert list(layer["density"]) == pytest.approx(list(expected["density"]), rel=1e-5)
    points = pd.read_csv(exp.results_dir / "figures" / "hmc_agreement.csv")
    assert len(points) == 3 and "zoo" not in set(points["method"])  # swag, ensemble, hmc; the zoo is the reference


def test_the_hmc_figures_are_not_applicable_with_the_zoo_reference(tmp_path):
    exp = Experiment(compose_config([f"store={tmp_path / 's'}", f"results={tmp_path / 'r'}", *OVERRIDES]))
    with pytest.raises(NotApplicableError, match="reference=hmc"):
        hmc.applies(exp)


def test_the_agreement_legend_fits_the_default_runs_fourteen_rows(tmp_path):
    """make hmc's 14 rows (long labels such as "BNN (orthogonal skips)"): one legend entry per method and
    one per mode, and nothing cut off (save_figure refuses a figure whose text leaves the canvas)."""
    from types import SimpleNamespace

    from benchmark.results import half_width

    labels = {"dropout": "Dropout", "bnn": "BNN", "bnn_ordered": "BNN (ordered biases)", "bnn_skip": "BNN (orthogonal skips)",
              "sghmc": "SGHMC", "sghmc_sa": "SGHMC (scale-adapted)", "swag": "SWAG", "laplace": "Laplace"}
    rows = [(m, mode) for m in labels for mode in ("one", "multi") if mode == "one" or m in ("dropout", "bnn", "swag", "laplace")]
    rows += [("ensemble", "multi"), ("hmc", "multi")]  # metrics.csv's order
    labels |= {"ensemble": "Deep Ensembles", "hmc": "HMC"}
    frame = pd.DataFrame([{"method": m, "mode": mode, "method_label": labels[m], "status": "ok", "ns_mmd_median": 0.1 * i,
                           half_width("ns_mmd_median"): 0.01, "agreement": 0.9, half_width("agreement"): 0.02,
                           "tv": 0.1, half_width("tv"): 0.01} for i, (m, mode) in enumerate(rows)])
    exp = SimpleNamespace(display_name="Digits - OptuNet", results_dir=tmp_path)
    written = hmc.draw_agreement(exp, frame, frame)
    assert (tmp_path / "figures" / "hmc_agreement.png") in written
    assert len(pd.read_csv(tmp_path / "figures" / "hmc_agreement.csv")) == len(rows)
