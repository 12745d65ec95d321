"""Model factories. Every factory returns a plain ``nn.Module`` whose ``state_dict`` keys
do not depend on the ``dropout`` option, so weight samples of every method are keyed like
the plain model; ``predict_with_weights`` runs the plain model with each weight sample."""
from benchmark.core.models.mlp import mlp
from benchmark.core.models.optunet import OptuNet, optunet
from benchmark.core.models.predict import fit_with_weights, predict_with_weights
from benchmark.core.models.registry import MODEL_NAMES, build_model
from benchmark.core.models.resnet import CifarResNet18, resnet18

__all__ = ["OptuNet", "optunet", "CifarResNet18", "resnet18", "mlp", "build_model", "MODEL_NAMES", "predict_with_weights", "fit_with_weights"]
