"""``analysis=toy``: the paper's Figure 1 (appendix A) — the posterior of the two output weights
of 2-2-1 ReLU perceptrons, raw, after removing the scaling symmetry, and after also removing
the permutation symmetry.

Protocol (appendix A and the authors' supplementary notebooks): two classes drawn from
N((-2, -2), I) and N((2, 2), I), 200 points each, redrawn until linearly separable;
``nn.Linear(2, 2) - ReLU - nn.Linear(2, 1)`` networks with PyTorch's default initialisation,
BCE-with-logits, plain SGD with learning rate 2, batches of 10 reshuffled every epoch, 10
epochs. The paper speaks of early stopping and of dropping the few (<1%) networks with a high
training loss; the authors' code trains every network for the 10 epochs and keeps those whose
mean batch loss over the last epoch is at most 0.01, which is what is done here (the dropped
fraction is reported, with a warning above the paper's 1%; the caption says that early stopping
is not implemented). All networks are trained at once as batched tensors.

Symmetry removal (on the kept networks, with the suite's symmetry engine): scaling -- every
hidden unit's incoming weights (bias excluded) rescaled to L2 norm 3, the factor pushed into
the output weights (the authors' "3-norm": norm 3 instead of 1 spreads the output weights over
the plotted window); permutation -- the two hidden units ordered so that the output weights
ascend (the paper orders from the last layer here, unlike its main pipeline). No softmax step:
a single-logit BCE head has no additive symmetry. Every network is checked on random inputs to
compute the same function after each removal.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure
from scipy.optimize import linprog

from benchmark.core.figures import COLUMN_WIDTH, new_figure, save_figure, sequential_colormap, style
from benchmark.analyses.inputs import figures_dir
from benchmark.experiment import Experiment
from benchmark.core.models import mlp
from benchmark.core.settings import require
from metrics.symmetries import normalize_scales, permute, rescale, sequential_spec

log = logging.getLogger(__name__)

NAME = "toy"
ORDER = 10  # its place in analysis=all and the tables of analyses: the paper order
TITLE = "Figure 1: toy posterior of the output weights of 2-2-1 ReLU perceptrons"
MEANS = ((-2.0, -2.0), (2.0, 2.0))
POINTS_PER_CLASS = 200
EPOCHS, BATCH_SIZE, LR = 10, 10, 2.0
KEEP_LOSS = 0.01  # last-epoch mean batch loss at most this (the authors' rule)
PAPER_DROPPED = 0.01  # the paper drops "<1%" of the networks; more is warned about
NORM = 3.0
CPU = torch.device("cpu")  # the toy's 10,000 perceptrons train on the CPU whatever the experiment's device
CHECK_INPUTS = 64
CHECK_RTOL = 1e-4
WINDOW = 4.0


@dataclass
class Settings:
    """``analysis=toy`` (Figure 1): ``networks`` 2-2-1 ReLU perceptrons trained at once
    (paper: 10,000); ``seed`` fixes the data, the initialisations and the batch orders."""

    networks: int = 10000
    seed: int = 0

    def __post_init__(self) -> None:
        require(self.networks >= 2, "networks", self.networks, "an integer >= 2")


def separable(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether a line separates the two classes of ``x [N, 2]`` (labels ``y [N]`` in {0, 1}):
    feasibility of ``s_i (w . x_i + c) >= 1`` as a linear program (scipy's HiGHS)."""
    signs = (2 * y.double() - 1).numpy()
    rows = -signs[:, None] * np.hstack([x.double().numpy(), np.ones((len(x), 1))])
    result = linprog(np.zeros(3), A_ub=rows, b_ub=-np.ones(len(x)), bounds=[(None, None)] * 3, method="highs")
    return result.status == 0


