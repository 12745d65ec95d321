"""The paper's analyses as figures, one module each, drawn by ``stage=analyze`` from the same
store as the tables: ``toy`` (Figure 1), ``min_mass`` (Figure 2), ``collapse`` (Figure 3,
appendix D.2), ``permutation_frequency`` (Figure 4), ``marginals`` (appendix D.1, D.3).

Each analysis is one module here (a new one: one module, no other edit): its ``NAME``, its
``ORDER`` (its place in ``analysis=all``, the paper's order) and its typed ``Settings`` (the node
``analyze.<name>``), found when this package is imported (``OWN``: the one discovery rule,
``benchmark.core.plugins.discover``); the analyses the registered references' hooks add follow
(``Reference.hooks.analysis``, ``analysis=<reference>``). ``found()`` maps each name to its module,
a module of this package or a reference's hook: what ``benchmark.loader.load`` gives the schema
(``analysis=`` accepts the names, ``analyze.<name>.<key>`` is typed by the settings) and the
analyze stage.
Each module follows the stage protocol (``benchmark/stages/__init__.py``): ``NAME``; ``needs(exp)``,
what it reads from the store (``"reference"``, ``"samples"``); ``check(exp, made)``, which raises
``MissingInputsError`` (naming what to run first) when the store lacks an input that no earlier
stage of the run makes; ``run(exp) -> list[Path]``; and also ``TITLE``, ``CAPTION`` and
``applies(exp)``, which raises ``NotApplicableError`` (with the reason) for a model it does not
apply to. The numerical pieces live in ``metrics/``; figures in ``benchmark.core.figures``.
"""
from __future__ import annotations

import importlib
import sys
from types import ModuleType

from benchmark.analyses.inputs import MissingInputsError, NotApplicableError, figures_dir
from benchmark.core import plugins
from benchmark.references import REFERENCES

HELPERS = ("inputs",)
"""The package's module that is not an analysis: the analyses' inputs."""


def discover() -> dict[str, ModuleType]:
    """Every analysis module of this package (``benchmark.core.plugins.discover``: all but ``HELPERS``
    and the references' hooks, which ``found`` adds after them) by ``NAME``, in ``ORDER``;
    ``TypeError`` naming what a module lacks."""
    hooks = {reference.hooks.analysis for reference in REFERENCES.values()}
    return plugins.discover(sys.modules[__name__], _analysis_module, skip=HELPERS + tuple(
        hook.rsplit(".", 1)[1] for hook in hooks if hook and hook.startswith(f"{__name__}.")),
        name=lambda module: module.NAME, order=lambda module: module.ORDER)


def _analysis_module(module: ModuleType) -> list[ModuleType]:
    """``[module]``, an analysis: it defines ``NAME`` (its module's name), ``ORDER`` and ``Settings``;
    ``TypeError`` naming what it lacks."""
    short = module.__name__.rsplit(".", 1)[1]
    missing = [a for a in ("NAME", "ORDER", "Settings") if not hasattr(module, a)]
    if missing or module.NAME != short:
        raise TypeError(f"{module.__name__}: an analysis module defines NAME (its module's name), ORDER and "
                        f"Settings; missing {missing or ['NAME = ' + repr(short)]}")
    return [module]


OWN = discover()
"""The analyses of this package by name, in drawing order (the paper's)."""


def _hooked() -> dict[str, ModuleType]:
    """The references' analysis hooks by the reference's name (``analysis=<reference>``); ``TypeError``
    when a hook's ``NAME`` is not its reference's."""
    out = {}
    for name, reference in REFERENCES.items():
        if reference.hooks.analysis is not None:
            module = importlib.import_module(reference.hooks.analysis)
            if module.NAME != name:
                raise TypeError(f"{reference.hooks.analysis}: NAME={module.NAME!r}; a reference's analysis hook is "
                                f"drawn as analysis={name} (its reference's name)")
            if name in OWN:
                raise ValueError(f"{reference.hooks.analysis}: analysis={name} is already {OWN[name].__name__}; a "
                                 "reference's analysis hook needs a name no analysis of this package has")
            out[name] = module
    return out


def found() -> dict[str, ModuleType]:
    """``analysis=<name>`` -> its module: this package's (``OWN``), in the paper's order, then the
    registered references' hooks (imported on this call, so that a hook module may import this package)."""
    return {**OWN, **_hooked()}


__all__ = ["OWN", "MissingInputsError", "NotApplicableError", "figures_dir", "found"]
