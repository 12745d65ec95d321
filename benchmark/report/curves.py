"""The zoo's training curves: per epoch, the median and the 10-90% band over the reference
zoo's networks of the training loss, the training accuracy and the validation accuracy, the
converged networks apart from those the recipe's rule failed (``figures/zoo_curves.{png,pdf,csv}``).

The numbers are the histories the zoo stage stores with every checkpoint and failure record
(``CheckpointMetadata.history``, the failure record's ``history``): ``loss`` is the epoch's mean
minibatch loss (augmented batches, train mode), ``train_subset_accuracy`` the accuracy on a fixed
evenly spaced subset of the un-augmented training split as large as the validation split
(``benchmark.core.training.curve_subset``), ``check_accuracy`` the accuracy on the validation split
(the data the convergence rule is judged on). A diverged network (NaN/Inf) has no history.
"""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.ticker import MaxNLocator

from benchmark.core.figures import PALETTE, new_figure, outside_canvas, save_figure, style
from benchmark.core.store import CheckpointMetadata, read_metadata
from benchmark.experiment import Experiment
from benchmark.results import figures_dir

log = logging.getLogger(__name__)
NAME = "zoo_curves"
QUANTITIES = {  # history key -> panel label
    "loss": "training loss (nats)",
    "train_subset_accuracy": "training accuracy",
    "check_accuracy": "validation accuracy",
}
GROUPS = ("converged", "failed")
BAND = (10, 90)  # percentiles of the band
TITLE = "Training curves of the reference zoo"
CAPTION = ("Training curves of the reference zoo: per epoch, the median (line) and the 10-90% band over the "
           "networks of the mean minibatch loss, the accuracy on a fixed subset of the un-augmented training "
           "split as large as the validation split, and the validation accuracy; converged networks and those "
           "the recipe's convergence rule failed apart (dashed: the rule's epoch and threshold). "
           "zoo_curves.csv has the numbers and how many networks each epoch holds.")


def histories(exp: Experiment) -> dict[str, list[list[dict]]]:
    """``{"converged": [...], "failed": [...]}``: the stored history (one record per epoch) of each
    network of the reference range that has one, by how its training ended."""
    store, found = exp.store, {group: [] for group in GROUPS}
    for seed in store.completed_seeds():
        if seed in exp.reference:
            history = CheckpointMetadata.decode(read_metadata(store.checkpoint_path(seed))).history
            if history:
                found["converged"].append(history)
    for seed, record in store.failed_seeds().items():
        if seed in exp.reference and record.get("history"):
            found["failed"].append(record["history"])
    return found


def curve_numbers(found: dict[str, list[list[dict]]]) -> pd.DataFrame:
    """One row per group x quantity x epoch: ``networks`` (how many have that epoch), ``median``,
    ``p10`` and ``p90`` over them."""
    rows = []
    for group, runs in found.items():
        for key in QUANTITIES:
            by_epoch: dict[int, list[float]] = {}
            for history in runs:
                for record in history:
                    if key in record:
                        by_epoch.setdefault(int(record["epoch"]), []).append(float(record[key]))
            for epoch in sorted(by_epoch):
                values = np.asarray(by_epoch[epoch])
                low, high = np.percentile(values, BAND)
                rows.append({"group": group, "quantity": key, "epoch": epoch, "networks": len(values),
                             "median": float(np.median(values)), "p10": float(low), "p90": float(high)})
    return pd.DataFrame(rows, columns=["group", "quantity", "epoch", "networks", "median", "p10", "p90"])


def write(exp: Experiment, numbers: pd.DataFrame) -> list[Path]:
    """Draw the figure of ``numbers`` (``curve_numbers(histories(exp))``) into ``results/<experiment>/figures/``;
    nothing (and a log line) when no network of the reference range has a stored history (an
    imported zoo, or one trained before histories were stored)."""
    if numbers.empty:
        log.info("%s: no training histories stored with the reference zoo's checkpoints; no figure", NAME)
        return []
    rule = exp.recipe.fail_rule
    colors = dict(zip(GROUPS, (PALETTE[0], PALETTE[1])))
    with style():
        figure = new_figure(3.6)
        axes = figure.subplots(len(QUANTITIES), 1, sharex=True)
        for ax, (key, label) in zip(axes, QUANTITIES.items()):
            for group in GROUPS:
                part = numbers[(numbers["group"] == group) & (numbers["quantity"] == key)]
                if part.empty:
                    continue
                count = int(numbers.loc[numbers["group"] == group, "networks"].max())  # epoch 1 holds every network
                ax.fill_between(part["epoch"], part["p10"], part["p90"], color=colors[group], alpha=0.25, linewidth=0)
                ax.plot(part["epoch"], part["median"], color=colors[group], marker="o" if len(part) < 4 else None,
                        markersize=2.5, label=f"{group} ({count} network{'s' if count != 1 else ''})")
            if key == "check_accuracy" and rule.active:
                ax.axvline(rule.epoch, color="0.4", linestyle="--", linewidth=0.6)
                ax.axhline(rule.final_threshold, color="0.4", linestyle="--", linewidth=0.6)
            ax.set_ylabel(label)
        axes[0].legend(loc="upper right")
        axes[-1].set_xlabel("epoch")
        axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
        title = figure.suptitle(f"{TITLE}, {exp.display_name}")
        figure.draw_without_rendering()
        if outside_canvas(figure):  # a long experiment name: on a line of its own
            title.set_text(f"{TITLE},\n{exp.display_name}")
        return save_figure(figure, figures_dir(exp.results_dir), NAME, numbers)


def summary_lines(numbers: pd.DataFrame) -> list[str]:
    """zoo.md's paragraph on the curves of ``numbers`` (``curve_numbers(histories(exp))``): the figure's
    link and the converged networks' last-epoch medians, or why there is none."""
    if numbers.empty:
        return ["Training curves: none (no training history is stored with the reference zoo's checkpoints)."]
    done = numbers[numbers["group"] == "converged"]
    medians = []
    for key, label in QUANTITIES.items():
        part = done[done["quantity"] == key]
        if not part.empty:
            last = part.loc[part["epoch"].idxmax()]
            medians.append(f"{label} {last['median']:.3g} (epoch {int(last['epoch'])}, {int(last['networks'])} networks)")
    text = f"Training curves: [figures/{NAME}.png](figures/{NAME}.png) ({CAPTION})"
    return [text + (f" Converged networks' medians at their last epoch: {'; '.join(medians)}." if medians else "")]
