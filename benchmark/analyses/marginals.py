"""``analysis=marginals``: appendix D.3 and D.1 — per layer, the marginal distribution of the
weights, raw and symmetry-free (the NS MMD column's form), of the reference zoo and of every
method's samples (first repetition of each method and mode), with two-sample Kolmogorov-Smirnov
statistics and p-values (``metrics.marginals``); the zoo's own check of the paper's corollary
that, raw, every unit of a layer has the same marginal (unit 0 against the next units), which
removing the symmetries breaks; and the D.1 estimate of the number of modes the permutations
make of each zoo network (``metrics.symmetries.modes``: grouped convolutions counted with and
without moving whole blocks).

Memory: the work goes layer by layer and method by method. A zoo too large for
``evaluate.max_in_memory_gb`` (ResNet-18: 45 MB per checkpoint) is read one layer at a time in
column blocks, never whole; a method's sample set and its NS form are in memory one method at a
time (as in the evaluate stage). Of each layer (pooled over the networks) the histograms and KS
tests use at most ``analyze.marginals.max_values`` entries, a fixed uniform subsample drawn from
``analyze.marginals.seed`` and the layer's position (the same positions for the raw and the NS
form); the CSVs give how many entries were used out of how many. The figures show at most
``analyze.marginals.max_layers_shown`` layers, evenly spaced from the first to the last, and the
CSVs every layer.

The KS test assumes independent values; the entries of one network are not, so the p-values
describe rather than test (the statistic D, the largest gap between the two empirical CDFs,
is the number to compare).
"""
from __future__ import annotations

import itertools
import logging
import math
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from benchmark.core.figures import COLUMN_WIDTH, PALETTE, legend_layout, new_figure, save_figure, style
from benchmark.analyses.inputs import figures_dir, first_repetition, reference, require_reference, require_samples
from benchmark.inventory import require_inputs
from benchmark.experiment import Experiment
from benchmark.core.settings import require
from benchmark.core.store import iter_layer_column_chunks, load_checkpoints_as_sample_set
from methods import method_class, method_names
from metrics.marginals import gather, ks_test, subsample_indices
from metrics.symmetries import canonicalize, log10_permutation_modes, spec_for_model

log = logging.getLogger(__name__)

NAME = "marginals"
ORDER = 50  # its place in analysis=all and the tables of analyses: the paper order
TITLE = "Appendix D.3: marginal weight distributions per layer, zoo vs methods, raw and symmetry-free"
FORMS = ("raw", "NS")
BLOCK_VALUES = 2**24
"""Entries of one column block read from a streamed zoo (64 MB of float32)."""


@dataclass
class Settings:
    """``analysis=marginals`` (appendix D.1, D.3): ``bins`` of the marginal histograms;
    ``max_values``: the most entries of one layer (pooled over the networks) that its histograms
    and KS tests use, a fixed uniform subsample drawn from ``seed`` when the layer has more (the
    default exceeds every OptuNet layer of a 1000-network zoo, 250,000 entries at most, so only
    ResNet-18 layers are subsampled); ``max_units``: the zoo's unit-vs-unit check compares unit 0
    with the next ``max_units`` units of each layer; ``max_layers_shown``: the figures show at
    most this many layers, evenly spaced from the first to the last (the CSVs keep every layer)."""

    bins: int = 40
    max_values: int = 500000
    seed: int = 0
    max_units: int = 16
    max_layers_shown: int = 6

    def __post_init__(self) -> None:
        require(self.bins >= 2, "bins", self.bins, "an integer >= 2")
        require(self.max_values >= 2, "max_values", self.max_values, "an integer >= 2")
        require(self.max_units >= 1, "max_units", self.max_units, "a positive integer")
        require(self.max_layers_shown >= 1, "max_layers_shown", self.max_layers_shown, "a positive integer")


def applies(exp: Experiment) -> None:
    """Applies to every model."""


