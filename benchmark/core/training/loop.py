"""The training loop shared by the zoo and by the methods that (re)train networks.

``train_network`` runs a ``Recipe`` for one seed, deterministically on CPU: the seed fixes
the initialisation (through the caller's model construction under ``seeded``) and the data
order (its own generator).
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from benchmark.core.data import as_in_memory
from benchmark.core.models import fit_with_weights
from benchmark.core.training.potential import squared_norm, training_potential
from benchmark.core.training.recipe import Recipe, Schedule

LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
StepCallback = Callable[[int, int, nn.Module], None]
"""``on_step(epoch, step, model)``: called after every optimiser step (0-based epoch and step
within the epoch) with the model being trained, e.g. to log its weights."""
Tensors = tuple[torch.Tensor, torch.Tensor]


class NonFiniteError(FloatingPointError):
    """Training produced a NaN/Inf loss or weight; the run must stop and store nothing."""


@dataclass(frozen=True)
class TrainingData:
    """The data a network is trained on, and what its convergence rule is judged on.

    ``train``: the training stream (``(image [C, H, W], label)`` items, augmented as the
    experiment says); ``train_tensors``: the same split un-augmented in memory ``(images
    [N, C, H, W], labels [N])`` (the data a posterior conditions on); ``check``: the held-out
    validation ``(images, labels)`` (carved from the official train split, never the test set)
    on which the recipe's non-convergence rule is judged; None when the experiment has none.
    """

    train: Dataset
    train_tensors: Tensors
    check: Tensors | None

    @property
    def input_shape(self) -> tuple[int, ...]:
        """``(C, H, W)`` of one input image."""
        return tuple(self.train_tensors[0].shape[1:])


@dataclass
class TrainResult:
    """Outcome of one training: final weights, accuracies (fractions: on the un-augmented train
    data and on the held-out ``check`` data, NaN when not measured), and failure reason if any.
    ``plateaued``: under ``recipe.until_plateau``, whether the run stopped because it plateaued
    (False: it reached ``max_epochs``, or failed before); None when the option is off."""

    state_dict: dict[str, torch.Tensor]
    train_accuracy: float
    check_accuracy: float
    epochs_run: int
    failure: str | None = None
    history: list[dict[str, float]] = field(default_factory=list)
    plateaued: bool | None = None


@dataclass(frozen=True)
class Acceleration:
    """How a training uses its device, beyond full-precision float32: ``autocast`` = the
    ``torch.autocast`` dtype of the forward pass and loss (``torch.bfloat16``, or
    ``torch.float16`` with a ``GradScaler``; None = off) and ``channels_last`` = the model and
    its image batches in NHWC memory format (cuDNN's fast layout for convolutions with
    tensor cores). The default changes nothing."""

    autocast: Optional[torch.dtype] = None
    channels_last: bool = False

    def prepare(self, model: nn.Module) -> nn.Module:
        """``model`` in the memory format (in place, as ``Module.to``)."""
        return model.to(memory_format=torch.channels_last) if self.channels_last else model

    def inputs(self, images: torch.Tensor) -> torch.Tensor:
        """An image batch ``[B, C, H, W]`` in the memory format."""
        return images.contiguous(memory_format=torch.channels_last) if self.channels_last and images.dim() == 4 else images

    def autocasting(self, device: torch.device):
        """The autocast context of forward passes on ``device`` (disabled when ``autocast`` is None)."""
        return torch.autocast(device.type, dtype=self.autocast or torch.float32, enabled=self.autocast is not None)

    def scaler(self, device: torch.device) -> torch.amp.GradScaler:
        """Loss scaling for float16 (a no-op otherwise): ``scale(loss).backward(); step(opt); update()``."""
        return torch.amp.GradScaler(device.type, enabled=self.autocast == torch.float16)


FULL_PRECISION = Acceleration()


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Fix torch's global RNG to ``seed`` inside the block (model init, dropout masks)."""
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        yield
    finally:
        torch.random.set_rng_state(state)


