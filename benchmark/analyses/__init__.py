"""The paper's analyses as figures, one module each, drawn by ``stage=analyze`` from the same
store as the tables: ``toy`` (Figure 1), ``min_mass`` (Figure 2), ``collapse`` (Figure 3,
appendix D.2), ``permutation_frequency`` (Figure 4), ``marginals`` (appendix D.1, D.3).

The table of analyses is ``AnalyzeConfig`` in ``benchmark/config.py`` (one settings node each, in
the paper's order; ``analysis=`` accepts its names): ``ANALYSES`` maps each name to its module, a
module of this package or a reference's analysis hook (``Reference.hooks.analysis``).
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
from benchmark.config import ANALYSIS_NAMES
from benchmark.references import REFERENCES

_HOOKED = {module.NAME: module for module in (importlib.import_module(r.hooks.analysis) for r in REFERENCES.values()
                                               if r.hooks.analysis is not None)}
ANALYSES: dict[str, ModuleType] = {name: _HOOKED.get(name) or importlib.import_module(f"benchmark.analyses.{name}")
                                   for name in ANALYSIS_NAMES}
"""``analysis=<name>`` -> its module, in the paper's order."""

__all__ = ["ANALYSES", "MissingInputsError", "NotApplicableError", "figures_dir"]
