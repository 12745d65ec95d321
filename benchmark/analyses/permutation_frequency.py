"""``analysis=permutation_frequency``: the paper's Figure 4 (section 5.2) — how often the
permutation that sorts a layer's units changes during training.

A few networks are trained with the experiment's recipe (``analyze.permutation_frequency``:
runs, seeds, logging interval). At initialisation, after every ``log_every`` optimiser steps
and after the last one, the network is put in the symmetry-free form of the NS MMD column (the
pre-sort steps of ``evaluate.canonical_steps``, then sorting by the first incoming weight, the
paper's appendix C.2), keeping only what that yields for every unit group ("layer"): the
permutation that sorts it, ``[n]`` integers per logged step. Weights are held only in a
preallocated buffer of ``buffer_bytes`` bytes (``SortingPermutations``), canonicalised chunk by
chunk whenever it is full, so a trace needs ``[T, units]`` integers, not ``T`` copies of the
weights (a ResNet-18: 45 MB each; an OptuNet on MNIST: 51,600 logged steps per run).

With ``stacked`` on, where the zoo trains stacked (``Experiment.zoo_trainer``: OptuNet and the
MLP on CPU, packed kernels), the runs are trained as one stack (``continue_networks`` from their initialisations,
reading every network's weights at the logged steps), each network with the bits it gets alone
in a stack (they agree with ``train_network`` up to float rounding, which changes the
figure's numbers: off by default); else one at a time (``train_network``'s ``on_step``). Kendall's tau between successive permutations (gather
indices; ``metrics.kendall``) is 1 when the order did not change. The figure shows its mean over
the groups with at least two units and over the runs (band: the runs' range), with the
learning-rate schedule. Runs that fail the recipe's convergence rule (dead networks, whose order
never changes) are replaced by the next seeds.
"""
from __future__ import annotations

import logging
import math
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from benchmark.core.figures import PALETTE, new_figure, save_figure, style
from benchmark.analyses.inputs import figures_dir
from benchmark.config import ConfigError
from benchmark.experiment import Experiment
from benchmark.core.settings import require
from benchmark.core.store import MAX_SEED
from benchmark.core.training import NonFiniteError, accuracy, learning_rate, seeded, train_network
from benchmark.core.training.continued import StepPlan, continue_networks
from metrics.kendall import successive_kendall_tau
from metrics.symmetries import canonicalize, spec_for_model

log = logging.getLogger(__name__)

NAME = "permutation_frequency"
ORDER = 40  # its place in analysis=all and the tables of analyses: the paper order
TITLE = "Figure 4: Kendall's tau between successive sorting permutations during training"
TITLE_CHARACTERS = 52  # the longest title line that fits above the plot at column width
BUFFER_BYTES = 64 * 2**20
"""Default of ``buffer_bytes``: the weights buffered before their permutations are computed,
over all the networks trained at once (OptuNet: 1,420 bytes, ~47,000 logged steps; a ResNet-18,
45 MB, one at a time)."""
WORKING_FACTOR = 8
"""Peak memory of canonicalising a full buffer, in buffers (its copies of the chunk, float64
sort keys): measured ~5 on OptuNet chunks."""
SETTING = f"analyze.{NAME}.buffer_bytes"


@dataclass
class Settings:
    """``analysis=permutation_frequency`` (Figure 4): ``runs`` trainings with the experiment's
    recipe (seeds from ``first_seed`` on; runs that fail the recipe's convergence rule are replaced
    by the next seeds, at most ``runs`` more), logging the sorting permutation of every layer every
    ``log_every`` optimiser steps (and at initialisation and after the last step). ``buffer_bytes``:
    the weights held before they are canonicalised, over all the networks trained at once (a
    preallocated buffer; must hold one network per run trained at once, ``check`` refuses less).
    ``stacked``: train the runs as one stack where the zoo trains stacked (``Experiment.zoo_trainer``;
    else one at a time). Off by default: a stacked network agrees with ``train_network`` only up to
    float rounding, which SGD amplifies into other permutation changes (on digits the summary's
    fraction of changed steps after epoch 30 reads 0.040 instead of 0.013, docs/performance.md),
    so the figure's numbers are those of one-at-a-time training."""

    runs: int = 5
    first_seed: int = 900000
    log_every: int = 1
    buffer_bytes: int = BUFFER_BYTES
    stacked: bool = False

    def __post_init__(self) -> None:
        require(self.runs >= 1, "runs", self.runs, "a positive integer")
        require(0 <= self.first_seed <= MAX_SEED - 2 * self.runs, "first_seed", self.first_seed,
                f"an integer in [0, {MAX_SEED} - 2 * runs]")
        require(self.log_every >= 1, "log_every", self.log_every, "a positive integer")
        require(self.buffer_bytes >= 1, "buffer_bytes", self.buffer_bytes, "a positive number of bytes")


