"""Predict with the plain model carrying each weight sample of a sample set in turn."""
from __future__ import annotations

from typing import Mapping

import torch
from torch import nn
from torch.func import functional_call


@torch.no_grad()
def predict_with_weights(
    model: nn.Module, sample_set: Mapping[str, torch.Tensor], images: torch.Tensor, batch_size: int = 1024
) -> torch.Tensor:
    """Softmax probabilities ``[S, N, C]`` (float32, CPU) of the plain ``model`` run with each
    weight sample of ``sample_set`` (``{state-dict key: [S, ...]}``) on ``images`` ``[N, ...]``,
    in eval mode, in batches of ``batch_size`` images."""
    model.eval()
    device = next(model.parameters()).device
    samples = next(iter(sample_set.values())).shape[0]
    out = []
    for i in range(samples):
        weights = {k: v[i].to(device) for k, v in sample_set.items()}
        probs = [
            torch.softmax(functional_call(model, weights, (images[a : a + batch_size].to(device),)), dim=-1).float().cpu()
            for a in range(0, len(images), batch_size)
        ]
        out.append(torch.cat(probs))
    return torch.stack(out)


@torch.no_grad()
def fit_with_weights(
    model: nn.Module, sample_set: Mapping[str, torch.Tensor], images: torch.Tensor, labels: torch.Tensor,
    batch_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """How each weight sample of ``sample_set`` (``{state-dict key: [S, ...]}``) fits ``images [N, ...]``
    with ``labels [N]``: the summed cross-entropy ``[S]`` (nats, float64, from the log-softmax, so a
    confident mistake costs what it costs rather than an underflowed probability) and the number of
    correct argmax predictions ``[S]`` (int64), the plain ``model`` in eval mode."""
    model.eval()
    device = next(model.parameters()).device
    samples = next(iter(sample_set.values())).shape[0]
    nll = torch.zeros(samples, dtype=torch.float64, device="cpu")
    correct = torch.zeros(samples, dtype=torch.int64, device="cpu")
    for i in range(samples):
        weights = {k: v[i].to(device) for k, v in sample_set.items()}
        for a in range(0, len(images), batch_size):
            logits = functional_call(model, weights, (images[a : a + batch_size].to(device),)).double()
            target = labels[a : a + batch_size].to(device)
            nll[i] += torch.nn.functional.cross_entropy(logits, target, reduction="sum").cpu()
            correct[i] += (logits.argmax(-1) == target).sum().cpu()
    return nll, correct
