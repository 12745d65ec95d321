"""The references a method's samples are scored against, as plug-ins: each is one module here
(a ``Reference`` subclass: its ``name``, what it ``needs`` from the store, why a store cannot give
it (``problem``), how it is built (``build``), which rows are scored against it (``against``,
``scores_zoo``)) and its settings in ``conf/reference/<name>.yaml`` (``reference=<name>``).

The zoo (``zoo``) is always evaluated (Table 1 is against it); ``reference=<name>`` adds that one.
The evaluate stage writes every row against every evaluated reference into the one
``metrics.csv``/``repetitions.csv``, told apart by their ``reference`` column; the report, the
findings and the analyses take the reference's name as a parameter.

- ``zoo``: the converged reference checkpoints of this store (``benchmark.references.zoo``);
- ``hmc``: full-batch HMC's pooled draws (``benchmark.references.hmc``);
- ``other_zoo``: the zoo of another store or experiment, e.g. a released zoo as the reference for a
  locally trained one (``benchmark.references.other_zoo``).
"""
from __future__ import annotations

from benchmark.experiment import Experiment
from benchmark.references.hmc import HMC_ROW, HMCReference
from benchmark.references.other_zoo import OtherZooReference
from benchmark.references.zoo import ZOO_ROW, Reference, files_key

ZOO = Reference.name
"""The reference every run is evaluated against (Table 1, Table 2, Table 3 and the findings)."""
REFERENCES: dict[str, type[Reference]] = {}
"""Every registered reference by name (``register``)."""
REFERENCE_METHODS = (HMC_ROW[0], ZOO_ROW[0])
"""The references' own rows (HMC's draws, the zoo's blocks): never ranked among the methods nor in the paper's claims."""


def register(reference: type[Reference]) -> type[Reference]:
    """Add ``reference`` (a ``Reference`` subclass with a unique ``name``) to ``REFERENCES``; returns it."""
    if not (isinstance(reference, type) and issubclass(reference, Reference)):
        raise TypeError(f"register: expected a Reference subclass, got {reference!r}")
    if reference.name in REFERENCES and REFERENCES[reference.name] is not reference:
        raise ValueError(f"register: a reference named {reference.name!r} is already registered "
                         f"({REFERENCES[reference.name].__module__})")
    REFERENCES[reference.name] = reference
    return reference


for _reference in (Reference, HMCReference, OtherZooReference):
    register(_reference)


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


__all__ = ["HMC_ROW", "HMCReference", "OtherZooReference", "REFERENCES", "REFERENCE_METHODS", "Reference",
           "ZOO", "ZOO_ROW", "evaluated", "files_key", "problems", "reference_class", "register"]