def applies(exp: Experiment) -> None:
    """Applies to every model (trains it with the experiment's recipe)."""


def needs(exp: Experiment) -> frozenset[str]:
    """Trains its own networks: needs nothing from the store."""
    return frozenset()


def check(exp: Experiment, made: frozenset[str] = frozenset()) -> None:
    """Trains its own networks: needs only the training data on disk, and a buffer that holds one
    network per run trained at once (``check_buffer``)."""
    exp.check_data()
    check_buffer(exp)


def state_bytes(state: Mapping[str, torch.Tensor]) -> int:
    """Bytes of one network's state dict (what a buffer row holds)."""
    return sum(v.numel() * v.element_size() for v in state.values())


def stacked(exp: Experiment) -> bool:
    """Whether the runs train as one stack: ``stacked`` is on and the zoo trains stacked
    (``Experiment.zoo_trainer``; where it cannot, one at a time, with the reason logged)."""
    if not exp.config.analyze.permutation_frequency.stacked:
        return False
    trainer = exp.zoo_trainer
    if not trainer.stacked:
        log.info("%s: one run at a time (%s)", NAME, trainer.reason)
    return trainer.stacked


def check_buffer(exp: Experiment, buffer_bytes: int | None = None, networks: int | None = None) -> int:
    """The buffer rows (logged networks) each of the ``networks`` trained at once gets out of
    ``buffer_bytes`` (default: the settings'; ``networks``: ``runs`` when stacked, else 1); a
    ``ConfigError`` naming ``analyze.permutation_frequency.buffer_bytes`` when that is not one row,
    or when canonicalising a full buffer would not fit in the memory available."""
    settings = exp.config.analyze.permutation_frequency
    buffer_bytes = settings.buffer_bytes if buffer_bytes is None else buffer_bytes
    networks = (settings.runs if stacked(exp) else 1) if networks is None else networks
    with seeded(0):  # building a model draws from the global RNG: leave it as it was for what runs next
        per_network = state_bytes(exp.model().state_dict())
    rows = buffer_bytes // networks // per_network
    if rows < 1:
        raise ConfigError(f"{SETTING}={buffer_bytes}: {networks} network(s) trained at once need at least one "
                          f"{per_network}-byte state each; use {SETTING}={networks * per_network} or more")
    import psutil

    available = psutil.virtual_memory().available
    if WORKING_FACTOR * buffer_bytes > available:
        raise ConfigError(f"{SETTING}={buffer_bytes}: canonicalising a full buffer needs about "
                          f"{WORKING_FACTOR * buffer_bytes / 2**30:.2f} GiB, more than the {available / 2**30:.2f} GiB "
                          f"available; use {SETTING}={max(networks * per_network, available // (2 * WORKING_FACTOR))} "
                          "or less")
    return rows


def sort_steps(exp: Experiment) -> list[str]:
    """The NS form's steps up to its permutation removal: the scaling steps of
    ``evaluate.canonical_steps``, then ``sort``."""
    return [s.value for s in exp.config.evaluate.canonical_steps if s.value in ("scale", "minmass")] + ["sort"]


