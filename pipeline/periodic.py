"""Dask plugins that do one thing every ``every_s`` seconds, for weeks.

The job's upkeep of its scheduler (:mod:`pipeline.scheduler_spans`,
:mod:`pipeline.scheduler_memory`) and of its workers
(:mod:`pipeline.worker_memory`) reaches into Dask's internals; should a Dask
release move them, the tick raises once, is logged, and stops, and the
scheduler or worker goes on without it.
"""

from __future__ import annotations

import logging
from typing import Any

from distributed.diagnostics.plugin import SchedulerPlugin, WorkerPlugin

log = logging.getLogger(__name__)


class _Periodic:
    """Calls :meth:`tick` on a server's event loop every ``every_s`` seconds."""

    doing = "a periodic task"
    where = "Dask server"

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self._callback: Any = None

    def tick(self) -> None:
        raise NotImplementedError

    def _begin(self) -> None:
        from tornado.ioloop import PeriodicCallback

        self._callback = PeriodicCallback(self._run, self.every_s * 1000)
        self._callback.start()

    def _run(self) -> None:
        try:
            self.tick()
        except Exception:  # Dask's internals moved: keep the server, say so once
            log.exception("%s on the %s failed; stopped", self.doing, self.where)
            self._stop()

    def _stop(self) -> None:
        if self._callback is not None:
            self._callback.stop()
            self._callback = None


class PeriodicPlugin(_Periodic, SchedulerPlugin):
    """A scheduler plugin whose :meth:`tick` runs every ``every_s`` seconds.

    Subclasses set ``name`` and ``doing`` (for the log line: "pruning ...") and
    define ``tick``; ``self.scheduler`` is the scheduler.
    """

    where = "Dask scheduler"
    idempotent = True  # every rank may register it; the first one stays

    async def start(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self._begin()

    async def close(self) -> None:
        self._stop()


class PeriodicWorkerPlugin(_Periodic, WorkerPlugin):
    """A worker plugin whose :meth:`tick` runs every ``every_s`` seconds on each worker,
    those that join later included; ``self.worker`` is the worker."""

    where = "Dask worker"
    idempotent = True  # every rank may register it; the first one stays

    async def setup(self, worker: Any) -> None:
        self.worker = worker
        self._begin()

    async def teardown(self, worker: Any) -> None:
        self._stop()
