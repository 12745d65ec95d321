"""Symmetry specs of the suite's architectures.

``chain_spec`` derives a spec from a chain of modules (plain sequential ReLU nets, with
Conv2d, grouped Conv2d, BatchNorm, pooling, Flatten and Dropout); the MLP (``nn.Sequential``)
and OptuNet (a fixed chain of its modules) use it. ``resnet_spec`` walks torchvision
BasicBlock ResNets: each stage's residual stream shares one permutation and one post-BatchNorm
scale across the stem/shortcut and every block's second BatchNorm, as in git-re-basin's
ResNet permutation spec.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from torch import nn

from metrics.symmetries.spec import Axis, RunningStats, Scaling, SymmetrySpec, UnitGroup

_PASS_THROUGH = (
    nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d, nn.MaxPool1d, nn.AvgPool1d,
    nn.Dropout, nn.Identity,
)
_HOMOGENEOUS = (nn.ReLU, nn.LeakyReLU)
_BATCHNORM = (nn.BatchNorm1d, nn.BatchNorm2d)


@dataclass
class _Producer:
    """A Linear/Conv2d producing units, optionally followed by a BatchNorm."""

    module: str
    has_bias: bool
    batchnorm: str | None = None
    eps: float = 0.0


@dataclass
class _Draft:
    name: str
    size: int
    producers: list[_Producer]
    consumers: list[Axis] = field(default_factory=list)
    blocks: int = 1
    follows: str | None = None


def _finish(draft: _Draft) -> UnitGroup:
    """A unit group from its producers and consumers: one scaling absorbed by each producer's
    BatchNorm (if any) plus the units' own post-activation scaling pushed into the consumers."""
    pre: list[Scaling] = []
    post_in: list[Axis] = []
    post_norm: list[str] = []
    for p in draft.producers:
        axes = [Axis(f"{p.module}.weight", 0)] + ([Axis(f"{p.module}.bias", 0)] if p.has_bias else [])
        if p.batchnorm is None:
            post_in += axes
            post_norm.append(f"{p.module}.weight")
            continue
        bn = p.batchnorm
        stats = RunningStats(bn, f"{bn}.running_mean", f"{bn}.running_var", p.eps)
        pre.append(Scaling(f"{p.module}->{bn}", tuple(axes), (f"{p.module}.weight",), (), stats))
        post_in += [Axis(f"{bn}.weight", 0), Axis(f"{bn}.bias", 0)]
        post_norm.append(f"{bn}.weight")
    first = draft.producers[0]
    bias = f"{first.batchnorm}.bias" if first.batchnorm else (f"{first.module}.bias" if first.has_bias else None)
    post = Scaling(draft.name, tuple(post_in), tuple(post_norm), tuple(draft.consumers))
    return UnitGroup(
        draft.name, draft.size, (*pre, post), f"{first.module}.weight", bias, draft.blocks, draft.follows
    )


def _batchnorm_producer(module: str, layer: nn.Module, bn_name: str, bn: nn.Module) -> _Producer:
    if not bn.affine or not bn.track_running_stats:
        raise ValueError(f"BatchNorm {bn_name!r}: needs affine=True and track_running_stats=True for its symmetries")
    return _Producer(module, layer.bias is not None, bn_name, float(bn.eps))


def _spec(architecture: str, model: nn.Module, groups: list[UnitGroup], logit_bias: str | None, mass: list[str]) -> SymmetrySpec:
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    buffers = frozenset(name for name, _ in model.named_buffers())
    return SymmetrySpec(architecture, shapes, tuple(groups), logit_bias, tuple(mass), buffers)