def needs(exp: Experiment) -> frozenset[str]:
    return frozenset({"reference", "samples"})


def check(exp: Experiment, made: frozenset[str] = frozenset()) -> None:
    """Needs the reference zoo and at least one method's samples (unless earlier stages of this run make them)."""
    require_inputs(exp, needs(exp) - made, f"analysis={NAME}")


def _label(method: str, mode: str) -> str:
    label = method_class(method).label if method in method_names() else method
    return f"{label} [{mode}]"


def shown_layers(keys: list[str], most: int) -> list[str]:
    """At most ``most`` of ``keys``, evenly spaced from the first to the last, in order."""
    if len(keys) <= most:
        return list(keys)
    return [keys[i] for i in sorted({round(x) for x in np.linspace(0, len(keys) - 1, most)})]


class ZooLayers:
    """The reference zoo's layers, raw and NS, as column blocks ``[R, d]``: from memory when the
    zoo fits in ``evaluate.max_in_memory_gb``, else streamed from its checkpoint files (the NS
    form from the evaluate stage's canonical checkpoints) one block at a time."""

    def __init__(self, exp: Experiment) -> None:
        ref = reference(exp)
        self.count = len(ref.seeds)
        if ref.in_memory:
            self.forms = {"raw": ref.weights(), "NS": ref.canonical()}
            self.paths = None
        else:
            self.forms = None
            self.paths = {"raw": ref.checked_paths(), "NS": ref.canonical_paths()}

    def blocks(self, form: str, key: str) -> Iterator[torch.Tensor]:
        """Tensor ``key`` of every zoo network as column blocks ``[R, d_i]`` (all of its columns)."""
        if self.forms is not None:
            yield self.forms[form][key].reshape(self.count, -1)
        else:
            yield from iter_layer_column_chunks(self.paths[form], key, max(1, BLOCK_VALUES // self.count))

    def units(self, form: str, key: str, count: int, per_unit: int) -> Iterator[torch.Tensor]:
        """The ``per_unit`` incoming weights of units ``0 .. count - 1`` of tensor ``key`` (its
        first axis), one block ``[R, per_unit]`` per unit."""
        if self.forms is not None:
            for unit in range(count):
                yield self.forms[form][key][:, unit].reshape(self.count, -1)
            return
        yield from itertools.islice(iter_layer_column_chunks(self.paths[form], key, per_unit), count)


class Layers:
    """The layers the marginals compare (the weights of the symmetry spec's ``mass_keys``), their
    entry counts, and the fixed subsample of a layer's entries that its histograms and KS tests use."""

    def __init__(self, exp: Experiment) -> None:
        self.settings = exp.config.analyze.marginals
        self.spec = spec_for_model(exp.model())
        self.steps = [s.value for s in exp.config.evaluate.canonical_steps]
        self.keys = list(self.spec.mass_keys)
        shapes = exp.shapes()
        self.entries = {key: math.prod(shapes[key]) for key in self.keys}

    def values(self, blocks, samples: int, key: str) -> np.ndarray:
        """The subsampled entries of layer ``key`` of ``samples`` networks given as column blocks: the
        same positions for every source of one size (seeded by the layer's position alone)."""
        indices = subsample_indices(samples, self.entries[key], self.settings.max_values,
                                    (self.settings.seed, self.keys.index(key)))
        return gather(blocks, indices)


def run(exp: Experiment) -> list[Path]:
    """KS statistics zoo vs each method per layer and form, the zoo's unit-vs-unit check, the mode
    count, and the two figures (marginals, KS heatmap)."""
    require_reference(exp, NAME)
    rows = require_samples(exp, NAME)
    layers = Layers(exp)
    settings, spec, steps, keys, entries, values = (layers.settings, layers.spec, layers.steps, layers.keys,
                                                    layers.entries, layers.values)
    zoo = ZooLayers(exp)

    zoo_values, edges, histograms = {}, {}, []
    for form in FORMS:
        for key in tqdm(keys, desc=f"{NAME}: zoo, {form}", unit="layer", dynamic_ncols=True, disable=len(keys) < 8):
            zoo_values[(form, key)] = values(zoo.blocks(form, key), zoo.count, key).astype(np.float32)
            edges[(form, key)] = bin_edges(zoo_values[(form, key)], settings.bins)
            histograms.append(histogram("zoo", key, form, zoo_values[(form, key)], edges[(form, key)],
                                        zoo.count * entries[key]))
    tests = []
    for method, mode in tqdm(rows, desc=f"{NAME}: methods", unit="row", dynamic_ncols=True):
        raw = first_repetition(exp, method, mode)
        count = int(next(iter(raw.values())).shape[0])
        forms = {"raw": {key: values([raw[key].reshape(count, -1)], count, key) for key in keys}}
        canonical = canonicalize(raw, spec, steps, device=exp.device)[0]
        del raw
        forms["NS"] = {key: values([canonical[key].reshape(count, -1)], count, key) for key in keys}
        del canonical
        for form in FORMS:
            for key in keys:
                theirs = forms[form][key]
                result = ks_test(zoo_values[(form, key)], theirs)
                histograms.append(histogram(_label(method, mode), key, form, theirs, edges[(form, key)],
                                            count * entries[key]))
                tests.append({"method": method, "mode": mode, "label": _label(method, mode), "layer": key, "form": form,
                              "ks_statistic": result.statistic, "ks_pvalue": result.pvalue, "n_zoo": result.n_x,
                              "n_method": result.n_y, "zoo_entries": zoo.count * entries[key],
                              "method_entries": count * entries[key]})
    shown = shown_layers(keys, settings.max_layers_shown)
    subsample = {"max_values": settings.max_values, "subsample_seed": settings.seed}
    numbers = pd.DataFrame(tests).assign(shown=lambda df: df["layer"].isin(shown), **subsample)
    units = unit_tests(exp, zoo, spec, keys).assign(**subsample)
    modes = mode_counts(exp, spec)
    log.info("%s: %d method rows x %d layers (figures: %s); zoo unit-vs-unit KS median D raw %.3f, NS %.3f; log10 "
             "modes per network (median, with block moves) %.1f", NAME, len(rows), len(keys), shown,
             units.loc[units["form"] == "raw", "ks_statistic"].median(),
             units.loc[units["form"] == "NS", "ks_statistic"].median(),
             float(modes.loc[modes["group"] == "total", "log10_modes_median"].iloc[0]))
    frame = pd.concat(histograms, ignore_index=True).assign(shown=lambda df: df["layer"].isin(shown), **subsample)
    written = draw_marginals(exp, frame, [(m, mode) for m, mode in rows], shown, len(keys))
    return written + draw_ks(exp, numbers, shown, len(keys), units, modes)


def bin_edges(values: np.ndarray, bins: int) -> np.ndarray:
    """``bins + 1`` edges over the zoo's 0.5-99.5 percentiles widened by a quarter on each side."""
    low, high = np.percentile(values, [0.5, 99.5])
    pad = 0.25 * (high - low) if high > low else 0.5
    return np.linspace(low - pad, high + pad, bins + 1)


def histogram(source: str, key: str, form: str, values: np.ndarray, edges: np.ndarray, entries: int) -> pd.DataFrame:
    """One histogram's rows for the CSV (densities over ``edges`` of the values inside them, 0 when
    none is; the fraction of the values outside; how many values of how many entries it counts)."""
    counts, _ = np.histogram(values, bins=edges)
    density = counts / (counts.sum() * np.diff(edges)) if counts.sum() else np.zeros(len(counts))
    return pd.DataFrame({"layer": key, "form": form, "source": source, "bin_left": edges[:-1], "bin_right": edges[1:],
                         "density": density, "outside_range": float(np.mean((values < edges[0]) | (values > edges[-1]))),
                         "values_used": len(values), "entries": entries})


def unit_tests(exp: Experiment, zoo: ZooLayers, spec, keys: list[str]) -> pd.DataFrame:
    """The zoo's unit 0 against each of the next ``max_units`` units of every unit group's layer
    (its sort key), raw and NS: KS on each unit's incoming weights over the zoo (subsampled as the
    layers are, seeded by the layer's and the unit's positions)."""
    settings = exp.config.analyze.marginals
    out = []
    for group in spec.groups:
        if group.sort_key not in keys or group.size < 2:
            continue
        per_unit = math.prod(exp.shapes()[group.sort_key][1:])
        count = min(group.size, settings.max_units + 1)
        for form in FORMS:
            picked = []
            for unit, block in enumerate(zoo.units(form, group.sort_key, count, per_unit)):
                indices = subsample_indices(zoo.count, per_unit, settings.max_values,
                                            (settings.seed, keys.index(group.sort_key), 1 + unit))
                picked.append(gather([block], indices))
            for unit in range(1, count):
                result = ks_test(picked[0], picked[unit])
                out.append({"layer": group.sort_key, "form": form, "unit_a": 0, "unit_b": unit,
                            "ks_statistic": result.statistic, "ks_pvalue": result.pvalue, "n": result.n_x,
                            "entries": zoo.count * per_unit, "units_in_layer": group.size})
    return pd.DataFrame(out, columns=["layer", "form", "unit_a", "unit_b", "ks_statistic", "ks_pvalue", "n", "entries",
                                      "units_in_layer"])


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


def _layers_text(shown: list[str], total: int) -> str:
    return "" if len(shown) == total else f"\n({len(shown)} of {total} layers, all in the CSV)"


def draw_marginals(exp, frame: pd.DataFrame, rows: list[tuple[str, str]], shown: list[str], total: int) -> list[Path]:
    """Figure: per shown layer (rows) and form (columns) the zoo's marginal (grey) and each
    method's (lines; solid one-mode, dashed multi-mode), drawn from the histograms of ``frame``,
    which the CSV keeps for every layer."""
    colors = {method: PALETTE[i % len(PALETTE)] for i, method in enumerate(dict.fromkeys(m for m, _ in rows))}
    lines = [(_label(method, mode), colors[method], "-" if mode == "one" else "--") for method, mode in rows]
    return draw_histograms(exp, frame, lines, shown, total, NAME,
                           f"Marginal weight distributions per layer ({exp.display_name})")


def draw_histograms(exp, frame: pd.DataFrame, lines: list[tuple[str, str, str]], shown: list[str], total: int,
                    name: str, title: str) -> list[Path]:
    """Figure ``name``: per shown layer (rows) and form (columns) the zoo's histogram (grey) and one
    line per ``(source, colour, line style)`` of ``lines``, drawn from the histograms of ``frame``
    (``histogram``'s rows: the CSV keeps every layer); ``title`` above (wrapped)."""
    columns, legend_height = legend_layout(["zoo", *(source for source, _, _ in lines)])
    with style():
        figure = new_figure(1.05 * len(shown) + 0.35 + legend_height, COLUMN_WIDTH)
        axes = figure.subplots(len(shown), 2, squeeze=False)
        for row, key in enumerate(shown):
            for col, form in enumerate(FORMS):
                ax = axes[row, col]
                part = frame[(frame["layer"] == key) & (frame["form"] == form)]
                zoo = part[part["source"] == "zoo"]
                edges = np.append(zoo["bin_left"].to_numpy(), zoo["bin_right"].iloc[-1])
                ax.stairs(zoo["density"].to_numpy(), edges, fill=True, color="#bbbbbb", label="zoo")
                for source, color, style_ in lines:
                    theirs = part[part["source"] == source]
                    ax.stairs(theirs["density"].to_numpy(), edges, color=color, linestyle=style_, linewidth=0.7,
                              label=source)
                ax.set_xlim(edges[0], edges[-1])
                ax.set_title(f"{key}, {form}", fontsize=7)
                ax.set_yticks([])
                if row == len(shown) - 1:
                    ax.set_xlabel("weight value")
            axes[row, 0].set_ylabel("density")
        handles, labels = axes[0, 0].get_legend_handles_labels()
        figure.legend(handles, labels, loc="outside lower center", ncol=columns)
        # 60 characters fit the column width at the title's font size (Digits - OptuNet's title is 58).
        figure.suptitle("\n".join(textwrap.wrap(title, 60)) + _layers_text(shown, total))
        return save_figure(figure, figures_dir(exp), name, frame)


def draw_ks(exp, numbers: pd.DataFrame, shown: list[str], total: int, units: pd.DataFrame,
            modes: pd.DataFrame) -> list[Path]:
    """Figure: heatmap of the KS statistic D, zoo vs each method row, per shown layer and form; its
    CSV has every test of every layer, with the zoo's unit-vs-unit tests and the mode counts beside it."""
    labels = list(dict.fromkeys(numbers["label"]))
    grid = numbers.set_index(["label", "form", "layer"])["ks_statistic"]
    with style():
        figure = new_figure(2 * (0.2 * len(labels) + 0.45) + 0.9, COLUMN_WIDTH)
        axes = figure.subplots(2, 1, sharex=True)
        for ax, form in zip(axes, FORMS):
            values = np.array([[grid[(label, form, key)] for key in shown] for label in labels])
            image = ax.imshow(values, vmin=0, vmax=1, cmap="viridis", aspect="auto")
            for i in range(values.shape[0]):
                for j in range(values.shape[1]):
                    ax.text(j, i, f"{values[i, j]:.2f}", ha="center", va="center",
                            color="white" if values[i, j] < 0.6 else "black")
            ax.set_yticks(range(len(labels)), labels)
            ax.set_title("raw weights" if form == "raw" else "symmetry-free (NS) weights")
            ax.spines[:].set_visible(False)
        axes[1].set_xticks(range(len(shown)), [key.removesuffix(".weight") for key in shown],
                           rotation=30 if len(shown) > 4 else 0, ha="right" if len(shown) > 4 else "center")
        axes[1].set_xlabel(f"layer{_layers_text(shown, total)}")
        figure.colorbar(image, ax=list(axes), orientation="horizontal", location="bottom", shrink=0.8,
                        label="KS statistic D (zoo vs method)")
        return save_figure(figure, figures_dir(exp), f"{NAME}_ks", numbers, {"units": units, "modes": modes})


CAPTION = (
    "Marginal distribution of each layer's weights (pooled over units and networks): the reference zoo (grey) and "
    "every method's samples (first repetition; solid one-mode, dashed multi-mode), raw and in the symmetry-free form "
    "of the NS MMD column; the x-range is the zoo's 0.5-99.5 percentiles widened by a quarter (marginals.csv: the "
    "densities and the fraction of values outside). marginals_ks: the two-sample KS statistic D between the zoo's "
    "and each method's marginal (p-values in marginals_ks.csv; entries of one network are not independent, so they "
    "describe rather than test). Histograms and KS use at most analyze.marginals.max_values entries of a layer "
    "(default 500,000: every OptuNet layer whole; ResNet-18 layers subsampled), a fixed uniform subsample seeded by "
    "analyze.marginals.seed (the CSVs: values_used / n_zoo / n_method out of entries / zoo_entries / method_entries). "
    "The figures show at most analyze.marginals.max_layers_shown layers (default 6), evenly spaced from the first "
    "to the last and named on the panels; the CSVs have every layer (column shown). marginals_ks_units.csv: the "
    "zoo's unit 0 vs each of the next analyze.marginals.max_units units of a layer (raw: one marginal for all "
    "units; NS: not). marginals_ks_modes.csv: log10 of the number of modes the permutations make of each zoo "
    "network (appendix D.1), grouped convolutions counted with and without whole-block moves."
)
