"""posterior-bench, by layer (ARCHITECTURE.md): the entry points ``cli`` (the command line) and
``scoring`` (``from benchmark import score``: weight samples scored from Python); the ``stages``,
siblings; ``report`` and ``analyses``, which the report and analyze stages run; the query layer
under the stages, ``inventory`` (what the store holds and whether it is usable) and ``reference``
(the reference zoo and its caches); the runner base ``experiment``, ``config`` and ``results``; and
under the methods and the metrics, the plumbing in ``benchmark.core``.

``score``, ``store_zoo`` and ``Score`` are imported on first use, so that ``import benchmark.core``
stays free of the runners."""
from __future__ import annotations

from typing import Any

__all__ = ["score", "store_zoo", "Score"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from benchmark import scoring

        return getattr(scoring, name)
    raise AttributeError(f"module 'benchmark' has no attribute {name!r}")
