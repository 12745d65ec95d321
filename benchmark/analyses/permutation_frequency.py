"""``analysis=permutation_frequency``: the paper's Figure 4 (section 5.2) — how often the
permutation that sorts a layer's units changes during training.

A few networks are trained with the experiment's recipe (``analyze.permutation_frequency``:
runs, seeds, logging interval). At initialisation, after every ``log_every`` optimiser steps
and after the last one, ``train_network``'s ``on_step`` callback puts the network in the
symmetry-free form of the NS MMD column (the pre-sort steps of ``evaluate.canonical_steps``,
then sorting by the first incoming weight, the paper's appendix C.2) and keeps only what that
yields for every unit group ("layer"): the permutation that sorts it, ``[n]`` integers per
logged step. Weights are held only in a small buffer (``BUFFER_BYTES``; batched for speed on
small models), so a ResNet-18 trace needs ``[T, 2880]`` integers, not ``T`` copies of its 45 MB
of weights. Kendall's tau
between successive permutations (gather indices; ``metrics.kendall``) is 1 when the order did
not change. The figure shows its mean over the groups with at least two units and over the
runs (band: the runs' range), with the learning-rate schedule. Runs that fail the recipe's
convergence rule (dead networks, whose order never changes) are replaced by the next seeds.
"""
from __future__ import annotations

import logging
import textwrap
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from benchmark.analyses.figures import PALETTE, new_figure, save_figure, style
from benchmark.analyses.inputs import figures_dir
from benchmark.experiment import Experiment
from benchmark.core.settings import require
from benchmark.core.store import MAX_SEED, stack_state_dicts
from benchmark.core.training import learning_rate, seeded, train_network
from metrics.kendall import successive_kendall_tau
from metrics.symmetries import canonicalize, spec_for_model

log = logging.getLogger(__name__)

NAME = "permutation_frequency"
ORDER = 40  # its place in analysis=all and the tables of analyses: the paper order
TITLE = "Figure 4: Kendall's tau between successive sorting permutations during training"
TITLE_CHARACTERS = 52  # the longest title line that fits above the plot at column width
BUFFER_BYTES = 64 * 2**20
"""Weights buffered before their permutations are computed: every logged step of a small model
(OptuNet: ~2 KB each) in one batch, a ResNet-18 (45 MB) one or two at a time."""


@dataclass
class Settings:
    """``analysis=permutation_frequency`` (Figure 4): ``runs`` trainings with the experiment's
    recipe (seeds from ``first_seed`` on; runs that fail the recipe's convergence rule are replaced
    by the next seeds, at most ``runs`` more), logging the sorting permutation of every layer every
    ``log_every`` optimiser steps (and at initialisation and after the last step)."""

    runs: int = 5
    first_seed: int = 900000
    log_every: int = 1

    def __post_init__(self) -> None:
        require(self.runs >= 1, "runs", self.runs, "a positive integer")
        require(0 <= self.first_seed <= MAX_SEED - 2 * self.runs, "first_seed", self.first_seed,
                f"an integer in [0, {MAX_SEED} - 2 * runs]")
        require(self.log_every >= 1, "log_every", self.log_every, "a positive integer")


def applies(exp: Experiment) -> None:
    """Applies to every model (trains it with the experiment's recipe)."""


def needs(exp: Experiment) -> frozenset[str]:
    """Trains its own networks: needs nothing from the store."""
    return frozenset()


def check(exp: Experiment, made: frozenset[str] = frozenset()) -> None:
    """Trains its own networks: needs only the training data on disk."""
    exp.check_data()


def sort_steps(exp: Experiment) -> list[str]:
    """The NS form's steps up to its permutation removal: the scaling steps of
    ``evaluate.canonical_steps``, then ``sort``."""
    return [s.value for s in exp.config.evaluate.canonical_steps if s.value in ("scale", "minmass")] + ["sort"]


