"""The one discovery rule of the plug-ins: methods (``methods/``), references
(``benchmark/references/``), baselines (``benchmark/baselines/``) and analyses
(``benchmark/analyses/``).

Every module of a plug-in package (its ``__path__``, by module name; a sub-package counts as one
module) is imported, and the plug-ins it defines are collected: for a class contract, each
subclass of the contract defined in that module with a ``name`` of its own (``defined_classes``);
for the analyses, each module itself. They are ordered by their ``order`` (stable: ties keep
module-name order) and keyed by their name; two plug-ins of one name are refused, naming both
modules. A new plug-in is one module in its package: nothing else names it.
"""
from __future__ import annotations

import importlib
import inspect
import pkgutil
from types import ModuleType
from typing import Any, Callable, Iterable


def defined_classes(contract: type) -> Callable[[ModuleType], list[type]]:
    """The plug-ins of a module under a class contract: the subclasses of ``contract`` that the
    module itself defines (not imports) with their own ``name`` (so an abstract base without one is
    not a plug-in), by attribute name."""
    def plugins(module: ModuleType) -> list[type]:
        return [cls for _, cls in inspect.getmembers(module, inspect.isclass)
                if issubclass(cls, contract) and cls.__module__ == module.__name__ and "name" in vars(cls)]
    return plugins


def discover(package: ModuleType, plugins_of: Callable[[ModuleType], Iterable[Any]], *,
             skip: Iterable[str] = (), name: Callable[[Any], str] = lambda p: p.name,
             order: Callable[[Any], Any] = lambda p: p.order) -> dict[str, Any]:
    """``{name: plug-in}`` of every plug-in that ``plugins_of(module)`` finds in a module of
    ``package`` (modules by name, those named in ``skip`` left out), sorted by ``order`` (stable);
    ``ValueError`` naming both modules when two plug-ins share a name."""
    found: dict[str, Any] = {}
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
        if info.name in skip:
            continue
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        for plugin in plugins_of(module):
            key = name(plugin)
            if key in found and found[key] is not plugin:
                raise ValueError(f"{package.__name__}: two plug-ins are named {key!r} ({_where(found[key])} and "
                                 f"{_where(plugin)}); a plug-in's name must be unique")
            found[key] = plugin
    return dict(sorted(found.items(), key=lambda item: order(item[1])))


def _where(plugin: Any) -> str:
    return plugin.__name__ if isinstance(plugin, ModuleType) else f"{plugin.__module__}.{plugin.__qualname__}"
