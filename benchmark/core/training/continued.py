"""Continue training K trained networks at once under a per-step learning-rate plan, reading
their weights at chosen steps (SWAG's SGD phase and snapshots, ``methods.swag``).

Network i follows the one-at-a-time loop a method writes with ``iterate_batches``: its own
``torch.Generator(seeds[i])`` (one permutation per epoch, then the crop offsets of each batch,
drawn as ``iterate_batches`` draws them), SGD with the recipe's momentum, Nesterov flag and
weight decay from its given weights (momentum starting at zero), the learning rate
``plan.lr(step)`` set before each 0-based step, and its weights read after each step in
``plan.snapshot_steps`` (1-based: after that many steps). Results agree with that loop up to
float rounding (the packed CPU kernels sum in another order than PyTorch's convolutions), and a
network's bits do not depend on the other members of its stack (the kernels compute each
network in its own SIMD lane; tested). A network whose loss or weights become NaN/Inf leaves the
stack at the end of that epoch with the ``NonFiniteError`` the one-at-a-time loop raises.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

from benchmark.core.data import epoch_crop_offsets
from benchmark.core.training.loop import NonFiniteError
from benchmark.core.training.objective import CrossEntropyObjective
from benchmark.core.training.recipe import Recipe
from benchmark.core.training.stacked import stacked_networks
from benchmark.core.training.vectorised import Lane, Stack, check_stackable

Snapshot = Callable[[int, int, torch.Tensor], None]
"""``on_snapshot(index, step, theta)``: network ``index`` (into the caller's lists) after ``step``
steps, its parameters flattened ``[P]`` in ``template.parameters()`` order (float64, CPU)."""


@dataclass(frozen=True)
class StepPlan:
    """``total_steps`` SGD steps, the rate ``lr(step)`` of 0-based step ``step``, and the 1-based
    steps after which the weights are read (``snapshot_steps``)."""

    total_steps: int
    lr: Callable[[int], float]
    snapshot_steps: frozenset[int]


def flat_parameters(state: Mapping[str, torch.Tensor], template: nn.Module) -> torch.Tensor:
    """``[P]`` float64: ``state``'s parameters in ``template.parameters()`` order, as
    ``parameters_to_vector`` flattens a model holding ``state``."""
    return torch.cat([state[name].detach().reshape(-1).double().cpu() for name, _ in template.named_parameters()])


def continue_networks(
    template: nn.Module,
    states: Sequence[Mapping[str, torch.Tensor]],
    train,
    recipe: Recipe,
    seeds: Sequence[int],
    where: Sequence[str],
    plan: StepPlan,
    on_snapshot: Snapshot,
    implementation: str = "auto",
    progress: bool = False,
) -> list[dict[str, torch.Tensor] | NonFiniteError]:
    """Continue training the networks of ``template``'s architecture holding ``states`` (K trained
    state dicts) on ``train`` together, network i with data order from ``seeds[i]`` (see the module
    doc). Returns per network its final state dict (CPU) or the ``NonFiniteError`` naming
    ``where[i]``. Raises ``NotStackableError`` if the architecture or data cannot be stacked
    (then train them one at a time)."""
    if not (len(states) == len(seeds) == len(where)) or not states:
        raise ValueError(f"continue_networks: {len(states)} states, {len(seeds)} seeds and {len(where)} names; "
                         f"need as many of each (>= 1)")
    dataset = check_stackable(train)
    device = next(template.parameters()).device
    stacked = stacked_networks(template, device, implementation)
    objective = CrossEntropyObjective(stacked, [])  # the zoo's loss; the networks start from ``states``
    lanes = [Lane(i, where[i], torch.Generator().manual_seed(int(s))) for i, s in enumerate(seeds)]
    stack = Stack(objective, stacked.pack([{k: v.detach() for k, v in state.items()} for state in states]), recipe, lanes)
    dtype = next(iter(stack.params.values())).dtype
    outcomes: list[dict[str, torch.Tensor] | NonFiniteError | None] = [None] * len(states)
    n, batch_size = len(dataset), recipe.batch_size
    source = stacked.source(dataset.images.to(dtype), device, dataset.codes)
    labels_on_device = dataset.labels.to(device)
    bar = tqdm(total=plan.total_steps, desc=f"{len(states)} networks stacked", unit="step", disable=not progress,
               dynamic_ncols=True)
    step = 0
    while step < plan.total_steps and stack.lanes:
        order = torch.stack([torch.randperm(n, generator=lane.generator) for lane in stack.lanes]).to(device)
        crops = None
        if dataset.augment:
            crops = torch.stack([epoch_crop_offsets(n, batch_size, dataset.augment_padding, lane.generator)
                                 for lane in stack.lanes]).to(device)
        bad_step = torch.full((len(stack.lanes),), -1, dtype=torch.long, device=device)
        bad_loss = torch.zeros(len(stack.lanes), dtype=torch.float64, device=device)
        for start in range(0, n, batch_size):
            idx = order[:, start : start + batch_size]
            offsets = None if crops is None else crops[:, :, start : start + idx.shape[1]]
            batch = stacked.batch(source, idx, offsets, dataset.augment_padding, dataset.fill)
            for group in stack.optimizer.param_groups:
                group["lr"] = plan.lr(step)
            losses = stack.step(lambda copies, b=batch: b, labels_on_device[idx])
            first = (bad_step < 0) & ~torch.isfinite(losses)
            bad_step = torch.where(first, step, bad_step)
            bad_loss = torch.where(first, losses.double(), bad_loss)
            step += 1
            bar.update()
            if step in plan.snapshot_steps:
                for position, lane in enumerate(stack.lanes):
                    on_snapshot(lane.index, step, flat_parameters(stacked.unpack(stack.params, position), template))
            if step == plan.total_steps:
                break
        failed_at, values = bad_step.tolist(), bad_loss.tolist()
        keep = []
        for lane, at, value in zip(stack.lanes, failed_at, values):
            if at >= 0:
                outcomes[lane.index] = NonFiniteError(f"{lane.where}: loss became {value} at step {at + 1}")
            keep.append(at < 0)
        if not all(keep):
            stack.keep(torch.tensor(keep))
        bad = stack.first_non_finite() if stack.lanes else []
        if any(bad):
            for lane, key in zip(stack.lanes, bad):
                if key is not None:
                    outcomes[lane.index] = NonFiniteError(f"{lane.where}, step {step}: {key!r} became NaN/Inf")
            stack.keep(torch.tensor([key is None for key in bad]))
    bar.close()
    for position, lane in enumerate(stack.lanes):
        outcomes[lane.index] = stacked.unpack(stack.params, position)
    return outcomes  # type: ignore[return-value]

