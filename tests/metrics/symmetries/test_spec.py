"""Specs: structure of the built-in architectures and errors on bad specs or bad weights."""
from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from torch import nn

from benchmark.core.models import mlp, optunet, resnet18
from metrics.symmetries import Axis, check_sample_set, sequential_spec, spec_for_model
from tests.metrics.symmetries.nets import conv_chain


def test_optunet_spec_ties_conv2_blocks_to_conv1_channels():
    spec = spec_for_model(optunet())
    conv1, conv2, fc1 = spec.groups
    assert (conv1.name, conv1.size, conv1.blocks, conv1.follows) == ("conv1", 2, 2, None)
    assert (conv2.name, conv2.size, conv2.blocks, conv2.follows) == ("conv2", 10, 2, "conv1")
    assert (fc1.name, fc1.size, fc1.blocks, fc1.bias) == ("fc1", 3, 1, "fc1.bias")
    assert Axis("conv2.weight", 1, groups=2) in conv1.axes()
    assert spec.logit_bias == "fc2.bias"
    assert spec.mass_keys == ("conv1.weight", "conv2.weight", "fc1.weight", "fc2.weight")


def test_mlp_spec_is_derived_from_the_sequential_module():
    spec = spec_for_model(mlp(in_features=5, hidden=[4, 3], num_classes=2))
    assert [(g.name, g.size) for g in spec.groups] == [("fc1", 4), ("fc2", 3)]
    assert set(spec.group("fc1").axes()) == {Axis("fc1.weight", 0), Axis("fc1.bias", 0), Axis("fc2.weight", 1)}
    assert spec.shapes == {k: tuple(v.shape) for k, v in mlp(5, [4, 3], 2).state_dict().items()}


def test_resnet18_streams_share_one_permutation_per_stage():
    spec = spec_for_model(resnet18(num_classes=10))
    names = [g.name for g in spec.groups]
    assert sorted(n for n in names if n.startswith("stream")) == ["stream1", "stream2", "stream3", "stream4"]
    assert len(names) == 4 + 8  # 4 residual streams + 8 block-hidden groups
    stream2 = {ax.key for ax in spec.group("stream2").axes()}
    expected = {
        "layer2.0.downsample.0.weight", "layer2.0.downsample.1.running_var", "layer2.0.conv2.weight",
        "layer2.1.bn2.weight", "layer2.1.conv1.weight", "layer3.0.conv1.weight", "layer3.0.downsample.0.weight",
    }
    assert expected <= stream2 and "layer2.0.conv1.weight" not in stream2
    assert {ax.key for ax in spec.group("stream4").axes()} >= {"fc.weight", "layer4.1.bn2.bias"}
    # one scaling absorbed by each conv's BatchNorm, plus the stream's own scaling
    assert len(spec.group("stream1").scalings) == 3 + 1
    covered = {ax.key for g in spec.groups for ax in g.axes()}
    assert covered | spec.buffers | {"fc.bias"} == set(spec.shapes)
    assert all(k.endswith("num_batches_tracked") for k in set(spec.shapes) - covered - {"fc.bias"})


def test_grouped_conv_chain_follows_the_root_leader():
    spec = sequential_spec(conv_chain())
    assert [(g.name, g.blocks, g.follows) for g in spec.groups] == [("0", 2, None), ("4", 2, "0"), ("7", 2, "0"), ("10", 1, None)]
    assert Axis("10.weight", 1, inner=4) in spec.group("7").axes()


