import pytest
import torch
import torchvision

from benchmark.core.models import build_model, mlp, optunet, resnet18


def n_params(model):
    return sum(p.numel() for p in model.parameters())


def test_optunet_has_355_parameters_and_the_published_layer_shapes():
    model = optunet(num_classes=10)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert shapes == {
        "conv1.weight": (2, 1, 4, 4),
        "conv2.weight": (10, 1, 5, 5),
        "fc1.weight": (3, 10),
        "fc1.bias": (3,),
        "fc2.weight": (10, 3),
        "fc2.bias": (10,),
    }
    assert n_params(model) == 2 * 16 + 10 * 25 + 3 * 10 + 3 + 10 * 3 + 10 == 355
    assert model.conv2.groups == 2 and model.conv1.bias is None and model.conv2.bias is None
    assert model(torch.randn(4, 1, 28, 28)).shape == (4, 10)


def test_dropout_adds_no_keys_and_is_identity_in_eval_mode():
    torch.manual_seed(0)
    plain = optunet()
    dropped = optunet(dropout=0.2)
    assert plain.state_dict().keys() == dropped.state_dict().keys()
    dropped.load_state_dict(plain.state_dict())
    x = torch.randn(3, 1, 28, 28)
    assert torch.equal(plain.eval()(x), dropped.eval()(x))
    with pytest.raises(ValueError, match="dropout"):
        optunet(dropout=1.0)


@pytest.mark.parametrize("size", [32, 64])
def test_resnet18_has_cifar_stem_and_torchvision_keys(size):
    model = resnet18(num_classes=100)
    assert model.conv1.kernel_size == (3, 3) and model.conv1.stride == (1, 1)
    assert isinstance(model.maxpool, torch.nn.Identity)
    reference = torchvision.models.resnet18(num_classes=100).state_dict()
    ours = model.state_dict()
    assert ours.keys() == reference.keys()
    assert all(ours[k].shape == reference[k].shape for k in ours if k != "conv1.weight")
    assert n_params(model) == 11_220_132
    with torch.no_grad():
        assert model.eval()(torch.randn(2, 3, size, size)).shape == (2, 100)


def test_resnet18_dropout_keeps_keys_and_drops_the_last_layer_input():
    model = resnet18(num_classes=10, dropout=0.5)
    assert model.state_dict().keys() == resnet18(num_classes=10).state_dict().keys()
    feats = torch.ones(1000, 512)
    model.train()
    dropped = model.dropout(feats)
    assert 0.4 < (dropped == 0).float().mean() < 0.6


def test_mlp_shapes_keys_and_parameter_count():
    model = mlp(784, [100, 50], 10)
    assert [k for k in model.state_dict()] == [
        "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "fc3.weight", "fc3.bias"
    ]
    assert n_params(model) == 784 * 100 + 100 + 100 * 50 + 50 + 50 * 10 + 10
    assert model(torch.randn(2, 1, 28, 28)).shape == (2, 10)
    with pytest.raises(ValueError, match="sizes must be positive"):
        mlp(0, [3], 2)


def test_build_model_lists_valid_names():
    assert isinstance(build_model("optunet", num_classes=10), torch.nn.Module)
    with pytest.raises(ValueError, match="mlp, optunet, resnet18"):
        build_model("vgg")
