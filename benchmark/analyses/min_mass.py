"""``analysis=min_mass``: the paper's Figure 2 (section 3.6) — over the reference zoo, each
network's mass (sum of squared weights, biases excluded) next to the mass of its minimum-mass
rescaling (same function; ``metrics.symmetries.min_mass``, batched Newton, checked against
cvxpy in the tests), and the largest absolute weight of each layer before and after.

The paper's claim: networks trained with weight decay are not at their minimum mass, and the
minimisation raises the maxima of the small layers without producing extreme values. Only
defined for networks without BatchNorm (a scale absorbed by BatchNorm makes the problem
unbounded): ResNet-18 experiments are not applicable.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.patches import Patch

from benchmark.core.figures import PALETTE, new_figure, save_figure, style
from benchmark.analyses.inputs import NotApplicableError, figures_dir, reference
from benchmark.inventory import require_inputs
from benchmark.experiment import Experiment
from benchmark.core.models import predict_with_weights
from benchmark.core.settings import require
from metrics.symmetries import DegenerateMinMassError, check_min_mass_defined, min_mass, spec_for_model

log = logging.getLogger(__name__)

NAME = "min_mass"
ORDER = 20  # its place in analysis=all and the tables of analyses: the paper order
TITLE = "Figure 2: mass of the zoo's networks and of their minimum-mass rescalings"


@dataclass
class Settings:
    """``analysis=min_mass`` (Figure 2): the minimum-mass rescaling of every reference checkpoint is
    checked to preserve the network's function on the first ``check_images`` test images, to
    ``check_atol`` (largest absolute difference of the logits)."""

    check_images: int = 32
    check_atol: float = 1e-4

    def __post_init__(self) -> None:
        require(self.check_images >= 1, "check_images", self.check_images, "a positive integer")
        require(self.check_atol > 0, "check_atol", self.check_atol, "a positive number")


def applies(exp: Experiment) -> None:
    """Only for models without BatchNorm (``NotApplicableError`` otherwise)."""
    try:
        check_min_mass_defined(spec_for_model(exp.model()))
    except DegenerateMinMassError as err:
        raise NotApplicableError(f"analysis={NAME}: {err}") from None


def needs(exp: Experiment) -> frozenset[str]:
    return frozenset({"reference"})


def check(exp: Experiment, made: frozenset[str] = frozenset()) -> None:
    """Needs the reference zoo (unless an earlier stage of this run trains it) and the test data."""
    exp.check_data()
    require_inputs(exp, needs(exp) - made, f"analysis={NAME}")


def run(exp: Experiment) -> list[Path]:
    """Solve every zoo network's min-mass problem, check the function is unchanged on test
    images, and draw the mass and largest-weight distributions."""
    ref = reference(exp)
    zoo = ref.weights()
    spec = spec_for_model(exp.model())
    rescaled, info = min_mass(zoo, spec)
    before, after = info["mass_before"].numpy(), info["mass_after"].numpy()
    if (after > before * (1 + 1e-9)).any():
        raise RuntimeError(f"min_mass: the optimum is above the starting mass for seeds "
                           f"{[ref.seeds[i] for i in np.flatnonzero(after > before * (1 + 1e-9))][:5]}")
    settings = exp.config.analyze.min_mass
    images = exp.test_tensors[0][: settings.check_images]
    model = exp.model().to(exp.device)
    change = (predict_with_weights(model, zoo, images) - predict_with_weights(model, rescaled, images)).abs().amax(dim=(1, 2))
    if bool((change > settings.check_atol).any()):
        raise RuntimeError(f"min_mass: rescaling changed the predictions of {int((change > settings.check_atol).sum())} network(s) "
                           f"by up to {float(change.max()):.3g}")
    layers = [key.removesuffix(".weight") for key in spec.mass_keys]
    numbers = pd.DataFrame({"seed": ref.seeds, "mass_before": before, "mass_after": after, "max_prob_change": change.numpy()})
    for key, layer in zip(spec.mass_keys, layers):
        numbers[f"max_abs_{layer}_before"] = zoo[key].flatten(1).abs().amax(dim=1).double().numpy()
        numbers[f"max_abs_{layer}_after"] = rescaled[key].flatten(1).abs().amax(dim=1).double().numpy()
    ratio = after / before
    log.info("min_mass: %d networks, mass after / before: median %.3f (min %.3f, max %.3f), iterations %d",
             len(before), np.median(ratio), ratio.min(), ratio.max(), info["iterations"])
    with style():
        figure = new_figure(3.0)
        top, bottom = figure.subplots(2, 1, height_ratios=[1, 1.15])
        edges = np.histogram_bin_edges(np.log10(np.concatenate([before, after])), bins=30)
        for values, label, color in ((before, "trained", PALETTE[0]), (after, "min-mass rescaling", PALETTE[1])):
            top.hist(np.log10(values), bins=edges, color=color, alpha=0.55, label=label)
        top.set_xlabel("log$_{10}$ mass (sum of squared weights, biases excluded)")
        top.set_ylabel("networks")
        top.set_title(f"Mass of {len(before)} zoo networks")
        top.legend(loc="upper left", title=f"median after/before: {np.median(ratio):.2f}", title_fontsize=7)
        positions = np.arange(len(layers))
        for offset, suffix, color in ((-0.18, "before", PALETTE[0]), (0.18, "after", PALETTE[1])):
            data = [numbers[f"max_abs_{layer}_{suffix}"].to_numpy() for layer in layers]
            parts = bottom.boxplot(data, positions=positions + offset, widths=0.3, patch_artist=True, showfliers=False,
                                   medianprops={"color": "black", "linewidth": 0.8}, whiskerprops={"linewidth": 0.6},
                                   capprops={"linewidth": 0.6}, boxprops={"linewidth": 0.6})
            for box in parts["boxes"]:
                box.set_facecolor(color)
                box.set_alpha(0.7)
        bottom.set_xticks(positions, layers)
        bottom.set_xlabel("layer")
        bottom.set_ylabel("largest |weight|")
        bottom.set_ylim(bottom=0)
        bottom.set_title("Largest absolute weight per layer")
        bottom.legend([Patch(color=PALETTE[0], alpha=0.7), Patch(color=PALETTE[1], alpha=0.7)],
                      ["trained", "min-mass rescaling"], loc="lower right", ncol=2)
        return save_figure(figure, figures_dir(exp), NAME, numbers)


CAPTION = (
    "Top: distribution over the reference zoo of each network's mass (sum of squared weights, biases excluded) and "
    "of the mass of its minimum-mass rescaling (the same function, found by convex optimisation over the positive "
    "scalings). Bottom: the largest absolute weight of each layer before and after (boxes: quartiles, whiskers: "
    "1.5 IQR). min_mass.csv has every network's numbers."
)
