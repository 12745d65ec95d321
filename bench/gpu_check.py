"""``make gpu-check``: the cluster path on one CUDA host, in one command and one closing table.

1. The CUDA test lane: every test that runs on CUDA (``-k cuda``: the GPU-vs-CPU comparisons of
   ``tests/benchmark/test_devices.py`` and ``tests/metrics/mmd/test_distances.py``; every stage end to
   end on ``device=cuda`` for small digits, MNIST-format and CIFAR-format ResNet-18 runs,
   ``tests/benchmark/stages/test_every_stage.py``; the ``cluster=gpu_node`` sweep on the GPUs here).
2. The GPU speed bench (``bench/gpu_bench.py``).
3. One table of every figure next to its goal (``bench/summary.py``), the test lane's count first.
Needs no network: run it with the node's own Python (``make gpu-check GPU_PYTHON=...``) and the
wheels of ``make wheels`` installed beside it (docs/gpu.md). Exit 1 if a test failed.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from summary import record  # noqa: E402

TESTS = ["tests"]


class Counter:
    """A pytest plugin counting the test lane's outcomes."""

    def __init__(self) -> None:
        self.passed = self.failed = self.skipped = 0

    def pytest_runtest_logreport(self, report) -> None:
        if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
            setattr(self, report.outcome, getattr(self, report.outcome) + 1)


def main() -> int:
    import pytest
    import torch

    if not torch.cuda.is_available():
        print("gpu-check: torch sees no CUDA device (torch.cuda.is_available() is False); run it on a GPU host")
        return 2
    summary = Path(os.environ.setdefault("BENCH_SUMMARY", str(REPO / "bench" / "_work" / "gpu_summary.jsonl")))
    summary.parent.mkdir(parents=True, exist_ok=True)
    summary.unlink(missing_ok=True)
    counter = Counter()
    code = pytest.main(["-q", "-p", "no:cacheprovider", "-k", "cuda", *[str(REPO / t) for t in TESTS]], plugins=[counter])
    record("gpu", f"CUDA test lane ({torch.cuda.get_device_name()}): tests passed of those run",
           counter.passed, goal=counter.passed + counter.failed, unit="")
    bench = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_bench.py"), "--device", "cuda"], cwd=REPO)
    subprocess.run([sys.executable, str(REPO / "bench" / "summary.py"), str(summary)], cwd=REPO, check=True)
    return 1 if code != 0 or bench.returncode != 0 else 0


if __name__ == "__main__":
    sys.exit(main())
