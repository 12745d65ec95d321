"""The rows the store holds (a method x mode with at least one unit written), the units a row
averages (all current, or ``StaleSamplesError`` naming each problem), and a row's label."""
from __future__ import annotations

from benchmark.core.store import MODES, SampleSetMetadata, StoreError, Unit, read_metadata
from benchmark.experiment import Experiment
from benchmark.inventory.units import unit_state
from methods import method_class, method_names


class StaleSamplesError(StoreError):
    """A repetition of a row is missing or was drawn with other settings or code."""



def available_rows(exp: Experiment) -> list[tuple[str, str]]:
    """``(method, mode)`` rows with at least one unit whose sample set and predictions are both in
    the store: registered methods in registry order, then external ones, sorted."""
    store = exp.store
    found = {u.row() for u in store.sample_units() if all(p.is_file() for p in store.unit_paths(u))}
    registered = list(method_names())
    order = registered + sorted({m for m, _ in found} - set(registered))
    return sorted(found, key=lambda row: (order.index(row[0]), MODES.index(row[1])))


def row_units(exp: Experiment, method: str, mode: str) -> list[Unit]:
    """The units a row averages: repetitions ``0 .. Design.repetitions_of(method) - 1`` of a registered
    method, all checked done and current (``StaleSamplesError`` naming every problem and the
    command that redoes them otherwise); the single unit of an external sample set."""
    if method not in method_names():
        return [exp.store.sample_unit(method, mode, 0)]
    units = [exp.store.sample_unit(method, mode, r) for r in range(exp.design.repetitions_of(method))]
    problems = [f"repetition {u.repetition}: {p}" for u in units if (p := unit_state(exp, u).problem) is not None]
    if problems:
        raise StaleSamplesError(
            f"{method}/{mode}: {'; '.join(problems)}. Redo them with: python -m benchmark stage=sample "
            f"experiment={exp.name} method={method} mode={mode} (or lower {_row_count_key(exp, method)})"
        )
    return units


def _row_count_key(exp: Experiment, method: str) -> str:
    """The key that sets ``method``'s count of repetitions."""
    named = method in dict(exp.design.per_method_repetitions)
    return f"sample.repetitions_per_method.{method}" if named else "sample.repetitions"


def describe_store(exp: Experiment) -> str:
    """One line per store folder, for error messages."""
    store = exp.store
    parts = [f"{len(store.completed_seeds())} zoo checkpoints"]
    for folder in (store.samples_dir, store.preds_dir):
        names = sorted(p.name for p in folder.glob("*.safetensors")) if folder.is_dir() else []
        parts.append(f"{folder}: {', '.join(names) if names else 'nothing'}")
    return "; ".join(parts)


def row_label(exp: Experiment, method: str, mode: str) -> str:
    """A row's name in the tables: the method's ``label``; an external sample set's ``label`` metadata."""
    if method in method_names():
        return method_class(method).label
    return SampleSetMetadata.decode(read_metadata(exp.store.samples_path(exp.store.sample_unit(method, mode, 0)))).label \
        or method
