"""The methods: name -> class, in the paper's row order.

Everything else derives from it: the config schema (``methods.<name>`` nodes and the
``method=`` choices), the sample stage's units, the Makefile's sweep, the tables' row order
and labels. A new method is one module in ``methods/`` with a ``PosteriorMethod`` subclass (its ``name``,
``label``, ``order`` and ``Settings``) and one ``conf/methods/<name>.yaml`` (a method kept outside
the package: ``register_method``).
"""
from __future__ import annotations

import methods
from benchmark.core.plugins import defined_classes, discover
from methods.base import PosteriorMethod

METHODS: dict[str, type[PosteriorMethod]] = discover(methods, defined_classes(PosteriorMethod), skip=("registry",))
"""Every method of the ``methods`` package (``benchmark.core.plugins.discover``: each
``PosteriorMethod`` subclass with its own ``name``), in table row order (``order``)."""


def method_names() -> tuple[str, ...]:
    """Registered method names, in table row order."""
    return tuple(METHODS)


def default_run_names() -> tuple[str, ...]:
    """The methods ``method=all`` runs (``in_default_run``), in table row order."""
    return tuple(name for name in method_names() if METHODS[name].in_default_run)


def method_class(name: str) -> type[PosteriorMethod]:
    """The class implementing method ``name``; ``ValueError`` listing the valid names otherwise."""
    if name not in METHODS:
        raise ValueError(f"method={name!r}: unknown method; expected one of {', '.join(METHODS)}")
    return METHODS[name]


def selected(method: str, mode: str) -> list[tuple[str, str]]:
    """``(method, mode)`` pairs that ``method=`` x ``mode=`` select (registered methods only).

    ``all`` expands to ``default_run_names()``, ``both`` to the modes each method supports; a named method with a named mode
    is kept even if unsupported, so that its ``check`` refuses it with the reason. Raises
    ``ValueError`` naming the valid methods for an unknown one.
    """
    names = default_run_names() if method == "all" else (method,)
    pairs = []
    for name in names:
        supported = method_class(name).modes
        wanted = supported if mode == "both" else (mode,)
        pairs += [(name, m) for m in wanted if m in supported or method != "all"]
    return pairs


def register_method(cls: type[PosteriorMethod]) -> type[PosteriorMethod]:
    """Add ``cls`` (a ``PosteriorMethod`` subclass with ``name``, ``label`` and ``Settings``) after the
    registered methods; usable as a class decorator. Register before the config is composed."""
    if not (isinstance(cls, type) and issubclass(cls, PosteriorMethod)):
        raise TypeError(f"register_method: expected a PosteriorMethod subclass, got {cls!r}")
    for attribute in ("name", "label"):
        if not isinstance(getattr(cls, attribute, None), str):
            raise TypeError(f"register_method: {cls.__name__} needs a class attribute {attribute!r} (a string)")
    if not cls.name.isidentifier() or cls.name in ("all", "external"):
        raise ValueError(f"register_method: name {cls.name!r} must be an identifier other than 'all' and 'external'")
    if cls.name in METHODS and METHODS[cls.name] is not cls:
        raise ValueError(f"register_method: a method named {cls.name!r} is already registered ({METHODS[cls.name].__name__})")
    METHODS[cls.name] = cls
    return cls
