"""The references a method's samples are scored against, as plug-ins: each is one module (or
package) here with a subclass of ``benchmark.references.base.Reference``, the contract (its
``name``, typed ``Settings``, what it ``needs`` from the store and why a store cannot give it
(``problem``), its forms and predictive, its caches and its report hooks), and its settings in
``conf/reference/<name>.yaml`` (``reference=<name>``; its defaults list ``base_<name>``, the schema
of its settings). Nothing else is edited: every module of this package is imported and every
``Reference`` subclass it defines with a ``name`` is registered (``discover``; the zoo first, then by
module name); the schema is built from ``REFERENCES`` (``benchmark.loader``), so that
``reference=<name>`` is typed by each one's ``Settings`` and a name not registered is refused when
the config is resolved, naming the registered ones.

The zoo (``zoo``) is always evaluated (Table 1 is against it); ``reference=<name>`` adds that one.
The evaluate stage writes every row against every evaluated reference into the one
``metrics.csv``/``repetitions.csv``, told apart by their ``reference`` column; the report, the
findings and the analyses take the reference's name as a parameter.

The zoo (``benchmark.references.zoo``: the converged reference checkpoints of this store) is one of
them; the others are listed by ``conf/reference/`` and described in their modules.
"""
from __future__ import annotations

import sys

from benchmark.core import plugins
from benchmark.experiment import Experiment
from benchmark.references.base import Reference, ReportHooks, files_key
from benchmark.references.zoo import ZOO_ROW, ZooReference

ZOO = ZooReference.name
"""The reference every run is evaluated against (Table 1, Table 2, Table 3 and the findings)."""
REFERENCES: dict[str, type[Reference]] = {}
"""Every registered reference by name (``register``)."""


def register(reference: type[Reference]) -> type[Reference]:
    """Add ``reference`` (a ``Reference`` subclass with a unique ``name``) to ``REFERENCES``; returns it."""
    if not (isinstance(reference, type) and issubclass(reference, Reference)):
        raise TypeError(f"register: expected a Reference subclass, got {reference!r}")
    if not isinstance(getattr(reference, "name", None), str) or not reference.name.isidentifier():
        raise TypeError(f"register: {reference.__name__} needs a class attribute 'name' (an identifier)")
    if reference.name in REFERENCES and REFERENCES[reference.name] is not reference:
        raise ValueError(f"register: a reference named {reference.name!r} is already registered "
                         f"({REFERENCES[reference.name].__module__})")
    REFERENCES[reference.name] = reference
    return reference


def discover() -> None:
    """Register every ``Reference`` subclass with a ``name`` defined in a module of this package
    (``benchmark.core.plugins.discover``; the zoo first, ``order``, then by module name); raises what
    ``register`` raises on a clash."""
    for reference in plugins.discover(sys.modules[__name__], plugins.defined_classes(Reference)).values():
        register(reference)


discover()

REFERENCE_METHODS = tuple(dict.fromkeys(r.own_row[0] for r in REFERENCES.values() if r.own_row is not None))
"""The references' own rows (``Reference.own_row``: e.g. the zoo's blocks): never ranked among the
methods nor in the paper's claims."""


def reference_class(name: str) -> type[Reference]:
    """The registered reference ``name``; ``ValueError`` naming the registered ones otherwise."""
    if name not in REFERENCES:
        raise ValueError(f"reference={name}: not a registered reference; expected one of {sorted(REFERENCES)} "
                         "(benchmark/references/, conf/reference/)")
    return REFERENCES[name]


def evaluated(exp: Experiment) -> list[str]:
    """The names of the references ``exp`` is evaluated against, in order: the zoo, then
    ``reference.name`` when it is another one."""
    chosen = str(exp.config.reference.name)
    reference_class(chosen)
    return [ZOO] if chosen == ZOO else [ZOO, chosen]


def problems(exp: Experiment, skip: frozenset[str] = frozenset()) -> list[str]:
    """Why the store cannot give the references ``exp`` is evaluated against beyond the zoo (each
    ``Reference.problem``, prefixed by ``reference=<name> needs``), leaving out those named in
    ``skip`` (made by an earlier stage of the same run); empty when it can."""
    out = []
    for name in [n for n in evaluated(exp)[1:] if n not in skip]:
        problem = REFERENCES[name].problem(exp)
        if problem is not None:
            out.append(f"reference={name} needs {problem}")
    return out


__all__ = ["REFERENCES", "REFERENCE_METHODS", "Reference", "ReportHooks",
           "ZOO", "ZOO_ROW", "ZooReference", "discover", "evaluated", "files_key", "problems", "reference_class",
           "register"]
