"""The one discovery rule (``benchmark.core.plugins``): every module of a package, the contract's
subclasses it defines with their own ``name``, in ``order``; a clash of names refused naming both."""
from __future__ import annotations

import sys

import pytest

from benchmark.core.plugins import defined_classes, discover


class Contract:
    order = 100


def _package(tmp_path, monkeypatch, modules: dict[str, str]):
    root = tmp_path / "plugpkg"
    root.mkdir()
    (root / "__init__.py").write_text("")
    for name, text in modules.items():
        (root / f"{name}.py").write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(sys.modules, "contract_mod", sys.modules[__name__])
    for name in [m for m in sys.modules if m.startswith("plugpkg")]:
        monkeypatch.delitem(sys.modules, name)
    import plugpkg
    return plugpkg


HEADER = "from contract_mod import Contract\n"


def test_the_plugins_are_the_subclasses_each_module_defines_with_a_name_in_their_order(tmp_path, monkeypatch):
    package = _package(tmp_path, monkeypatch, {
        "a_first": HEADER + "class Abstract(Contract):\n    pass\nclass B(Contract):\n    name = 'b'\n",
        "b_second": HEADER + "from plugpkg.a_first import B\nclass Early(Contract):\n    name = 'early'\n    order = 1\n"
                             "class C(B):\n    name = 'c'\n",
        "helper": "VALUE = 1\n"})
    found = discover(package, defined_classes(Contract))
    assert list(found) == ["early", "b", "c"]  # by order; ties by module name; B imported by b_second counted once
    assert found["b"].__module__ == "plugpkg.a_first"
    assert list(discover(package, defined_classes(Contract), skip=("b_second",))) == ["b"]


def test_two_plugins_of_one_name_are_refused_naming_both(tmp_path, monkeypatch):
    package = _package(tmp_path, monkeypatch, {
        "one": HEADER + "class X(Contract):\n    name = 'same'\n",
        "two": HEADER + "class Y(Contract):\n    name = 'same'\n"})
    with pytest.raises(ValueError, match=r"'same' \(plugpkg.one.X and plugpkg.two.Y\)"):
        discover(package, defined_classes(Contract))
