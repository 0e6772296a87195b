"""The prediction server's Prometheus metrics, shared by its HTTP and gRPC front ends.

>>> metrics = ServeMetrics()
>>> metrics.count_request("infer", 200)
>>> b'streamrec_serve_requests_total{code="200",endpoint="infer"} 1.0' in metrics.exposition()
True
"""

from __future__ import annotations

from typing import Final

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import generate_latest

# Infer latency buckets, in seconds: fine-grained below 5 ms, where small requests
# land (``benchmarks/serve.py``), coarse up to a stalled call.
LATENCY_BUCKETS: Final = (
    0.00025, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5,
)  # fmt: skip


class ServeMetrics:
    """The server's Prometheus metrics, in a registry of their own (never the global one)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "streamrec_serve_requests",
            "HTTP requests answered, by endpoint and status code.",
            ["endpoint", "code"],
            registry=self.registry,
        )
        self.infer_latency = Histogram(
            "streamrec_serve_infer_latency_seconds",
            "Time from an infer request's headers to its answer.",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.errors = Counter(
            "streamrec_serve_errors",
            "Requests refused or failed, by reason (bad_records, invalid_request, ...).",
            ["reason"],
            registry=self.registry,
        )
        self.bad_records = Counter(
            "streamrec_serve_bad_records",
            "Records a model refused, by the record error's reason.",
            ["reason"],
            registry=self.registry,
        )
        self.records = Counter(
            "streamrec_serve_records_scored", "Records scored.", registry=self.registry
        )
        # labels() hashes and locks; the children are looked up once each.
        self._requests: dict[tuple[str, int], Counter] = {}

    def count_request(self, endpoint: str, code: int) -> None:
        """Count one answered request."""
        child = self._requests.get((endpoint, code))
        if child is None:
            child = self._requests[endpoint, code] = self.requests.labels(endpoint, str(code))
        child.inc()

    def exposition(self) -> bytes:
        """The Prometheus text of every metric."""
        return generate_latest(self.registry)
