"""The stages, one module each, and the static table the CLI dispatches on.

Each stage is ``run(exp: Experiment)``: it reads the experiment's config through ``exp``,
skips work whose output already exists and is valid, and writes atomically.
"""
from __future__ import annotations

from typing import Any, Callable

from benchmark.stages import analyze, evaluate, import_zoo, report, sample, verify, zoo

STAGES: dict[str, Callable[..., Any]] = {
    "zoo": zoo.run,
    "sample": sample.run,
    "evaluate": evaluate.run,
    "report": report.run,
    "analyze": analyze.run,
    "verify": verify.run,
    "import": import_zoo.run,
}
PIPELINE = ("zoo", "sample", "evaluate", "report", "analyze")  # what stage=all runs, in order (not verify; import replaces zoo when asked)
