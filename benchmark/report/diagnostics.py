"""``results/<experiment>/diagnostics.{md,csv}``: per method and mode, the numbers that explain
its row of Table 1: the spread of its samples' accuracies, and each method's own diagnostics
(``PosteriorMethod.diagnostics``, recorded by the sample stage, mean over bases and repetitions):
SWAG's diagonal and low-rank variances, the vBNN's sigma/|mu| per layer, Laplace's prior
precision, near-flat GGN directions and GLM vs sampled accuracy, SGHMC's temperature and
effective sample size."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from benchmark.core.store import CheckpointMetadata, SampleSetMetadata, atomic_write_text, load_sample_set, read_metadata
from benchmark.experiment import Experiment
from benchmark.inventory import available_rows, row_units
from benchmark.results import layers_path, metrics_path, read_layers, read_metrics, rows_against
from methods import method_class, method_names
from metrics.mcmc import chain_ess, split_rhat

CHAIN_COORDINATES = 2_000  # weights (a fixed random subset of larger models) behind the chain figures
CHAIN_TEXT = (
    "Chain figures of the Markov-chain rows, from the first repetition's stored samples read as their "
    "chains (storage order plays no part): chain_ess_total, the median over weights of the sum over chains of "
    "each chain's bulk ESS (ArviZ; with few draws per chain it overstates correlated chains: 55 where the ESS of the "
    "mean is 11 for AR(1) chains at rho 0.97, 10 x 10 draws); chain_ess_of_mean, the ESS of the mean from the chain "
    "means (independent chains; holds at any chain length); chain_ess_min_chain, the smallest chain's ArviZ ESS; "
    "chain_split_rhat_test_loglik, the split R-hat of the test log-likelihood of the kept states over every "
    "chain's two halves (about 1: settled; above 1.05: some chain still drifts or the chains disagree); "
    "chains and draws_per_chain, the layout read. NaN below 4 states per chain.")

BASE_COLUMNS = ["method", "method_label", "mode", "repetitions", "n_samples", "sample_acc_min", "sample_acc_median",
                "sample_acc_max", "ensemble_acc", "ess", "base_acc_min", "base_acc_median", "base_acc_max", "n_bases"]

def diagnostics_notes() -> list[tuple[str, str]]:
    """``(method, what its diagnostics columns mean)`` of every registered method that explains them
    (``PosteriorMethod.diagnostics_note``), in table row order: the sections of diagnostics.md."""
    return [(name, method_class(name).diagnostics_note) for name in method_names()
            if method_class(name).diagnostics_note is not None]


def is_chain(method: str) -> bool:
    """Whether ``method``'s samples are Markov-chain states (its class's ``markov_chain``; the rows of
    an external sample set, no)."""
    return method in method_names() and method_class(method).markov_chain


def collect(exp: Experiment) -> pd.DataFrame:
    """One row per (method, mode) in the store: ``BASE_COLUMNS`` then the method's diagnostics."""
    labels = exp.test_tensors[1].numpy()
    rows = []
    for method, mode in available_rows(exp):
        units = row_units(exp, method, mode)  # the repetitions the config asks for, as evaluate averages them
        preds = load_sample_set(exp.store.preds_path(units[0]), ["id"])["id"].numpy()
        per_sample = (preds.argmax(-1) == labels[None]).mean(1)
        row = {"method": method, "mode": mode, "repetitions": len(units), "n_samples": len(per_sample),
               "sample_acc_min": per_sample.min(), "sample_acc_median": float(np.median(per_sample)),
               "sample_acc_max": per_sample.max(), "ensemble_acc": float((preds.mean(0).argmax(-1) == labels).mean())}
        diagnostics: dict[str, list[float]] = {}
        bases: list[float] = []
        for unit in units:
            meta = SampleSetMetadata.decode(read_metadata(exp.store.samples_path(unit)))
            row["method_label"] = meta.label or method
            bases += [base_accuracy(exp, seed) for seed in meta.base_seeds or []]
            for key, value in (meta.diagnostics or {}).items():
                diagnostics.setdefault(key, []).append(float(value))
        # The mean of the repetitions that recorded a number (as metrics.csv's ess): NaN only when none did.
        row |= {key: float(np.mean(known)) if (known := [v for v in values if not math.isnan(v)]) else math.nan
                for key, values in diagnostics.items()}
        if is_chain(method):
            row |= chain_figures(exp, units[0], method, preds, labels)
        known = [a for a in bases if not math.isnan(a)]
        row |= {"n_bases": len(bases), "base_acc_min": min(known, default=math.nan),
                "base_acc_median": float(np.median(known)) if known else math.nan, "base_acc_max": max(known, default=math.nan)}
        rows.append(row)
    frame = pd.DataFrame(rows)
    extra = sorted(c for c in frame.columns if c not in BASE_COLUMNS)
    return frame.reindex(columns=BASE_COLUMNS + extra)