class SortingPermutations:
    """Collects, network by network, the permutation that sorts each unit group in the NS form
    (``sort_steps``): ``add`` copies a network's weights into a buffer, which is put through
    ``canonicalize`` (on ``device``) and emptied once it holds ``buffer_bytes``; ``result``
    returns ``{group: [T, n] int64}`` over every network added, in order."""

    def __init__(self, spec, steps: list[str], device: torch.device | str, buffer_bytes: int = 0) -> None:
        self.spec, self.steps, self.device = spec, steps, device
        self.buffer_bytes = buffer_bytes or BUFFER_BYTES
        self.pending: list[dict[str, torch.Tensor]] = []
        self.held = 0  # bytes in ``pending``
        self.parts: dict[str, list[torch.Tensor]] = {}

    def add(self, state: dict[str, torch.Tensor]) -> None:
        """Queue one network's state dict (copied to the CPU); flush when the buffer is full."""
        self.pending.append({k: v.detach().to("cpu", copy=True) for k, v in state.items()})
        self.held += sum(v.numel() * v.element_size() for v in self.pending[-1].values())
        if self.held >= self.buffer_bytes:
            self.flush()

    def flush(self) -> None:
        """Sort the buffered networks and keep only their permutations."""
        if not self.pending:
            return
        _, applied = canonicalize(stack_state_dicts(self.pending), self.spec, self.steps, device=self.device)
        for name, perm in applied["sort"].items():
            self.parts.setdefault(name, []).append(perm.to("cpu", torch.int64))
        self.pending.clear()
        self.held = 0

    def result(self) -> dict[str, torch.Tensor]:
        """``{group: [T, n] int64}``: row t sorts the group's units of the t-th network added."""
        self.flush()
        return {name: torch.cat(parts) for name, parts in self.parts.items()}


