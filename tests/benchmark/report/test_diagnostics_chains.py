"""diagnostics.md's Markov-chain section: the layout each chain method stores its samples in, and
the chain figures rendered for every chain row."""
from __future__ import annotations

import math

import pandas as pd

from benchmark.core.store import SampleSetMetadata
from benchmark.report.diagnostics import BASE_COLUMNS, is_chain, render
from methods import method_class, method_names


def chain_layout(method: str, meta: SampleSetMetadata, n: int):
    return method_class(method).chain_layout(meta, n)


def test_each_chain_method_layout_is_read_from_its_metadata():
    sghmc = SampleSetMetadata(diagnostics={"chains": 10.0, "states_per_chain": 10.0})
    assert chain_layout("sghmc", sghmc, 100) == (10, 10)
    assert chain_layout("sghmc", sghmc, 95) == (9, 10)  # the chains whose every state is stored
    assert chain_layout("sghmc", SampleSetMetadata(diagnostics={"ess": 3.0}), 100) is None  # an older unit: unknown
    assert chain_layout("sghmc_sa", SampleSetMetadata(), 100) == (1, 100)
    hmc = SampleSetMetadata(base_seeds=[1, 2, 3, 4], samples_per_base=25)
    assert chain_layout("hmc", hmc, 100) == (4, 25) and chain_layout("hmc", hmc, 99) is None


def test_the_chain_methods_are_the_ones_that_say_so():
    assert [m for m in method_names() if is_chain(m)] == ["sghmc", "sghmc_sa", "hmc"]
    assert not is_chain("external") and chain_layout("swag", SampleSetMetadata(), 100) is None


def test_the_markov_chain_section_shows_total_and_per_chain_figures_and_stationarity():
    row = {c: math.nan for c in BASE_COLUMNS} | {
        "method": "sghmc", "method_label": "SGHMC", "mode": "one", "n_samples": 100, "sample_acc_min": 0.7,
        "sample_acc_median": 0.8, "sample_acc_max": 0.9, "ensemble_acc": 0.85, "ess": 11.3, "n_bases": 1,
        "chains": 10.0, "draws_per_chain": 10.0, "chain_ess_total": 55.9, "chain_ess_of_mean": 11.3, "chain_ess_min_chain": 4.1,
        "chain_split_rhat_test_loglik": 1.7, "spread_growth": 2.0, "split_rhat_loglik": 1.73, "stationary": 0.0}
    text = render(pd.DataFrame([row]), "Digits")
    section = text[text.index("## Markov chains"):]
    for figure in ("chain_ess_total", "chain_ess_of_mean", "chain_ess_min_chain", "chain_split_rhat_test_loglik", "spread_growth", "stationary"):
        assert figure in section
    assert "| SGHMC" in section and "1.7" in section and "4.1" in section
