"""K networks of one architecture as one set of stacked parameters and one forward pass.

Two implementations of one interface (``StackedNetworks``), both exact per network (a
network's output never depends on the others):

- ``PackedChain`` (CPU): the layer chain of the model (``model.layer_chain()``, or an
  ``nn.Sequential``) run on activations ``[B, C, H, W, K]`` with the network index innermost;
  convolutions (and a max-pool right after one) and the head (global average pooling, the Linear
  layers, the cross-entropy of ``loss_and_grads``) go through the numba kernels of
  ``benchmark.core.training.kernels``. Supports a body of Conv2d (stride 1, no padding, any groups)
  each optionally followed by ReLU and MaxPool2d (kernel = stride), then a head of [global
  average pooling] -> Flatten -> Linear layers, each optionally followed by one ReLU (Identity and
  Dropout(p=0) are skipped): OptuNet and the MLP. Dropout masks are not drawn here: ``forward`` and
  ``loss_and_grads`` take a multiplier of the last Linear's input instead (``last_input_scale``;
  MC Dropout's masks, ``methods.dropout``).
- ``VmapNetworks`` (any device, any model without BatchNorm or active dropout):
  ``torch.func.vmap`` over ``functional_call``; PyTorch batches each convolution into a
  grouped one (``last_input_scale`` through a pre-hook on the last Linear).

Parameters are a dict keyed like the model's state dict; each tensor holds the K networks
along ``network_axis(key)`` (so an SGD step over them is K independent steps).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Mapping, Protocol, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, vmap

from benchmark.core.data import crop_at, decode
from benchmark.core.training.kernels import (
    average_positions, conv_kernels, cross_entropy, dense_backward, dense_forward, gather_batch, input_grad_kernel,
    spread_positions,
)

Params = dict[str, torch.Tensor]
LANES = 16  # networks per SIMD vector of float32 (AVX-512); stacks are padded to a multiple of it
PART_IMAGES = 16  # images of a training batch that loss_and_grads takes through forward and backward at a time


class NotStackableError(ValueError):
    """The model cannot be trained as stacked networks; the message says which layer and why."""


class StackedNetworks(Protocol):
    """What the vectorised trainer needs from a stacked architecture."""

    def network_axis(self, key: str) -> int:
        """The axis of parameter ``key``'s stacked tensor that indexes the networks."""

    def pack(self, state_dicts: Sequence[Mapping[str, torch.Tensor]]) -> Params:
        """Stack K state dicts (the template's keys) into parameters."""

    def unpack(self, params: Params, index: int) -> dict[str, torch.Tensor]:
        """The state dict of network ``index`` (contiguous CPU copies, the template's key order)."""

    def select(self, tensors: Params, indices: torch.Tensor) -> Params:
        """The networks ``indices`` (1-D long tensor) of parameters or same-shaped buffers."""

    def source(self, images: torch.Tensor, device: torch.device, codes: tuple[torch.Tensor, torch.Tensor] | None = None):
        """The training images ``[N, C, H, W]`` stored as ``batch`` reads them (an opaque value for
        ``batch``); ``codes``: the same images as ``(uint8 codes, levels [C, L])`` with
        ``images[n, c] == levels[c, codes[n, c]]`` (``InMemoryImageDataset.codes``), which an
        implementation may read instead."""

    def batch(self, source: torch.Tensor, index: torch.Tensor, offsets: torch.Tensor | None, padding: int,
              fill: float) -> torch.Tensor:
        """The input of ``forward``: image ``index[k, b]`` of ``source`` for network k, cropped at
        ``offsets[k, :, b]`` after padding by ``padding`` pixels of ``fill`` when ``offsets`` is given
        (as ``benchmark.core.data.crop_at``)."""

    def forward(self, params: Params, batch: torch.Tensor, last_input_scale: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[K, B, classes]`` of network k on its own images of ``batch``; ``last_input_scale``
        (optional, ``[K, B, in]``): network k's input of its last Linear layer on image b is multiplied
        elementwise by ``last_input_scale[k, b]`` (a training dropout mask, ``methods.dropout``)."""

    def predict(self, params: Params, images: torch.Tensor) -> torch.Tensor:
        """Logits ``[K, N, classes]`` of every network on the same ``images [N, C, H, W]``."""


def _chain(model: nn.Module) -> list[tuple[str, nn.Module]]:
    chain = getattr(model, "layer_chain", None)
    if callable(chain):
        return list(chain())
    if isinstance(model, nn.Sequential):
        return list(model.named_children())
    raise NotStackableError(f"{type(model).__name__} declares no layer chain (layer_chain() or nn.Sequential)")


def _pair(value) -> tuple[int, int]:
    return (value, value) if isinstance(value, int) else tuple(value)


@dataclass(frozen=True)
class _Op:
    """One step of a packed chain: ``kind`` in conv, relu, gap, flatten, linear."""

    kind: str
    prefix: str = ""
    groups: int = 1
    pool: int = 0
    relu: bool = False
    has_bias: bool = False


def _conv_problem(name: str, conv: nn.Conv2d) -> str | None:
    if _pair(conv.stride) != (1, 1) or _pair(conv.dilation) != (1, 1):
        return f"{name}: stride {conv.stride} / dilation {conv.dilation}; the packed kernels need 1"
    if conv.padding not in ("valid", 0, (0, 0)):
        return f"{name}: padding {conv.padding}; the packed kernels need none"
    return None


def _pool_size(name: str, pool: nn.MaxPool2d) -> int:
    kernel, stride = _pair(pool.kernel_size), _pair(pool.stride if pool.stride is not None else pool.kernel_size)
    ok = (kernel[0] == kernel[1] and kernel == stride and _pair(pool.padding) == (0, 0) and _pair(pool.dilation) == (1, 1)
          and not pool.ceil_mode and not pool.return_indices)
    if not ok:
        raise NotStackableError(f"{name}: MaxPool2d {pool}; the packed kernels need a square kernel equal to the "
                                "stride, no padding, no dilation, floor mode")
    return kernel[0]


def compile_chain(model: nn.Module) -> list[_Op]:
    """The chain of ``model`` as packed ops; ``NotStackableError`` names the first layer that is not supported."""
    chain = _chain(model)
    ops: list[_Op] = []
    image = True  # activations are images [B, C, H, W, K] until Flatten
    i = 0
    while i < len(chain):
        name, module = chain[i]
        if isinstance(module, nn.Conv2d):
            problem = _conv_problem(name, module)
            if problem or not image:
                raise NotStackableError(problem or f"{name}: a Conv2d after Flatten")
            following = [m for _, m in chain[i + 1 : i + 3]]
            kinds = [("relu" if isinstance(m, nn.ReLU) else "pool" if isinstance(m, nn.MaxPool2d) else "") for m in following]
            # conv [relu] [pool] or conv pool relu: one fused op. relu(maxpool(y)) = maxpool(relu(y)),
            # gradients included (ties go to the same first maximum; a window with no positive value
            # passes no gradient either way).
            taken = 2 if kinds[:2] in (["relu", "pool"], ["pool", "relu"]) else 1 if kinds[:1] in (["relu"], ["pool"]) else 0
            fused = dict(zip(kinds[:taken], chain[i + 1 : i + 1 + taken]))
            pool = _pool_size(*fused["pool"]) if "pool" in fused else 0
            ops.append(_Op("conv", name, module.groups, pool, "relu" in fused, module.bias is not None))
            i += 1 + taken
            continue
        if isinstance(module, nn.ReLU):
            ops.append(_Op("relu"))
        elif isinstance(module, nn.MaxPool2d):
            raise NotStackableError(f"{name}: a MaxPool2d that does not follow a Conv2d (optionally after a ReLU)")
        elif isinstance(module, nn.AdaptiveAvgPool2d):
            if _pair(module.output_size) != (1, 1) or not image:
                raise NotStackableError(f"{name}: AdaptiveAvgPool2d({module.output_size}); only global pooling (1) is supported")
            ops.append(_Op("gap"))
        elif isinstance(module, nn.Flatten):
            if (module.start_dim, module.end_dim) != (1, -1):
                raise NotStackableError(f"{name}: Flatten({module.start_dim}, {module.end_dim}); only Flatten(1, -1)")
            ops.append(_Op("flatten"))
            image = False
        elif isinstance(module, nn.Linear):
            if image:
                raise NotStackableError(f"{name}: a Linear layer on images (no Flatten before it)")
            ops.append(_Op("linear", name, has_bias=module.bias is not None))
        elif isinstance(module, nn.Dropout):
            if module.p > 0:
                raise NotStackableError(f"{name}: Dropout(p={module.p}); stacked training draws no dropout masks")
        elif not isinstance(module, nn.Identity):
            raise NotStackableError(f"{name}: {type(module).__name__} is not supported by the packed kernels")
        i += 1
    if image or not ops or ops[-1].kind != "linear":
        raise NotStackableError(f"{type(model).__name__}: the chain must end with Flatten ... Linear")
    return ops


def _conv_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, groups: int, pool: int,
                  relu: bool) -> tuple[torch.Tensor, tuple]:
    """A packed convolution ``x [B, C, H, W, K]`` -> ``[B, C_out, H', W', K]`` with its ReLU and
    max-pool, and what its backward needs."""
    c_out, cpg, kh, kw, n_k = weight.shape
    kernels = conv_kernels(cpg, kh, kw, max(pool, 1))
    n_b, _, h, w, _ = x.shape
    ho, wo = h - kh + 1, w - kw + 1
    bias_arg = (bias if bias is not None else weight.new_zeros(1, 1)).detach().contiguous().numpy()
    x, weight = x.detach().contiguous(), weight.detach().contiguous()
    if pool:
        out = x.new_empty(n_b, c_out, ho // pool, wo // pool, n_k)
        arg = torch.empty(out.shape, dtype=torch.int8, device="cpu")  # packed kernels: CPU only
        kernels.pool_forward(x.numpy(), weight.numpy(), bias_arg, bias is not None, groups, relu, out.numpy(), arg.numpy())
        return out, (x, weight, out, arg)
    out = x.new_empty(n_b, c_out, ho, wo, n_k)
    kernels.forward(x.numpy(), weight.numpy(), bias_arg, bias is not None, groups, relu, out.numpy())
    return out, (x, weight, out)


def _conv_backward(saved: tuple, grad_out: torch.Tensor, groups: int, pool: int, relu: bool, has_bias: bool,
                   need_x: bool, grad_w: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """``(grad_x or None, grad_w, grad_b or None)`` of ``_conv_forward`` given ``grad_out``; the
    weight gradient is added to ``grad_w`` when given (image by image: a batch's parts added in
    turn give the whole batch's sums to the bit), else to zeros."""
    x, weight, out, *arg = saved
    _, cpg, kh, kw, _ = weight.shape
    kernels = conv_kernels(cpg, kh, kw, max(pool, 1))
    grad_out = grad_out.contiguous()
    grad_w = torch.zeros_like(weight) if grad_w is None else grad_w
    grad_x = torch.zeros_like(x) if need_x else x.new_zeros((1,) * 5)
    args = (x.numpy(), weight.numpy(), out.numpy(), grad_out.numpy())
    if pool:
        kernels.pool_backward(*args, arg[0].numpy(), groups, relu, grad_x.numpy(), grad_w.numpy(), need_x)
    else:
        kernels.backward(*args, groups, relu, grad_w.numpy())
        if need_x:
            input_grad_kernel(cpg, kh, kw, *x.shape[2:4])(weight.numpy(), out.numpy(), grad_out.numpy(), groups, relu,
                                                          grad_x.numpy())
    grad_b = (grad_out * (out > 0) if relu else grad_out).sum(dim=(0, 2, 3)) if has_bias else None
    return (grad_x if need_x else None), grad_w, grad_b


class _ConvFunction(torch.autograd.Function):
    """A packed convolution, with the ReLU and max-pool fused after it, and its own backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, groups: int, pool: int, relu: bool):
        out, saved = _conv_forward(x, weight, bias, groups, pool, relu)
        ctx.save_for_backward(*saved)
        ctx.groups, ctx.pool, ctx.relu, ctx.has_bias = groups, pool, relu, bias is not None
        return out

    @staticmethod
    def backward(ctx, grad_out):
        grads = _conv_backward(ctx.saved_tensors, grad_out, ctx.groups, ctx.pool, ctx.relu, ctx.has_bias,
                               ctx.needs_input_grad[0])
        return (*grads, None, None, None)


def _head(ops: list[_Op]) -> tuple[list[_Op], bool, tuple[_Op, ...]]:
    """``ops`` split into the image part (convolutions, ReLUs) and the head: whether it starts with
    a global average pool, and its linear layers (``relu``: a ReLU follows)."""
    start = next(i for i, op in enumerate(ops) if op.kind in ("gap", "flatten"))
    rest = ops[start:]
    gap = rest[0].kind == "gap"
    rest = rest[1:] if gap else rest
    layers: list[_Op] = []
    if not rest or rest[0].kind != "flatten":
        raise NotStackableError("the packed head needs Flatten right after the global pool")
    for op in rest[1:]:
        if op.kind == "linear":
            layers.append(op)
        elif op.kind == "relu" and layers and not layers[-1].relu:
            layers[-1] = replace(layers[-1], relu=True)
        else:
            raise NotStackableError("after Flatten the packed head takes Linear layers, each optionally followed by one ReLU")
    return ops[:start], gap, tuple(layers)


def _head_forward(x: torch.Tensor, gap: bool, layers: tuple[_Op, ...], params,
                  scale: torch.Tensor | None = None) -> tuple[torch.Tensor, tuple]:
    """The head of a packed chain: ``x [B, C, H, W, K]`` -> [global average pool] -> flatten -> linear
    layers (each with its ReLU) -> logits ``[B, classes, K]``, through the numba kernels with the
    networks innermost (a linear weight ``[K, out, in]`` is laid out ``[out, in, K]`` for them); and
    what its backward needs. ``params``: weight and bias (or None) of each layer, in turn. ``scale``
    (optional, ``[B, in, K]``): multiplies the last layer's input elementwise (e.g. a dropout mask)."""
    x = x.detach().contiguous()
    n_b, n_c, n_h, n_w, n_k = x.shape
    if gap:
        features = x.new_empty(n_b, n_c, n_k)
        average_positions(x.numpy(), features.numpy())
    else:
        features = x.view(n_b, n_c * n_h * n_w, n_k)  # NCHW flatten order
    inputs, weights, outputs = [], [], []
    for index, (layer, weight, bias) in enumerate(zip(layers, params[::2], params[1::2])):
        w = weight.detach().permute(1, 2, 0).contiguous()
        b = bias.detach().T.contiguous() if bias is not None else w.new_zeros(1, 1)
        if scale is not None and index == len(layers) - 1:
            features = features * scale
        out = x.new_empty(n_b, w.shape[0], n_k)
        dense_forward(features.numpy(), w.numpy(), b.numpy(), bias is not None, layer.relu, out.numpy())
        inputs.append(features)
        weights.append(w)
        outputs.append(out)
        features = out
    return features, (x, inputs, weights, outputs, [bias is not None for bias in params[1::2]], scale)


def _head_backward(saved: tuple, grad: torch.Tensor, gap: bool, layers: tuple[_Op, ...],
                   need_x: bool, into: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> tuple[torch.Tensor | None, list]:
    """``(grad_x or None, [grad weight, grad bias or None] per layer, in turn)`` of ``_head_forward``
    given the gradient of its logits ``grad [B, classes, K]`` (overwritten). ``into``: per layer,
    the ``(weight [out, in, K], bias [out, K])`` gradient sums to add this batch's to, image by
    image (``head_sums``); else zeros."""
    x, inputs, weights, outputs, has_bias, scale = saved
    into = head_sums(weights) if into is None else into
    grads: list[torch.Tensor | None] = []
    for index in reversed(range(len(layers))):
        w, features, out = weights[index], inputs[index], outputs[index]
        grad_w, grad_b = into[index]
        need = index > 0 or need_x
        grad_in = torch.empty_like(features) if need else features.new_zeros((1, 1, 1))
        dense_backward(features.numpy(), w.numpy(), out.numpy(), grad.numpy(), layers[index].relu, grad_in.numpy(),
                       grad_w.numpy(), grad_b.numpy(), need)
        if need and scale is not None and index == len(layers) - 1:
            grad_in *= scale
        grads = [grad_w.permute(2, 0, 1), grad_b.T if has_bias[index] else None] + grads
        grad = grad_in
    if not need_x:
        return None, grads
    if gap:
        grad_x = torch.empty_like(x)
        spread_positions(grad.numpy(), grad_x.numpy())
        return grad_x, grads
    return grad.view(x.shape), grads


def head_sums(weights: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zeroed gradient sums ``(weight [out, in, K], bias [out, K])`` of the head's layers, from their
    weights as ``_head_forward`` lays them out."""
    return [(torch.zeros_like(w), w.new_zeros(w.shape[0], w.shape[2])) for w in weights]


class _Head(torch.autograd.Function):
    """``_head_forward`` as an autograd function (logits ``[K, B, classes]``, a view)."""

    @staticmethod
    def forward(ctx, x, gap: bool, layers: tuple[_Op, ...], scale: torch.Tensor | None, *params):
        logits, ctx.saved = _head_forward(x, gap, layers, params, scale)
        ctx.gap, ctx.layers = gap, layers
        return logits.permute(2, 0, 1)

    @staticmethod
    def backward(ctx, grad_logits):
        grad_x, grads = _head_backward(ctx.saved, grad_logits.permute(1, 2, 0).contiguous(), ctx.gap, ctx.layers,
                                       ctx.needs_input_grad[0])
        return (grad_x, None, None, None, *grads)


def _padded(source: "torch.Tensor | _Coded", padding: int, fill: float) -> "torch.Tensor | _Coded":
    """Images (or codes) padded by ``padding`` pixels of ``fill`` on every side; for codes the fill is
    the code of that level (a new level if none has its value, the decoded images if no code is free)."""
    if not isinstance(source, _Coded):
        return F.pad(source, (padding,) * 4, value=fill)
    levels = source.levels
    same = (levels == fill).all(dim=0).nonzero()
    if len(same):
        return _Coded(F.pad(source.codes, (padding,) * 4, value=int(same[0])), levels)
    if levels.shape[1] < 256:
        levels = torch.cat([levels, levels.new_full((levels.shape[0], 1), fill)], dim=1)
        return _Coded(F.pad(source.codes, (padding,) * 4, value=levels.shape[1] - 1), levels)
    return F.pad(decode(source.codes, levels), (padding,) * 4, value=fill)


@dataclass(frozen=True)
class _Coded:
    """Images held as uint8 ``codes [N, C, H, W]`` into per-channel ``levels [C, L]`` (a packed source)."""

    codes: torch.Tensor
    levels: torch.Tensor


class PackedChain:
    """K networks of a layer-chain architecture on CPU (see the module docstring)."""

    def __init__(self, template: nn.Module) -> None:
        self.ops = compile_chain(template)
        self.body, self.gap, self.layers = _head(self.ops)
        state = template.state_dict()
        known = {f"{op.prefix}.{leaf}" for op in self.ops if op.prefix for leaf in ("weight", "bias")}
        extra = sorted(set(state) - known)
        if extra:
            raise NotStackableError(f"{type(template).__name__}: state-dict keys {extra} belong to no packed layer")
        self.keys = list(state)
        self.kinds = {f"{op.prefix}.{leaf}": op.kind for op in self.ops if op.prefix for leaf in ("weight", "bias")}

    def network_axis(self, key: str) -> int:
        """Axis of ``key``'s packed tensor that indexes the networks (last for convolutions)."""
        return -1 if self.kinds[key] == "conv" else 0

    def pack(self, state_dicts: Sequence[Mapping[str, torch.Tensor]]) -> Params:
        return {key: torch.stack([sd[key] for sd in state_dicts], dim=self.network_axis(key)).contiguous()
                for key in self.keys}

    def unpack(self, params: Params, index: int) -> dict[str, torch.Tensor]:
        return {key: params[key].detach().select(self.network_axis(key), index).cpu().contiguous().clone()
                for key in self.keys}

    def select(self, tensors: Params, indices: torch.Tensor) -> Params:
        return {key: value.index_select(self.network_axis(key) % value.dim(), indices).contiguous()
                for key, value in tensors.items()}

    def _run(self, params: Params, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        """``x [B, C, H, W, K]`` through the chain -> logits ``[K, B, classes]``; ``scale [B, in, K]``:
        the last Linear's input multiplier (``_head_forward``)."""
        for op in self.body:
            if op.kind == "conv":
                bias = params.get(f"{op.prefix}.bias") if op.has_bias else None
                x = _ConvFunction.apply(x, params[f"{op.prefix}.weight"], bias, op.groups, op.pool, op.relu)
            else:  # a ReLU on images
                x = torch.relu(x)
        head = [params.get(f"{layer.prefix}.{leaf}") for layer in self.layers for leaf in ("weight", "bias")]
        return _Head.apply(x, self.gap, self.layers, scale, *head)

    def source(self, images: torch.Tensor, device: torch.device, codes: tuple[torch.Tensor, torch.Tensor] | None = None):
        # [N, C, H, W]: each image read whole (a large set stays cache-friendly); uint8 codes when given
        return images.contiguous() if codes is None else _Coded(codes[0].contiguous(), codes[1].to(images.dtype).contiguous())

    def batch(self, source: torch.Tensor, index: torch.Tensor, offsets: torch.Tensor | None, padding: int,
              fill: float) -> torch.Tensor:
        # Lanes padded to a multiple of LANES (copies of network 0's images), so that the kernels'
        # network loops run in whole SIMD vectors; forward drops the padding lanes again.
        spare = -len(index) % LANES
        if spare:
            index = torch.cat([index, index[:1].expand(spare, -1)])
            offsets = None if offsets is None else torch.cat([offsets, offsets[:1].expand(spare, -1, -1)])
        n_k, n_b = index.shape
        images = source.codes if isinstance(source, _Coded) else source
        out = torch.empty(n_b, *images.shape[1:], n_k, dtype=source.levels.dtype if images is not source else source.dtype,
                          device="cpu")
        if offsets is None:
            rows = cols = np.zeros((n_b, n_k), dtype=np.int64)
        else:  # crops read from the images padded with the fill (made once per source)
            source = self._padded_source(source, padding, fill)
            rows, cols = (np.ascontiguousarray(part) for part in offsets.permute(1, 2, 0).numpy())
        index_t = index.T.numpy().astype(np.uint32)
        if isinstance(source, _Coded):
            gather_batch(source.codes.numpy(), source.levels.numpy(), index_t, rows, cols, out.numpy())
        else:
            gather_batch(source.numpy(), np.empty((1, 1), dtype=out.numpy().dtype), index_t, rows, cols, out.numpy())
        return out

    def _padded_source(self, source: torch.Tensor, padding: int, fill: float) -> torch.Tensor:
        """``source`` padded by ``padding`` pixels of ``fill`` on every side, kept for the next batches
        of the same source (held by reference: the key cannot be a recycled address)."""
        kept = getattr(self, "_padding", None)
        if kept is None or kept[0] is not source or kept[1:3] != (padding, fill):
            self._padding = (source, padding, fill, _padded(source, padding, fill))
        return self._padding[3]

    def _padded(self, params: Params, lanes: int) -> Params:
        """``params`` with zero networks appended up to ``lanes`` networks."""
        out = {}
        for key, value in params.items():
            axis = self.network_axis(key) % value.dim()
            spare = lanes - value.shape[axis]
            shape = list(value.shape)
            shape[axis] = spare
            out[key] = torch.cat([value, value.new_zeros(shape)], dim=axis) if spare else value
        return out

    def count(self, params: Params) -> int:
        """K, the number of networks in ``params``."""
        return next(iter(params.values())).shape[self.network_axis(self.keys[0])]

    def _scale(self, scale: torch.Tensor | None, lanes: int) -> torch.Tensor | None:
        """A last-input multiplier ``[K, B, in]`` laid out for the head, ``[B, in, lanes]`` (padding lanes 1)."""
        if scale is None:
            return None
        spare = lanes - len(scale)
        padded = torch.cat([scale, scale.new_ones(spare, *scale.shape[1:])]) if spare else scale
        return padded.permute(1, 2, 0).contiguous()

    def forward(self, params: Params, batch: torch.Tensor, last_input_scale: torch.Tensor | None = None) -> torch.Tensor:
        lanes = batch.shape[-1]
        return self._run(self._padded(params, lanes), batch, self._scale(last_input_scale, lanes))[: self.count(params)]

    def loss_and_grads(self, params: Params, batch: torch.Tensor, labels: torch.Tensor,
                       last_input_scale: torch.Tensor | None = None,
                       part_images: int = PART_IMAGES) -> tuple[torch.Tensor, Params]:
        """The training step's numbers without autograd: per network the mean cross-entropy of its
        images of ``batch`` (``forward``'s input) against ``labels [K, B]`` -> ``(losses [K],
        gradients of each network's loss keyed like params)``, the forward, loss and backward all
        through the numba kernels. Same results as autograd over ``forward`` and
        ``F.cross_entropy``, up to rounding. ``last_input_scale``: as in ``forward`` (one
        elementwise multiply of the last layer's input, and of its gradient).

        The batch goes through in parts of ``part_images`` images, each part's whole forward and
        backward before the next, so that its activations are still in the cache when the backward
        reads them (a batch of 64 MNIST images for 128 networks is 26 MB; gathering each part just
        before its forward instead of the batch at once was slower, measured). The kernels add to
        the weight gradients image by image, so the parts give the whole batch's sums to the bit (a
        convolution's bias gradient excepted: torch sums each part, then the parts are added).
        ``PART_IMAGES`` suits a training batch of a few dozen images; a full-batch gradient over
        thousands (``methods.hmc.NetworkPotential``) takes larger parts, fewer calls of the kernels."""
        n_k, lanes, n_b = self.count(params), batch.shape[-1], batch.shape[0]
        padded = self._padded(params, lanes)
        targets = torch.cat([labels, labels[:1].expand(lanes - n_k, -1)]).T.contiguous()
        head = [padded.get(f"{layer.prefix}.{leaf}") for layer in self.layers for leaf in ("weight", "bias")]
        losses, sums, head_into = batch.new_zeros(lanes), {}, None
        scale = self._scale(last_input_scale, lanes)
        for start in range(0, n_b, part_images):
            x, saved = batch[start : start + part_images], []
            for op in self.body:
                if op.kind == "conv":
                    bias = padded.get(f"{op.prefix}.bias") if op.has_bias else None
                    x, context = _conv_forward(x, padded[f"{op.prefix}.weight"], bias, op.groups, op.pool, op.relu)
                else:
                    x, context = torch.relu(x), x
                saved.append(context)
            part_scale = None if scale is None else scale[start : start + part_images]
            logits, context = _head_forward(x, self.gap, self.layers, head, part_scale)
            grad = torch.empty_like(logits)
            cross_entropy(logits.numpy(), targets[start : start + part_images].numpy(), losses.numpy(), grad.numpy(), n_b)
            head_into = head_sums(context[2]) if head_into is None else head_into
            grad, head_grads = _head_backward(context, grad, self.gap, self.layers, need_x=bool(self.body), into=head_into)
            for layer, weight, bias in zip(self.layers, head_grads[::2], head_grads[1::2]):
                sums[f"{layer.prefix}.weight"] = weight
                if bias is not None:
                    sums[f"{layer.prefix}.bias"] = bias
            for index in reversed(range(len(self.body))):
                op, context = self.body[index], saved[index]
                if op.kind == "conv":
                    key = f"{op.prefix}.weight"
                    grad, sums[key], bias = _conv_backward(context, grad, op.groups, op.pool, op.relu, op.has_bias,
                                                           need_x=index > 0, grad_w=sums.get(key))
                    if bias is not None:
                        key = f"{op.prefix}.bias"
                        sums[key] = bias if key not in sums else sums[key] + bias
                else:
                    grad = grad * (context > 0)
        losses /= n_b
        return losses[:n_k], {key: self._unpadded(key, sums[key], n_k) for key in params}

    def _unpadded(self, key: str, value: torch.Tensor, count: int) -> torch.Tensor:
        """``value`` (a stacked parameter's gradient over the padded lanes) cut to ``count`` networks."""
        return value.narrow(self.network_axis(key) % value.dim(), 0, count).contiguous()

    def predict(self, params: Params, images: torch.Tensor) -> torch.Tensor:
        n_k = self.count(params)
        lanes = n_k + (-n_k % LANES)
        return self._run(self._padded(params, lanes), images.unsqueeze(-1).expand(*images.shape, lanes).contiguous())[:n_k]


class VmapNetworks:
    """K networks of any architecture without BatchNorm or active dropout, on any device,
    through ``torch.func.vmap`` (see the module docstring)."""

    # Whether the template's buffers are constants of the architecture that every network of the stack
    # reads (a subclass's choice, e.g. methods.bnn_stacked.ConstantBuffersVmap); else buffers are refused.
    keeps_buffers = False

    def __init__(self, template: nn.Module) -> None:
        if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in template.modules()):
            raise NotStackableError(f"{type(template).__name__}: BatchNorm running statistics are updated in place, "
                                    "which vmap cannot batch")
        if any(isinstance(m, nn.Dropout) and m.p > 0 for m in template.modules()):
            raise NotStackableError(f"{type(template).__name__}: active dropout; stacked training draws no dropout masks")
        buffers = [name for name, _ in template.named_buffers()]
        if buffers and not self.keeps_buffers:
            raise NotStackableError(f"{type(template).__name__}: buffers {buffers} are not trained by SGD")
        self.buffers = {name: buffer.detach() for name, buffer in template.named_buffers()}
        self.template = copy.deepcopy(template).to("meta")
        self.keys = [name for name, _ in template.named_parameters()]
        linears = [module for module in self.template.modules() if isinstance(module, nn.Linear)]
        self.last_linear = linears[-1] if linears else None

    def network_axis(self, key: str) -> int:
        return 0

    def pack(self, state_dicts: Sequence[Mapping[str, torch.Tensor]]) -> Params:
        return {key: torch.stack([sd[key] for sd in state_dicts]).contiguous() for key in self.keys}

    def unpack(self, params: Params, index: int) -> dict[str, torch.Tensor]:
        return {key: params[key].detach()[index].cpu().contiguous().clone() for key in self.keys}

    def select(self, tensors: Params, indices: torch.Tensor) -> Params:
        return {key: value.index_select(0, indices.to(value.device)).contiguous() for key, value in tensors.items()}

    def _call(self, params: Params, images: torch.Tensor) -> torch.Tensor:
        return functional_call(self.template, params, (images,))

    def source(self, images: torch.Tensor, device: torch.device, codes: tuple[torch.Tensor, torch.Tensor] | None = None):
        # on the device once: as uint8 codes where the set has them (a quarter of the bytes), decoded per batch
        if codes is None:
            return images.to(device)
        return _Coded(codes[0].to(device), codes[1].to(device, images.dtype))

    def batch(self, source: "torch.Tensor | _Coded", index: torch.Tensor, offsets: torch.Tensor | None, padding: int,
              fill: float) -> torch.Tensor:
        if isinstance(source, _Coded):
            index = index.to(source.codes.device)
            images = decode(source.codes[index], source.levels)  # [K, B, C, H, W], the set's exact floats
        else:
            images = source[index.to(source.device)]
        if offsets is None:
            return images
        n_k, n_b = index.shape
        flat = crop_at(images.flatten(0, 1), padding, fill, offsets.permute(1, 0, 2).reshape(2, n_k * n_b))
        return flat.view(images.shape)

    def _scaled_call(self, params: Params, images: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """``_call`` with the last Linear's input multiplied by ``scale [B, in]``."""
        handle = self.last_linear.register_forward_pre_hook(lambda _module, inputs: (inputs[0] * scale,))
        try:
            return self._call(params, images)
        finally:
            handle.remove()

    def forward(self, params: Params, batch: torch.Tensor, last_input_scale: torch.Tensor | None = None) -> torch.Tensor:
        if last_input_scale is None:
            return vmap(self._call)(params, batch)
        if self.last_linear is None:
            raise NotStackableError(f"{type(self.template).__name__}: no Linear layer whose input to scale")
        return vmap(self._scaled_call)(params, batch, last_input_scale.to(batch.device))

    def predict(self, params: Params, images: torch.Tensor) -> torch.Tensor:
        return vmap(self._call, in_dims=(0, None))(params, images)


IMPLEMENTATIONS = ("packed", "vmap")


def stacked_networks(template: nn.Module, device: torch.device, implementation: str = "auto") -> StackedNetworks:
    """The stacked form of ``template``'s architecture: ``packed`` (CPU), ``vmap``, or ``auto``
    (packed on CPU when the chain is supported, else vmap). ``NotStackableError`` if none applies."""
    if implementation not in ("auto", *IMPLEMENTATIONS):
        raise ValueError(f"stacked_networks: implementation {implementation!r}; expected auto, packed or vmap")
    problems = []
    if implementation in ("auto", "packed"):
        if device.type != "cpu":
            problems.append(f"packed: CPU only (device {device})")
        else:
            try:
                return PackedChain(template)
            except NotStackableError as err:
                problems.append(f"packed: {err}")
    if implementation in ("auto", "vmap"):
        try:
            return VmapNetworks(template)
        except NotStackableError as err:
            problems.append(f"vmap: {err}")
    raise NotStackableError("; ".join(problems))