def blobs(generator: torch.Generator, max_draws: int = 100) -> tuple[torch.Tensor, torch.Tensor]:
    """The toy data: ``(x [400, 2] float32, y [400] float32 in {0, 1})``, class 0 from
    N((-2, -2), I) then class 1 from N((2, 2), I), redrawn until linearly separable."""
    for _ in range(max_draws):
        x = torch.cat([torch.tensor(m, device=CPU) + torch.randn(POINTS_PER_CLASS, 2, generator=generator, dtype=torch.float64)
                       for m in MEANS]).float()
        y = torch.cat([torch.zeros(POINTS_PER_CLASS, device=CPU), torch.ones(POINTS_PER_CLASS, device=CPU)])
        if separable(x, y):
            return x, y
    raise RuntimeError(f"toy data: no linearly separable draw in {max_draws} tries")


def default_init(networks: int, generator: torch.Generator, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """PyTorch's default ``nn.Linear`` initialisation of ``networks`` 2-2-1 perceptrons, batched:
    every weight and bias uniform in ``+-1/sqrt(fan_in)`` (fan_in = 2 in both layers)."""
    bound = 2.0 ** -0.5
    shapes = {"fc1.weight": (2, 2), "fc1.bias": (2,), "fc2.weight": (1, 2), "fc2.bias": (1,)}
    return {k: (torch.rand(networks, *s, generator=generator, dtype=torch.float64) * 2 - 1).mul(bound).to(dtype)
            for k, s in shapes.items()}


def batch_orders(networks: int, points: int, generator: torch.Generator) -> torch.Tensor:
    """Each network's data order in each epoch: ``[EPOCHS, networks, points]`` (a fresh shuffle
    per network and epoch, like a shuffling DataLoader per network)."""
    return torch.rand(EPOCHS, networks, points, generator=generator).argsort(dim=2)


def forward(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Logits ``[M, B]`` of every network on its own inputs ``x [M, B, 2]`` (or shared ``[B, 2]``)."""
    hidden = torch.relu(torch.matmul(x, params["fc1.weight"].transpose(1, 2)) + params["fc1.bias"][:, None, :])
    return (torch.matmul(hidden, params["fc2.weight"].transpose(1, 2)) + params["fc2.bias"][:, None, :])[..., 0]


def train_perceptrons(
    params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, orders: torch.Tensor
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Train every network of ``params`` (batched ``[M, ...]``) at once with SGD (lr 2, batches
    of 10, BCE with logits) over ``orders [epochs, M, N]``. Each network's loss is its own batch
    mean, so summing them gives each network exactly its own gradient. Returns the trained
    parameters and each network's mean batch loss over the last epoch ``[M]``."""
    params = {k: v.detach().clone().requires_grad_(True) for k, v in params.items()}
    x, y = x.to(params["fc1.weight"].dtype), y.to(params["fc1.weight"].dtype)
    last = torch.zeros(orders.shape[1], dtype=torch.float64, device=CPU)
    steps = orders.shape[2] // BATCH_SIZE
    for epoch in range(orders.shape[0]):
        last.zero_()
        for step in range(steps):
            index = orders[epoch, :, step * BATCH_SIZE : (step + 1) * BATCH_SIZE]
            losses = F.binary_cross_entropy_with_logits(forward(params, x[index]), y[index], reduction="none").mean(dim=1)
            grads = torch.autograd.grad(losses.sum(), list(params.values()))
            with torch.no_grad():
                for value, grad in zip(params.values(), grads):
                    value -= LR * grad
            last += losses.detach().double()
    return {k: v.detach() for k, v in params.items()}, last / steps


@dataclass
class ToyResult:
    """The kept networks in the three forms (``{key: [M, ...]}``), the largest relative change
    of any network's outputs on random inputs after each removal, and the counts."""

    raw: dict[str, torch.Tensor]
    scaled: dict[str, torch.Tensor]
    sorted: dict[str, torch.Tensor]
    max_change: dict[str, float]
    trained: int
    kept: int


def function_change(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], inputs: torch.Tensor) -> torch.Tensor:
    """Per network, ``max |f_a - f_b| / (1 + max |f_a|)`` over ``inputs [B, 2]`` (float64): ``[M]``."""
    fa = forward({k: v.double() for k, v in a.items()}, inputs.double())
    fb = forward({k: v.double() for k, v in b.items()}, inputs.double())
    return (fa - fb).abs().amax(dim=1) / (1 + fa.abs().amax(dim=1))


def remove_symmetries(params: dict[str, torch.Tensor], generator: torch.Generator) -> ToyResult:
    """Scaling (hidden incoming weights to L2 norm 3) then permutation (output weights ascending)
    removal of every network in ``params``; raises ``RuntimeError`` naming the networks whose
    function changed by more than ``CHECK_RTOL`` on ``CHECK_INPUTS`` Gaussian inputs."""
    spec = sequential_spec(mlp(2, [2], 1, flatten=False))
    networks = params["fc1.weight"].shape[0]
    unit, _ = normalize_scales(params, spec)
    scaled = rescale(unit, spec, {"fc1": torch.full((networks, 2), NORM, device=CPU)})
    order = scaled["fc2.weight"][:, 0, :].argsort(dim=1)
    ordered = permute(scaled, spec, {"fc1": order})
    inputs = torch.randn(CHECK_INPUTS, 2, generator=generator, dtype=torch.float64)
    changes = {"scaling": function_change(params, scaled, inputs), "scaling+permutation": function_change(params, ordered, inputs)}
    for what, change in changes.items():
        bad = (change > CHECK_RTOL).nonzero().flatten().tolist()
        if bad:
            raise RuntimeError(f"toy: removing {what} changed the function of {len(bad)} network(s) (first {bad[:5]}, "
                               f"worst relative change {float(change.max()):.3g} > {CHECK_RTOL})")
    return ToyResult(params, scaled, ordered, {k: float(v.max()) for k, v in changes.items()}, networks, networks)


def simulate(networks: int, seed: int) -> tuple[ToyResult, torch.Tensor]:
    """Data, training, selection and symmetry removal of ``networks`` perceptrons from ``seed``;
    returns the result and the last-epoch losses of all trained networks ``[networks]``."""
    generator = torch.Generator().manual_seed(seed)
    x, y = blobs(generator)
    params, losses = train_perceptrons(default_init(networks, generator), x, y, batch_orders(networks, len(x), generator))
    keep = losses <= KEEP_LOSS
    finite = torch.stack([torch.isfinite(v).flatten(1).all(dim=1) for v in params.values()]).all(dim=0)
    kept = {k: v[keep & finite] for k, v in params.items()}
    if int((keep & finite).sum()) < 2:
        raise RuntimeError(f"toy: only {int((keep & finite).sum())} of {networks} networks reached a last-epoch loss "
                           f"<= {KEEP_LOSS} with finite weights; at least 2 are needed")
    result = remove_symmetries(kept, generator)
    result.trained = networks
    return result, losses


def applies(exp: Experiment) -> None:
    """The toy is its own experiment: it applies whatever the model."""


def needs(exp: Experiment) -> frozenset[str]:
    """The toy needs nothing from the store."""
    return frozenset()


def check(exp: Experiment, made: frozenset[str] = frozenset()) -> None:
    """The toy needs nothing from the store."""


def run(exp: Experiment) -> list[Path]:
    """Train, select, remove the symmetries, draw Figure 1; returns the files written. Warns when
    more networks are dropped than the paper's <1% (``PAPER_DROPPED``)."""
    settings = exp.config.analyze.toy
    result, _ = simulate(settings.networks, settings.seed)
    dropped = (result.trained - result.kept) / result.trained
    log.info("toy: %d of %d networks kept (%.2f%% dropped: last-epoch loss > %g); largest function change %s",
             result.kept, result.trained, 100 * dropped, KEEP_LOSS, result.max_change)
    if dropped > PAPER_DROPPED:
        log.warning("toy: %.2f%% of the %d networks dropped (last-epoch loss > %g), more than the paper's <%g%%; "
                    "the figure shows the %d kept", 100 * dropped, result.trained, KEEP_LOSS, 100 * PAPER_DROPPED,
                    result.kept)
    points = output_weights(result)
    numbers = pd.DataFrame({"network": np.arange(result.kept)})
    for values, short in zip(points.values(), ("raw", "scaled", "sorted")):
        numbers[f"{short}_w1"], numbers[f"{short}_w2"] = values[:, 0], values[:, 1]
    summary = pd.DataFrame([{
        "networks_trained": result.trained, "networks_kept": result.kept, "dropped_fraction": dropped,
        "dropped_above_paper": dropped > PAPER_DROPPED, "paper_dropped_at_most": PAPER_DROPPED,
        "keep_rule": f"last-epoch mean batch BCE <= {KEEP_LOSS}", "early_stopping": "no (all networks train 10 epochs)",
        "hidden_norm": NORM, "max_relative_change_scaling": result.max_change["scaling"],
        "max_relative_change_scaling_permutation": result.max_change["scaling+permutation"],
        "check_inputs": CHECK_INPUTS, "seed": settings.seed,
    }])
    with style():
        figure = draw(points, result.kept)
        return save_figure(figure, figures_dir(exp), "toy", numbers, {"summary": summary})


def output_weights(result: ToyResult) -> dict[str, np.ndarray]:
    """The kept networks' output weights ``(w1, w2)`` ``[M, 2]`` float64 in each form, keyed by
    the panel titles."""
    forms = {"raw": result.raw, "scaling\nremoved": result.scaled, "scaling, perm.\nremoved": result.sorted}
    return {name: form["fc2.weight"][:, 0, :].double().numpy() for name, form in forms.items()}


def draw(points: dict[str, np.ndarray], kept: int) -> Figure:
    """Figure 1 (call inside ``figures.style()``): one hexbin panel of the output weights per form,
    all on one logarithmic colour scale from 1 to the largest count of any bin of any panel."""
    figure = new_figure(1.95, COLUMN_WIDTH)
    axes = figure.subplots(1, 3, sharex=True, sharey=True)
    meshes = []
    for ax, (name, values) in zip(axes, points.items()):
        inside = (np.abs(values) < WINDOW).all(axis=1)
        meshes.append(ax.hexbin(values[inside, 0], values[inside, 1], gridsize=30,
                                extent=(-WINDOW, WINDOW, -WINDOW, WINDOW), mincnt=1, cmap=sequential_colormap(),
                                linewidths=0))
        ax.set_title(name, fontsize=7)
        ax.set_xlim(-WINDOW, WINDOW)
        ax.set_ylim(-WINDOW, WINDOW)
        ax.set_aspect("equal")
        ax.set_xticks([-4, 0, 4])
        ax.set_yticks([-4, 0, 4])
    largest = max((float(mesh.get_array().max()) for mesh in meshes if mesh.get_array().size), default=1.0)
    norm = LogNorm(vmin=1, vmax=max(2.0, largest))
    for mesh in meshes:
        mesh.set_norm(norm)
    axes[2].plot([-WINDOW, WINDOW], [-WINDOW, WINDOW], "k--", linewidth=0.6)
    axes[0].set_ylabel("$w_2$ (output weight of unit 2)")
    figure.supxlabel("$w_1$ (output weight of hidden unit 1, unitless)", fontsize=7)
    figure.colorbar(meshes[0], ax=list(axes), shrink=0.8, label="networks per bin (log scale)", pad=0.02)
    figure.suptitle(f"Toy posterior of the output weights ({kept:,} networks)")
    return figure


CAPTION = (
    "Output weights (w1, w2) of 2-2-1 ReLU perceptrons trained on two separable Gaussian blobs (hexbin counts on "
    "one logarithmic colour scale for the three panels; window [-4, 4]^2): raw, after rescaling every hidden unit's "
    "incoming weights to L2 norm 3, and after also ordering the hidden units by their output weight (dashed: "
    "w1 = w2). Networks whose last-epoch training loss exceeds 0.01 are dropped (toy_summary.csv: the dropped "
    "fraction, flagged and logged as a warning above the paper's <1%); every removal is checked to leave each "
    "network's function unchanged. The paper's early stopping is not implemented: as in the authors' notebooks, the "
    "only full statement of the protocol, every network trains the full 10 epochs and is then kept or dropped by "
    "its last-epoch loss."
)
