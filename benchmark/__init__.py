"""posterior-bench, by layer (ARCHITECTURE.md): the entry point ``cli``; the ``stages``, siblings;
``report`` and ``analyses``, which the report and analyze stages run; the query layer under the
stages, ``inventory`` (what the store holds and whether it is usable) and ``reference`` (the
reference zoo and its caches); the runner base ``experiment``, ``config`` and ``results``; and
under the methods and the metrics, the plumbing in ``benchmark.core``."""
