"""Prometheus metrics of an embedding store shard, built from its ``ShardStats``.

``store_metric_families`` is the pure core: counters in, metric families out.
Each shard process serves them on its own ``/metrics`` (``serve_store_metrics``,
what ``streamrec store serve --metrics-port`` runs); other processes that hold a
shard's stats (from the Stats RPC) build the same families with it, and
``merge_families`` joins several shards' into one exposition.

Every name starts with ``streamrec_store_``; every sample has a ``shard`` label,
the per-table ones a ``table`` label too.

>>> import numpy as np
>>> from embedding_store.shard import StoreShard
>>> from embedding_store.types import StoreConfig
>>> shard = StoreShard(StoreConfig(tables={"user": {"dim": 4, "capacity": 100}}))
>>> rows = shard.lookup({"user": np.arange(3, dtype=np.uint64)})
>>> families = {f.name: f for f in store_metric_families("s0", shard.stats())}
>>> [(s.name, s.labels, s.value) for s in families["streamrec_store_rows"].samples]
[('streamrec_store_rows', {'shard': 's0', 'table': 'user'}, 3)]
>>> [s.name for s in families["streamrec_store_admissions"].samples]
['streamrec_store_admissions_total']
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from embedding_store.types import LatencySnapshot, ShardStats, TableStats

__all__ = [
    "MetricsServer",
    "StoreMetricsCollector",
    "merge_families",
    "serve_store_metrics",
    "store_metric_families",
]

StatsFn = Callable[[], ShardStats]

# (name, value, help) of the per-table figures.
_TABLE_GAUGES: tuple[tuple[str, Callable[[TableStats], int], str], ...] = (
    ("streamrec_store_rows", lambda t: t.rows, "Rows the table holds on this shard."),
    (
        "streamrec_store_capacity_rows",
        lambda t: t.capacity,
        "Rows the table may hold on this shard (its configured capacity).",
    ),
    (
        "streamrec_store_memory_bytes",
        lambda t: t.memory_bytes,
        "Bytes of the table's arrays on this shard.",
    ),
    ("streamrec_store_memory_rows", lambda t: t.memory_rows, "Rows the table holds in memory."),
    (
        "streamrec_store_disk_rows",
        lambda t: t.disk_rows,
        "Rows of a tiered table with a copy in its disk tier.",
    ),
    (
        "streamrec_store_disk_bytes",
        lambda t: t.disk_bytes,
        "Bytes of a tiered table's disk tier files.",
    ),
)
_TABLE_COUNTERS: tuple[tuple[str, Callable[[TableStats], int], str], ...] = (
    (
        "streamrec_store_lookup_ids_total",
        lambda t: t.lookup_ids,
        "Ids looked up by training lookups (train=true).",
    ),
    (
        "streamrec_store_push_ids_total",
        lambda t: t.push_ids,
        "Ids whose gradients were pushed (applied or not).",
    ),
    (
        "streamrec_store_admissions_total",
        lambda t: t.admissions,
        "Rows created for new ids the admission policy let in.",
    ),
    (
        "streamrec_store_rejected_admissions_total",
        lambda t: t.rejected_admissions,
        "Lookups of new ids the admission policy refused a row.",
    ),
    (
        "streamrec_store_evictions_total",
        lambda t: t.evictions,
        "Least recently seen rows removed to stay within capacity.",
    ),
    (
        "streamrec_store_expirations_total",
        lambda t: t.expirations,
        "Rows removed because they were unseen for ttl_steps.",
    ),
    (
        "streamrec_store_unknown_reads_total",
        lambda t: t.unknown_reads,
        "Ids a serving replica read without a row (served the table's initial row).",
    ),
    (
        "streamrec_store_tier_asked_ids_total",
        lambda t: t.tier_asked,
        "Ids a tiered table was asked for (repeats counted).",
    ),
    (
        "streamrec_store_tier_missed_ids_total",
        lambda t: t.tier_missed,
        "Ids a tiered table was asked for that were not in memory: 1 - missed/asked is "
        "its hit rate.",
    ),
    (
        "streamrec_store_promotions_total",
        lambda t: t.promotions,
        "Rows a tiered table read back from disk.",
    ),
    (
        "streamrec_store_demotions_total",
        lambda t: t.demotions,
        "Rows a tiered table moved out of memory (written to disk where changed).",
    ),
)


def _le(bound: float) -> str:
    # The spelling prometheus_client's own Histogram uses: 0.001, 1.0, +Inf.
    return "+Inf" if bound == float("inf") else repr(float(bound))


def _histogram(name: str, doc: str, shard: str, snap: LatencySnapshot) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, doc, labels=["shard"])
    family.add_metric(
        [shard],
        buckets=[(_le(b), c) for b, c in zip(snap.buckets, snap.counts, strict=True)],
        sum_value=snap.sum_s,
    )
    return family


def store_metric_families(shard: str, stats: ShardStats) -> list[Metric]:
    """The metric families of one shard's stats, labelled ``shard=<shard>``.

    Latency histograms are left out when the stats carry none (an older
    server), the checkpoint gauges until the shard has written a checkpoint.
    """
    families: list[Metric] = []
    for name, value, doc in _TABLE_GAUGES:
        gauge = GaugeMetricFamily(name, doc, labels=["shard", "table"])
        for t in stats.tables:
            gauge.add_metric([shard, t.name], value(t))
        families.append(gauge)
    for name, value, doc in _TABLE_COUNTERS:
        counter = CounterMetricFamily(name, doc, labels=["shard", "table"])
        for t in stats.tables:
            counter.add_metric([shard, t.name], value(t))
        families.append(counter)
    dups = CounterMetricFamily(
        "streamrec_store_duplicate_pushes_total",
        "Pushes whose request id was already applied (retries, not applied again).",
        labels=["shard"],
    )
    dups.add_metric([shard], stats.duplicate_pushes)
    families.append(dups)
    for name, method, snap in (
        ("streamrec_store_lookup_seconds", "Lookup", stats.lookup_latency),
        ("streamrec_store_push_seconds", "Push", stats.push_latency),
    ):
        if snap is not None:
            doc = f"Seconds the shard's server spent per {method} call."
            families.append(_histogram(name, doc, shard, snap))
    last = stats.last_checkpoint
    if last is not None:
        size = GaugeMetricFamily(
            "streamrec_store_last_checkpoint_bytes",
            "Bytes the shard's last checkpoint wrote.",
            labels=["shard"],
        )
        size.add_metric([shard], last.bytes)
        took = GaugeMetricFamily(
            "streamrec_store_last_checkpoint_seconds",
            "Seconds the shard's last checkpoint took to write.",
            labels=["shard"],
        )
        took.add_metric([shard], last.seconds)
        families += [size, took]
    return families


def merge_families(families: Iterable[Metric]) -> list[Metric]:
    """One family per name holding the samples of all: several shards in one exposition.

    An exposition must not name a family twice, so a process showing many
    shards merges their ``store_metric_families`` first.

    >>> from embedding_store.types import ShardStats
    >>> shards = {"a": ShardStats(()), "b": ShardStats(())}
    >>> merged = merge_families(f for k, v in shards.items() for f in store_metric_families(k, v))
    >>> [(f.name, [s.labels["shard"] for s in f.samples]) for f in merged]
    ... # doctest: +ELLIPSIS
    [..., ('streamrec_store_duplicate_pushes', ['a', 'b'])]
    """
    merged: dict[str, Metric] = {}
    for family in families:
        into = merged.get(family.name)
        if into is None:
            into = Metric(family.name, family.documentation, family.type, family.unit)
            merged[family.name] = into
        elif into.type != family.type:
            msg = f"merge_families: {family.name} is a {into.type} and a {family.type}"
            raise ValueError(msg)
        into.samples.extend(family.samples)
    return list(merged.values())


class StoreMetricsCollector:
    """A prometheus_client collector of one shard: ``stats_fn()`` is called on every scrape.

    >>> from prometheus_client import CollectorRegistry, generate_latest
    >>> from embedding_store.types import ShardStats
    >>> registry = CollectorRegistry()
    >>> registry.register(StoreMetricsCollector("s0", lambda: ShardStats((), duplicate_pushes=2)))
    >>> print(generate_latest(registry).decode().splitlines()[-1])
    streamrec_store_duplicate_pushes_total{shard="s0"} 2.0
    """

    def __init__(self, shard_label: str, stats_fn: StatsFn) -> None:
        self.shard_label = shard_label
        self._stats_fn = stats_fn

    def collect(self) -> list[Metric]:
        return store_metric_families(self.shard_label, self._stats_fn())


def _split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        msg = f"metrics address {address!r}: expected HOST:PORT (PORT 0 picks a free one)"
        raise ValueError(msg)
    return host, int(port)


class MetricsServer:
    """An HTTP server of ``/metrics`` on a thread of its own; ``close()`` stops it."""

    def __init__(self, host: str, httpd: WSGIServer, thread: threading.Thread) -> None:
        self.host = host
        self.port = int(httpd.server_port)
        self._httpd = httpd
        self._thread = thread
        self._closed = False

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and free the port (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=10)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass  # a scrape or probe every few seconds is not worth a line


def _threading_server(host: str) -> type[WSGIServer]:
    """A WSGI server class serving each request on a thread, for ``host``'s family."""

    class _Server(ThreadingMixIn, WSGIServer):
        daemon_threads = True
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

    return _Server


