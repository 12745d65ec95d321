"""The stages, one module each, siblings that never import one another, and the static table the
CLI dispatches on.

Every stage module follows one protocol (the analyses follow it too):

- ``NAME``: what ``stage=`` calls it;
- ``needs(exp) -> frozenset[str]``: what it reads from the store (``benchmark.inventory.INPUTS``:
  ``reference``, ``heldout``, ``samples``, ``metrics``);
- ``produces(exp) -> frozenset[str]``: what it writes (the same names, and ``tables``, ``figures``);
- ``check(exp, made)``: refuses a configuration that cannot run, before any work: its settings,
  the data on disk, and the inputs it needs that are not in the store and that no earlier stage
  of this run makes (``made``);
- ``run(exp)``: does the work; it skips work whose output already exists and is valid, and
  writes atomically.

What two stages share (what the store holds and whether it is usable, the reference zoo and its
caches) lives under them, in ``benchmark.inventory`` and ``benchmark.references``.
"""
from __future__ import annotations

from types import ModuleType
from typing import Sequence

from benchmark.baselines import selected as selected_baselines
from benchmark.experiment import Experiment
from benchmark.references import reference_class
from benchmark.stages import analyze, evaluate, import_zoo, report, sample, verify, zoo

STAGES: dict[str, ModuleType] = {module.NAME: module for module in (zoo, sample, evaluate, report, analyze, verify, import_zoo)}
"""``stage=<name>`` -> its module."""
PIPELINE = ("zoo", "sample", "evaluate", "report", "analyze")
"""What ``stage=all`` runs, in order (not verify; import replaces zoo when asked)."""


def preflight(exp: Experiment, stages: Sequence[str]) -> None:
    """Check every stage of ``stages`` in order before any of them runs: the plug-ins the config
    names (``reference.name``, ``evaluate.baselines``: registered ones, else ``ValueError`` naming
    them), then each stage with what the stages before it produce (``made``)."""
    reference_class(str(exp.config.reference.name))
    selected_baselines(exp)
    made: frozenset[str] = frozenset()
    for name in stages:
        STAGES[name].check(exp, made)
        made = made | STAGES[name].produces(exp)