def make_optimizer(params, recipe: Recipe, lr: float | None = None) -> torch.optim.SGD:
    """SGD with the recipe's momentum, Nesterov flag and weight decay."""
    return torch.optim.SGD(
        params,
        lr=recipe.lr if lr is None else lr,
        momentum=recipe.momentum,
        nesterov=recipe.nesterov and recipe.momentum > 0,
        weight_decay=recipe.weight_decay,
    )


class OptimizerChain:
    """Several optimizers stepped as one (e.g. SGD for the weights, Adam for variational scales).
    ``param_groups`` lists every group; a group's ``lr_scale`` (default 1) multiplies the
    recipe's scheduled rate in ``train_network``."""

    def __init__(self, *optimizers: torch.optim.Optimizer) -> None:
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict]:
        return [group for optimizer in self.optimizers for group in optimizer.param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()


OptimizerFactory = Callable[[nn.Module, Recipe], "torch.optim.Optimizer | OptimizerChain"]


def learning_rate(recipe: Recipe, epoch: int) -> float:
    """Learning rate of ``epoch`` (0-based) under the recipe's schedule; past the recipe's epochs
    (``until_plateau``) the schedule's last rate, that of epoch ``epochs - 1``."""
    epoch = min(epoch, recipe.epochs - 1)
    if recipe.schedule == Schedule.multistep:
        return recipe.lr * recipe.gamma ** sum(epoch >= m for m in recipe.milestones)
    if recipe.schedule == Schedule.cosine:
        return 0.5 * recipe.lr * (1 + math.cos(math.pi * epoch / recipe.epochs))
    return recipe.lr


def iterate_batches(
    dataset: Dataset, batch_size: int, generator: torch.Generator, device: torch.device
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """One shuffled epoch of ``(images [B, C, H, W], labels [B])`` on ``device``.

    In-memory datasets (and subsets of one) are sliced directly (no per-item Python work,
    augmentation as one batched crop and flip, the images kept on ``device``:
    ``InMemoryImageDataset.batch``); others go through a single-process ``DataLoader`` with
    ``generator``.
    """
    memory = as_in_memory(dataset)
    if memory is not None:  # the set on the device once; crops (and flips) drawn on the CPU, applied there
        order = torch.randperm(len(memory), generator=generator)
        for start in range(0, len(order), batch_size):
            yield memory.batch(order[start : start + batch_size], device, generator)
        return
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=True, generator=generator, num_workers=0)
    for images, labels in loader:
        yield images.to(device), labels.to(device)


def cross_entropy_loss(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``model(images)`` against ``labels``."""
    return F.cross_entropy(model(images), labels)


@torch.no_grad()
def accuracy(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, batch_size: int = 2048) -> float:
    """Top-1 accuracy (fraction) of ``model`` in eval mode on in-memory ``images`` ``[N, ...]``."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    correct = 0
    for start in range(0, len(labels), batch_size):
        logits = model(images[start : start + batch_size].to(device))
        correct += int((logits.argmax(1).cpu() == labels[start : start + batch_size]).sum())
    model.train(was_training)
    return correct / max(1, len(labels))


def check_weights_finite(model: nn.Module, where: str) -> None:
    """Raise ``NonFiniteError`` naming the first non-finite parameter or buffer."""
    for name, value in model.state_dict().items():
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise NonFiniteError(f"{where}: {name!r} became NaN/Inf")


def train_epoch(
    model: nn.Module,
    dataset: Dataset,
    optimizer: "torch.optim.Optimizer | OptimizerChain",
    batch_size: int,
    generator: torch.Generator,
    where: str,
    loss_fn: LossFn = cross_entropy_loss,
    on_step: StepCallback | None = None,
    epoch: int = 0,
    acceleration: Acceleration = FULL_PRECISION,
    scaler: torch.amp.GradScaler | None = None,
) -> float:
    """One epoch of SGD; returns the mean loss. A non-finite loss raises ``NonFiniteError``.
    ``on_step(epoch, step, model)`` (optional) runs after every optimiser step.

    With ``acceleration`` the forward pass runs under autocast and the batches in its memory
    format; ``scaler`` (from ``acceleration.scaler``) scales float16 losses across epochs.
    """
    device = next(model.parameters()).device
    scaler = scaler if scaler is not None else acceleration.scaler(device)
    model.train()
    total, count = 0.0, 0
    for step, (images, labels) in enumerate(iterate_batches(dataset, batch_size, generator, device)):
        with acceleration.autocasting(device):
            loss = loss_fn(model, acceleration.inputs(images), labels)
        if not torch.isfinite(loss):
            raise NonFiniteError(f"{where}: loss became {loss.item()} at step {step}")
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        if on_step is not None:
            on_step(epoch, step, model)
        total += float(loss.detach()) * len(labels)
        count += len(labels)
    return total / max(1, count)


def curve_subset(train_eval: Tensors, size: int) -> Tensors:
    """``size`` items of the un-augmented training split ``(images [N, ...], labels [N])``, evenly
    spaced (item ``i N // size``): the fixed subset on which a training curve measures the training
    accuracy each epoch, at the cost of the validation split's (``train_network(curves=True)``)."""
    n = len(train_eval[1])
    index = torch.arange(min(size, n), device=train_eval[1].device) * n // max(1, min(size, n))
    return train_eval[0][index], train_eval[1][index]


def train_network(
    model: nn.Module,
    train_set: Dataset,
    check_set: Tensors | None,
    recipe: Recipe,
    seed: int,
    where: str = "training",
    loss_fn: LossFn = cross_entropy_loss,
    train_eval: Tensors | None = None,
    optimizer_factory: OptimizerFactory | None = None,
    on_step: StepCallback | None = None,
    acceleration: Acceleration = FULL_PRECISION,
    curves: bool = False,
) -> TrainResult:
    """Train ``model`` in place with ``recipe``; data order drawn from ``seed``.

    ``check_set`` ``(images [N, ...], labels [N])`` is the held-out set for the recipe's
    non-convergence rule and the reported check accuracy (None: no rule can be judged; an
    active rule then raises ValueError); ``train_eval`` (optional) the same for the reported
    train accuracy. ``optimizer_factory(model, recipe)`` replaces the recipe's SGD (its groups
    follow the recipe's schedule, scaled by their ``lr_scale``). ``on_step(epoch, step, model)``
    (optional) runs after every optimiser step. A run below ``recipe.fail_rule.min_accuracy`` after
    ``fail_rule.epoch`` epochs stops early, and one that ends below ``fail_rule.final_threshold``
    is also failed; both return with ``failure`` set.
    NaN/Inf raises ``NonFiniteError`` (nothing to store). ``acceleration``: mixed precision and
    memory format (see ``Acceleration``; evaluation runs in full precision).

    ``curves``: every epoch's history record also holds ``check_accuracy`` (on ``check_set``) and
    ``train_subset_accuracy`` (on ``curve_subset(train_eval, len(check_set))``), measured in eval
    mode without touching any generator, so the weights are those of a run without curves.
    """
    if check_set is None and recipe.fail_rule.active:
        raise ValueError(f"{where}: the recipe's convergence rule needs held-out data; set dataset.validation_fraction > 0")
    problem = plateau_problem(recipe, train_eval, loss_fn is cross_entropy_loss and optimizer_factory is None)
    if problem:
        raise ValueError(f"{where}: {problem}")
    plateau = recipe.until_plateau if recipe.until_plateau.enabled else None
    potentials: list[float] = []
    accuracies: list[float] = []
    plateaued = False if plateau is not None else None
    generator = torch.Generator().manual_seed(seed)
    model = acceleration.prepare(model)
    optimizer = make_optimizer(model.parameters(), recipe) if optimizer_factory is None else optimizer_factory(model, recipe)
    scaler = acceleration.scaler(next(model.parameters()).device)
    history = []
    curve_train = curve_subset(train_eval, len(check_set[1])) if curves and check_set is not None and train_eval is not None else None
    epochs_run = recipe.max_epochs  # unless it plateaus first
    for epoch in range(recipe.max_epochs):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(recipe, epoch) * group.get("lr_scale", 1.0)
        loss = train_epoch(model, train_set, optimizer, recipe.batch_size, generator, f"{where}, epoch {epoch + 1}", loss_fn,
                           on_step, epoch, acceleration, scaler)
        check_weights_finite(model, f"{where}, epoch {epoch + 1}")
        record = {"epoch": epoch + 1, "loss": loss}
        if curves and check_set is not None:
            record["check_accuracy"] = accuracy(model, *check_set)
        if curve_train is not None:
            record["train_subset_accuracy"] = accuracy(model, *curve_train)
        rule = recipe.fail_rule
        if rule.epoch is not None and epoch + 1 == rule.epoch:
            acc = record["check_accuracy"] if "check_accuracy" in record else accuracy(model, *check_set)
            record["check_accuracy"] = acc
            history.append(record)
            if rule.min_accuracy is not None and acc < rule.min_accuracy:
                reason = f"held-out accuracy {acc:.3f} < {rule.min_accuracy} after epoch {epoch + 1} (did not converge)"
                return TrainResult(_cpu_state(model), math.nan, acc, epoch + 1, failure=reason, history=history,
                                   plateaued=plateaued)
        else:
            history.append(record)
        if plateau is not None and epoch + 1 >= plateau.first_measured(recipe.epochs):
            record["potential"], record["train_accuracy"] = model_potential(model, train_eval, recipe.weight_decay)
            potentials.append(record["potential"])
            accuracies.append(record["train_accuracy"])
            if epoch + 1 >= recipe.epochs and plateau.reached(potentials, accuracies):
                plateaued, epochs_run = True, epoch + 1
                break
    check_acc = accuracy(model, *check_set) if check_set is not None else math.nan
    train_acc = accuracy(model, *train_eval) if train_eval is not None else math.nan
    failure = recipe.fail_rule.final_failure(check_acc)
    return TrainResult(_cpu_state(model), train_acc, check_acc, epochs_run, failure=failure, history=history,
                       plateaued=plateaued)


def plateau_problem(recipe: Recipe, train_eval: Tensors | None, plain: bool) -> str | None:
    """Why a training cannot follow ``recipe.until_plateau`` (None: it can, or the option is off):
    the criterion needs the un-augmented training split (``train_eval``) and the plain network's
    cross-entropy and SGD (``plain``), whose potential it measures."""
    if not recipe.until_plateau.enabled:
        return None
    if train_eval is None:
        return "train.until_plateau needs the un-augmented training split (train_eval) to measure the potential"
    if not plain:
        return ("train.until_plateau measures the plain network's training potential; this training has its own "
                "loss or optimizer (a method's training follows the recipe's epochs: Recipe.without_plateau)")
    return None


def model_potential(model: nn.Module, train_eval: Tensors, weight_decay: float) -> tuple[float, float]:
    """``(U, training accuracy)`` of ``model`` on the un-augmented training split ``train_eval``:
    ``training_potential`` (nats) and the fraction of correct argmax predictions."""
    images, labels = train_eval
    state = {k: v.detach()[None] for k, v in model.state_dict().items()}
    was_training = model.training
    nll, correct = fit_with_weights(model, state, images, labels)
    model.train(was_training)
    names = [name for name, _ in model.named_parameters()]
    potential = training_potential(nll, squared_norm(state, names), len(labels), weight_decay)
    return float(potential[0]), float(correct[0]) / max(1, len(labels))


def _cpu_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in model.state_dict().items()}
