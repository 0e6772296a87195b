"""How fresh a server's parameters are: for its responses and its ``/metrics``.

Rows: the replicas a server reads say when they were last current with their
training shards (``StoreClient.current_at``: the oldest replica's newest
round that caught up); a :class:`SparseFreshness` asks them every ``poll_s``.
Dense: the published version a :class:`~serving.model.DenseFollower` holds
and when it was published. ``FreshnessCollector`` turns both into gauges.

>>> from prometheus_client import CollectorRegistry, generate_latest
>>> class Rows:
...     def current_at(self): return 100.0
>>> sparse = SparseFreshness(Rows())
>>> sparse.poll(); sparse.version()
100000
>>> registry = CollectorRegistry()
>>> registry.register(FreshnessCollector(sparse, None, clock=lambda: 102.5))
>>> b"streamrec_serve_sparse_age_seconds 2.5" in generate_latest(registry)
True
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Protocol

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from serving.model import DenseFollower

log = logging.getLogger(__name__)


class CurrentRows(Protocol):
    def current_at(self) -> float: ...


class SparseFreshness:
    """When the rows a server reads were last current, asked every ``poll_s``."""

    def __init__(self, rows: CurrentRows, *, poll_s: float = 0.25) -> None:
        self.rows = rows
        self.poll_s = poll_s
        self.as_of: float | None = None
        # Whether every replica answered the last poll, caught up: what readiness means
        # for a server that reads replica processes.
        self.answering = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def poll(self) -> None:
        try:
            at = self.rows.current_at()
        except Exception as exc:  # a replica that restarts: the previous answer stands
            log.debug("asking the replicas how current they are: %s", exc)
            self.answering = False
            return
        self.answering = at > 0
        if at > 0:
            self.as_of = at if self.as_of is None else max(self.as_of, at)

    def version(self) -> int:
        """The rows' version in responses: Unix milliseconds up to which they are current."""
        return 0 if self.as_of is None else int(self.as_of * 1000)

    def start(self) -> None:
        self.poll()
        self._thread = threading.Thread(target=self._run, name="sparse-freshness", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.poll()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)


class FreshnessCollector(Collector):
    """Gauges of the served parameters' versions and ages."""

    def __init__(
        self,
        sparse: SparseFreshness | None,
        dense: DenseFollower | None,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.sparse = sparse
        self.dense = dense
        self.clock = clock

    def collect(self) -> Iterator[Metric]:
        now = self.clock()
        if self.sparse is not None and self.sparse.as_of is not None:
            yield GaugeMetricFamily(
                "streamrec_serve_sparse_age_seconds",
                "seconds since the rows served were last current with the training shards",
                value=max(0.0, now - self.sparse.as_of),
            )
        current = self.dense.current if self.dense is not None else None
        if current is not None:
            yield GaugeMetricFamily(
                "streamrec_serve_dense_version",
                "the published dense version served",
                value=current.entry.version,
            )
            yield GaugeMetricFamily(
                "streamrec_serve_dense_age_seconds",
                "seconds since the dense version served was published",
                value=max(0.0, now - current.entry.created),
            )
