"""The ways to train K OptuNets at once that ``bench_zoo.py`` times side by side, per network and step.

- ``packed``: the suite's numba kernels (``PackedChain``, networks in the SIMD lanes), the step as the
  zoo trainer takes it (``loss_and_grads``: forward, cross-entropy and backward without autograd);
- ``vmap``: ``torch.func.vmap`` over the model (``VmapNetworks``; PyTorch turns each convolution
  into a grouped one), with oneDNN (mkldnn) on and off;
- ``grouped``: the same written by hand, the K networks as the groups of one ``conv2d`` per layer and
  ``baddbmm`` for the linear layers, oneDNN on and off;
- ``compiled``: ``grouped`` through ``torch.compile`` (inductor), oneDNN on;
- ``one``: ``train_network``'s loop, one network after the other (the baseline).

Each is timed on the same batches (indices drawn once), the same SGD (momentum, weight decay), float
images, one thread, after two warm-up steps; the
PyTorch-native ones (vmap, grouped, compiled) run unchanged on a GPU.
"""
from __future__ import annotations

import time
from typing import Callable

import torch
import torch.nn.functional as F

from benchmark.core.training.stacked import PackedChain, VmapNetworks


def grouped_forward(params: dict[str, torch.Tensor], images: torch.Tensor) -> torch.Tensor:
    """OptuNet of K networks as grouped convolutions: ``images [K, B, 1, H, W]`` (each network its
    own) and parameters stacked on axis 0 (``VmapNetworks.pack``) -> logits ``[K, B, classes]``."""
    k, b = images.shape[:2]
    x = images.transpose(0, 1).reshape(b, k * images.shape[2], *images.shape[3:])
    w1 = params["conv1.weight"]
    x = F.max_pool2d(torch.relu(F.conv2d(x, w1.reshape(-1, *w1.shape[2:]), groups=k)), 3)
    w2 = params["conv2.weight"]
    x = torch.relu(F.conv2d(x, w2.reshape(-1, *w2.shape[2:]), groups=2 * k))
    x = x.mean((2, 3)).view(b, k, -1).transpose(0, 1)
    x = torch.relu(torch.baddbmm(params["fc1.bias"].unsqueeze(1), x, params["fc1.weight"].transpose(1, 2)))
    return torch.baddbmm(params["fc2.bias"].unsqueeze(1), x, params["fc2.weight"].transpose(1, 2))


def _timed(step: Callable[[], None], steps: int) -> float:
    """Seconds per call of ``step`` (process CPU time, after two warm-up calls)."""
    step()
    step()
    start = time.process_time()
    for _ in range(steps):
        step()
    return (time.process_time() - start) / steps


LR, MOMENTUM, WEIGHT_DECAY = 0.01, 0.9, 2e-4  # every candidate's SGD


def _optimizer(params) -> torch.optim.SGD:
    return torch.optim.SGD(list(params), lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)


def _stacked_step(forward, params, batch, labels) -> Callable[[], None]:
    """A step through autograd over ``forward`` (the PyTorch-native candidates)."""
    optimizer = _optimizer(params.values())
    k, b = labels.shape

    def step() -> None:
        logits = forward(params, batch())
        losses = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(k, b).mean(1)
        optimizer.zero_grad(set_to_none=True)
        losses.sum().backward()
        optimizer.step()
    return step


def _fused_step(stacked: PackedChain, params, batch, labels) -> Callable[[], None]:
    """The packed kernels' step as the zoo trainer takes it: ``loss_and_grads`` without autograd."""
    optimizer = _optimizer(params.values())

    def step() -> None:
        _, grads = stacked.loss_and_grads(params, batch(), labels)
        for key, value in params.items():
            value.grad = grads[key]
        optimizer.step()
    return step


def seconds_per_network_step(models: list[torch.nn.Module], images: torch.Tensor, labels: torch.Tensor, batch: int,
                             steps: int, candidates: tuple[str, ...]) -> dict[str, float]:
    """Seconds per network and training step (SGD with momentum) of each candidate on ``len(models)``
    OptuNets, ``batch`` images each (``images [N, 1, H, W]``, ``labels [N]``)."""
    k = len(models)
    generator = torch.Generator().manual_seed(0)
    index = torch.stack([torch.randperm(len(labels), generator=generator)[:batch] for _ in range(k)])
    targets = labels[index]
    states = [m.state_dict() for m in models]
    out: dict[str, float] = {}
    saved = torch.backends.mkldnn.enabled
    try:
        for name in candidates:
            if name == "one":
                model, optimizer = models[0], _optimizer(models[0].parameters())

                def step(model=model, optimizer=optimizer):
                    for i in range(k):
                        loss = F.cross_entropy(model(images[index[i]]), targets[i])
                        optimizer.zero_grad(set_to_none=True)
                        loss.backward()
                        optimizer.step()
                torch.backends.mkldnn.enabled = False  # the suite's CPU setting for OptuNet (model.cpu_native_conv)
                out[name] = _timed(step, max(1, steps // 4)) / k
                continue
            if name == "packed":
                stacked = PackedChain(models[0])
                source = stacked.source(images, torch.device("cpu"))
                make_batch = lambda: stacked.batch(source, index, None, 0, 0.0)  # noqa: E731
                params = {key: value.clone().requires_grad_() for key, value in stacked.pack(states).items()}
                out[name] = _timed(_fused_step(stacked, params, make_batch, targets), steps) / k
                continue
            else:
                stacked = VmapNetworks(models[0])
                make_batch = lambda: images[index]  # noqa: E731
                forward = {"vmap": stacked.forward, "grouped": grouped_forward}.get(name.split()[0])
                if name.startswith("compiled"):
                    forward = torch.compile(grouped_forward, dynamic=False)
            torch.backends.mkldnn.enabled = "mkldnn off" not in name
            params = {key: value.clone().requires_grad_() for key, value in stacked.pack(states).items()}
            out[name] = _timed(_stacked_step(forward, params, make_batch, targets), steps) / k
    finally:
        torch.backends.mkldnn.enabled = saved
    return out