def chain_figures(exp: Experiment, unit, method: str, preds: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """The chain figures of ``CHAIN_TEXT`` for ``unit``'s samples and their test predictions
    ``preds [n, N, C]`` (labels ``[N]``); empty when the layout is unknown."""
    path = exp.store.samples_path(unit)
    layout = method_class(method).chain_layout(SampleSetMetadata.decode(read_metadata(path)), len(preds))
    if layout is None:
        return {}
    chains, per = layout
    samples = load_sample_set(path)
    flat = np.concatenate([v.reshape(len(v), -1).double().numpy() for v in samples.values() if v.is_floating_point()], 1)
    flat = flat[: chains * per]
    if flat.shape[1] > CHAIN_COORDINATES:
        keep = np.sort(np.random.default_rng(0).permutation(flat.shape[1])[:CHAIN_COORDINATES])
        flat = flat[:, keep]
    flat = flat[:, flat.std(0) > 0]
    picked = np.take_along_axis(preds[: chains * per], labels[None, :, None], axis=2)[..., 0]
    loglik = np.log(np.clip(picked, 1e-30, None)).mean(1).reshape(chains, per)
    ess = (chain_ess(flat.reshape(chains, per, -1)) if flat.shape[1]
           else {"total": math.nan, "chain_min": math.nan, "of_mean": math.nan})
    return {"chains": float(chains), "draws_per_chain": float(per), "chain_ess_total": ess["total"],
            "chain_ess_of_mean": ess["of_mean"],
            "chain_ess_min_chain": ess["chain_min"], "chain_split_rhat_test_loglik": split_rhat(loglik)}


def base_accuracy(exp: Experiment, seed: int) -> float:
    """Test accuracy (fraction) of held-out zoo checkpoint ``seed`` as its metadata record it; NaN
    when the checkpoint is gone or does not say (imports without evaluation)."""
    path = exp.store.checkpoint_path(seed)
    if not path.is_file():
        return math.nan
    return float(CheckpointMetadata.decode(read_metadata(path)).test_accuracy)


def render(frame: pd.DataFrame, experiment: str) -> str:
    """Markdown: the samples' accuracy spread for every row, then each method's diagnostics."""
    lines = [f"# Diagnostics of {experiment}", "",
             "Accuracy (%) on the ID test set of each weight sample (first repetition), and of their ensemble; ESS: "
             "effective sample size of the kept states of the Markov-chain methods as the sampler measured it (SGHMC: chains as "
             "chains, the ESS of the mean from its chain means, median over weights; the scale-adapted SGHMC: ArviZ's on its one chain; "
             "mean over repetitions, the ess column of metrics.csv; the per-chain figures are in the Markov-chains section); base networks: the test accuracy of the held-out zoo "
             "networks of the row's base seeds over all repetitions (the networks SWAG, Laplace and SGHMC start from; "
             "MC Dropout and the vBNNs train their own networks under those seeds, the scale-adapted SGHMC starts its chain "
             "from the initialisation under the first; for Deep Ensembles, the "
             "members).", ""]
    table = pd.DataFrame({
        "Method": frame["method_label"], "Mode": frame["mode"],
        "Samples": frame["n_samples"].map("{:.0f}".format),
        "Per-sample acc. min / median / max": [
            f"{a * 100:.1f} / {b * 100:.1f} / {c * 100:.1f}"
            for a, b, c in zip(frame["sample_acc_min"], frame["sample_acc_median"], frame["sample_acc_max"])],
        "Ensemble acc.": (frame["ensemble_acc"] * 100).map("{:.1f}".format),
        "ESS": frame["ess"].map(lambda v: "" if np.isnan(v) else f"{v:.0f}"),
        "Base networks: n, acc. min / median / max": [
            f"{n:.0f}: {a * 100:.1f} / {b * 100:.1f} / {c * 100:.1f}" if n and not np.isnan(b) else ""
            for n, a, b, c in zip(frame["n_bases"], frame["base_acc_min"], frame["base_acc_median"], frame["base_acc_max"])],
    })
    lines += [table.to_markdown(index=False), ""]
    chain_rows = frame[frame["method"].map(is_chain)] if "chain_ess_total" in frame.columns else frame.iloc[:0]
    if not chain_rows.empty:
        columns = ["chains", "draws_per_chain", "chain_ess_total", "chain_ess_of_mean", "chain_ess_min_chain",
                   "chain_split_rhat_test_loglik",
                   *[c for c in ("spread_growth", "split_rhat_loglik", "stationary") if c in frame.columns]]
        body = chain_rows[["method_label", "mode", *columns]].rename(columns={"method_label": "Method", "mode": "Mode"})
        lines += ["## Markov chains", "", CHAIN_TEXT + " spread_growth, split_rhat_loglik (train log-likelihood) and "
                  "stationary (1: split_rhat_loglik below 1.05) are the sampler's own, where it records them.", "",
                  body.to_markdown(index=False, floatfmt=".4g"), ""]
    for method, explanation in diagnostics_notes():
        rows = frame[frame["method"] == method]
        if rows.empty:
            continue
        columns = [c for c in frame.columns if c not in BASE_COLUMNS and rows[c].notna().any()]
        if not columns:
            continue
        lines += [f"## {rows['method_label'].iloc[0]}", "", explanation, ""]
        body = rows[["mode", *columns]].T.reset_index()
        body.columns = ["", *rows["mode"]]
        lines += [body.iloc[1:].to_markdown(index=False, floatfmt=".4g"), ""]
    return "\n".join(lines)


PER_LAYER_TEXT = (
    "Per layer, first repetition, against the zoo: the MMD (median over the 20 kernels) and the energy coefficient "
    "(Energy), x100, of every one-mode row and every baseline; the row's MMD and Energy in Table 1 are these "
    "weighted by the layers' parameter counts (in the header). A layer where a one-mode row sits near the "
    "Copies of the base row is one where its samples barely leave their base."
)


def per_layer_section(layers: pd.DataFrame, metrics: pd.DataFrame) -> list[str]:
    """Markdown lines: for the raw and the symmetry-free form, one table of the one-mode and
    baseline rows (``layers``: layers.csv's rows against the zoo; labels from ``metrics``) with a
    column per layer, ``MMD / Energy`` x100; empty when there are none."""
    picked = layers[layers["mode"].isin(["one", "baseline"])]
    if picked.empty:
        return []
    labels = {(r.method, r.mode): r.method_label for r in metrics.itertuples()}
    lines = ["## Per layer: one-mode rows and baselines", "", PER_LAYER_TEXT, ""]
    for form, title in (("mmd", "Raw weights"), ("ns_mmd", "Symmetries removed (NS)")):
        rows = picked[picked["form"] == form]
        if rows.empty:
            continue
        order = list(dict.fromkeys(rows["layer"]))
        params = rows.drop_duplicates("layer").set_index("layer")["n_params"]
        body = []
        for (method, mode), group in rows.groupby(["method", "mode"], sort=False):
            cells = group.set_index("layer")
            body.append({"Method": labels.get((method, mode), method), "Mode": mode,
                         **{f"{layer} ({int(params[layer])})": f"{100 * cells.at[layer, 'median']:.1f} / "
                            f"{100 * cells.at[layer, 'energy']:.1f}" if layer in cells.index else "" for layer in order}})
        lines += [f"### {title}: MMD / Energy per layer (parameters)", "", pd.DataFrame(body).to_markdown(index=False), ""]
    return lines


def write(exp: Experiment, out_dir: Path) -> list[Path]:
    """Write ``diagnostics.csv`` and ``diagnostics.md`` into ``out_dir`` (with the per-layer tables
    of ``layers.csv`` when the evaluate stage wrote it there); return their paths."""
    frame = collect(exp)
    paths = [out_dir / "diagnostics.csv", out_dir / "diagnostics.md"]
    atomic_write_text(paths[0], frame.to_csv(index=False, float_format="%.6g"))
    text = render(frame, exp.display_name)
    if layers_path(out_dir).is_file() and metrics_path(out_dir).is_file():
        layers = rows_against(read_layers(layers_path(out_dir)), "zoo")
        text += "\n" + "\n".join(per_layer_section(layers, rows_against(read_metrics(metrics_path(out_dir)), "zoo")))
    atomic_write_text(paths[1], text)
    return paths
