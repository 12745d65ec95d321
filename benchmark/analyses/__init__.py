"""The paper's analyses as figures, one module each (``run(exp) -> list[Path]``), drawn by
``stage=analyze`` from the same store as the tables: ``toy`` (Figure 1), ``min_mass`` (Figure 2),
``collapse`` (Figure 3, appendix D.2), ``permutation_frequency`` (Figure 4), ``marginals``
(appendix D.1, D.3). Each module also has ``NAME``, ``TITLE``, ``CAPTION``; ``INPUTS``, what it
reads from the store (``"reference"``: the reference zoo, ``"samples"``: the methods' samples);
``applies(exp)``, which raises ``NotApplicableError`` (with the reason) for a model it does not
apply to; and ``check(exp)``, which raises ``MissingInputsError`` (naming what to run first) when
the store lacks its inputs. Both run before any work. The numerical pieces live in ``metrics/``;
figures in ``benchmark.analyses.figures``.
"""
from __future__ import annotations

from types import ModuleType

from benchmark.analyses import collapse, marginals, min_mass, permutation_frequency, toy
from benchmark.analyses.inputs import MissingInputsError, NotApplicableError, figures_dir

ANALYSES: dict[str, ModuleType] = {
    module.NAME: module for module in (toy, min_mass, collapse, permutation_frequency, marginals)
}
"""Static table: ``analysis=<name>`` -> its module, in the paper's order."""

__all__ = ["ANALYSES", "MissingInputsError", "NotApplicableError", "figures_dir"]
