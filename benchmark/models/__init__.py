"""Model factories. Every factory returns a plain ``nn.Module`` whose ``state_dict`` keys
do not depend on the ``dropout`` option, so weight samples of every method are keyed like
the plain model."""
from benchmark.models.mlp import mlp
from benchmark.models.optunet import OptuNet, optunet
from benchmark.models.resnet import CifarResNet18, resnet18
from benchmark.models.registry import MODEL_NAMES, build_model

__all__ = ["OptuNet", "optunet", "CifarResNet18", "resnet18", "mlp", "build_model", "MODEL_NAMES"]
