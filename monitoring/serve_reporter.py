"""``ServeReporter``: a prediction server's reports to the scheduler's streamrec plugin.

``serve_report`` reads a server's own Prometheus registry
(``serving.metrics.ServeMetrics.registry``, with the ``FreshnessCollector`` on it
for the ages) into a ``ServeReport``: cumulative counters and the infer latency
histogram as they are; the scheduler takes rates and the p99 of each interval
from two reports. A ``ServeReporter`` sends one every ``every_s`` from a daemon
thread of its own, off the request path: a scheduler that is slow or gone costs
a warning (once per kind of failure), never a request.

>>> from serving.metrics import ServeMetrics
>>> metrics = ServeMetrics()
>>> for seconds in (0.0004, 0.0009, 0.004):
...     metrics.count_request("infer", 200)
...     metrics.infer_latency.observe(seconds)
>>> metrics.records.inc(3)
>>> report = serve_report("http://10.0.0.7:8080", metrics.registry, now=100.0)
>>> report["requests_total"], report["records_total"], report["dense_version"]
(3, 3, None)
>>> report["latency_buckets"][:4], report["latency_counts"][:4]
([0.00025, 0.0005, 0.001, 0.002], [0, 1, 2, 2])
>>> sent = []
>>> reporter = ServeReporter(sent.append, "http://10.0.0.7:8080", metrics.registry)
>>> reporter.start()  # a first report at once, then one every second
>>> reporter.close()
>>> [r["requests_total"] for r in sent]
[3]
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry

from monitoring.types import ServeReport

__all__ = ["MIN_INTERVAL_S", "ServeReporter", "serve_report"]

log = logging.getLogger(__name__)

MIN_INTERVAL_S = 1.0  # the plugin folds a report a second per server at most

# The samples read, as serving.metrics.ServeMetrics and serving.freshness name them.
_REQUESTS = "streamrec_serve_requests_total"  # {endpoint, code}: only endpoint="infer"
_ERRORS = "streamrec_serve_errors_total"  # {reason}: all of them
_RECORDS = "streamrec_serve_records_scored_total"
_LATENCY_BUCKET = "streamrec_serve_infer_latency_seconds_bucket"  # {le}
_DENSE_VERSION = "streamrec_serve_dense_version"
_DENSE_AGE = "streamrec_serve_dense_age_seconds"
_SPARSE_AGE = "streamrec_serve_sparse_age_seconds"
_GAUGES = (_DENSE_VERSION, _DENSE_AGE, _SPARSE_AGE)


def serve_report(server: str, registry: CollectorRegistry, now: float) -> ServeReport:
    """The server's figures in ``registry`` as the plugin's dict (pure: reads, never writes).

    A family the registry lacks reads as 0 (counters), an empty histogram, or
    None (the freshness gauges, absent until a version is served).
    """
    requests = errors = records = 0.0
    buckets: dict[float, float] = {}
    gauges: dict[str, float] = {}
    for family in registry.collect():
        for sample in family.samples:
            name = sample.name
            if name == _REQUESTS:
                if sample.labels.get("endpoint") == "infer":
                    requests += sample.value
            elif name == _ERRORS:
                errors += sample.value
            elif name == _RECORDS:
                records += sample.value
            elif name == _LATENCY_BUCKET:
                buckets[float(sample.labels["le"])] = sample.value  # "+Inf" reads as inf
            elif name in _GAUGES:
                gauges[name] = sample.value
    bounds = sorted(buckets)
    version = gauges.get(_DENSE_VERSION)
    return ServeReport(
        kind="serve",
        server=server,
        time=float(now),
        requests_total=int(requests),
        errors_total=int(errors),
        records_total=int(records),
        latency_buckets=bounds,
        latency_counts=[int(buckets[b]) for b in bounds],
        dense_version=None if version is None else int(version),
        dense_age_s=_seconds(gauges.get(_DENSE_AGE)),
        sparse_age_s=_seconds(gauges.get(_SPARSE_AGE)),
    )


def _seconds(value: float | None) -> float | None:
    return None if value is None or math.isnan(value) else float(value)


class ServeReporter:
    """Sends ``serve_report(server, registry, now)`` through ``send`` every ``every_s``.

    ``send`` is what carries a report to the scheduler, e.g.
    ``lambda report: client.log_event(TOPIC, report)``; whatever it raises is
    counted in ``failures``, logged once per exception type, and swallowed.
    ``start()`` sends a first report at once, from the thread; ``close()`` stops
    the thread (a report being sent is waited for ten seconds at most).
    """

    def __init__(
        self,
        send: Callable[[ServeReport], None],
        server: str,
        registry: CollectorRegistry,
        *,
        every_s: float = MIN_INTERVAL_S,
    ) -> None:
        if not every_s >= MIN_INTERVAL_S:  # NaN too
            msg = (
                f"every_s: expected {MIN_INTERVAL_S} s or more (the scheduler's page folds "
                f"one report a second per server), got {every_s}"
            )
            raise ValueError(msg)
        self.send = send
        self.server = server
        self.registry = registry
        self.every_s = float(every_s)
        self.sent = 0
        self.failures = 0
        self._failed_kinds: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Report from a daemon thread: now, then every ``every_s`` until ``close()``."""
        if self._thread is not None:
            msg = f"ServeReporter of {self.server}: already started"
            raise RuntimeError(msg)
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._run, name="streamrec-serve-reporter", daemon=True
        )
        self._thread.start()

    def report(self) -> bool:
        """Read the registry and send one report now; False (and a warning) when it failed."""
        try:
            self.send(serve_report(self.server, self.registry, time.time()))
        except Exception as exc:  # monitoring must never cost a request
            self.failures += 1
            kind = type(exc).__qualname__
            if kind not in self._failed_kinds:
                self._failed_kinds.add(kind)
                log.warning(
                    "streamrec: could not report server %s to the scheduler (%s: %s); "
                    "still trying every %.0f s, and not logging %s again",
                    self.server,
                    kind,
                    exc,
                    self.every_s,
                    kind,
                )
            return False
        self.sent += 1
        return True

    def close(self) -> None:
        """Stop reporting (idempotent)."""
        thread = self._thread
        if thread is None:
            return
        self._stop.set()
        thread.join(timeout=10)
        self._thread = None

    def _run(self) -> None:
        while True:
            self.report()
            if self._stop.wait(self.every_s):
                return
