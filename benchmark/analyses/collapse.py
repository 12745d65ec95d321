"""``analysis=collapse``: the paper's Figure 3 (section 5.1, appendix D.2) — the mutual
information between pairs of independently trained zoo members, on the ID test set and on
the OOD set, their distributions, and the Pearson correlation between a pair's ID and OOD MI.

Pairwise MI of members i, j: the mean over inputs of ``H((p_i + p_j) / 2) - (H(p_i) + H(p_j)) / 2``
(nats; ``metrics.collapse``). Pairs: all pairs among the first ``analyze.collapse.members``
converged reference checkpoints when there are at most ``analyze.collapse.max_pairs`` of them,
else that many pairs drawn uniformly without replacement (the figure and CSV say how many).
Pairs sharing a member are not independent, so the p-value of the correlation is optimistic
(as in the paper, which does not correct for it).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import numpy as np
import pandas as pd
import torch
from scipy import stats

from benchmark.core.figures import PALETTE, new_figure, save_figure, style
from benchmark.analyses.inputs import figures_dir, reference, require_reference
from benchmark.inventory import require_inputs
from benchmark.experiment import Experiment
from benchmark.core.models import predict_with_weights
from benchmark.core.settings import require
from benchmark.core.store import iter_checkpoint_batches
from metrics.collapse import pairs_to_use, pairwise_mutual_information

log = logging.getLogger(__name__)

NAME = "collapse"
ORDER = 30  # its place in analysis=all and the tables of analyses: the paper order
TITLE = "Figure 3: pairwise mutual information between zoo members, ID vs OOD"


@dataclass
class Settings:
    """``analysis=collapse`` (Figure 3): pairwise mutual information among the first ``members``
    converged reference checkpoints (null = all), on at most ``max_pairs`` pairs (all pairs when
    there are fewer; else a uniform draw without replacement, seeded by ``seed``)."""

    members: Optional[int] = None
    max_pairs: int = 50000
    seed: int = 0

    def __post_init__(self) -> None:
        require(self.members is None or self.members >= 2, "members", self.members, "an integer >= 2 or null (= all)")
        require(self.max_pairs >= 1, "max_pairs", self.max_pairs, "a positive integer")


def applies(exp: Experiment) -> None:
    """Applies to every model."""


def needs(exp: Experiment) -> frozenset[str]:
    return frozenset({"reference"})


def check(exp: Experiment, made: frozenset[str] = frozenset()) -> None:
    """Needs the reference zoo (unless an earlier stage of this run trains it) and the ID and OOD data."""
    exp.check_data()
    require_inputs(exp, needs(exp) - made, f"analysis={NAME}")


def member_probabilities(exp: Experiment, seeds: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each member's softmax probabilities on the ID test set and the OOD set: ``([K, N, C],
    [K, M, C])`` float32 (zoos larger than ``evaluate.max_in_memory_gb`` are read in batches)."""
    ref = reference(exp)
    model = ref.model
    images = (exp.test_tensors[0], exp.ood_tensors[0])
    if ref.in_memory:
        zoo = ref.weights()
        index = torch.tensor([ref.seeds.index(s) for s in seeds], device="cpu")
        batches = [{k: v[index] for k, v in zoo.items()}]
    else:  # the zoo's files validated whole first (checksums, shapes, finite values, experiment and seed)
        checked = dict(zip(ref.seeds, ref.checked_paths()))
        batches = iter_checkpoint_batches([checked[s] for s in seeds], ref.batch, validated=True)
    parts = [(predict_with_weights(model, b, images[0]), predict_with_weights(model, b, images[1])) for b in batches]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def run(exp: Experiment) -> list[Path]:
    """Pairwise MI on ID and OOD data, their histograms, and their correlation."""
    settings = exp.config.analyze.collapse
    seeds = require_reference(exp, NAME)
    seeds = seeds[: settings.members] if settings.members else seeds
    probs_id, probs_ood = member_probabilities(exp, seeds)
    pairs = pairs_to_use(len(seeds), settings.max_pairs, np.random.default_rng(settings.seed))
    id_mi, ood_mi = pairwise_mutual_information(probs_id, pairs), pairwise_mutual_information(probs_ood, pairs)
    if len(pairs) >= 3:
        correlation = stats.pearsonr(id_mi, ood_mi)
    else:  # a correlation of two points means nothing: reported as NaN
        log.warning("collapse: %d pair(s) of zoo members; Pearson's correlation needs 3 or more (reported as NaN)",
                    len(pairs))
        correlation = SimpleNamespace(statistic=float("nan"), pvalue=float("nan"))
    total = len(seeds) * (len(seeds) - 1) // 2
    names = np.asarray(seeds)
    numbers = pd.DataFrame({"seed_i": names[pairs[:, 0]], "seed_j": names[pairs[:, 1]], "id_mi": id_mi, "ood_mi": ood_mi})
    summary = pd.DataFrame([{
        "members": len(seeds), "pairs": len(pairs), "all_pairs": total, "id_inputs": probs_id.shape[1],
        "ood_inputs": probs_ood.shape[1], "id_mi_mean": id_mi.mean(), "id_mi_sd": id_mi.std(ddof=1),
        "ood_mi_mean": ood_mi.mean(), "ood_mi_sd": ood_mi.std(ddof=1), "pearson_r": correlation.statistic,
        "pearson_p": correlation.pvalue,
        "note": "MI in nats; pairs sharing a member are not independent, so the p-value is optimistic",
    }])
    log.info("collapse: %d members, %d of %d pairs; mean MI ID %.4f, OOD %.4f nats; Pearson r %.3f (p %.2g)",
             len(seeds), len(pairs), total, id_mi.mean(), ood_mi.mean(), correlation.statistic, correlation.pvalue)
    dataset, ood = exp.info.name, exp.config.dataset.ood.value
    with style():
        figure = new_figure(3.3)
        axes = figure.subplot_mosaic([["id", "ood"], ["joint", "joint"]], height_ratios=[1, 1.3])
        for key, values, label, color in (("id", id_mi, f"ID ({dataset})", PALETTE[0]), ("ood", ood_mi, f"OOD ({ood})", PALETTE[1])):
            axes[key].hist(values, bins=40, color=color, alpha=0.8)
            axes[key].set_title(label)
            axes[key].set_xlabel("pairwise MI (nats)")
        axes["id"].set_ylabel("pairs")
        joint = axes["joint"]
        joint.scatter(id_mi, ood_mi, s=1.5, alpha=0.25, color=PALETTE[6], linewidths=0, rasterized=True)
        joint.set_xlabel(f"ID pairwise MI (nats, {dataset})")
        joint.set_ylabel(f"OOD pairwise MI\n(nats, {ood})")  # two lines: "fashionmnist" does not fit one
        joint.set_title(f"Pearson r = {correlation.statistic:.3f} (p = {correlation.pvalue:.2g})")
        shown = f"all {total:,} pairs" if len(pairs) == total else f"{len(pairs):,} random pairs of {total:,}"
        figure.suptitle(f"Pairwise MI of {len(seeds)} zoo members\n({shown})")
        return save_figure(figure, figures_dir(exp), NAME, numbers, {"summary": summary})


CAPTION = (
    "Mutual information between pairs of independently trained zoo members (mean over the inputs of the Jensen-Shannon "
    "divergence of the two predictives, nats) on the ID test set and on the OOD set, and the pairs' ID vs OOD MI "
    "with Pearson's correlation. Pairs sharing a member are not independent: the p-value is optimistic. "
    "collapse_summary.csv has the counts and statistics."
)
