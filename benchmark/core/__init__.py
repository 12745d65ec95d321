"""The plumbing every layer above builds on: ``data`` (datasets), ``models`` (architectures),
``store`` (the checkpoint store), ``training`` (the recipe and the loops) and ``settings`` (the
range errors of every settings dataclass). It imports nothing of the project above it: not the
config, the experiment, the stages, the methods or the metrics (ARCHITECTURE.md)."""
