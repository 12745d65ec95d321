"""Another store's zoo as the reference (``reference=other_zoo``, ``conf/reference/other_zoo.yaml``):
e.g. a released zoo (imported with ``stage=import`` into its own store) as the reference for a
locally trained one, or the zoo of another experiment of the same model and data.

Settings (``reference.*``): ``store``, the other store's root (default: this run's ``store``);
``experiment``, the experiment name the checkpoints were written under there (default: this run's);
``seeds``, their reference range ``[start, stop)`` (default: this run's ``seeds.reference``). The
checkpoints must be of this run's model (their shapes are checked as the zoo's are). The forms are
cached in this store (``<store>/<experiment>/reference-other_zoo/``), never in the other one, which
may be read-only; the numbers are cached as the zoo's are (``eval/<unit>.other_zoo.json``), keyed
by the other zoo's files.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

from benchmark.core.settings import require
from benchmark.core.store import ExperimentStore
from benchmark.experiment import Experiment
from benchmark.inventory import reference_seeds
from benchmark.references.base import Reference
from benchmark.references.zoo import ZooReference


@dataclass(frozen=True)
class OtherZooSettings:
    """``reference.store``: the other store's root (None: this run's ``store``);
    ``reference.experiment``: the experiment its checkpoints were written under (None: this run's);
    ``reference.seeds``: their reference range ``[start, stop)`` (None: this run's ``seeds.reference``)."""

    store: Optional[str] = None
    experiment: Optional[str] = None
    seeds: Optional[List[int]] = None

    def __post_init__(self) -> None:
        require(self.seeds is None or len(self.seeds) == 2, "seeds", self.seeds, "null or [start, stop)")


class OtherZooReference(ZooReference):
    """The zoo of ``reference.experiment`` in ``reference.store`` (see the module docstring),
    scored against exactly as this store's zoo is (``ZooReference``)."""

    name = "other_zoo"
    order = Reference.order  # among the other references, not first with the zoo it extends
    Settings = OtherZooSettings
    own_row = None  # the zoo's row is this store's zoo's (``ZooReference.own_row``), not the other store's
    needs = "the converged reference checkpoints of reference.experiment in reference.store"

    def __init__(self, exp: Experiment) -> None:
        super().__init__(exp, source=self.source_of(exp), folder=self.cache_folder(exp.store))

    @classmethod
    def cache_folder(cls, store: ExperimentStore) -> Path | None:
        """``store/<experiment>/reference-other_zoo/``: this store's, never the other one's."""
        return store.other_reference_dir(cls.name)

    @classmethod
    def source_of(cls, exp: Experiment) -> Experiment:
        """The experiment whose store holds the other zoo: ``exp``'s config with ``store``,
        ``experiment_name`` and ``seeds.reference`` replaced by ``reference.store``,
        ``reference.experiment`` and ``reference.seeds`` (each where set), and no held-out range."""
        settings, config = cls.settings(exp), exp.config
        reference = config.seeds.reference if settings.seeds is None else list(settings.seeds)
        seeds = dataclasses.replace(config.seeds, reference=reference, heldout=[0, 0])  # only its zoo is read
        return Experiment(dataclasses.replace(
            config, store=settings.store if settings.store is not None else config.store,
            experiment_name=settings.experiment if settings.experiment is not None else config.experiment_name,
            seeds=seeds))

    @classmethod
    def problem(cls, exp: Experiment) -> str | None:
        """Why the other store cannot give the reference (no folder, fewer than 2 converged
        checkpoints in the range), naming the keys that choose it; ``None`` when it can."""
        source = cls.source_of(exp)
        where = (f"reference.store={source.config.store} reference.experiment={source.name} "
                 f"reference.seeds={[source.reference.start, source.reference.stop]}")
        if not source.store.zoo_dir.is_dir():
            return f"the other zoo: {source.store.zoo_dir} is not a folder ({where})"
        found = len(reference_seeds(source))
        if found < 2:
            return (f"the other zoo: at least 2 converged checkpoints in {source.store.zoo_dir}, found {found} ({where}); "
                    f"train them with python -m benchmark stage=zoo experiment={source.name} store={source.config.store} "
                    "zoo.range=reference or import them with stage=import")
        return None