def chain_spec(architecture: str, model: nn.Module, layers: Sequence[tuple[str, nn.Module]]) -> SymmetrySpec:
    """Spec of a network that applies ``layers`` (name, module) one after the other.

    Names must be the modules' state-dict prefixes. Supported: Linear, Conv2d (grouped too),
    BatchNorm1d/2d directly after a Linear/Conv2d, ReLU/LeakyReLU, pooling, Dropout, Identity,
    Flatten; the last layer must be a Linear/Conv2d (the logits). Anything else raises a
    ``ValueError`` naming the module.
    """
    groups: list[UnitGroup] = []
    mass: list[str] = []
    current: _Draft | None = None  # units of the current activation (None: the network input)
    pending: tuple[_Producer, int, int, str | None] | None = None  # producer, size, blocks, follows
    flattened = False
    for name, m in layers:
        if isinstance(m, (nn.Linear, nn.Conv2d)):
            if pending is not None:
                raise ValueError(f"{architecture}: layer {name!r} follows {pending[0].module!r} with no ReLU in between; only ReLU networks are supported")
            blocks, follows = 1, None
            if current is not None:
                follows, blocks = _attach_consumer(architecture, current, name, m, flattened)
                groups.append(_finish(current))
            size = m.out_features if isinstance(m, nn.Linear) else m.out_channels
            pending, current, flattened = (_Producer(name, m.bias is not None), size, blocks, follows), None, False
            mass.append(f"{name}.weight")
        elif isinstance(m, _BATCHNORM):
            if pending is None or pending[0].batchnorm is not None:
                raise ValueError(f"{architecture}: BatchNorm {name!r} must directly follow a Linear/Conv2d layer")
            layer = dict(layers)[pending[0].module]
            pending = (_batchnorm_producer(pending[0].module, layer, name, m), *pending[1:])
            mass.append(f"{name}.weight")
        elif isinstance(m, _HOMOGENEOUS):
            if pending is not None:
                producer, size, blocks, follows = pending
                current, pending = _Draft(producer.module, size, [producer], blocks=blocks, follows=follows), None
        elif isinstance(m, nn.Flatten):
            flattened = True
        elif not isinstance(m, _PASS_THROUGH):
            raise ValueError(
                f"{architecture}: module {name!r} ({type(m).__name__}) is not supported by the symmetry spec; supported: "
                "Linear, Conv2d, BatchNorm1d/2d, ReLU, LeakyReLU, pooling, Flatten, Dropout, Identity"
            )
    if pending is None:
        raise ValueError(f"{architecture}: the network must end with a Linear/Conv2d layer producing the outputs")
    last = pending[0]
    logit_bias = f"{last.batchnorm}.bias" if last.batchnorm else (f"{last.module}.bias" if last.has_bias else None)
    return _spec(architecture, model, groups, logit_bias, mass)


def _attach_consumer(architecture: str, current: _Draft, name: str, m: nn.Module, flattened: bool) -> tuple[str | None, int]:
    """Record layer ``m`` as the consumer of ``current``; returns (follows, blocks) of its outputs."""
    key = f"{name}.weight"
    if isinstance(m, nn.Linear):
        inner = m.in_features // current.size if flattened else 1
        if m.in_features != current.size * inner:
            raise ValueError(
                f"{architecture}: {key!r} expects {m.in_features} inputs, which is not a multiple of the "
                f"{current.size} units of {current.name!r}"
            )
        current.consumers.append(Axis(key, 1, inner=inner))
        return None, 1
    if m.in_channels != current.size:
        raise ValueError(f"{architecture}: {key!r} expects {m.in_channels} input channels, {current.name!r} has {current.size}")
    if m.groups == 1:
        current.consumers.append(Axis(key, 1))
        return None, 1
    if current.blocks == 1 and current.follows is None:
        current.blocks = m.groups
    elif current.blocks != m.groups:
        raise ValueError(
            f"{architecture}: grouped conv {name!r} (groups={m.groups}) reads {current.name!r}, whose permutation is "
            f"already tied to {current.blocks} blocks; mixed group counts are not supported"
        )
    current.consumers.append(Axis(key, 1, groups=m.groups))
    return current.follows or current.name, m.groups


def sequential_spec(model: nn.Sequential, architecture: str = "sequential") -> SymmetrySpec:
    """Spec derived from a plain sequential ReLU net (e.g. ``benchmark.core.models.mlp``)."""
    if not isinstance(model, nn.Sequential):
        raise ValueError(f"sequential_spec: expected an nn.Sequential, got {type(model).__name__}")
    return chain_spec(architecture, model, list(model.named_children()))


def optunet_spec(model: nn.Module) -> SymmetrySpec:
    """Spec of an OptuNet (``model.layer_chain()``): conv1's channels are the blocks of the grouped
    conv2, whose output channels follow them; fc1's 3 hidden units are free."""
    return layer_chain_spec(model, "optunet")


