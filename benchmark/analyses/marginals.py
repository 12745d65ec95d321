"""``analysis=marginals``: appendix D.3 and D.1 — per layer, the marginal distribution of the
weights, raw and symmetry-free (the NS MMD column's form), of the reference zoo and of every
method's samples (first repetition of each method and mode), with two-sample Kolmogorov-Smirnov
statistics and p-values (``metrics.marginals``); the zoo's own check of the paper's corollary
that, raw, every unit of a layer has the same marginal (unit 0 against each other unit), which
removing the symmetries breaks; and the D.1 estimate of the number of modes the permutations
make of each zoo network (``metrics.symmetries.modes``: grouped convolutions counted with and
without moving whole blocks).

The KS test assumes independent values; the entries of one network are not, so the p-values
describe rather than test (the statistic D, the largest gap between the two empirical CDFs,
is the number to compare).
"""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from benchmark.analyses.figures import COLUMN_WIDTH, PALETTE, new_figure, save_figure, style
from benchmark.analyses.inputs import figures_dir, first_repetition, reference, require_reference, require_samples
from benchmark.experiment import Experiment
from benchmark.store import load_checkpoints_as_sample_set, load_layer
from methods import method_class, method_names
from metrics.marginals import ks_test, layer_values, unit_values
from metrics.symmetries import canonicalize, log10_permutation_modes, spec_for_model

log = logging.getLogger(__name__)

NAME = "marginals"
TITLE = "Appendix D.3: marginal weight distributions per layer, zoo vs methods, raw and symmetry-free"
FORMS = ("raw", "NS")


def check(exp: Experiment) -> None:
    """Needs the reference zoo and at least one method's samples."""
    require_reference(exp, NAME)
    require_samples(exp, NAME)


def _label(method: str, mode: str) -> str:
    label = method_class(method).label if method in method_names() else method
    return f"{label} [{mode}]"


