"""What a stage or an analysis needs from the store (``INPUTS``), and the one error naming what
is missing with the command that makes it."""
from __future__ import annotations

from typing import Iterable

from benchmark.core.store import StoreError
from benchmark.experiment import Experiment
from benchmark.inventory.rows import available_rows
from benchmark.inventory.zoo import converged, reference_seeds


class MissingInputsError(StoreError):
    """A stage or an analysis needs something the store lacks; the message names the command that makes it."""



INPUTS = ("reference", "heldout", "samples", "metrics")
"""What stages and analyses read (``needs``) and write (``produces``): the reference zoo, the
held-out zoo (bases and ensemble members), the methods' samples, the evaluate stage's metrics.csv."""


def input_problem(exp: Experiment, name: str) -> str | None:
    """Why input ``name`` (of ``INPUTS``) is not in the store, with the command that makes it; ``None`` if it is."""
    if name == "reference":
        found = len(reference_seeds(exp))
        if found < 2:
            return (f"the reference zoo: {found} converged checkpoint(s) in seeds.reference={[exp.reference.start, exp.reference.stop]} "
                    f"under {exp.store.zoo_dir}, at least 2 needed; run python -m benchmark stage=zoo experiment={exp.name} "
                    "zoo.range=reference first")
    elif name == "heldout":
        if not converged(exp, exp.heldout):
            return (f"the held-out zoo: no converged checkpoint in seeds.heldout={[exp.heldout.start, exp.heldout.stop]}; "
                    f"run python -m benchmark stage=zoo experiment={exp.name} zoo.range=heldout first")
    elif name == "samples":
        if not available_rows(exp):
            return (f"the methods' samples: {exp.store.samples_dir} holds none; run python -m benchmark stage=sample "
                    f"experiment={exp.name} first")
    elif name == "metrics":
        path = exp.results_dir / "metrics.csv"
        if not path.is_file():
            return f"the metrics: no {path}; run python -m benchmark stage=evaluate experiment={exp.name} first"
    else:
        raise ValueError(f"unknown input {name!r}; expected one of {INPUTS}")
    return None


def require_inputs(exp: Experiment, needed: Iterable[str], who: str) -> None:
    """Raise ``MissingInputsError`` naming ``who`` and every input of ``needed`` the store lacks."""
    problems = [p for name in sorted(needed) if (p := input_problem(exp, name)) is not None]
    if problems:
        raise MissingInputsError(f"{who} needs {'; and '.join(problems)}")
