"""The HMC reference's analysis hook (``HMCReference.hooks.analysis``), ``analysis=hmc``
(``reference=hmc``): the zoo next to full-batch HMC. ``hmc``: per layer,
the marginal distribution of the weights of the zoo, of HMC's pooled draws (the HMC reference,
``benchmark.references.HMCReference``) and of the approximate method closest to HMC (lowest NS MMD
to HMC among metrics.csv's rows with ``reference`` = ``hmc``, first repetition), raw and symmetry-free (the NS MMD column's form).
``hmc_agreement``: each row's predictive agreement with HMC's predictive against its NS MMD to the
zoo, with both error bars (metrics.csv's rows against HMC and against the zoo): whether being close to the zoo in
weight space goes with predicting like HMC.

Histograms as ``analysis=marginals`` draws them (``benchmark.analyses.marginals``: the same bins
from the zoo's percentiles, the same fixed subsample of a layer's entries, at most
``analyze.marginals.max_layers_shown`` layers shown, every layer in the CSV).
"""
from __future__ import annotations

import logging
import textwrap
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.lines import Line2D

from benchmark.core.figures import COLUMN_WIDTH, PALETTE, legend_layout, new_figure, save_figure, style
from benchmark.analyses.inputs import NotApplicableError, figures_dir, first_repetition, require_reference, require_samples
from benchmark.analyses.marginals import FORMS, Layers, ZooLayers, bin_edges, draw_histograms, histogram, shown_layers
from benchmark.experiment import Experiment
from benchmark.inventory import MissingInputsError, require_inputs, row_label
from benchmark.results import BASELINE_MODE
from benchmark.references import REFERENCE_METHODS, ZOO, evaluated
from benchmark.references.hmc import HMC_ROW, HMCReference
from benchmark.results import half_width, metrics_path, read_metrics, rows_against
from methods.hmc import stochastic_layers
from metrics.symmetries import canonicalize

log = logging.getLogger(__name__)

NAME = "hmc"
TITLE = "The zoo next to full-batch HMC: marginals per layer, and agreement with HMC against NS MMD to the zoo"


def applies(exp: Experiment) -> None:
    """Applies with ``reference=hmc`` to a model whose likelihood is a fixed function of its weights."""
    if HMCReference.name not in evaluated(exp):
        raise NotApplicableError("drawn with reference=hmc (make hmc), which scores every row against full-batch HMC")
    problems = stochastic_layers(exp.model())
    if problems:
        raise NotApplicableError(f"HMC needs a fixed likelihood: {'; '.join(problems)}")


def needs(exp: Experiment) -> frozenset[str]:
    return frozenset({"reference", "samples", "metrics"})


def check(exp: Experiment, made: frozenset[str] = frozenset()) -> None:
    """Needs the zoo, HMC's multi-mode units and both metrics files (unless earlier stages of this run make them)."""
    require_inputs(exp, needs(exp) - made, f"analysis={NAME}")
    if "samples" not in made and (problem := HMCReference.problem(exp)) is not None:
        raise MissingInputsError(f"analysis={NAME} needs {problem}")
    path = metrics_path(exp.results_dir)
    if "metrics" not in made and (not path.is_file() or rows_against(read_metrics(path), HMCReference.name).empty):
        raise MissingInputsError(f"analysis={NAME} needs the rows of {path} with reference={HMCReference.name}; run "
                                 f"python -m benchmark stage=evaluate experiment={exp.name} reference=hmc first")


def closest(hmc: pd.DataFrame) -> tuple[str, str] | None:
    """The approximate method's row with the lowest NS MMD to HMC (not a reference's own row, not a
    baseline, not failed)."""
    rows = hmc[~hmc["method"].isin(REFERENCE_METHODS) & hmc["mode"].ne(BASELINE_MODE) & hmc["status"].eq("ok")
               & hmc["ns_mmd_median"].notna()]
    if rows.empty:
        return None
    best = rows.loc[rows["ns_mmd_median"].idxmin()]
    return str(best["method"]), str(best["mode"])


def run(exp: Experiment) -> list[Path]:
    """The two figures (see the module doc)."""
    require_reference(exp, NAME)
    require_samples(exp, NAME)
    return draw(exp, read_metrics(metrics_path(exp.results_dir)))


def draw(exp: Experiment, metrics: pd.DataFrame, reference: str = HMCReference.name) -> list[Path]:
    """The two figures from ``metrics`` (metrics.csv's frame: its rows against the zoo and against
    ``reference``, full-batch HMC's draws); their paths."""
    zoo_frame, hmc_frame = rows_against(metrics, ZOO), rows_against(metrics, reference)
    written = draw_marginals(exp, closest(hmc_frame))
    return written + draw_agreement(exp, zoo_frame, hmc_frame)


