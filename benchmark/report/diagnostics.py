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

BASE_COLUMNS = ["method", "method_label", "mode", "repetitions", "n_samples", "sample_acc_min", "sample_acc_median",
                "sample_acc_max", "ensemble_acc", "ess", "base_acc_min", "base_acc_median", "base_acc_max", "n_bases"]

EXPLANATIONS = {
    "swag": ("SWAG: mean over weights of the snapshots' diagonal variance and of the low-rank variance diag(D D^T)/(K-1); "
             "a draw's variance is scale x their sum."),
    "bnn": ("vBNN: mean sigma/|mu| per parameter tensor (0 = a point mass); with BLiTZ's initialisation (sigma ~ 1e-3) "
            "trained by SGD, sigma barely leaves its start (methods.bnn.variance lets it learn). kl_weight: the weight of "
            "the KL term in the per-example loss; kl_weight_times_n: that weight times the training split's size "
            "(1 = the exact ELBO, the paper's recipe; below 1 a tempered posterior)."),
    "laplace": ("Laplace: optimised prior precision; GGN eigen-directions below it (near-flat: the posterior variance "
                "there is the prior's, 1/precision); test accuracy of laplace-torch's GLM predictive (probit), of the "
                "sampled predictive (100 draws) and of one draw. A sampled predictive far below the GLM one means the "
                "weight samples are broader than the linearised model assumes."),
    "sghmc": ("SGHMC: kinetic temperature mean(m^2)/T of the sampling segment (1 = at the configured temperature), "
              "fraction of coordinates where the minibatch gradient noise alone exceeded the target (there the chain "
              "runs hot), that noise as a share of the target, and the effective sample size of the kept states "
              "(median over weights; ess as the sampler measured it). chains: independent chains from the base, "
              "states_per_chain: kept states of each, full_batch: 1 for full-batch gradients (no minibatch noise), "
              "spread_growth: the chains' spread at the first kept states over their spread half-way there (about 1: "
              "settled; about 2: still spreading from the base, as free diffusion does)."),
    "sghmc_sa": ("SGHMC (scale-adapted), the paper's code base: steps of the one chain, fraction of steps whose gradient "
                 "the dynamic clipping cut, the mean prior standard deviation 1/sqrt(lambda) over parameter tensors at "
                 "the end (the Gamma hyperprior's draws), and the effective sample size of its 100 consecutive kept "
                 "states (median over weights)."),
}


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
        known = [a for a in bases if not math.isnan(a)]
        row |= {"n_bases": len(bases), "base_acc_min": min(known, default=math.nan),
                "base_acc_median": float(np.median(known)) if known else math.nan, "base_acc_max": max(known, default=math.nan)}
        rows.append(row)
    frame = pd.DataFrame(rows)
    extra = sorted(c for c in frame.columns if c not in BASE_COLUMNS)
    return frame.reindex(columns=BASE_COLUMNS + extra)


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
             "effective sample size of the kept states of the Markov-chain methods (as the sampler measured it: median over weights, "
             "mean over repetitions, the ess column of metrics.csv); base networks: the test accuracy of the held-out zoo "
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
    for method, explanation in EXPLANATIONS.items():
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


def write(exp: Experiment, out_dir: Path) -> list[Path]:
    """Write ``diagnostics.csv`` and ``diagnostics.md`` into ``out_dir``; return their paths."""
    frame = collect(exp)
    paths = [out_dir / "diagnostics.csv", out_dir / "diagnostics.md"]
    atomic_write_text(paths[0], frame.to_csv(index=False, float_format="%.6g"))
    atomic_write_text(paths[1], render(frame, exp.display_name))
    return paths