def layer_chain_spec(model: nn.Module, architecture: str | None = None) -> SymmetrySpec:
    """Spec of a model that declares its forward pass as ``model.layer_chain()``: a list of
    ``(state-dict prefix, module)`` applied in order (see ``chain_spec`` for what is supported)."""
    chain = getattr(model, "layer_chain", None)
    if not callable(chain):
        raise ValueError(f"{type(model).__name__} has no layer_chain() method describing its forward pass")
    return chain_spec(architecture or type(model).__name__.lower(), model, chain())


def resnet_spec(model: nn.Module, architecture: str = "resnet18") -> SymmetrySpec:
    """Spec of a torchvision BasicBlock ResNet (``benchmark.core.models.resnet18``).

    Groups: ``stream1..4`` (the residual stream of each stage: stem or shortcut output plus every
    block's ``bn2`` output, read by the next blocks' ``conv1``, the next shortcut and ``fc``) and
    one hidden group per block (``layerK.i``: ``conv1 -> bn1``, read by ``conv2``). Every conv
    feeding a BatchNorm has its own scaling absorbed by the running statistics.
    """
    from torchvision.models.resnet import BasicBlock

    groups: list[UnitGroup] = []
    mass = ["conv1.weight", "bn1.weight"]
    stream = _Draft("stream1", model.conv1.out_channels, [_batchnorm_producer("conv1", model.conv1, "bn1", model.bn1)])
    stage = 0
    for layer_name in ("layer1", "layer2", "layer3", "layer4"):
        for i, block in enumerate(getattr(model, layer_name)):
            prefix = f"{layer_name}.{i}"
            if not isinstance(block, BasicBlock):
                raise ValueError(f"{architecture}: block {prefix!r} is {type(block).__name__}; only BasicBlock ResNets are supported")
            stream.consumers.append(Axis(f"{prefix}.conv1.weight", 1))
            if block.downsample is not None:
                conv, bn = block.downsample[0], block.downsample[1]
                if len(block.downsample) != 2 or not isinstance(conv, nn.Conv2d) or not isinstance(bn, nn.BatchNorm2d):
                    raise ValueError(f"{architecture}: {prefix}.downsample must be Sequential(Conv2d, BatchNorm2d)")
                stream.consumers.append(Axis(f"{prefix}.downsample.0.weight", 1))
                groups.append(_finish(stream))
                stage += 1
                stream = _Draft(f"stream{stage + 1}", conv.out_channels, [_batchnorm_producer(f"{prefix}.downsample.0", conv, f"{prefix}.downsample.1", bn)])
                mass += [f"{prefix}.downsample.0.weight", f"{prefix}.downsample.1.weight"]
            hidden = _Draft(prefix, block.conv1.out_channels, [_batchnorm_producer(f"{prefix}.conv1", block.conv1, f"{prefix}.bn1", block.bn1)])
            hidden.consumers.append(Axis(f"{prefix}.conv2.weight", 1))
            groups.append(_finish(hidden))
            stream.producers.append(_batchnorm_producer(f"{prefix}.conv2", block.conv2, f"{prefix}.bn2", block.bn2))
            mass += [f"{prefix}.conv1.weight", f"{prefix}.bn1.weight", f"{prefix}.conv2.weight", f"{prefix}.bn2.weight"]
    stream.consumers.append(Axis("fc.weight", 1))
    groups.append(_finish(stream))
    mass.append("fc.weight")
    return _spec(architecture, model, groups, "fc.bias" if model.fc.bias is not None else None, mass)


def spec_for_model(model: nn.Module) -> SymmetrySpec:
    """The symmetry spec of a model instance: a torchvision BasicBlock ResNet, a model that
    declares its forward pass with ``layer_chain()`` (OptuNet), or a plain ``nn.Sequential``
    ReLU net (the MLP)."""
    from torchvision.models.resnet import ResNet

    if isinstance(model, ResNet):
        return resnet_spec(model)
    if callable(getattr(model, "layer_chain", None)):
        return layer_chain_spec(model)
    if isinstance(model, nn.Sequential):
        return sequential_spec(model, "mlp")
    raise ValueError(
        f"spec_for_model: no symmetry spec for module type {type(model).__name__}; supported: torchvision "
        "BasicBlock ResNets, models with a layer_chain() method (OptuNet), nn.Sequential ReLU nets"
    )
