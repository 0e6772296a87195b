"""Store shard metrics: the families built from ``ShardStats``, and a real shard's ``/metrics``.

The end-to-end tests start ``streamrec store serve --metrics-port 0`` as a
process, drive it with the real ``StoreClient`` over gRPC and scrape it over
HTTP. Nothing here asserts how long anything took.
"""

from __future__ import annotations

import math
import socket
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from deploy.config import load_config
from deploy.local.shards import ShardProcess
from embedding_store.client import StoreClient
from embedding_store.types import (
    CheckpointResult,
    LatencySnapshot,
    ShardStats,
    StoreConfig,
    TableStats,
)
from monitoring.store_metrics import (
    StoreMetricsCollector,
    merge_families,
    serve_store_metrics,
    store_metric_families,
)
from tests.support.ports import held_port
from tests.support.processes import grpc_address, streamrec

INF = math.inf
TABLE_FAMILIES = {
    "streamrec_store_rows": "gauge",
    "streamrec_store_capacity_rows": "gauge",
    "streamrec_store_memory_bytes": "gauge",
    "streamrec_store_lookup_ids_total": "counter",
    "streamrec_store_push_ids_total": "counter",
    "streamrec_store_admissions_total": "counter",
    "streamrec_store_rejected_admissions_total": "counter",
    "streamrec_store_evictions_total": "counter",
    "streamrec_store_expirations_total": "counter",
    "streamrec_store_unknown_reads_total": "counter",
    "streamrec_store_memory_rows": "gauge",
    "streamrec_store_disk_rows": "gauge",
    "streamrec_store_disk_bytes": "gauge",
    "streamrec_store_tier_asked_ids_total": "counter",
    "streamrec_store_tier_missed_ids_total": "counter",
    "streamrec_store_promotions_total": "counter",
    "streamrec_store_demotions_total": "counter",
}
SHARD_FAMILIES = {
    "streamrec_store_duplicate_pushes_total": "counter",
    "streamrec_store_lookup_seconds": "histogram",
    "streamrec_store_push_seconds": "histogram",
    "streamrec_store_last_checkpoint_bytes": "gauge",
    "streamrec_store_last_checkpoint_seconds": "gauge",
}

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _table(name: str, **counts: int) -> TableStats:
    fields = dict.fromkeys(TableStats.__dataclass_fields__, 0)
    return TableStats(**{**fields, "name": name, "dim": 4, **counts})  # type: ignore[arg-type]


def _flat(families: list[Metric]) -> Samples:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}


def _exposed(families: list[Metric]) -> str:
    class Fixed:
        def collect(self) -> list[Metric]:
            return families

    registry = CollectorRegistry()
    registry.register(Fixed())
    return generate_latest(registry).decode()


def _parse(text: str) -> tuple[dict[str, str], Samples]:
    """(exposed family name -> type, flat samples) of a Prometheus text exposition."""
    families = list(text_string_to_metric_families(text))
    # The parser drops a counter family's _total; the exposed name keeps it.
    types = {f.name + ("_total" if f.type == "counter" else ""): f.type for f in families}
    return types, _flat(families)


def scrape(url: str) -> tuple[dict[str, str], Samples]:
    with urllib.request.urlopen(url, timeout=30) as resp:
        assert resp.status == 200
        return _parse(resp.read().decode())