class SortingPermutations:
    """Collects, step by step, the permutation that sorts each unit group of one network in the NS
    form (``sort_steps``): ``add`` copies its weights into row after row of a buffer preallocated
    for ``rows`` state dicts shaped like ``template``, which is put through ``canonicalize`` (on
    ``device``) and emptied when full; ``result`` returns ``{group: [T, n] int64}`` over every state
    added, in order. The memory held is the buffer and the permutations, whatever ``T``."""

    def __init__(self, spec, steps: list[str], device: torch.device | str, template: Mapping[str, torch.Tensor],
                 rows: int) -> None:
        if rows < 1:
            raise ConfigError(f"{SETTING}: a buffer of {rows} rows holds no network")
        self.spec, self.steps, self.device = spec, steps, device
        self.buffer = {k: torch.empty((rows, *v.shape), dtype=v.dtype) for k, v in template.items()}
        self.rows, self.filled = rows, 0
        self.parts: dict[str, list[torch.Tensor]] = {}

    def add(self, state: Mapping[str, torch.Tensor]) -> None:
        """Copy one network's state dict into the next row; flush when the buffer is full."""
        with torch.no_grad():
            for key, row in self.buffer.items():
                row[self.filled].copy_(state[key])
        self.filled += 1
        if self.filled == self.rows:
            self.flush()

    def add_flat(self, theta: torch.Tensor) -> None:
        """``add`` of a network's parameters flattened ``[P]`` in state-dict order (every key of the
        buffer a parameter: ``continued.flat_parameters``), cast to the buffer's dtypes."""
        offset = 0
        for key, row in self.buffer.items():
            size = row[0].numel()
            row[self.filled].view(-1).copy_(theta[offset : offset + size])
            offset += size
        if offset != theta.numel():
            raise ValueError(f"{NAME}: {theta.numel()} parameters, the buffer's state holds {offset}")
        self.filled += 1
        if self.filled == self.rows:
            self.flush()

    def flush(self) -> None:
        """Sort the buffered networks and keep only their permutations."""
        if not self.filled:
            return
        chunk = {k: v[: self.filled] for k, v in self.buffer.items()}
        _, applied = canonicalize(chunk, self.spec, self.steps, device=self.device)
        for name, perm in applied["sort"].items():
            self.parts.setdefault(name, []).append(perm.to("cpu", torch.int64, copy=True))
        self.filled = 0

    def result(self) -> dict[str, torch.Tensor]:
        """``{group: [T, n] int64}``: row t sorts the group's units of the t-th network added."""
        self.flush()
        return {name: torch.cat(parts) for name, parts in self.parts.items()}


