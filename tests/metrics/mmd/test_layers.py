import pytest
import torch

from benchmark.core.models import optunet, resnet18
from metrics.mmd import MMDInputError, check_comparable_shapes, group_layers, layer_name


def test_optunet_layers_and_parameter_count():
    state = optunet(10, 0.0).state_dict()
    layers = group_layers(state)
    assert layers == {
        "conv1": ["conv1.weight"],
        "conv2": ["conv2.weight"],
        "fc1": ["fc1.weight", "fc1.bias"],
        "fc2": ["fc2.weight", "fc2.bias"],
    }
    assert sum(state[k].numel() for keys in layers.values() for k in keys) == 355


def test_resnet18_groups_exclude_batchnorm_buffers():
    state = resnet18(100, 0.0).state_dict()
    layers = group_layers(state)
    assert layers["bn1"] == ["bn1.weight", "bn1.bias"]
    assert layers["layer2.0.downsample.0"] == ["layer2.0.downsample.0.weight"]
    assert layers["layer2.0.downsample.1"] == ["layer2.0.downsample.1.weight", "layer2.0.downsample.1.bias"]
    assert not any(k.endswith(("running_mean", "running_var", "num_batches_tracked")) for v in layers.values() for k in v)
    n_params = sum(state[k].numel() for keys in layers.values() for k in keys)
    assert n_params == sum(p.numel() for p in resnet18(100, 0.0).parameters())


def test_layer_name_without_dot_is_the_key():
    assert layer_name("weight") == "weight"
    assert layer_name("layer1.0.conv1.weight") == "layer1.0.conv1"


def _shapes(sample_set):
    return {k: tuple(v.shape) for k, v in sample_set.items()}


def test_different_layer_names_are_rejected_naming_the_layer():
    x = {"fc1.weight": torch.zeros(3, 2, 2), "fc2.weight": torch.zeros(3, 2)}
    y = {"fc1.weight": torch.zeros(4, 2, 2), "fc3.weight": torch.zeros(4, 2)}
    with pytest.raises(MMDInputError, match="'fc2'"):
        check_comparable_shapes(_shapes(x), _shapes(y))


def test_different_keys_within_a_layer_are_rejected():
    x = {"fc1.weight": torch.zeros(3, 2, 2), "fc1.bias": torch.zeros(3, 2)}
    y = {"fc1.weight": torch.zeros(4, 2, 2)}
    with pytest.raises(MMDInputError, match="layer 'fc1'.*fc1.bias"):
        check_comparable_shapes(_shapes(x), _shapes(y))


def test_different_shapes_are_rejected_naming_layer_and_key():
    x = {"fc1.weight": torch.zeros(3, 2, 2)}
    y = {"fc1.weight": torch.zeros(4, 2, 3)}
    with pytest.raises(MMDInputError, match=r"layer 'fc1': key 'fc1.weight' has per-sample shape \[2, 2\]"):
        check_comparable_shapes(_shapes(x), _shapes(y))


@pytest.mark.parametrize("m, n, side", [(1, 4, "X"), (4, 1, "Y")])
def test_fewer_than_two_samples_is_rejected(m, n, side):
    x = {"conv.weight": torch.zeros(m, 2)}
    y = {"conv.weight": torch.zeros(n, 2)}
    with pytest.raises(MMDInputError, match=f"layer 'conv'.*1 sample\\(s\\) in {side}"):
        check_comparable_shapes(_shapes(x), _shapes(y))


def test_missing_sample_axis_is_rejected():
    with pytest.raises(MMDInputError, match="leading sample axis"):
        check_comparable_shapes({"a.w": ()}, {"a.w": ()})
