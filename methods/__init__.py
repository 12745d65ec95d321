"""Posterior approximations, one module per method, one common interface (``methods.base``),
one registry (``methods.registry``). Methods never see the Hydra config: each is built from a
model factory, the data, a typed settings dataclass and the training recipe."""
from methods.base import MODES, MethodConfigError, MethodFitError, MethodSettings, ModelFactory, PosteriorMethod, ResumableChains
from methods.registry import METHODS, default_run_names, method_class, method_names, register_method, selected

__all__ = [
    "MODES", "MethodConfigError", "MethodFitError", "MethodSettings", "ModelFactory", "PosteriorMethod", "ResumableChains",
    "METHODS", "default_run_names", "method_class", "method_names", "register_method", "selected",
]
