"""The Dask scheduler's memory kept flat: its cache of task names and its freed heap.

Two things grow in a scheduler that runs a streaming job for weeks, neither a
leak: every task key is unique (``prepare-<partition>-<start>-<end>-<runner>``),
and Dask caches the name it splits from each key (``dask.utils.key_split``, up
to 100,000 entries, strings that are never asked for again); and glibc keeps
the pages freed between live blocks of the scheduler's churn of task messages.
Together they grow the scheduler's memory steadily (``benchmarks/soak.py``
watches it).

:class:`SchedulerTrim` is a scheduler plugin that calls :func:`trim_key_cache_and_heap`
every ``every_s``: the key cache is emptied once it holds more than
``key_cache_limit`` names (the live tasks' are split again on their next use),
then the heap is trimmed.

>>> from dask.utils import key_split
>>> _ = [key_split(f"prepare-topic-0-{i}-{i + 10}-ab12cd34") for i in range(50)]
>>> trim_key_cache_and_heap(key_cache_limit=10) >= 50
True
>>> key_split.cache_info().currsize
0
"""

from __future__ import annotations

from dask.utils import key_split

from embedding_store.heap import trim_heap
from pipeline.periodic import PeriodicPlugin


def trim_key_cache_and_heap(key_cache_limit: int = 10_000) -> int:
    """Empty Dask's key-name cache if it holds more than ``key_cache_limit``, trim the
    heap; return how many names were dropped."""
    size = key_split.cache_info().currsize
    dropped = 0
    if size > key_cache_limit:
        key_split.cache_clear()
        dropped = size
    trim_heap()
    return dropped


class SchedulerTrim(PeriodicPlugin):
    """Calls :func:`trim_key_cache_and_heap` on its scheduler every ``every_s`` seconds."""

    name = "streamrec-scheduler-trim"
    doing = "trimming memory"

    def __init__(self, every_s: float = 60.0, key_cache_limit: int = 10_000) -> None:
        super().__init__(every_s)
        self.key_cache_limit = key_cache_limit
        self.trims = 0
        self.key_names_dropped = 0

    def tick(self) -> None:
        self.key_names_dropped += trim_key_cache_and_heap(self.key_cache_limit)
        self.trims += 1
