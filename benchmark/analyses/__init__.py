"""The paper's analyses as figures, one module each, drawn by ``stage=analyze`` from the same
store as the tables: ``toy`` (Figure 1), ``min_mass`` (Figure 2), ``collapse`` (Figure 3,
appendix D.2), ``permutation_frequency`` (Figure 4), ``marginals`` (appendix D.1, D.3).

The table of analyses is ``AnalyzeConfig`` in ``benchmark/config.py`` (one settings node each, in
the paper's order), followed by the analyses the registered references' hooks add
(``Reference.hooks.analysis``, ``analysis=<reference>``; ``config.analysis_names``): ``ANALYSES``
maps each name to its module, a module of this package or a reference's hook.
Each module follows the stage protocol (``benchmark/stages/__init__.py``): ``NAME``; ``needs(exp)``,
what it reads from the store (``"reference"``, ``"samples"``); ``check(exp, made)``, which raises
``MissingInputsError`` (naming what to run first) when the store lacks an input that no earlier
stage of the run makes; ``run(exp) -> list[Path]``; and also ``TITLE``, ``CAPTION`` and
``applies(exp)``, which raises ``NotApplicableError`` (with the reason) for a model it does not
apply to. The numerical pieces live in ``metrics/``; figures in ``benchmark.analyses.figures``.
"""
from __future__ import annotations

import importlib
from types import ModuleType

from benchmark.analyses.inputs import MissingInputsError, NotApplicableError, figures_dir
from benchmark.config import analysis_names
from benchmark.references import REFERENCES


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


_HOOKED = _hooked()
ANALYSES: dict[str, ModuleType] = {name: _HOOKED.get(name) or importlib.import_module(f"benchmark.analyses.{name}")
                                   for name in analysis_names()}
"""``analysis=<name>`` -> its module, in the paper's order, then the references' hooks."""

__all__ = ["ANALYSES", "MissingInputsError", "NotApplicableError", "figures_dir"]
