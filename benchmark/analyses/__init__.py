"""The paper's analyses as figures, one module each, drawn by ``stage=analyze`` from the same
store as the tables: ``toy`` (Figure 1), ``min_mass`` (Figure 2), ``collapse`` (Figure 3,
appendix D.2), ``permutation_frequency`` (Figure 4), ``marginals`` (appendix D.1, D.3).

Each analysis is one module here (a new one: one module, no other edit): its ``NAME``, its
``ORDER`` (its place in ``analysis=all``, the paper's order) and its typed ``Settings`` (the node
``analyze.<name>``), declared to the schema when this package is imported (``discover``,
``benchmark.config.declare_analysis``), so that ``analysis=`` accepts the names and
``analyze.<name>.<key>`` is typed by its settings; the analyses the registered references' hooks
add follow (``Reference.hooks.analysis``, ``analysis=<reference>``; ``config.analysis_names``).
``ANALYSES`` maps each name to its module, a module of this package or a reference's hook.
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

import benchmark.baselines  # noqa: F401  (declares the baselines to the schema beside the references and the analyses)
from benchmark.analyses.inputs import MissingInputsError, NotApplicableError, figures_dir
from benchmark.config import analysis_names, declare_analysis
from benchmark.core import plugins
from benchmark.references import REFERENCES

HELPERS = ("inputs",)
"""The package's module that is not an analysis: the analyses' inputs."""


def discover() -> None:
    """Declare every analysis module of this package (``benchmark.core.plugins.discover``: all but
    ``HELPERS`` and the references' hooks, declared with their reference) to the schema: its
    ``NAME`` (the module's name), its typed ``Settings`` (the node ``analyze.<name>``) and its
    ``ORDER`` (``benchmark.config.declare_analysis``); ``TypeError`` naming what a module lacks."""
    hooks = {reference.hooks.analysis for reference in REFERENCES.values()}
    found = plugins.discover(sys.modules[__name__], _analysis_module, skip=HELPERS + tuple(
        hook.rsplit(".", 1)[1] for hook in hooks if hook and hook.startswith(f"{__name__}.")),
        name=lambda module: module.NAME, order=lambda module: module.ORDER)
    for module in found.values():
        declare_analysis(module.NAME, module.Settings, module.ORDER)


def _analysis_module(module: ModuleType) -> list[ModuleType]:
    """``[module]``, an analysis: it defines ``NAME`` (its module's name), ``ORDER`` and ``Settings``;
    ``TypeError`` naming what it lacks."""
    short = module.__name__.rsplit(".", 1)[1]
    missing = [a for a in ("NAME", "ORDER", "Settings") if not hasattr(module, a)]
    if missing or module.NAME != short:
        raise TypeError(f"{module.__name__}: an analysis module defines NAME (its module's name), ORDER and "
                        f"Settings; missing {missing or ['NAME = ' + repr(short)]}")
    return [module]


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
            out[name] = module
    return out


def __getattr__(name: str) -> dict[str, ModuleType]:
    """``ANALYSES``: ``analysis=<name>`` -> its module, in the paper's order, then the references'
    hooks; built on first use, not on import, because a hook module imports this package (a hook
    imported first would otherwise be read before its ``NAME`` is defined)."""
    if name != "ANALYSES":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    hooked = _hooked()
    analyses = {a: hooked.get(a) or importlib.import_module(f"{__name__}.{a}") for a in analysis_names()}
    globals()["ANALYSES"] = analyses
    return analyses


discover()

__all__ = ["ANALYSES", "MissingInputsError", "NotApplicableError", "figures_dir"]
