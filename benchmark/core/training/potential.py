"""The training potential of a plain network: the one definition the reference's description
(``ZooReference.training_potential``) and the trainers' ``until_plateau`` criterion both use.

``U(w) = sum_i CE(f_w(x_i), y_i) + (N weight_decay / 2) |w|^2`` over the network's parameters
(nats; the un-augmented training split of N images): the potential of the posterior at T = 1
whose prior is the Gaussian the recipe's weight decay implies, and N times what SGD with that weight
decay minimises (the mean cross-entropy of its batches plus ``weight_decay / 2 |w|^2``).
"""
from __future__ import annotations

from typing import Callable, Iterable, Mapping

import torch


def training_potential(nll: torch.Tensor, squared: torch.Tensor, count: int, weight_decay: float) -> torch.Tensor:
    """``U`` (float64, same shape as ``nll``) from the summed training cross-entropy ``nll`` (nats)
    of each network, the squared norm ``squared`` of its parameters, the number ``count`` of
    training images and the recipe's ``weight_decay``."""
    return nll.double() + 0.5 * count * float(weight_decay) * squared.double()


def squared_norm(tensors: Mapping[str, torch.Tensor], keys: Iterable[str],
                 axis: Callable[[str], int] = lambda key: 0) -> torch.Tensor:
    """``[S]`` (float64): for each of the S networks stacked in ``tensors`` (``{key: tensor}``, the
    networks along ``axis(key)``), the summed squares of its entries under ``keys`` (its parameters)."""
    total = None
    for key in keys:
        value = tensors[key].detach()
        value = value.movedim(axis(key) % value.dim(), 0)
        part = value.reshape(value.shape[0], -1).double().pow(2).sum(1).cpu()
        total = part if total is None else total + part
    if total is None:
        raise ValueError("squared_norm: no parameter keys")
    return total
