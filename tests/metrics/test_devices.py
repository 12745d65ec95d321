"""Tensors the metrics create follow the device of their inputs (checked on the source: this
machine may have no GPU; the same computations on a GPU are compared with the CPU in
tests/benchmark/test_devices.py when one is present)."""
from __future__ import annotations

import ast

import pytest

from tests.conftest import REPO

CREATORS = {"arange", "zeros", "ones", "empty", "full", "eye", "linspace", "tensor", "rand", "randn", "randint", "randperm"}
# Where a CPU tensor is intended: drawn from a CPU generator and moved where it is used, or
# only read back as Python numbers, or a reference computation that runs on the CPU.
ON_PURPOSE = {
    ("metrics/symmetries/engine.py", "random_permutations"), ("metrics/symmetries/engine.py", "random_scales"),
    ("metrics/mmd/bandwidths.py", "bandwidth_grid"),
    ("metrics/mmd/distances.py", "_add_upper_gram"), ("metrics/mmd/mmdagg.py", "relabelling_indicators"),
    ("metrics/mmd/mmdagg.py", "aggregate_decision"), ("metrics/mmd/mmdagg.py", "quantiles"),
    ("metrics/mmd/table.py", "halves"),  # row indices from a CPU generator (subset_x moves them)
}


def creations_without_device():
    for path in sorted((REPO / "metrics").rglob("*.py")):
        relative = str(path.relative_to(REPO))
        tree = ast.parse(path.read_text())
        for function in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
            for call in ast.walk(function):
                if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr in CREATORS
                        and isinstance(call.func.value, ast.Name) and call.func.value.id == "torch"
                        and not any(k.arg == "device" for k in call.keywords)
                        and (relative, function.name) not in ON_PURPOSE):
                    yield f"{relative}:{call.lineno} torch.{call.func.attr} in {function.name}()"


def test_every_tensor_the_metrics_create_names_its_device():
    assert list(creations_without_device()) == []


@pytest.mark.parametrize("pair", sorted(ON_PURPOSE))
def test_the_cpu_exceptions_still_exist(pair):
    path, name = pair
    assert f"def {name}(" in (REPO / path).read_text()
