"""A Dask scheduler plugin that does one thing every ``every_s`` seconds, for weeks.

The job's upkeep of its scheduler (:mod:`pipeline.scheduler_spans`,
:mod:`pipeline.scheduler_memory`) reaches into Dask's internals; should a Dask
release move them, the tick raises once, is logged, and stops, and the
scheduler goes on without it.
"""

from __future__ import annotations

import logging
from typing import Any

from distributed.diagnostics.plugin import SchedulerPlugin

log = logging.getLogger(__name__)


class PeriodicPlugin(SchedulerPlugin):
    """Calls :meth:`tick` on the scheduler's event loop every ``every_s`` seconds.

    Subclasses set ``name`` and ``doing`` (for the log line: "pruning ...") and
    define ``tick``.
    """

    doing = "a periodic task"
    idempotent = True  # every rank may register it; the first one stays

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self._callback: Any = None

    def tick(self) -> None:
        raise NotImplementedError

    async def start(self, scheduler: Any) -> None:
        from tornado.ioloop import PeriodicCallback

        self.scheduler = scheduler
        self._callback = PeriodicCallback(self._run, self.every_s * 1000)
        self._callback.start()

    def _run(self) -> None:
        try:
            self.tick()
        except Exception:  # Dask's internals moved: keep the scheduler, say so once
            log.exception("%s on the Dask scheduler failed; stopped", self.doing)
            self._stop()

    def _stop(self) -> None:
        if self._callback is not None:
            self._callback.stop()
            self._callback = None

    async def close(self) -> None:
        self._stop()
