"""What the vectorised trainer (``train_networks``) minimises for K stacked networks.

An objective owns the trainable stacked parameters (their layout, ``network_axis``), each network's
loss on its own batch, and how a network's accuracy is judged, so that the trainer's loop (data
order, augmentation, SGD and its schedule, the convergence rule, NaN handling, lanes leaving the
stack) serves other training problems than the plain network's cross-entropy: the vBNN's ELBO
(``methods.bnn_stacked``) trains means and scales whose draws are the networks' weights.

Every method takes ``lanes``: for each position of the stack, the index (into the trainer's
``models``) of the network there, since networks leave the stack as they fail; an objective that
draws random numbers per network uses it to keep each network's own stream.

An objective may also offer ``loss_and_grads(params, batch, labels, lanes) -> (losses [K], grads)``:
the step's losses and the gradients of their sum without an autograd graph; the trainer then uses
it instead of ``losses`` and ``backward`` (the zoo's cross-entropy, and MC Dropout's
(``methods.dropout``), through the packed CPU kernels).
"""
from __future__ import annotations

from typing import Callable, Mapping, Protocol, Sequence

import torch
import torch.nn.functional as F

from benchmark.core.training.stacked import Params, StackedNetworks

EVAL_ELEMENTS = 2**22  # images x pixels x networks per evaluation batch (16 MiB of float32)
Gather = Callable[[int], torch.Tensor]
"""``gather(copies)``: the step's batch as ``StackedNetworks.forward`` reads it, for ``copies x K``
networks: network ``c K + k`` sees network ``k``'s images (copies of each network's batch, e.g. one
per Monte Carlo draw of its weights)."""


class StackedObjective(Protocol):
    """The training problem of K stacked networks (see the module doc)."""

    def initial(self) -> Params:
        """The trainable parameters of the K networks at the start, stacked along ``network_axis``."""

    def network_axis(self, key: str) -> int:
        """The axis of parameter ``key``'s stacked tensor that indexes the networks."""

    def select(self, tensors: Params, indices: torch.Tensor) -> Params:
        """The networks at positions ``indices`` (1-D long tensor) of parameters or same-shaped buffers."""

    def losses(self, params: Params, gather: Gather, labels: torch.Tensor, lanes: Sequence[int]) -> torch.Tensor:
        """``[K]``: each network's mean loss on its own batch (``gather``) with ``labels [K, B]``,
        differentiable with respect to ``params``."""

    def accuracies(self, params: Params, tensors: tuple[torch.Tensor, torch.Tensor], lanes: Sequence[int]) -> torch.Tensor:
        """``[K]`` (float64): each network's top-1 accuracy (fraction) on the shared ``(images [N, ...], labels [N])``."""

    def result(self, params: Params, position: int, lane: int) -> dict[str, torch.Tensor]:
        """The trained state of the network at ``position`` (CPU tensors), what its ``TrainResult`` carries."""


def stacked_accuracies(predict, images: torch.Tensor, labels: torch.Tensor, count: int, device: torch.device,
                       dtype: torch.dtype) -> torch.Tensor:
    """``[count]`` (float64) accuracies of ``count`` networks whose logits on shared images
    ``predict(images [b, ...]) -> [count, b, classes]`` gives (``stacked_fit``'s correct predictions)."""
    return stacked_fit(predict, images, labels, count, device, dtype)[1].double() / max(1, len(labels))


def stacked_fit(predict, images: torch.Tensor, labels: torch.Tensor, count: int, device: torch.device,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(nll [count] float64, correct [count] int64)``: the summed cross-entropy (from float64
    logits, as ``benchmark.core.models.fit_with_weights``) and the correct argmax predictions of
    ``count`` networks whose logits on shared images ``predict(images [b, ...]) -> [count, b,
    classes]`` gives, evaluated in batches of at most ``EVAL_ELEMENTS`` images x pixels x networks
    and summed on the device (read once)."""
    batch = max(1, EVAL_ELEMENTS // max(1, images[0].numel() * count))
    nll = torch.zeros(count, dtype=torch.float64, device=device)
    correct = torch.zeros(count, dtype=torch.long, device=device)
    labels = labels.to(device)
    with torch.no_grad():
        for start in range(0, len(labels), batch):
            logits = predict(images[start : start + batch].to(device, dtype)).double()  # [count, b, classes]
            target = labels[start : start + batch]
            nll += F.cross_entropy(logits.flatten(0, 1), target.repeat(count), reduction="none").view(count, -1).sum(1)
            correct += (logits.argmax(-1) == target).sum(1)
    return nll.cpu(), correct.cpu()


class CrossEntropyObjective:
    """The plain networks ``models`` trained on the mean cross-entropy of their batches (the zoo)."""

    def __init__(self, stacked: StackedNetworks, models: Sequence[torch.nn.Module]) -> None:
        self.stacked = stacked
        self.states: list[Mapping[str, torch.Tensor]] = [m.state_dict() for m in models]
        fused = getattr(stacked, "loss_and_grads", None)
        if fused is not None:  # the packed kernels compute the cross-entropy step themselves
            self.loss_and_grads = lambda params, batch, labels, lanes: fused(params, batch, labels)

    def initial(self) -> Params:
        return self.stacked.pack(self.states)

    def network_axis(self, key: str) -> int:
        return self.stacked.network_axis(key)

    def select(self, tensors: Params, indices: torch.Tensor) -> Params:
        return self.stacked.select(tensors, indices)

    def losses(self, params: Params, gather: Gather, labels: torch.Tensor, lanes: Sequence[int]) -> torch.Tensor:
        logits = self.stacked.forward(params, gather(1))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(labels.shape).mean(1)

    def accuracies(self, params: Params, tensors: tuple[torch.Tensor, torch.Tensor], lanes: Sequence[int]) -> torch.Tensor:
        first = next(iter(params.values()))
        return stacked_accuracies(lambda images: self.stacked.predict(params, images), *tensors, len(lanes),
                                  first.device, first.dtype)

    def fit(self, params: Params, tensors: tuple[torch.Tensor, torch.Tensor], lanes: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(nll [K], correct [K])`` of each network on the shared ``(images, labels)`` (``stacked_fit``):
        what ``train.until_plateau`` measures the training potential from."""
        first = next(iter(params.values()))
        return stacked_fit(lambda images: self.stacked.predict(params, images), *tensors, len(lanes), first.device,
                           first.dtype)

    def result(self, params: Params, position: int, lane: int) -> dict[str, torch.Tensor]:
        return self.stacked.unpack(params, position)