def trace(exp: Experiment, seed: int, log_every: int,
          buffer_bytes: int = 0) -> tuple[dict[str, torch.Tensor], pd.DataFrame, str | None]:
    """Train seed ``seed`` with the recipe; at initialisation, after every ``log_every`` steps and
    after the last step, record the permutation that sorts each unit group
    (``SortingPermutations``, buffer ``buffer_bytes``, default ``BUFFER_BYTES``). Returns
    ``{group: [T, n] int64}``, one row per logged step (``step``, ``epoch`` as a fraction of
    epochs, ``lr``), and the failure reason, if any."""
    recipe = exp.recipe
    steps_per_epoch = -(-len(exp.train_set) // recipe.batch_size)
    last = recipe.epochs * steps_per_epoch
    with seeded(seed):
        model = exp.model().to(exp.device)
    perms = SortingPermutations(spec_for_model(exp.model()), sort_steps(exp), exp.device, buffer_bytes)
    perms.add(model.state_dict())
    rows = [{"step": 0, "epoch": 0.0, "lr": learning_rate(recipe, 0)}]

    def log_step(epoch: int, step: int, net: torch.nn.Module) -> None:
        done = epoch * steps_per_epoch + step + 1
        if done % log_every == 0 or done == last:
            perms.add(net.state_dict())
            rows.append({"step": done, "epoch": done / steps_per_epoch, "lr": learning_rate(recipe, epoch)})

    result = train_network(model, exp.train_set, exp.validation_tensors, recipe, seed, where=f"{NAME} seed {seed}",
                           on_step=log_step)
    return perms.result(), pd.DataFrame(rows), result.failure


def kendall_by_group(perms: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per unit group with at least 2 units: Kendall's tau ``[T - 1]`` between the sorting
    permutations ``[T, n]`` of successive logged networks."""
    return {name: successive_kendall_tau(perm) for name, perm in perms.items() if perm.shape[1] >= 2}


def run(exp: Experiment) -> list[Path]:
    """Train the runs, compute the Kendall traces, draw Figure 4."""
    settings = exp.config.analyze.permutation_frequency
    recipe = exp.recipe
    runs, failures = [], {}
    seeds = iter(range(settings.first_seed, settings.first_seed + 2 * settings.runs))
    bar = tqdm(total=settings.runs, desc=NAME, unit="run", dynamic_ncols=True)
    while len(runs) < settings.runs:
        seed = next(seeds, None)
        if seed is None:
            raise RuntimeError(f"{NAME}: only {len(runs)} of {settings.runs} runs converged in {2 * settings.runs} seeds "
                               f"from {settings.first_seed}; failures: {failures}")
        perms, steps, failure = trace(exp, seed, settings.log_every)
        if failure:
            failures[seed] = failure
            continue
        taus = kendall_by_group(perms)
        logged = steps.iloc[1:]
        runs.append(pd.concat([
            pd.DataFrame({"seed": seed, "step": logged["step"].to_numpy(), "epoch": logged["epoch"].to_numpy(),
                          "lr": logged["lr"].to_numpy(), "group": name, "tau": tau.numpy()})
            for name, tau in taus.items()]))
        bar.update()
    bar.close()
    per_run = pd.concat(runs, ignore_index=True)
    by_step = per_run.groupby(["seed", "step", "epoch", "lr"], as_index=False)["tau"].mean()
    numbers = by_step.groupby(["step", "epoch", "lr"], as_index=False)["tau"].agg(
        mean_tau="mean", min_run_tau="min", max_run_tau="max")
    edges = [0, *recipe.milestones, recipe.epochs] if recipe.schedule.value == "multistep" else [0, recipe.epochs]
    phases = []
    for start, stop in zip(edges[:-1], edges[1:]):
        inside = by_step[(by_step["epoch"] > start) & (by_step["epoch"] <= stop)]
        phases.append({"epochs": f"({start}, {stop}]", "lr": learning_rate(recipe, start), "transitions": len(inside),
                       "fraction_changed": float((inside["tau"] < 1).mean()) if len(inside) else np.nan,
                       "mean_tau": float(inside["tau"].mean()) if len(inside) else np.nan})
    summary = pd.DataFrame(phases).assign(runs=settings.runs, log_every=settings.log_every,
                                          groups=", ".join(sorted(per_run["group"].unique())),
                                          failed_seeds=", ".join(map(str, failures)) or "none")
    log.info("%s: %d runs (failed seeds: %s); fraction of logged steps whose order changed per LR phase: %s", NAME,
             settings.runs, list(failures) or "none", [round(p["fraction_changed"], 4) for p in phases])
    with style():
        figure = new_figure(2.3)
        ax = figure.subplots()
        ax.fill_between(numbers["epoch"], numbers["min_run_tau"], numbers["max_run_tau"], color=PALETTE[0], alpha=0.25,
                        linewidth=0, label=f"range over {settings.runs} runs")
        ax.plot(numbers["epoch"], numbers["mean_tau"], color=PALETTE[0], linewidth=0.7, label="mean over runs")
        for milestone in (recipe.milestones if recipe.schedule.value == "multistep" else []):
            ax.axvline(milestone, color="black", linestyle="--", linewidth=0.6)
        ax.set_xlim(0, recipe.epochs)
        ax.set_xlabel("epoch")
        ax.set_ylabel("Kendall's $\\tau$ (mean over layers)")
        lr_axis = ax.twinx()
        lr_axis.step(numbers["epoch"], numbers["lr"], where="post", color=PALETTE[6], linewidth=0.8, alpha=0.6)
        lr_axis.set_ylabel("learning rate (grey)")
        lr_axis.set_ylim(0, 1.1 * numbers["lr"].max())
        lr_axis.spines["right"].set_visible(True)
        ax.set_zorder(lr_axis.get_zorder() + 1)
        ax.patch.set_visible(False)
        ax.legend(loc="lower right")
        ax.set_title("\n".join(textwrap.wrap(f"Successive sorting permutations ({exp.display_name})", TITLE_CHARACTERS)))
        return save_figure(figure, figures_dir(exp), NAME, numbers, {"runs": per_run, "summary": summary})


CAPTION = (
    "Kendall's tau between the permutations that sort each layer's units (the NS form's sorting) at successive "
    "logged training steps, averaged over the layers with at least two units and over the runs (band: range over "
    "runs); tau = 1: the order did not change. Grey: the recipe's learning rate; dashed: its milestones. "
    "permutation_frequency_summary.csv has, per learning-rate phase, the fraction of steps whose order changed."
)
