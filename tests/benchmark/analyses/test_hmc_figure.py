"""``analysis=hmc``: drawn with reference=hmc from the zoo, HMC's pooled draws and the closest
method (histograms as analysis=marginals computes them); skipped under reference=zoo."""
from __future__ import annotations

import pandas as pd
import pytest

from benchmark.analyses import NotApplicableError, hmc, marginals
from benchmark.experiment import Experiment
from benchmark.reference import HMCReference, Reference
from benchmark.results import read_metrics
from benchmark.stages import evaluate
from tests.benchmark.hmc_store import OVERRIDES, fill
from tests.conftest import compose_config


def test_the_hmc_figures_plot_the_zoo_hmc_and_the_method_closest_to_hmc(tmp_path):
    exp, _ = fill(tmp_path)
    evaluate.run(exp)
    hmc.check(exp)
    written = hmc.run(exp)
    assert {p.name for p in written} >= {"hmc.png", "hmc.pdf", "hmc.csv", "hmc_agreement.png", "hmc_agreement.csv"}
    against = read_metrics(exp.results_dir / "metrics_hmc.csv")
    ranked = against[~against["method"].isin(["hmc", "zoo"])]
    best = ranked.loc[ranked["ns_mmd_median"].idxmin()]
    assert hmc.closest(against) == (best["method"], best["mode"])
    frame = pd.read_csv(exp.results_dir / "figures" / "hmc.csv")
    assert set(frame["source"]) == {"zoo", "HMC", f"{best['method_label']} [{best['mode']}]"}
    layer = frame[(frame["layer"] == "fc2.weight") & (frame["form"] == "raw") & (frame["source"] == "HMC")]
    pooled = HMCReference(exp).weights()["fc2.weight"].reshape(-1).numpy()
    zoo = Reference(exp).weights()["fc2.weight"].reshape(-1).numpy()
    edges = marginals.bin_edges(zoo, exp.config.analyze.marginals.bins)
    expected = marginals.histogram("HMC", "fc2.weight", "raw", pooled, edges, pooled.size)
    assert list(layer["density"]) == pytest.approx(list(expected["density"]), rel=1e-5)
    points = pd.read_csv(exp.results_dir / "figures" / "hmc_agreement.csv")
    assert len(points) == 3 and "zoo" not in set(points["method"])  # swag, ensemble, hmc; the zoo is the reference


def test_the_hmc_figures_are_not_applicable_with_the_zoo_reference(tmp_path):
    exp = Experiment(compose_config([f"store={tmp_path / 's'}", f"results={tmp_path / 'r'}", *OVERRIDES]))
    with pytest.raises(NotApplicableError, match="reference=hmc"):
        hmc.applies(exp)
