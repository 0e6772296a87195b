"""Compiling a server's kernels before its readiness probe says yes.

The scoring path runs numba kernels (the JSON scan, hashing, the rows' reads),
which a process compiles on their first call: well under a second from numba's
cache, tens of seconds when the cache is cold (a fresh image, a read-only
install). A :class:`Warmup` runs the model's warm-up on a thread of its own
once the model can score (its dense weights loaded, its rows caught up), and
the server's readiness waits for it, so that a load balancer sends the first
request to a server that answers it in milliseconds, and no request's deadline
pays for a compiler.

>>> calls = []
>>> warmup = Warmup(lambda: True, lambda: calls.append("warmed"))
>>> warmup.wait(10), calls
(True, ['warmed'])
>>> warmup.close()
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class Warmup:
    """Runs ``warm`` once, on a daemon thread, as soon as ``can_start()`` is true
    (asked every ``poll_s``: as often as a server looks for new dense weights, and
    nothing beside the seconds a cold compile takes). A warm-up that fails is logged
    and counts as done: the first requests then compile what it did not."""

    def __init__(
        self, can_start: Callable[[], bool], warm: Callable[[], object], *, poll_s: float = 0.2
    ) -> None:
        self._can_start = can_start
        self._warm = warm
        self._poll_s = poll_s
        self._done = threading.Event()
        self._stop = threading.Event()
        self.seconds: float | None = None  # how long the warm-up took, once done
        self._thread = threading.Thread(target=self._run, name="streamrec-warmup", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._can_start():
            if self._stop.wait(self._poll_s):
                return
        start = time.perf_counter()
        try:
            self._warm()
        except Exception:
            log.warning("warming up the scoring kernels failed; the first requests compile "
                        "them", exc_info=True)  # fmt: skip
        finally:
            self.seconds = time.perf_counter() - start
            self._done.set()
        log.info("scoring kernels warmed up in %.1f s", self.seconds)

    def done(self) -> bool:
        """Whether the warm-up ran (or failed)."""
        return self._done.is_set()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait up to ``timeout_s`` for the warm-up; whether it is done."""
        return self._done.wait(timeout_s)

    def close(self) -> None:
        """Stop waiting to start (a warm-up already running ends on its own)."""
        self._stop.set()
