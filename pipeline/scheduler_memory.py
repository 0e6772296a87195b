"""The Dask scheduler's memory kept flat: its cache of task names and its freed heap.

Two things grow in a scheduler that runs a streaming job for weeks, neither a
leak: every task key is unique (``prepare-<partition>-<start>-<end>-<runner>``),
and Dask caches the name it splits from each key (``dask.utils.key_split``, up
to 100,000 entries, about 25 MB of strings that are never asked for again);
and glibc keeps the pages freed between live blocks of the scheduler's churn of
task messages. In an hour's soak the scheduler's RSS rose by about 0.7 MB a
minute with both.

:class:`SchedulerTrim` is a scheduler plugin that calls :func:`trim_scheduler_memory`
every ``every_s``: the key cache is emptied once it holds more than
``key_cache_limit`` names (the live tasks' are split again on their next use),
then the heap is trimmed.

>>> from dask.utils import key_split
>>> _ = [key_split(f"prepare-topic-0-{i}-{i + 10}-ab12cd34") for i in range(50)]
>>> trim_scheduler_memory(key_cache_limit=10).key_names_dropped >= 50
True
>>> key_split.cache_info().currsize
0
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from dask.utils import key_split
from distributed.diagnostics.plugin import SchedulerPlugin

from embedding_store.heap import trim_heap

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Trimmed:
    """What one :func:`trim_scheduler_memory` did."""

    key_names_dropped: int
    heap_trimmed: bool


def trim_scheduler_memory(key_cache_limit: int = 10_000) -> Trimmed:
    """Empty Dask's key-name cache if it holds more than ``key_cache_limit``; trim the heap."""
    size = key_split.cache_info().currsize
    dropped = 0
    if size > key_cache_limit:
        key_split.cache_clear()
        dropped = size
    return Trimmed(key_names_dropped=dropped, heap_trimmed=trim_heap())


class SchedulerTrim(SchedulerPlugin):
    """Calls :func:`trim_scheduler_memory` on its scheduler every ``every_s`` seconds."""

    name = "streamrec-scheduler-trim"
    idempotent = True  # every rank may register it; the first one stays

    def __init__(self, every_s: float = 60.0, key_cache_limit: int = 10_000) -> None:
        self.every_s = every_s
        self.key_cache_limit = key_cache_limit
        self.trims = 0
        self.key_names_dropped = 0
        self._callback: Any = None

    async def start(self, scheduler: Any) -> None:
        from tornado.ioloop import PeriodicCallback

        self._callback = PeriodicCallback(self.trim, self.every_s * 1000)
        self._callback.start()

    def trim(self) -> None:
        try:
            done = trim_scheduler_memory(self.key_cache_limit)
        except Exception:  # Dask's cache moved: keep the scheduler, say so once
            log.exception("trimming the Dask scheduler's memory failed; stopped")
            self._stop()
            return
        self.trims += 1
        self.key_names_dropped += done.key_names_dropped

    def _stop(self) -> None:
        if self._callback is not None:
            self._callback.stop()
            self._callback = None

    async def close(self) -> None:
        self._stop()