def serve_store_metrics(
    address: str,
    shard_label: str,
    stats_fn: StatsFn,
    health_fn: Callable[[], str] | None = None,
) -> MetricsServer:
    """Serve one shard's metrics over HTTP on ``address`` (``HOST:PORT``, port 0: any free).

    The metrics live in a private registry, not prometheus_client's global one,
    so several servers (or tests) in one process do not see each other's.
    ``health_fn``: ``/healthz`` answers 200 when it says ``SERVING``, else 503 with
    what it says (Kubernetes' probes, without starting a Python per probe).

    >>> import urllib.request
    >>> from embedding_store.types import ShardStats
    >>> with serve_store_metrics("127.0.0.1:0", "s0", lambda: ShardStats(())) as server:
    ...     body = urllib.request.urlopen(server.url, timeout=10).read().decode()
    >>> 'streamrec_store_duplicate_pushes_total{shard="s0"} 0.0' in body
    True
    """
    host, port = _split_address(address)
    registry = CollectorRegistry()
    registry.register(StoreMetricsCollector(shard_label, stats_fn))
    metrics_app = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") == "/healthz" and health_fn is not None:
            status = health_fn()
            code = "200 OK" if status == "SERVING" else "503 Service Unavailable"
            start_response(code, [("Content-Type", "text/plain; charset=utf-8")])
            return [f"{status}\n".encode()]
        return metrics_app(environ, start_response)  # type: ignore[no-any-return]

    try:
        httpd = make_server(host, port, app, _threading_server(host), handler_class=_QuietHandler)
        thread = threading.Thread(target=httpd.serve_forever, name="metrics", daemon=True)
        thread.start()
    except OSError as exc:
        msg = (
            f"could not serve metrics on {address} ({exc.strerror or exc}); "
            "pick another port, or 0 for any free one"
        )
        raise OSError(msg) from exc
    return MetricsServer(host, httpd, thread)
