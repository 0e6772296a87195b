"""``serve_report`` over a real server's registry, and ``ServeReporter``'s thread."""

from __future__ import annotations

import logging
import math
import threading
import time
from types import SimpleNamespace
from typing import Any

import msgpack
import pytest

from monitoring.serve_reporter import ServeReporter, serve_report
from monitoring.state import MonitorState
from serving.freshness import FreshnessCollector, SparseFreshness
from serving.metrics import LATENCY_BUCKETS, ServeMetrics

URL = "http://10.0.0.7:8080"


def record(metrics: ServeMetrics, *latencies_s: float, code: int = 200, records: int = 1) -> None:
    """What the infer handler records for each request it answers."""
    for seconds in latencies_s:
        metrics.count_request("infer", code)
        metrics.infer_latency.observe(seconds)
        if code == 200:
            metrics.records.inc(records)
        else:
            metrics.errors.labels("bad_records").inc()


def test_serve_report_reads_a_real_server_registry() -> None:
    metrics = ServeMetrics()
    record(metrics, 0.0002, 0.0004, 0.0009, 0.004, records=3)
    record(metrics, 0.2, code=400)
    metrics.count_request("health_ready", 200)  # not an infer request
    metrics.count_request("unknown", 404)
    metrics.errors.labels("http_404").inc()  # an error of another endpoint: counted
    report = serve_report(URL, metrics.registry, now=123.5)
    assert report["kind"] == "serve"
    assert (report["server"], report["time"]) == (URL, 123.5)
    assert report["requests_total"] == 5
    assert report["errors_total"] == 2
    assert report["records_total"] == 12
    assert report["latency_buckets"] == [*LATENCY_BUCKETS, math.inf]
    counts = dict(zip(report["latency_buckets"], report["latency_counts"], strict=True))
    assert (counts[0.00025], counts[0.0005], counts[0.001], counts[0.005]) == (1, 2, 3, 4)
    assert (counts[0.1], counts[0.25], counts[math.inf]) == (4, 5, 5)
    # No freshness collector (or nothing served yet): None, never a made-up 0.
    assert (report["dense_version"], report["dense_age_s"], report["sparse_age_s"]) == (
        None,
        None,
        None,
    )


def test_serve_report_reads_the_freshness_gauges() -> None:
    class Rows:
        def current_at(self) -> float:
            return 990.0

    sparse = SparseFreshness(Rows())
    sparse.poll()
    # A DenseFollower's current version, as FreshnessCollector reads it.
    dense = SimpleNamespace(current=SimpleNamespace(entry=SimpleNamespace(version=42, created=970)))
    metrics = ServeMetrics()
    collector = FreshnessCollector(sparse, dense, clock=lambda: 1000.0)  # type: ignore[arg-type]
    metrics.registry.register(collector)
    report = serve_report(URL, metrics.registry, now=1000.0)
    assert (report["dense_version"], report["dense_age_s"], report["sparse_age_s"]) == (
        42,
        30.0,
        10.0,
    )
    assert type(report["dense_version"]) is int


def test_a_report_travels_as_msgpack_with_plain_types() -> None:
    metrics = ServeMetrics()
    record(metrics, 0.001, 0.003)
    report = serve_report(URL, metrics.registry, now=1.0)
    assert msgpack.unpackb(msgpack.packb(report)) == report
    # Dask's log_event takes exact ints and floats only (no numpy, no subclasses).
    for key in ("requests_total", "errors_total", "records_total"):
        assert type(report[key]) is int
    assert all(type(c) is int for c in report["latency_counts"])
    assert all(type(b) is float for b in report["latency_buckets"])


def test_two_reports_of_a_real_registry_fold_into_rates_and_the_p99() -> None:
    metrics = ServeMetrics()
    record(metrics, *[0.2] * 50)  # slow, before the interval: not in its p99
    state = MonitorState()
    state.receive(dict(serve_report(URL, metrics.registry, now=10.0)))
    record(metrics, *[0.0004] * 197, 0.0009, 0.0009, 0.0045, records=2)
    state.receive(dict(serve_report(URL, metrics.registry, now=12.0)))
    s = state.serving(now=12.0)[URL]
    assert s["requests_per_s"] == 100.0
    assert s["records_per_s"] == 200.0
    assert s["p99_ms"] == 1.0  # 199 of 200 within 1 ms
    record(metrics, *[0.0004] * 97, 0.03, 0.03, 0.03)  # 3 in 100 within 50 ms only
    state.receive(dict(serve_report(URL, metrics.registry, now=13.0)))
    assert state.serving(now=13.0)[URL]["p99_ms"] == 50.0


def test_the_reporter_sends_at_once_then_every_interval_until_closed() -> None:
    metrics = ServeMetrics()
    sent: list[dict[str, Any]] = []
    reporter = ServeReporter(sent.append, URL, metrics.registry)  # type: ignore[arg-type]
    reporter.start()
    try:
        deadline = time.monotonic() + 5
        while len(sent) < 2 and time.monotonic() < deadline:
            record(metrics, 0.001)
            time.sleep(0.05)
    finally:
        reporter.close()
    assert len(sent) >= 2
    assert sent[1]["time"] - sent[0]["time"] == pytest.approx(1.0, abs=0.5)
    assert sent[1]["requests_total"] > sent[0]["requests_total"]
    n = len(sent)
    time.sleep(1.2)
    assert len(sent) == n  # closed: no more reports
    assert reporter.sent == n
    reporter.close()  # idempotent


def test_a_slow_scheduler_never_holds_up_the_caller() -> None:
    release = threading.Event()
    reporter = ServeReporter(lambda r: release.wait(10) and None, URL, ServeMetrics().registry)
    t0 = time.monotonic()
    reporter.start()
    assert time.monotonic() - t0 < 0.5
    release.set()
    reporter.close()


def test_failures_are_swallowed_and_logged_once_per_kind(
    caplog: pytest.LogCaptureFixture,
) -> None:
    errors: list[Exception] = [
        OSError("scheduler gone"),
        OSError("scheduler gone"),
        TimeoutError("slow"),
        OSError("scheduler gone"),
    ]

    def send(report: Any) -> None:
        if errors:
            raise errors.pop(0)

    reporter = ServeReporter(send, URL, ServeMetrics().registry)
    with caplog.at_level(logging.WARNING, logger="monitoring.serve_reporter"):
        results = [reporter.report() for _ in range(5)]
    assert results == [False, False, False, False, True]
    assert (reporter.failures, reporter.sent) == (4, 1)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2
    assert "OSError: scheduler gone" in warnings[0]
    assert URL in warnings[0]
    assert "TimeoutError: slow" in warnings[1]


def test_the_interval_is_a_second_or_more() -> None:
    registry = ServeMetrics().registry
    for bad in (0.5, 0.0, float("nan")):
        with pytest.raises(ValueError, match=r"every_s: expected 1\.0 s or more"):
            ServeReporter(lambda r: None, URL, registry, every_s=bad)
    reporter = ServeReporter(lambda r: None, URL, registry, every_s=2.0)
    reporter.start()
    try:
        with pytest.raises(RuntimeError, match="already started"):
            reporter.start()
    finally:
        reporter.close()