def draw_marginals(exp: Experiment, best: tuple[str, str] | None) -> list[Path]:
    """Per shown layer and form: the zoo's histogram (grey), HMC's pooled draws' and the closest method's."""
    layers = Layers(exp)  # the layers, entries and subsample analysis=marginals takes
    settings, keys, entries, values = layers.settings, layers.keys, layers.entries, layers.values
    zoo = ZooLayers(exp)
    sources = {"HMC": HMCReference(exp).weights()}
    if best is not None:
        sources[_label(exp, *best)] = first_repetition(exp, *best)
    # Each source in each form once (the symmetry-free form canonicalises the whole sample set).
    forms = {(name, form): samples if form == "raw" else canonicalize(samples, layers.spec, layers.steps, device=exp.device)[0]
             for name, samples in sources.items() for form in FORMS}
    histograms = []
    for form in FORMS:
        for key in keys:
            theirs = values(zoo.blocks(form, key), zoo.count, key).astype(np.float32)
            edges = bin_edges(theirs, settings.bins)
            histograms.append(histogram("zoo", key, form, theirs, edges, zoo.count * entries[key]))
            for name in sources:
                form_of = forms[(name, form)]
                count = int(next(iter(form_of.values())).shape[0])
                histograms.append(histogram(name, key, form, values([form_of[key].reshape(count, -1)], count, key), edges,
                                            count * entries[key]))
    shown = shown_layers(keys, settings.max_layers_shown)
    frame = pd.concat(histograms, ignore_index=True).assign(shown=lambda df: df["layer"].isin(shown),
                                                             max_values=settings.max_values, subsample_seed=settings.seed)
    lines = [(name, PALETTE[i], "-" if i == 0 else "--") for i, name in enumerate(sources)]
    return draw_histograms(exp, frame, lines, shown, len(keys), NAME,
                           f"Zoo, HMC and the method closest to HMC ({exp.display_name})")


def draw_agreement(exp: Experiment, zoo: pd.DataFrame, hmc: pd.DataFrame) -> list[Path]:
    """Each method row's agreement with HMC (y) against its NS MMD to the zoo (x), both x100 with their
    half-widths (the baselines are in table_hmc, not here: the figure compares methods)."""
    keys = ["method", "mode"]
    both = zoo[keys + ["method_label", "status", "ns_mmd_median", half_width("ns_mmd_median")]].merge(
        hmc[keys + ["status", "agreement", half_width("agreement"), "tv", half_width("tv")]], on=keys,
        suffixes=("_zoo", "_hmc"))
    both = both[both["status_zoo"].eq("ok") & both["status_hmc"].eq("ok") & both["mode"].ne(BASELINE_MODE)].copy()
    both["label"] = [f"{label} [{mode}]" for label, mode in zip(both["method_label"], both["mode"])]
    numbers = both[["method", "mode", "label", "ns_mmd_median", half_width("ns_mmd_median"), "agreement",
                    half_width("agreement"), "tv", half_width("tv")]].reset_index(drop=True)
    # One colour per method (HMC black), the marker says the mode: the legend lists each once.
    methods = list(dict.fromkeys(zip(both["method"], both["method_label"])))
    colors = {method: "black" if method == HMC_ROW[0] else PALETTE[i % len(PALETTE)] for i, (method, _) in enumerate(methods)}
    markers = {"multi": "o", "one": "s"}
    handles = [Line2D([], [], color=colors[method], marker="o", linestyle="", markersize=3, label=label)
               for method, label in methods]
    handles += [Line2D([], [], color="black", markerfacecolor="none", marker=marker, linestyle="", markersize=3,
                       label=f"{mode}-mode")
                for mode, marker in markers.items() if mode in set(numbers["mode"])]
    columns, legend_height = legend_layout([h.get_label() for h in handles])
    with style():
        figure = new_figure(2.6 + legend_height, COLUMN_WIDTH)
        ax = figure.subplots()
        for _, row in numbers.iterrows():
            ax.errorbar(100 * row["ns_mmd_median"], 100 * row["agreement"], xerr=_width(row, "ns_mmd_median"),
                        yerr=_width(row, "agreement"), fmt=markers.get(row["mode"], "o"), color=colors[row["method"]],
                        markersize=3, elinewidth=0.6, capsize=1.5)
        ax.set_xlabel("NS MMD to the zoo (x100)")
        ax.set_ylabel("agreement with HMC's predictive (%)")
        figure.legend(handles=handles, loc="outside lower center", ncol=columns)
        figure.suptitle("\n".join(textwrap.wrap(f"Predicting like HMC vs close to the zoo ({exp.display_name})", 60)))
        return save_figure(figure, figures_dir(exp), f"{NAME}_agreement", numbers)


def _width(row: pd.Series, column: str) -> float:
    value = row[half_width(column)]
    return 0.0 if not np.isfinite(value) else 100 * value


def _label(exp: Experiment, method: str, mode: str) -> str:
    return f"{row_label(exp, method, mode)} [{mode}]"


CAPTION = (
    "hmc: the marginal distribution of each layer's weights (pooled over units and networks) of the reference zoo "
    "(grey), of full-batch HMC's pooled draws (the HMC reference: every chain of the HMC multi-mode units, all "
    "repetitions; solid) and of the approximate method closest to HMC (lowest NS MMD to HMC in metrics.csv, its "
    "first repetition; dashed), raw and in the symmetry-free form of the NS MMD column; bins and subsample as in "
    "marginals (hmc.csv: every layer's densities). hmc_agreement: each row's agreement with HMC's predictive (the "
    "fraction of ID test inputs where the argmax of its predictive equals that of the mean of HMC's draws; HMC's own "
    "row against the other repetitions' chains) against its NS MMD to the zoo, x100 with the 95% half-widths of "
    "metrics.csv's rows against HMC and against the zoo (one colour per method, circles multi-mode, squares one-mode; the zoo's own row, at distance 0 from "
    "itself by definition, is not drawn: Deep Ensembles are its stand-in)."
)