def zoo_layers(exp: Experiment, keys: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    """``{form: {key: [R, ...]}}`` of the reference zoo (raw and NS), read whole when it fits in
    ``evaluate.max_in_memory_gb``, else layer by layer from the store."""
    ref = reference(exp)
    if ref.in_memory:
        raw, ns = ref.weights(), ref.canonical()
        return {"raw": {k: raw[k] for k in keys}, "NS": {k: ns[k] for k in keys}}
    canonical = ref.canonical_paths()
    return {"raw": {k: load_layer(ref.paths, k) for k in keys}, "NS": {k: load_layer(canonical, k) for k in keys}}


def run(exp: Experiment) -> list[Path]:
    """KS statistics zoo vs each method per layer and form, the zoo's unit-vs-unit check, the mode
    count, and the two figures (marginals, KS heatmap)."""
    require_reference(exp, NAME)
    rows = require_samples(exp, NAME)
    spec = spec_for_model(exp.model())
    steps = [s.value for s in exp.config.evaluate.canonical_steps]
    keys = list(spec.mass_keys)
    zoo = zoo_layers(exp, keys)
    methods = {}
    for method, mode in rows:
        samples = first_repetition(exp, method, mode)
        methods[(method, mode)] = {"raw": samples, "NS": canonicalize(samples, spec, steps)[0]}
    tests = []
    for (method, mode), forms in methods.items():
        for form in FORMS:
            for key in keys:
                result = ks_test(layer_values(zoo[form], key), layer_values(forms[form], key))
                tests.append({"method": method, "mode": mode, "label": _label(method, mode), "layer": key, "form": form,
                              "ks_statistic": result.statistic, "ks_pvalue": result.pvalue, "n_zoo": result.n_x,
                              "n_method": result.n_y})
    numbers = pd.DataFrame(tests)
    units = []
    for group in spec.groups:
        for form in FORMS:
            first = unit_values(zoo[form], group.sort_key, 0) if group.sort_key in zoo[form] else None
            if first is None:
                continue
            for unit in range(1, group.size):
                result = ks_test(first, unit_values(zoo[form], group.sort_key, unit))
                units.append({"layer": group.sort_key, "form": form, "unit_a": 0, "unit_b": unit,
                              "ks_statistic": result.statistic, "ks_pvalue": result.pvalue, "n": result.n_x})
    modes = mode_counts(exp, spec)
    log.info("%s: %d method rows x %d layers; zoo unit-vs-unit KS median D raw %.3f, NS %.3f; log10 modes per network "
             "(median, with block moves) %.1f", NAME, len(methods), len(keys),
             np.median([u["ks_statistic"] for u in units if u["form"] == "raw"] or [np.nan]),
             np.median([u["ks_statistic"] for u in units if u["form"] == "NS"] or [np.nan]),
             float(modes.loc[modes["group"] == "total", "log10_modes_median"].iloc[0]))
    written = draw_marginals(exp, zoo, methods, keys)
    return written + draw_ks(exp, numbers, keys, pd.DataFrame(units), modes)


def mode_counts(exp: Experiment, spec) -> pd.DataFrame:
    """Per unit group and in total, log10 of the number of modes permutations make of each zoo
    network (median, min, max over the zoo), counting grouped convolutions with whole-block moves
    (every permutation the spec allows) and without (the paper's intra-group count, D.4.2)."""
    ref = reference(exp)
    canonical = ref.canonical() if ref.in_memory else None
    if canonical is None:  # streamed zoos: one batch of canonical checkpoints is enough for the estimate
        canonical = load_checkpoints_as_sample_set(ref.canonical_paths()[: ref.batch])
    rows = []
    for block_moves in (True, False):
        counts = log10_permutation_modes(canonical, spec, block_moves=block_moves)
        for name, values in counts.items():
            group = next((g for g in spec.groups if g.name == name), None)
            rows.append({
                "group": name, "units": group.size if group else sum(g.size for g in spec.groups),
                "blocks": group.blocks if group else "", "follows": (group.follows or "") if group else "",
                "block_moves": block_moves, "log10_modes_median": float(values.median()),
                "log10_modes_min": float(values.min()), "log10_modes_max": float(values.max()), "networks": len(values),
            })
    return pd.DataFrame(rows)


def draw_marginals(exp, zoo, methods, keys) -> list[Path]:
    """Figure: per layer (rows) and form (columns) the zoo's marginal (grey) and each method's
    (lines; solid one-mode, dashed multi-mode); its CSV has every histogram's densities."""
    bins = exp.config.analyze.marginals.bins
    colors = {method: PALETTE[i % len(PALETTE)] for i, method in enumerate(dict.fromkeys(m for m, _ in methods))}
    histograms = []

    def record(source: str, key: str, form: str, values: np.ndarray, edges: np.ndarray) -> np.ndarray:
        density, _ = np.histogram(values, bins=edges, density=True)
        histograms.append(pd.DataFrame({"layer": key, "form": form, "source": source, "bin_left": edges[:-1],
                                        "bin_right": edges[1:], "density": density,
                                        "outside_range": float(np.mean((values < edges[0]) | (values > edges[-1])))}))
        return values
    with style():
        figure = new_figure(1.05 * len(keys) + 0.9, COLUMN_WIDTH)
        axes = figure.subplots(len(keys), 2, squeeze=False)
        for row, key in enumerate(keys):
            for col, form in enumerate(FORMS):
                ax = axes[row, col]
                values = layer_values(zoo[form], key)
                low, high = np.percentile(values, [0.5, 99.5])
                pad = 0.25 * (high - low)
                edges = np.linspace(low - pad, high + pad, bins + 1)
                ax.hist(record("zoo", key, form, values, edges), bins=edges, density=True, color="#bbbbbb", label="zoo")
                for (method, mode), forms in methods.items():
                    theirs = record(_label(method, mode), key, form, layer_values(forms[form], key), edges)
                    ax.hist(theirs, bins=edges, density=True, histtype="step",
                            color=colors[method], linestyle="-" if mode == "one" else "--", linewidth=0.7,
                            label=_label(method, mode))
                ax.set_xlim(edges[0], edges[-1])
                ax.set_title(f"{key}, {form}", fontsize=7)
                ax.set_yticks([])
                if row == len(keys) - 1:
                    ax.set_xlabel("weight value")
            axes[row, 0].set_ylabel("density")
        handles, labels = axes[0, 0].get_legend_handles_labels()
        figure.legend(handles, labels, loc="outside lower center", ncol=2)
        figure.suptitle(f"Marginal weight distributions per layer ({exp.display_name})")
        return save_figure(figure, figures_dir(exp), NAME, pd.concat(histograms, ignore_index=True))


def draw_ks(exp, numbers: pd.DataFrame, keys: list[str], units: pd.DataFrame, modes: pd.DataFrame) -> list[Path]:
    """Figure: heatmap of the KS statistic D, zoo vs each method row, per layer and form; its CSV
    has every test, with the zoo's unit-vs-unit tests and the mode counts beside it."""
    labels = list(dict.fromkeys(numbers["label"]))
    grid = numbers.set_index(["label", "form", "layer"])["ks_statistic"]
    with style():
        figure = new_figure(2 * (0.2 * len(labels) + 0.45) + 0.9, COLUMN_WIDTH)
        axes = figure.subplots(2, 1, sharex=True)
        for ax, form in zip(axes, FORMS):
            values = np.array([[grid[(label, form, key)] for key in keys] for label in labels])
            image = ax.imshow(values, vmin=0, vmax=1, cmap="viridis", aspect="auto")
            for i in range(values.shape[0]):
                for j in range(values.shape[1]):
                    ax.text(j, i, f"{values[i, j]:.2f}", ha="center", va="center",
                            color="white" if values[i, j] < 0.6 else "black")
            ax.set_yticks(range(len(labels)), labels)
            ax.set_title("raw weights" if form == "raw" else "symmetry-free (NS) weights")
            ax.spines[:].set_visible(False)
        axes[1].set_xticks(range(len(keys)), [key.removesuffix(".weight") for key in keys])
        axes[1].set_xlabel("layer")
        figure.colorbar(image, ax=list(axes), orientation="horizontal", location="bottom", shrink=0.8,
                        label="KS statistic D (zoo vs method)")
        return save_figure(figure, figures_dir(exp), f"{NAME}_ks", numbers, {"units": units, "modes": modes})


CAPTION = (
    "Marginal distribution of each layer's weights (pooled over units and networks): the reference zoo (grey) and "
    "every method's samples (first repetition; solid one-mode, dashed multi-mode), raw and in the symmetry-free form "
    "of the NS MMD column; the x-range is the zoo's 0.5-99.5 percentiles widened by a quarter (marginals.csv: the "
    "densities and the fraction of values outside). marginals_ks: the two-sample KS statistic D between the zoo's "
    "and each method's marginal (p-values in marginals_ks.csv; entries of one network are not independent, so they "
    "describe rather than test). marginals_ks_units.csv: the zoo's unit 0 vs each other unit of a layer (raw: one "
    "marginal for all units; NS: not). marginals_ks_modes.csv: log10 of the number "
    "of modes the permutations make of each zoo network (appendix D.1), grouped convolutions counted with and "
    "without whole-block moves."
)
