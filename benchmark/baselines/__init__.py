"""Baseline rows as plug-ins: what a table's numbers mean, scored exactly as a method's samples are.

A score of 6 says little until one knows what the prior scores, or a second zoo of the same
recipe (what a perfect method would score: the noise floor). sbibm and the NeurIPS 2021 BDL
competition print such rows; these are ours. Each baseline draws ``sample.per_method`` weight
samples per repetition of the sample stage (the same repetitions as the methods), which the
evaluate stage scores against the reference like a method's samples (MMD, NS MMD, predictive
metrics; ``Reference.score_samples``) into rows of group ``baseline``, never ranked among the
methods. Each is one module here with a ``benchmark.baselines.base.Baseline`` subclass (its
``name``, ``label``, ``about``, table ``order`` and ``draw``); nothing else is edited: every module
of this package is imported and every subclass with a ``name`` registered (``discover``), and
``evaluate.baselines`` (null: every registered one, in table order) names some of them:

- ``prior``: independent draws of every parameter from the recipe's prior N(0, 1/(N x
  weight_decay)) (N the training split; the precision the L2 term of the recipe implies, the
  prior of HMC and SGHMC); buffers (BatchNorm statistics) as a fresh model has them.
- ``init``: untrained networks, the model's own initialisation under seeds no zoo uses.
- ``gaussian``: a mean-field Gaussian fitted to the reference zoo (each weight's mean and
  standard deviation over the checkpoints), sampled independently per weight.
- ``gaussian_ns``: the same fitted to the symmetry-free zoo (the NS steps of
  ``evaluate.canonical_steps`` removed), so its draws are in the canonical coordinates.
- ``second_zoo``: converged networks of the reference's own recipe that are not in it: repetition
  k's block of ``seeds.heldout`` (the networks Deep Ensembles' repetition k uses as members):
  the noise floor of the measure.
- ``copies`` and ``copies_multi``: exact copies of repetition k's one-mode base (one mode) or of its
  ``sample.modes_multi`` multi-mode bases: samples with no spread, the ceiling of the measure.

The draws are a pure function of the baseline, the repetition and the reference, so the
evaluate stage caches their numbers like a method's (keyed by these inputs and the source).
An unregistered name in ``evaluate.baselines`` is refused when the config is resolved (the schema
is built from ``BASELINES``, ``benchmark.loader``) and again by ``stages.preflight``
(``baseline_class``), naming the registered ones.
"""
from __future__ import annotations

import sys

from benchmark.baselines.base import Baseline
from benchmark.core import plugins
from benchmark.experiment import Experiment

BASELINES: dict[str, type[Baseline]] = {}
"""Every registered baseline by name, in table order (``Baseline.order``; ``discover``)."""


def register(baseline: type[Baseline]) -> type[Baseline]:
    """Add ``baseline`` (a ``Baseline`` subclass with a unique ``name``) to ``BASELINES``, kept in
    table order; returns it."""
    if not (isinstance(baseline, type) and issubclass(baseline, Baseline)):
        raise TypeError(f"register: expected a Baseline subclass, got {baseline!r}")
    for attribute in ("name", "label", "about"):
        if not isinstance(getattr(baseline, attribute, None), str):
            raise TypeError(f"register: {baseline.__name__} needs a class attribute {attribute!r} (a string)")
    if "draw" not in vars(baseline) and baseline.draw.__func__ is Baseline.draw.__func__:
        raise TypeError(f"register: {baseline.__name__} needs a classmethod draw(exp, zoo, n, repetition) "
                        "(benchmark/baselines/base.py: what a baseline gives)")
    if baseline.name in BASELINES and BASELINES[baseline.name] is not baseline:
        raise ValueError(f"register: a baseline named {baseline.name!r} is already registered "
                         f"({BASELINES[baseline.name].__module__})")
    BASELINES[baseline.name] = baseline
    ordered = sorted(BASELINES.values(), key=lambda b: (b.order, b.name))
    BASELINES.clear()
    BASELINES.update((b.name, b) for b in ordered)
    return baseline


def discover() -> None:
    """Register every ``Baseline`` subclass with a ``name`` defined in a module of this package
    (``benchmark.core.plugins.discover``), in table order."""
    for baseline in plugins.discover(sys.modules[__name__], plugins.defined_classes(Baseline)).values():
        register(baseline)


def baseline_class(name: str) -> type[Baseline]:
    """The registered baseline ``name``; ``ValueError`` naming the registered ones otherwise."""
    if name not in BASELINES:
        raise ValueError(f"evaluate.baselines: {name!r} is not a registered baseline; expected some of "
                         f"{list(BASELINES)} (benchmark/baselines/)")
    return BASELINES[name]


def selected(exp: Experiment) -> list[str]:
    """The baselines ``evaluate.baselines`` names (null: every registered one), in its order; each
    checked (``baseline_class``)."""
    chosen = exp.config.evaluate.baselines
    names = list(BASELINES) if chosen is None else [str(b) for b in chosen]
    for name in names:
        baseline_class(name)
    return names


discover()

__all__ = ["BASELINES", "Baseline", "baseline_class", "discover", "register", "selected"]