def at(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


# --- the pure core ------------------------------------------------------------------


STATS = ShardStats(
    tables=(
        _table(
            "user",
            rows=7,
            capacity=100,
            memory_bytes=4096,
            lookup_ids=30,
            push_ids=20,
            admissions=9,
            rejected_admissions=3,
            evictions=2,
            expirations=1,
        ),
        _table("item", rows=1, capacity=50, memory_bytes=512),
    ),
    duplicate_pushes=4,
    last_checkpoint=CheckpointResult("m.json", "full", 3, 8, 0, 12345, 0.5),
    lookup_latency=LatencySnapshot((0.001, 0.01, INF), (3, 5, 6), sum_s=2.5, count=6),
    push_latency=LatencySnapshot((0.001, 0.01, INF), (0, 2, 2), sum_s=0.01, count=2),
)


def test_families_have_the_documented_names_types_and_values() -> None:
    types, samples = _parse(_exposed(store_metric_families("s0", STATS)))
    assert types == {**TABLE_FAMILIES, **SHARD_FAMILIES}
    user = {"shard": "s0", "table": "user"}
    assert at(samples, "streamrec_store_rows", **user) == 7
    assert at(samples, "streamrec_store_rows", shard="s0", table="item") == 1
    assert at(samples, "streamrec_store_capacity_rows", **user) == 100
    assert at(samples, "streamrec_store_memory_bytes", **user) == 4096
    assert at(samples, "streamrec_store_lookup_ids_total", **user) == 30
    assert at(samples, "streamrec_store_push_ids_total", **user) == 20
    assert at(samples, "streamrec_store_admissions_total", **user) == 9
    assert at(samples, "streamrec_store_rejected_admissions_total", **user) == 3
    assert at(samples, "streamrec_store_evictions_total", **user) == 2
    assert at(samples, "streamrec_store_expirations_total", **user) == 1
    assert at(samples, "streamrec_store_duplicate_pushes_total", shard="s0") == 4
    assert at(samples, "streamrec_store_last_checkpoint_bytes", shard="s0") == 12345
    assert at(samples, "streamrec_store_last_checkpoint_seconds", shard="s0") == 0.5
    # Histogram buckets are cumulative, as in the snapshot.
    h = "streamrec_store_lookup_seconds"
    assert at(samples, h + "_bucket", shard="s0", le="0.001") == 3
    assert at(samples, h + "_bucket", shard="s0", le="0.01") == 5
    assert at(samples, h + "_bucket", shard="s0", le="+Inf") == 6
    assert at(samples, h + "_count", shard="s0") == 6
    assert at(samples, h + "_sum", shard="s0") == 2.5
    assert at(samples, "streamrec_store_push_seconds_count", shard="s0") == 2
    # Only the per-table families carry a table label.
    for (name, labels), _ in samples.items():
        keys = {k for k, _ in labels} - {"le"}
        family = name.removesuffix("_bucket").removesuffix("_count").removesuffix("_sum")
        assert keys == ({"shard", "table"} if family in TABLE_FAMILIES else {"shard"}), name


def test_latency_and_checkpoint_families_are_left_out_when_absent() -> None:
    bare = ShardStats(tables=(_table("user"),))
    types, samples = _parse(_exposed(store_metric_families("s0", bare)))
    assert types == {**TABLE_FAMILIES, "streamrec_store_duplicate_pushes_total": "counter"}
    assert at(samples, "streamrec_store_duplicate_pushes_total", shard="s0") == 0


def test_merged_shards_make_one_valid_exposition() -> None:
    other = ShardStats(tables=(_table("user", rows=3),), lookup_latency=STATS.lookup_latency)
    merged = merge_families(
        [*store_metric_families("a", STATS), *store_metric_families("b", other)]
    )
    text = _exposed(merged)
    assert text.count("# TYPE streamrec_store_rows gauge") == 1
    _, samples = _parse(text)
    assert at(samples, "streamrec_store_rows", shard="a", table="user") == 7
    assert at(samples, "streamrec_store_rows", shard="b", table="user") == 3
    assert at(samples, "streamrec_store_lookup_seconds_count", shard="b") == 6


def test_merging_refuses_one_name_with_two_types() -> None:
    gauge = Metric("x", "a gauge", "gauge")
    counter = Metric("x", "a counter", "counter")
    with pytest.raises(ValueError, match="x is a gauge and a counter"):
        merge_families([gauge, counter])


def test_the_collector_asks_for_fresh_stats_on_every_scrape() -> None:
    calls = []

    def stats() -> ShardStats:
        calls.append(1)
        return ShardStats(tables=(_table("user", rows=len(calls)),))

    registry = CollectorRegistry()
    registry.register(StoreMetricsCollector("s0", stats))
    for want in (1, 2):
        _, samples = _parse(generate_latest(registry).decode())
        assert at(samples, "streamrec_store_rows", shard="s0", table="user") == want


def test_metrics_server_serves_and_frees_its_port() -> None:
    server = serve_store_metrics("127.0.0.1:0", "s0", lambda: STATS)
    try:
        assert server.url == f"http://127.0.0.1:{server.port}/metrics"
        _, samples = scrape(server.url)
        assert at(samples, "streamrec_store_rows", shard="s0", table="user") == 7
    finally:
        server.close()
    server.close()  # idempotent
    with socket.socket() as s:
        # SO_REUSEADDR passes the scrape's TIME_WAIT, never a listener still there.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", server.port))
        s.listen()


@pytest.mark.parametrize("address", ["127.0.0.1", "127.0.0.1:x", ":9100", "h:70000"])
def test_metrics_server_refuses_a_bad_address(address: str) -> None:
    with pytest.raises(ValueError, match="expected HOST:PORT"):
        serve_store_metrics(address, "s0", lambda: STATS)


def test_in_process_client_reports_latencies_too() -> None:
    cfg = StoreConfig(tables={"user": {"dim": 4}}, row_dtype="float32")
    ids = np.arange(10, dtype=np.uint64)
    with StoreClient.connect("inproc://2", config=cfg) as store:
        store.lookup({"user": ids})
        store.lookup({"user": ids}, train=False)
        store.push({"user": (ids, np.ones((10, 4), np.float32))})
        stats = store.stats()
    for s in stats:
        assert s.lookup_latency is not None
        assert s.push_latency is not None
        assert s.lookup_latency.count == 2
        assert s.push_latency.count == 1


# --- a real shard process -----------------------------------------------------------


TABLES: dict[str, Any] = {
    # Small capacity: new ids evict the least recently seen rows.
    "user": {"dim": 8, "optimizer": {"kind": "sgd", "lr": 0.1}, "capacity": 100},
    # A new id gets a row on its second training lookup.
    "item": {
        "dim": 4,
        "capacity": 10_000,
        "admission": {"kind": "count_min", "threshold": 2, "width": 65536},
    },
    # Rows unseen for 2 steps expire.
    "ctx": {"dim": 4, "capacity": 10_000, "ttl_steps": 2},
}


@pytest.fixture
def metered_shard(
    write_job: Callable[..., Path], token_file: Path, tmp_path: Path
) -> Iterator[ShardProcess]:
    job = write_job(tables=TABLES)
    proc = ShardProcess.start(job, tmp_path / "metered-0", token_file=token_file, metrics_port=0)
    yield proc
    proc.kill()


def _client(proc: ShardProcess, token_file: Path) -> StoreClient:
    cfg = load_config(proc.config).store
    return StoreClient.connect(
        grpc_address([proc]), token=token_file.read_text().strip(), config=cfg
    )


@pytest.mark.processes
def test_a_shard_serves_metrics_that_move(metered_shard: ShardProcess, token_file: Path) -> None:
    proc = metered_shard
    url = proc.metrics_url
    assert url == f"http://127.0.0.1:{proc.metrics_port}/metrics"
    assert proc.metrics_port != proc.port
    shard = proc.address  # the shard label is the gRPC address
    assert f"metrics on {url} (shard={shard})" in proc.log()

    types, before = scrape(url)
    # No checkpoint yet: every family but the checkpoint gauges.
    assert types == {
        **TABLE_FAMILIES,
        **{k: v for k, v in SHARD_FAMILIES.items() if "checkpoint" not in k},
    }
    for table in TABLES:
        assert at(before, "streamrec_store_rows", shard=shard, table=table) == 0
        capacity = TABLES[table]["capacity"]
        assert at(before, "streamrec_store_capacity_rows", shard=shard, table=table) == capacity
        assert at(before, "streamrec_store_memory_bytes", shard=shard, table=table) > 0
    assert at(before, "streamrec_store_lookup_seconds_count", shard=shard) == 0
    assert at(before, "streamrec_store_push_seconds_count", shard=shard) == 0

    lookups = pushes = 0
    with _client(proc, token_file) as client:
        # user: 5 steps of 100 new ids each into a table of 100 rows.
        for step in range(5):
            ids = np.arange(step * 100, (step + 1) * 100, dtype=np.uint64)
            client.lookup({"user": ids})
            lookups += 1
        _, mid = scrape(url)
        user = {"shard": shard, "table": "user"}
        assert at(mid, "streamrec_store_lookup_ids_total", **user) == 500
        assert at(mid, "streamrec_store_admissions_total", **user) == 500
        rows = at(mid, "streamrec_store_rows", **user)
        assert 0 < rows <= 100
        assert at(mid, "streamrec_store_evictions_total", **user) == 500 - rows
        assert at(mid, "streamrec_store_lookup_seconds_count", shard=shard) == lookups

        # item: 50 new ids are refused once, then admitted.
        items = np.arange(1000, 1050, dtype=np.uint64)
        item = {"shard": shard, "table": "item"}
        client.lookup({"item": items})
        lookups += 1
        _, s = scrape(url)
        assert at(s, "streamrec_store_rejected_admissions_total", **item) == 50
        assert at(s, "streamrec_store_rows", **item) == 0
        client.lookup({"item": items})
        lookups += 1
        _, s = scrape(url)
        assert at(s, "streamrec_store_admissions_total", **item) == 50
        assert at(s, "streamrec_store_rows", **item) == 50

        # ctx: 20 ids seen once, then 6 steps of 10 others: the first 20 expire.
        client.lookup({"ctx": np.arange(20, dtype=np.uint64)})
        lookups += 1
        for _ in range(6):
            client.lookup({"ctx": np.arange(100, 110, dtype=np.uint64)})
            lookups += 1
        _, s = scrape(url)
        ctx = {"shard": shard, "table": "ctx"}
        assert at(s, "streamrec_store_expirations_total", **ctx) == 20
        assert at(s, "streamrec_store_rows", **ctx) == 10

        # Pushes: three distinct, then one retried under the same request id.
        recent = np.arange(400, 500, dtype=np.uint64)
        for _ in range(3):
            client.push({"user": (recent, np.ones((100, 8), np.float32))})
            pushes += 1
        grads = {"item": (items, np.ones((50, 4), np.float32))}
        client.push(grads, request_id="retry-me")
        client.push(grads, request_id="retry-me")
        pushes += 2
        types, after = scrape(url)
        assert at(after, "streamrec_store_push_ids_total", **user) == 300
        assert at(after, "streamrec_store_push_ids_total", **item) == 50
        assert at(after, "streamrec_store_duplicate_pushes_total", shard=shard) == 1
        assert at(after, "streamrec_store_push_seconds_count", shard=shard) == pushes
        assert at(after, "streamrec_store_lookup_seconds_count", shard=shard) == lookups
        for h in ("streamrec_store_lookup_seconds", "streamrec_store_push_seconds"):
            assert at(after, h + "_sum", shard=shard) > 0
            assert at(after, h + "_bucket", shard=shard, le="+Inf") == at(
                after, h + "_count", shard=shard
            )

        # The same figures over the Stats RPC, latencies included.
        (stats,) = client.stats()
        assert stats.lookup_latency is not None
        assert stats.push_latency is not None
        assert stats.lookup_latency.count == lookups
        assert stats.push_latency.count == pushes
        assert stats.lookup_latency.sum_s > 0
        assert 0 < stats.push_latency.quantile(0.5) <= stats.push_latency.buckets[-2]
        assert stats.table("user").rows == rows
        assert stats.duplicate_pushes == 1

        # A checkpoint brings its gauges.
        (ckpt,) = client.checkpoint()
        types, s = scrape(url)
        assert "streamrec_store_last_checkpoint_bytes" in types
        assert at(s, "streamrec_store_last_checkpoint_bytes", shard=shard) == ckpt.bytes > 0
        assert at(s, "streamrec_store_last_checkpoint_seconds", shard=shard) >= 0

    # The metrics server does not stand in the way of a clean stop.
    assert proc.stop() == 0
    assert "wrote" in proc.log().splitlines()[-1]


@pytest.mark.processes
def test_metrics_are_off_unless_asked_for(
    write_job: Callable[..., Path], token_file: Path, start_shards: Callable[..., Any]
) -> None:
    (proc,) = start_shards(1, write_job(), token_file)
    assert proc.metrics_port is None
    assert proc.metrics_url is None
    assert "metrics on" not in proc.log()


@pytest.mark.processes
def test_a_taken_metrics_port_fails_the_start_clearly(
    write_job: Callable[..., Path], token_file: Path, tmp_path: Path
) -> None:
    with held_port() as port:
        clash = f"--metrics-port {port}: could not serve metrics"
        with pytest.raises(RuntimeError, match=clash):
            ShardProcess.start(
                write_job(), tmp_path / "clash-0", token_file=token_file, metrics_port=port
            )


@pytest.mark.processes
def test_cli_rejects_an_impossible_metrics_port(
    write_job: Callable[..., Path], tmp_path: Path
) -> None:
    result = streamrec(
        "store", "serve", "--config", str(write_job()), "--data-dir", str(tmp_path / "d"),
        "--no-auth", "--metrics-port", "70000",
    )  # fmt: skip
    assert result.returncode == 2
    assert "--metrics-port 70000: expected 0-65535" in result.stderr
    help_text = streamrec("store", "serve", "--help").stdout
    assert "--metrics-port N" in help_text
