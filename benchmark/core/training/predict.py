"""Predictions of many weight samples of one architecture at once: through the packed CPU kernels
(``benchmark.core.training.stacked.PackedChain``) where the architecture allows, else one sample
after another (``benchmark.core.models.predict_with_weights``). Same probabilities up to float
rounding (the kernels sum in another order than PyTorch's convolutions; tested)."""
from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from benchmark.core.models import predict_with_weights
from benchmark.core.training.objective import EVAL_ELEMENTS
from benchmark.core.training.stacked import LANES, NotStackableError, PackedChain

NETWORKS = 128  # samples per pass through the kernels (zoo.vectorize=auto's K: no faster beyond, make bench)


@torch.no_grad()
def predict_samples(model: nn.Module, sample_set: Mapping[str, torch.Tensor], images: torch.Tensor) -> torch.Tensor:
    """Softmax probabilities ``[S, N, C]`` (float32, CPU) of the plain ``model`` run with each weight
    sample of ``sample_set`` (``{state-dict key: [S, ...]}``) on ``images`` ``[N, ...]`` in eval mode:
    ``NETWORKS`` samples at a time through the packed kernels when ``model`` is on the CPU and its
    architecture is a packed chain whose keys are the sample set's, else ``predict_with_weights``."""
    if next(model.parameters()).device.type != "cpu":
        return predict_with_weights(model, sample_set, images)
    try:
        chain = PackedChain(model)
    except NotStackableError:
        return predict_with_weights(model, sample_set, images)
    if set(chain.keys) != set(sample_set):
        return predict_with_weights(model, sample_set, images)
    dtype = next(model.parameters()).dtype
    samples, n = next(iter(sample_set.values())).shape[0], len(images)
    out: torch.Tensor | None = None
    for first in range(0, samples, NETWORKS):
        last = min(samples, first + NETWORKS)
        params = {key: sample_set[key][first:last].to(dtype).movedim(0, chain.network_axis(key)).contiguous()
                  for key in chain.keys}
        lanes = (last - first) + (-(last - first) % LANES)
        batch = max(1, EVAL_ELEMENTS // max(1, images[0].numel() * lanes))
        for start in range(0, n, batch):
            logits = chain.predict(params, images[start : start + batch].to(dtype))  # [K, b, C]
            if out is None:
                out = torch.empty(samples, n, logits.shape[-1], dtype=torch.float32, device="cpu")  # on the CPU by contract
            out[first:last, start : start + batch] = torch.softmax(logits, dim=-1).float()
    assert out is not None
    return out
