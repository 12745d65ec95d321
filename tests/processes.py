"""Other processes for the tests, forked from this one (no interpreter start-up, no import of
torch again) and stopped at exactly the point a test names, never after a sleep."""
from __future__ import annotations

import multiprocessing
import os
import signal
import traceback
from typing import Any, Callable

from benchmark.core.store.atomic import TEMP_MARK


def _child(conn, target: Callable[[], Any], env: dict[str, str], kill_at_publish: int | None) -> None:
    os.environ.update(env)
    if kill_at_publish is not None:
        replace, link, published = os.replace, os.link, [0]

        def count() -> None:
            published[0] += 1
            if published[0] == kill_at_publish:  # the temp file is written, the rename/link not done
                os.kill(os.getpid(), signal.SIGKILL)

        def publish(src, dst, *args, **kwargs):
            count()
            return replace(src, dst, *args, **kwargs)

        def publish_fenced(src, dst, *args, **kwargs):
            if TEMP_MARK in os.path.basename(src):  # a fenced publication (atomic.py), not a claim or quarantine
                count()
            return link(src, dst, *args, **kwargs)

        os.replace, os.link = publish, publish_fenced
    try:
        conn.send(("ok", target()))
    except BaseException:  # noqa: BLE001  (reported to the parent, which raises)
        conn.send(("error", traceback.format_exc()))


class Forked:
    """A target running in a forked child: ``result()`` waits for it and returns its exit code
    and what the target returned (``None`` when it was killed)."""

    def __init__(self, target: Callable[[], Any], env: dict[str, str] | None = None,
                 kill_at_publish: int | None = None) -> None:
        context = multiprocessing.get_context("fork")
        self._parent, child = context.Pipe(duplex=False)
        self.process = context.Process(target=_child, args=(child, target, env or {}, kill_at_publish))
        self.process.start()
        child.close()

    def result(self, timeout: float = 300) -> tuple[int, Any]:
        value = None
        if self._parent.poll(timeout):
            try:
                status, value = self._parent.recv()
            except EOFError:  # killed before it could answer
                status = "killed"
            if status == "error":
                raise AssertionError(f"the child process failed:\n{value}")
        self.process.join(timeout)
        return self.process.exitcode, value


def forked(target: Callable[[], Any], **options: Any) -> tuple[int, Any]:
    """Run ``target`` in a forked child and wait for it (``Forked`` options: ``env``: environment
    variables of the child; ``kill_at_publish=k``: the child SIGKILLs itself at its k-th atomic
    publication, after writing the temp file and before renaming or linking it onto the final name)."""
    return Forked(target, **options).result()