@pytest.mark.parametrize(
    "layers, message",
    [
        ([nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)], "'1' (Tanh) is not supported"),
        ([nn.Linear(3, 4), nn.Linear(4, 2)], "follows '0' with no ReLU"),
        ([nn.Linear(3, 4), nn.ReLU()], "must end with a Linear/Conv2d"),
        ([nn.BatchNorm1d(3), nn.Linear(3, 2)], "BatchNorm '0' must directly follow"),
        ([nn.Linear(3, 4), nn.BatchNorm1d(4, affine=False), nn.ReLU(), nn.Linear(4, 2)], "BatchNorm '1': needs affine"),
        ([nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(10, 2)], "'3.weight' expects 10 inputs, which is not a multiple of the 4 units"),
        ([nn.Conv2d(1, 4, 1), nn.ReLU(), nn.Conv2d(4, 4, 1, groups=2), nn.ReLU(), nn.Conv2d(4, 4, 1, groups=4), nn.ReLU(), nn.Conv2d(4, 1, 1)], "mixed group counts"),
    ],
)
def test_sequential_spec_names_the_module_it_cannot_handle(layers, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        sequential_spec(nn.Sequential(*layers))


def test_spec_for_model_rejects_unknown_modules():
    with pytest.raises(ValueError, match="no symmetry spec for module type Linear"):
        spec_for_model(nn.Linear(2, 2))


def test_layer_chain_is_the_forward_pass_of_optunet():
    model = optunet()
    x = torch.randn(4, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    chained = x
    for _, module in model.eval().layer_chain():
        chained = module(chained)
    torch.testing.assert_close(chained, model(x), rtol=1e-6, atol=1e-6)
    assert [name for name, _ in model.layer_chain() if name in dict(model.named_modules())] == [
        "conv1", "pool", "conv2", "fc1", "dropout", "fc2"]


def test_spec_rejects_grouped_conv_whose_channels_are_not_divisible_by_groups():
    spec = spec_for_model(optunet())
    with pytest.raises(ValueError, match=r"'conv2.weight' has 9 output channels, not divisible by groups=2"):
        dataclasses.replace(spec, shapes={**spec.shapes, "conv2.weight": (9, 1, 5, 5)})
    with pytest.raises(ValueError, match=r"'fc1.weight' has shape \[3, 9\], expected \[3, 10\]"):
        dataclasses.replace(spec, shapes={**spec.shapes, "fc1.weight": (3, 9)})


def _weights(spec, samples=2):
    return {k: torch.randn(samples, *shape, dtype=torch.float64) for k, shape in spec.shapes.items()}


def test_check_sample_set_names_missing_and_misshaped_keys():
    spec = spec_for_model(optunet())
    weights = _weights(spec)
    assert check_sample_set(spec, weights) == 2
    with pytest.raises(ValueError, match=r"missing key 'fc1.bias' \(expected shape \[S, 3\]\)"):
        check_sample_set(spec, {k: v for k, v in weights.items() if k != "fc1.bias"})
    with pytest.raises(ValueError, match=r"key 'conv2.weight' has shape \[2, 10, 2, 5, 5\], expected \[S, 10, 1, 5, 5\]"):
        check_sample_set(spec, {**weights, "conv2.weight": torch.zeros(2, 10, 2, 5, 5)})
    with pytest.raises(ValueError, match="key 'extra' is not part of the optunet symmetry spec"):
        check_sample_set(spec, {**weights, "extra": torch.zeros(2, 1)})
    with pytest.raises(ValueError, match="disagree on the sample count"):
        check_sample_set(spec, {**weights, "fc2.bias": torch.zeros(3, 10)})
    nan = weights["fc1.weight"].clone()
    nan[1, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="key 'fc1.weight' contains NaN or Inf"):
        check_sample_set(spec, {**weights, "fc1.weight": nan})
    with pytest.raises(ValueError, match="key 'fc1.weight' has dtype torch.int64"):
        check_sample_set(spec, {**weights, "fc1.weight": torch.zeros(2, 3, 10, dtype=torch.long)})


def test_spec_shapes_match_the_model_state_dict():
    model = optunet(num_classes=7, in_channels=3)
    spec = spec_for_model(model)
    assert spec.shapes == {k: tuple(v.shape) for k, v in model.state_dict().items()}