def _steps_frame(recipe, steps_per_epoch: int, logged: Sequence[int]) -> pd.DataFrame:
    """One row per logged step (0: initialisation): ``step``, ``epoch`` (fraction of epochs), ``lr``."""
    rows = [{"step": 0, "epoch": 0.0, "lr": learning_rate(recipe, 0)}]
    rows += [{"step": done, "epoch": done / steps_per_epoch, "lr": learning_rate(recipe, (done - 1) // steps_per_epoch)}
             for done in logged]
    return pd.DataFrame(rows)


def trace(exp: Experiment, seed: int, log_every: int,
          buffer_bytes: int = 0) -> tuple[dict[str, torch.Tensor], pd.DataFrame, str | None]:
    """Train seed ``seed`` with the recipe one at a time (``train_network``); at initialisation,
    after every ``log_every`` steps and after the last step, record the permutation that sorts each
    unit group (``SortingPermutations``, buffer ``buffer_bytes``, default the settings'). Returns
    ``{group: [T, n] int64}``, one row per logged step (``step``, ``epoch`` as a fraction of
    epochs, ``lr``), and the failure reason, if any."""
    recipe = exp.recipe
    steps_per_epoch = -(-len(exp.train_set) // recipe.batch_size)
    last = recipe.epochs * steps_per_epoch
    rows = check_buffer(exp, buffer_bytes or None, networks=1)
    with seeded(seed):
        model = exp.model().to(exp.device)
    perms = SortingPermutations(spec_for_model(exp.model()), sort_steps(exp), exp.device, model.state_dict(), rows)
    perms.add(model.state_dict())
    logged = []

    def log_step(epoch: int, step: int, net: torch.nn.Module) -> None:
        done = epoch * steps_per_epoch + step + 1
        if done % log_every == 0 or done == last:
            perms.add(net.state_dict())
            logged.append(done)

    result = train_network(model, exp.train_set, exp.validation_tensors, recipe, seed, where=f"{NAME} seed {seed}",
                           on_step=log_step)
    return perms.result(), _steps_frame(recipe, steps_per_epoch, logged), result.failure


def trace_stacked(exp: Experiment, seeds: Sequence[int], log_every: int, buffer_bytes: int = 0
                  ) -> list[tuple[dict[str, torch.Tensor], pd.DataFrame, str | None]]:
    """``trace`` of every seed of ``seeds``, trained as one stack (``continue_networks`` from the
    initialisations ``seeded(seed)`` builds, the recipe's schedule step by step; the zoo's stacked
    trainer), the buffer (``buffer_bytes``, default the settings') shared out between them. The
    convergence rule is judged as ``train_network`` judges it, on the weights after
    ``fail_rule.epoch`` epochs and at the end; a network that fails it early trains on to the end
    in the stack (its trace is dropped by ``run``). A NaN/Inf raises its ``NonFiniteError``, as
    ``train_network`` does."""
    recipe = exp.recipe
    steps_per_epoch = -(-len(exp.train_set) // recipe.batch_size)
    last = recipe.epochs * steps_per_epoch
    rows = check_buffer(exp, buffer_bytes or None, networks=len(seeds))
    models = []
    for seed in seeds:
        with seeded(seed):
            models.append(exp.model().to(exp.device))
    template = models[0]
    names = [name for name, _ in template.named_parameters()]
    if names != list(template.state_dict()):
        raise ValueError(f"{NAME}: a stacked trace needs a state dict of parameters only, not {list(template.state_dict())}")
    spec, steps = spec_for_model(exp.model()), sort_steps(exp)
    traces = [SortingPermutations(spec, steps, exp.device, model.state_dict(), rows) for model in models]
    for perms, model in zip(traces, models):
        perms.add(model.state_dict())
    logged = [done for done in range(1, last + 1) if done % log_every == 0 or done == last]
    rule = recipe.fail_rule
    rule_step = rule.epoch * steps_per_epoch if rule.epoch is not None and rule.epoch <= recipe.epochs else None
    at_rule: dict[int, torch.Tensor] = {}
    logged_set = frozenset(logged)

    def on_snapshot(index: int, step: int, theta: torch.Tensor) -> None:
        if step in logged_set:
            traces[index].add_flat(theta)
        if step == rule_step:
            at_rule[index] = theta.clone()

    plan = StepPlan(last, lambda step: learning_rate(recipe, step // steps_per_epoch),
                    logged_set | ({rule_step} if rule_step else set()))
    outcomes = continue_networks(template, [m.state_dict() for m in models], exp.train_set, recipe, list(seeds),
                                 [f"{NAME} seed {seed}" for seed in seeds], plan, on_snapshot)
    frame, check = _steps_frame(recipe, steps_per_epoch, logged), exp.validation_tensors
    results = []
    for index, (model, outcome) in enumerate(zip(models, outcomes)):
        if isinstance(outcome, NonFiniteError):
            raise outcome
        failure = None
        if rule_step is not None:
            torch.nn.utils.vector_to_parameters(at_rule[index].to(next(model.parameters()).dtype), model.parameters())
            acc = accuracy(model, *check)
            if rule.min_accuracy is not None and acc < rule.min_accuracy:
                failure = f"held-out accuracy {acc:.3f} < {rule.min_accuracy} after epoch {rule.epoch} (did not converge)"
        if failure is None:
            model.load_state_dict(outcome)
            failure = recipe.fail_rule.final_failure(accuracy(model, *check) if check is not None else math.nan)
        results.append((traces[index].result(), frame, failure))
    return results


def kendall_by_group(perms: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per unit group with at least 2 units: Kendall's tau ``[T - 1]`` between the sorting
    permutations ``[T, n]`` of successive logged networks."""
    return {name: successive_kendall_tau(perm) for name, perm in perms.items() if perm.shape[1] >= 2}


def run(exp: Experiment) -> list[Path]:
    """Train the runs, compute the Kendall traces, draw Figure 4."""
    settings = exp.config.analyze.permutation_frequency
    recipe = exp.recipe
    check_buffer(exp)  # before any training
    together = stacked(exp)
    runs, failures = [], {}
    seeds = list(range(settings.first_seed, settings.first_seed + 2 * settings.runs))
    bar = tqdm(total=settings.runs, desc=NAME + (" (stacked)" if together else ""), unit="run", dynamic_ncols=True)
    while len(runs) < settings.runs:
        # the seeds still needed, in order: as many converged runs as seed after seed alone would give
        chosen, seeds = seeds[: settings.runs - len(runs)], seeds[settings.runs - len(runs):]
        if not chosen:
            raise RuntimeError(f"{NAME}: only {len(runs)} of {settings.runs} runs converged in {2 * settings.runs} seeds "
                               f"from {settings.first_seed}; failures: {failures}")
        traced = (trace_stacked(exp, chosen, settings.log_every) if together
                  else (trace(exp, seed, settings.log_every) for seed in chosen))
        for seed, (perms, steps, failure) in zip(chosen, traced):
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
