"""Train K networks of one architecture at once, each exactly as ``train_network`` trains it.

Each network keeps what makes it itself in ``train_network``: its initialisation (the caller
builds it under ``seeded(seed)``), its data order and augmentation (its own
``torch.Generator(seed)``, consumed in the same order: one permutation per epoch, then the
crop offsets of each batch), its SGD (momentum, Nesterov, weight decay: one optimizer over the
stacked parameters is K independent ones because the update is elementwise and the loss is
the *sum* of the K mean losses), the recipe's schedule, the convergence rule judged on
``TrainingData.check``, and its failure record. A network whose loss or weights become
NaN/Inf, or that fails the rule, leaves the stack (the others go on, unchanged) and is
reported through ``on_done`` at the end of that epoch (the losses are checked on the device and
read once per epoch, so that a step never waits for the host). Results agree with ``train_network`` up to float
rounding (sums in another order) and do not depend on K.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import nn
from torch.utils.data import Dataset
from tqdm.auto import tqdm

from benchmark.core.data import InMemoryImageDataset, as_in_memory, epoch_crop_offsets, in_memory_problem
from benchmark.core.training.loop import (
    NonFiniteError, curve_subset, seeded, Tensors, TrainingData, TrainResult, learning_rate, make_optimizer, plateau_problem,
)
from benchmark.core.training.potential import squared_norm, training_potential
from benchmark.core.training.objective import EVAL_ELEMENTS, CrossEntropyObjective, Gather, StackedObjective
from benchmark.core.training.recipe import Recipe
from benchmark.core.training.stacked import NotStackableError, Params, stacked_networks

Outcome = TrainResult | NonFiniteError
MEMORY_SHARE = 0.5  # of the free memory a stack may use (the rest: other jobs, the data, the allocator)
AUTO_NETWORKS = 128  # K of zoo.vectorize=auto: per-network time stops improving there on a CPU (make bench)


@dataclass
class Lane:
    """Bookkeeping of one network while it trains."""

    index: int
    where: str
    generator: torch.Generator
    history: list[dict[str, float]] = field(default_factory=list)
    potentials: list[float] = field(default_factory=list)
    accuracies: list[float] = field(default_factory=list)


def check_stackable(train: Dataset) -> InMemoryImageDataset:
    """The in-memory training set the vectorised trainer slices (``as_in_memory``: an
    ``InMemoryImageDataset`` or a subset of one); any other raises ``NotStackableError`` with the
    reason the data layer gives (``benchmark.core.data.memory_problem`` decides which sets are
    held in memory)."""
    memory = as_in_memory(train)
    if memory is None:
        raise NotStackableError(f"stacked training needs the training images in memory: {in_memory_problem(train)}")
    if memory.flip:
        raise NotStackableError("the stacked trainer draws no random flips (an augmented RGB set): one at a time")
    return memory


def stacking_problem(train: Dataset, stacked_form: Callable[[], object]) -> str | None:
    """Why networks cannot be trained stacked on ``train``, or None: the training set must be one
    the stacked trainer slices (``check_stackable``) and ``stacked_form()`` (building the stacked
    form of their architecture, e.g. ``stacked_networks(template, device)``; run under a fixed
    global seed, which is then restored) must not raise ``NotStackableError``."""
    try:
        check_stackable(train)
        with seeded(0):  # building a model draws from the global RNG; leave it as it was
            stacked_form()
    except NotStackableError as err:
        return str(err)
    return None


def network_bytes(template: nn.Module, input_shape: Sequence[int], batch_size: int, dtype: torch.dtype = torch.float32) -> int:
    """Memory one more network adds to a stack, in bytes: its parameters with their gradient
    and momentum (x4), and its training batch and the activations kept for backward with their
    gradients (x3, sizes measured with forward hooks on a zero batch of the template)."""
    sizes = []
    hooks = [m.register_forward_hook(lambda _m, _i, out: sizes.append(out.numel()))
             for m in template.modules() if not list(m.children())]
    try:
        with torch.no_grad():
            template(torch.zeros(batch_size, *input_shape, device=next(template.parameters()).device))
    finally:
        for hook in hooks:
            hook.remove()
    item = torch.empty((), dtype=dtype, device="cpu").element_size()
    params = sum(p.numel() for p in template.parameters())
    return item * (4 * params + 3 * (sum(sizes) + batch_size * math.prod(input_shape)))


def available_bytes(device: torch.device) -> int:
    """Free memory on ``device`` (CUDA: the driver's free memory; CPU: what the OS reports available)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    import psutil

    return int(psutil.virtual_memory().available)


def networks_that_fit(template: nn.Module, input_shape: Sequence[int], batch_size: int, device: torch.device,
                      share: float = MEMORY_SHARE, stacks: int = 1) -> tuple[int, int, int]:
    """``(K, bytes per network, bytes available)``: the most networks like ``template`` per stack
    when ``stacks`` stacks of K train at once in ``share`` of the free memory of ``device``, each
    next to its fixed evaluation buffer (``EVAL_ELEMENTS``)."""
    per_network = network_bytes(template, input_shape, batch_size)
    available = available_bytes(device)
    usable = share * available / stacks - 4 * EVAL_ELEMENTS
    return max(0, int(usable // per_network)), per_network, available


class Stack:
    """The stacked parameters, their optimizer and the lanes still training."""

    def __init__(self, objective: StackedObjective, params: Params, recipe: Recipe, lanes: list[Lane]) -> None:
        self.objective, self.recipe, self.lanes = objective, recipe, lanes
        self.params = {k: v.detach().requires_grad_() for k, v in params.items()}
        self.optimizer = make_optimizer(list(self.params.values()), recipe)

    def keep(self, mask: torch.Tensor) -> None:
        """Drop the lanes where ``mask`` is False (parameters and momentum buffers follow)."""
        indices = mask.nonzero().squeeze(1)
        momentum = {k: self.optimizer.state[p].get("momentum_buffer") for k, p in self.params.items()}
        lr = self.optimizer.param_groups[0]["lr"]
        self.params = {k: v.detach().requires_grad_() for k, v in self.objective.select(self.params, indices).items()}
        self.optimizer = make_optimizer(list(self.params.values()), self.recipe, lr=lr)
        buffers = {k: v for k, v in momentum.items() if v is not None}
        for key, buffer in self.objective.select(buffers, indices).items():
            self.optimizer.state[self.params[key]]["momentum_buffer"] = buffer
        self.lanes = [lane for lane, kept in zip(self.lanes, mask.tolist()) if kept]

    def step(self, gather: Gather, labels: torch.Tensor) -> torch.Tensor:
        """One SGD step of every network at the optimizer's rate, each on its own batch (``gather``,
        ``labels [K, B]``): through the objective's fused ``loss_and_grads`` where it has one, else
        autograd over its ``losses``. Returns the ``[K]`` losses (detached). A network whose loss is
        not finite adds nothing to the others (each loss depends on its own parameters alone)."""
        fused = getattr(self.objective, "loss_and_grads", None)
        if fused is not None:  # the objective's own step without an autograd graph (the packed kernels)
            losses, grads = fused(self.params, gather(1), labels, self.indices)
            for key, value in self.params.items():
                value.grad = grads[key]
        else:
            losses = self.objective.losses(self.params, gather, labels, self.indices)
            self.optimizer.zero_grad(set_to_none=True)
            torch.where(torch.isfinite(losses.detach()), losses, 0.0).sum().backward()
        self.optimizer.step()
        return losses.detach()

    @property
    def indices(self) -> list[int]:
        """The index (into the trainer's models) of the network at each position."""
        return [lane.index for lane in self.lanes]

    def first_non_finite(self) -> list[str | None]:
        """Per lane, the first key (state-dict order) holding NaN/Inf, or None."""
        bad: list[str | None] = [None] * len(self.lanes)
        for key, value in self.params.items():
            moved = value.detach().movedim(self.objective.network_axis(key) % value.dim(), 0).reshape(len(self.lanes), -1)
            for i in (~torch.isfinite(moved).all(1)).nonzero().squeeze(1).tolist():
                bad[i] = bad[i] or key
        return bad


def train_networks(
    models: Sequence[nn.Module],
    data: TrainingData,
    recipe: Recipe,
    seeds: Sequence[int],
    where: Sequence[str],
    on_done: Callable[[int, Outcome], None] | None = None,
    train_eval: Tensors | None = None,
    implementation: str = "auto",
    objective: StackedObjective | None = None,
    progress: str | None = None,
    curves: bool = False,
) -> list[Outcome]:
    """Train ``models`` (K freshly built networks of one architecture, on one device) together.

    Network i follows ``train_network(models[i], data.train, data.check, recipe, seeds[i],
    where[i], train_eval=train_eval)``: the same data order, updates, convergence rule and
    failure reasons; its outcome is a ``TrainResult`` or, where ``train_network`` would raise
    it, the ``NonFiniteError``. ``on_done(i, outcome)`` is called as each network finishes
    (early failures and NaN/Inf first, the rest after the last epoch). ``implementation``: see
    ``stacked_networks``. ``objective``: what is trained (``benchmark.core.training.objective``; default
    the cross-entropy of the plain networks ``models``; another one, e.g. the vBNN's ELBO, brings its
    own parameters, losses and accuracies, and ``models`` then only give the architecture and
    device, or only the device when the objective has its stacked form as ``stacked``). ``progress``:
    the description of a bar over the epochs (with the stack's ETA; none without it). Raises
    ``NotStackableError`` if the architecture or data cannot be stacked.

    ``recipe.until_plateau``: each network trains on until it plateaus, as in ``train_network``; a
    plateaued network leaves the stack at the end of that epoch (its outcome reported then), the
    others go on unchanged (needs ``train_eval`` and an objective that measures the plain
    network's fit, ``CrossEntropyObjective.fit``).

    ``curves``: every epoch's history record also holds ``check_accuracy`` and
    ``train_subset_accuracy``, as ``train_network(curves=True)`` records them.
    """
    if not (len(models) == len(seeds) == len(where)) or not models:
        raise ValueError(f"train_networks: {len(models)} models, {len(seeds)} seeds and {len(where)} names; need as many of each (>= 1)")
    dataset = check_stackable(data.train)
    device = next(models[0].parameters()).device
    # an objective that runs its own stacked form (``stacked``) gets the batches laid out for it
    stacked = getattr(objective, "stacked", None) or stacked_networks(models[0], device, implementation)
    lanes = [Lane(i, where[i], torch.Generator().manual_seed(int(seed))) for i, seed in enumerate(seeds)]
    objective = CrossEntropyObjective(stacked, models) if objective is None else objective
    problem = plateau_problem(recipe, train_eval, callable(getattr(objective, "fit", None)))
    if problem:
        raise ValueError(f"train_networks: {problem}")
    plateau = recipe.until_plateau if recipe.until_plateau.enabled else None
    stack = Stack(objective, objective.initial(), recipe, lanes)
    dtype = next(iter(stack.params.values())).dtype
    outcomes: list[Outcome | None] = [None] * len(models)

    def finish(lane: Lane, outcome: Outcome) -> None:
        outcomes[lane.index] = outcome
        if on_done is not None:
            on_done(lane.index, outcome)

    def result(position: int, train_acc: float, test_acc: float, epochs: int, failure: str | None,
               plateaued: bool | None = None) -> TrainResult:
        lane = stack.lanes[position]
        return TrainResult(objective.result(stack.params, position, lane.index), train_acc, test_acc, epochs, failure,
                           lane.history, False if plateau is not None and plateaued is None else plateaued)

    def finish_trained(positions: list[int], epochs: int, plateaued: bool | None) -> None:
        """Report the networks at ``positions`` as trained to the end (``epochs`` run), judged by the end check."""
        params, lanes_there = stack.params, stack.indices
        if len(positions) < len(stack.lanes):  # some leave the stack (plateaued): only theirs evaluated
            chosen = torch.tensor(positions, dtype=torch.long)
            params = objective.select(stack.params, chosen.to(next(iter(stack.params.values())).device))
            lanes_there = [stack.lanes[p].index for p in positions]
        test = objective.accuracies(params, data.check, lanes_there).tolist()
        train = (objective.accuracies(params, train_eval, lanes_there).tolist()
                 if train_eval is not None else [math.nan] * len(positions))
        for i, position in enumerate(positions):
            finish(stack.lanes[position], result(position, train[i], test[i], epochs, rule.final_failure(test[i]), plateaued))

    n, rule = len(dataset), recipe.fail_rule
    curve_train = (curve_subset(train_eval, len(data.check[1]))
                   if curves and data.check is not None and train_eval is not None else None)
    source = stacked.source(dataset.images.to(dtype), device, dataset.codes)
    labels_on_device = dataset.labels.to(device)
    bar = tqdm(total=recipe.max_epochs, desc=progress, unit="epoch", leave=False, dynamic_ncols=True,
               disable=progress is None)
    for epoch in range(recipe.max_epochs):
        if not stack.lanes:
            break
        for group in stack.optimizer.param_groups:
            group["lr"] = learning_rate(recipe, epoch)
        # The epoch's data order and crop offsets, drawn from each network's CPU generator as
        # train_network draws them (so they are the same on every device), moved in one copy each.
        order = torch.stack([torch.randperm(n, generator=lane.generator) for lane in stack.lanes]).to(device)
        crops = None
        if dataset.augment:
            crops = torch.stack([epoch_crop_offsets(n, recipe.batch_size, dataset.augment_padding, lane.generator)
                                 for lane in stack.lanes]).to(device)  # [K, 2, n]
        # Kept on the device and read once at the end of the epoch: no host synchronisation per step.
        totals = torch.zeros(len(stack.lanes), dtype=torch.float64, device=device)
        bad_step = torch.full((len(stack.lanes),), -1, dtype=torch.long, device=device)
        bad_loss = torch.zeros(len(stack.lanes), dtype=torch.float64, device=device)
        for step, start in enumerate(range(0, n, recipe.batch_size)):
            idx = order[:, start : start + recipe.batch_size]
            size = idx.shape[1]
            offsets = None if crops is None else crops[:, :, start : start + size]

            def gather(copies: int, idx=idx, offsets=offsets) -> torch.Tensor:
                return stacked.batch(source, idx.repeat(copies, 1), None if offsets is None else offsets.repeat(copies, 1, 1),
                                     dataset.augment_padding, dataset.fill)

            losses = stack.step(gather, labels_on_device[idx])  # a non-finite one leaves at the epoch's end
            first = (bad_step < 0) & ~torch.isfinite(losses)
            bad_step = torch.where(first, step, bad_step)
            bad_loss = torch.where(first, losses.double(), bad_loss)
            totals += losses.double() * size
        failed_at = bad_step.tolist()
        if any(s >= 0 for s in failed_at):
            values = bad_loss.tolist()
            for lane, s, value in zip(stack.lanes, failed_at, values):
                if s >= 0:
                    finish(lane, NonFiniteError(f"{lane.where}, epoch {epoch + 1}: loss became {value} at step {s}"))
            finite = torch.tensor([s < 0 for s in failed_at], device="cpu")
            stack.keep(finite)
            totals = totals[finite.to(device)]
        if not stack.lanes:
            break
        bad = stack.first_non_finite()
        if any(bad):
            for lane, key in zip(stack.lanes, bad):
                if key is not None:
                    finish(lane, NonFiniteError(f"{lane.where}, epoch {epoch + 1}: {key!r} became NaN/Inf"))
            keep = torch.tensor([key is None for key in bad], device="cpu")
            stack.keep(keep)
            totals = totals[keep.to(device)]
        for lane, total in zip(stack.lanes, totals.tolist()):
            lane.history.append({"epoch": epoch + 1, "loss": total / n})
        checked = None
        if curves and data.check is not None and stack.lanes:
            checked = objective.accuracies(stack.params, data.check, stack.indices).tolist()
            for lane, acc in zip(stack.lanes, checked):
                lane.history[-1]["check_accuracy"] = acc
        if curve_train is not None and stack.lanes:
            for lane, acc in zip(stack.lanes, objective.accuracies(stack.params, curve_train, stack.indices).tolist()):
                lane.history[-1]["train_subset_accuracy"] = acc
        if rule.epoch is not None and epoch + 1 == rule.epoch and stack.lanes:
            accs = checked if checked is not None else objective.accuracies(stack.params, data.check, stack.indices).tolist()
            failed = []
            for position, (lane, acc) in enumerate(zip(stack.lanes, accs)):
                lane.history[-1]["check_accuracy"] = acc
                if rule.min_accuracy is not None and acc < rule.min_accuracy:
                    reason = f"held-out accuracy {acc:.3f} < {rule.min_accuracy} after epoch {epoch + 1} (did not converge)"
                    finish(lane, result(position, math.nan, acc, epoch + 1, reason))
                    failed.append(position)
            if failed:
                stack.keep(torch.tensor([p not in failed for p in range(len(stack.lanes))], device="cpu"))
        if plateau is not None and epoch + 1 >= plateau.first_measured(recipe.epochs) and stack.lanes:
            nll, correct = objective.fit(stack.params, train_eval, stack.indices)
            potential = training_potential(nll, squared_norm(stack.params, list(stack.params), objective.network_axis),
                                           len(train_eval[1]), recipe.weight_decay).tolist()
            plateaued = []
            for position, (lane, u, right) in enumerate(zip(stack.lanes, potential, correct.tolist())):
                lane.history[-1]["potential"] = u
                lane.history[-1]["train_accuracy"] = right / max(1, len(train_eval[1]))
                lane.potentials.append(u)
                lane.accuracies.append(lane.history[-1]["train_accuracy"])
                if epoch + 1 >= recipe.epochs and plateau.reached(lane.potentials, lane.accuracies):
                    plateaued.append(position)
            if plateaued:
                finish_trained(plateaued, epoch + 1, True)
                stack.keep(torch.tensor([p not in plateaued for p in range(len(stack.lanes))], device="cpu"))
        bar.update()
    bar.close()
    if stack.lanes:
        finish_trained(list(range(len(stack.lanes))), recipe.max_epochs, None)
    return outcomes  # type: ignore[return-value]
