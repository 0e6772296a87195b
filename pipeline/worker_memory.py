"""A Dask worker's memory kept flat: its metrics by span, its cache of task names.

A worker adds up the time its tasks spend in each activity, by span
(``Worker.digests_total``, and the highest value since the last Prometheus
poll in ``Worker.digests_max``), and keeps every key for as long as it lives:
nothing in Dask reads those totals back or drops a span's. A streaming job
starts a new span whenever its tasks are all done for a moment, many a
minute, each adding a handful of keys to both; and the worker caches the name
it splits from every task key (``dask.utils.key_split``), each unique here.
Together they grow a worker's memory steadily (``benchmarks/soak.py`` watches
it).

:class:`WorkerTrim` is a worker plugin that calls :func:`trim_worker_memory`
every ``every_s``: the totals of every span are folded into the same totals
with ``None`` in the span's place, the maxima likewise, then the key cache
and heap are trimmed as on the scheduler
(:func:`pipeline.scheduler_memory.trim_key_cache_and_heap`).

>>> from collections import defaultdict
>>> from types import SimpleNamespace
>>> totals = defaultdict(int, {("execute", "span-1", "prepare", "thread-cpu", "seconds"): 2.0,
...                            ("execute", "span-2", "prepare", "thread-cpu", "seconds"): 1.0,
...                            "latency": 0.5})
>>> worker = SimpleNamespace(digests_total=totals, digests_max=defaultdict(float), digests=None)
>>> fold_span_digests(worker)
2
>>> dict(worker.digests_total)
{'latency': 0.5, ('execute', None, 'prepare', 'thread-cpu', 'seconds'): 3.0}
>>> fold_span_digests(worker)  # folded ones stay as they are
0
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from pipeline.periodic import PeriodicWorkerPlugin
from pipeline.scheduler_memory import trim_key_cache_and_heap

# The metric contexts whose keys carry a span id in second place (Dask's
# ``distributed.spans.CONTEXTS_WITH_SPAN_ID``).
SPAN_CONTEXTS = ("execute", "p2p")


def _span_keyed(key: Hashable) -> bool:
    return (
        isinstance(key, tuple) and len(key) > 2 and key[0] in SPAN_CONTEXTS and key[1] is not None
    )


def _without_span(key: tuple[Hashable, ...]) -> tuple[Hashable, ...]:
    return (key[0], None, *key[2:])


def fold_span_digests(worker: Any) -> int:
    """Fold ``worker``'s metrics by span into the same metrics with ``None`` for the
    span; return how many keys by span there were. Totals are added up, maxima kept
    the highest."""
    total = worker.digests_total
    span_keys = [k for k in total if _span_keyed(k)]
    for k in span_keys:
        total[_without_span(k)] += total.pop(k)
    highest = worker.digests_max
    for k in [k for k in highest if _span_keyed(k)]:
        folded = _without_span(k)
        highest[folded] = max(highest.get(folded, 0), highest.pop(k))
    if worker.digests is not None:  # crick's digests cannot be merged: a span's go
        for k in [k for k in worker.digests if _span_keyed(k)]:
            del worker.digests[k]
    return len(span_keys)


def trim_worker_memory(worker: Any, key_cache_limit: int = 10_000) -> int:
    """:func:`fold_span_digests`, then the key cache and heap; returns the keys folded."""
    folded = fold_span_digests(worker)
    trim_key_cache_and_heap(key_cache_limit)
    return folded


class WorkerTrim(PeriodicWorkerPlugin):
    """Calls :func:`trim_worker_memory` on each worker every ``every_s`` seconds."""

    name = "streamrec-worker-trim"
    doing = "trimming memory"

    def __init__(self, every_s: float = 60.0, key_cache_limit: int = 10_000) -> None:
        super().__init__(every_s)
        self.key_cache_limit = key_cache_limit
        self.trims = 0
        self.span_keys_folded = 0

    def tick(self) -> None:
        self.span_keys_folded += trim_worker_memory(self.worker, self.key_cache_limit)
        self.trims += 1
