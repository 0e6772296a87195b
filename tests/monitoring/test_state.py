"""``MonitorState`` and the Prometheus families built from it: pure, no network."""

from __future__ import annotations

import json
import math
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from monitoring.prometheus import JobMetricsCollector, job_metric_families
from monitoring.state import MonitorState
from monitoring.wire import shard_stats_from_report
from tests.monitoring.reports import FRESH, store_report, trainer


def test_rates_come_from_two_reports_of_the_same_rank() -> None:
    state = MonitorState()
    state.receive(trainer(time=10.0, samples_total=1000, events_total=1010))
    state.receive(trainer(rank=1, time=10.0, samples_total=0, events_total=0))
    state.receive(trainer(time=12.0, samples_total=5000, events_total=5030, wait_s=1, compute_s=3))
    series = state.snapshot(now=12.0)["ranks"]["0"]["series"]
    assert series["samples_per_s"] == [2000.0]
    assert series["events_per_s"] == [2010.0]
    assert series["wait_share"] == [0.25]
    assert state.snapshot(now=12.0)["ranks"]["1"]["series"]["samples_per_s"] == []


def test_a_restart_or_a_late_report_gives_no_rate() -> None:
    state = MonitorState()
    state.receive(trainer(time=10.0, samples_total=1000, events_total=1000))
    state.receive(trainer(time=11.0, samples_total=2000, events_total=0))  # restarted run
    state.receive(trainer(time=10.5, samples_total=2100, events_total=100))  # out of order
    state.receive(trainer(time=12.0, samples_total=2600, events_total=700))
    assert state.snapshot(now=12.0)["ranks"]["0"]["series"]["samples_per_s"] == [600.0]


def test_history_is_bounded() -> None:
    state = MonitorState(history=5)
    for i in range(20):
        state.receive(trainer(time=float(i), samples_total=i * 10, events_total=i * 10))
    assert len(state.snapshot(now=20.0)["ranks"]["0"]["series"]["t"]) == 5


def test_staleness_sums_ranks_and_fills_every_count_up_to_the_bound() -> None:
    state = MonitorState()
    state.receive(trainer(missed_pushes={"0": 5, "1": 2}))
    state.receive(trainer(rank=1, missed_pushes={"0": 1, "4": 1}))
    assert state.staleness() == {
        "bound": 2,
        "hist": {"0": 6, "1": 2, "2": 0, "3": 0, "4": 1},
    }


def test_row_staleness_sums_the_ranks_that_count_rows() -> None:
    state = MonitorState()
    state.receive(trainer(**FRESH))
    state.receive(
        trainer(
            rank=1,
            missed_pushes_by_row={"0": 100},
            trained_missed_pushes_by_row={"0": 100},
            rows_freshened=1,
            rows_predicted=0,
            fresh_waits=1,
        )
    )
    # Fresh rows off: empty figures. Not counted as 1,000 fresh rows.
    state.receive(
        trainer(
            rank=2,
            missed_pushes_by_row={},
            trained_missed_pushes_by_row={},
            rows_freshened=0,
            rows_predicted=0,
            fresh_waits=0,
        )
    )
    state.receive(trainer(rank=3))  # a trainer from before the per-row figures
    rows = state.snapshot(now=100.0)["row_staleness"]
    assert rows == {
        "ranks": 2,
        "bound": 2,
        "lookup": {"0": 1000, "1": 80, "2": 0, "3": 20},
        "trained": {"0": 1095, "1": 5, "2": 0, "3": 0},
        "lookup_stale_share": 100 / 1100,
        "trained_stale_share": 5 / 1100,
        "rows_freshened": 101,
        "rows_predicted": 40,
        "fresh_waits": 3,
    }


def test_row_staleness_without_per_row_figures_is_no_figure() -> None:
    state = MonitorState()
    assert state.row_staleness()["ranks"] == 0
    state.receive(trainer(mode="sync", staleness_bound=0, missed_pushes={"0": 4}))
    state.receive(trainer(rank=1))
    rows = state.snapshot(now=100.0)["row_staleness"]
    assert rows["ranks"] == 0
    assert (rows["lookup"], rows["trained"]) == ({}, {})
    assert (rows["lookup_stale_share"], rows["trained_stale_share"]) == (None, None)


def test_partitions_show_lag_and_dead_letters() -> None:
    state = MonitorState()
    parts = {
        "t/0": {"position": 90, "end": 100, "deadletter": {"bad_json": 2}},
        "t/1": {"position": 5, "end": None, "deadletter": {}},
    }
    state.receive(trainer(partitions=parts))
    rows = state.partitions()
    assert [(r["partition"], r["lag"]) for r in rows] == [("t/0", 10), ("t/1", None)]
    assert rows[0]["deadletter"] == {"bad_json": 2}


def test_shards_total_their_tables_and_give_latency_quantiles() -> None:
    state = MonitorState()
    state.receive(store_report(rows=40))
    shards = state.shards()
    assert [s["rows"] for s in shards] == [41, 41]
    assert shards[0]["lookup_ms"]["p50"] == 1.0  # 10 of 20 calls took at most 1 ms
    assert shards[0]["push_ms"] is None  # not timed


def test_checkpoint_age_is_the_newest_one() -> None:
    state = MonitorState()
    cp = {"step": 4, "time": 50.0, "seconds": 0.5, "bytes": 100}
    state.receive(trainer(checkpoint=cp))
    state.receive(trainer(rank=1, checkpoint={**cp, "step": 2, "time": 10.0}))
    assert state.checkpoint(now=60.0) == {**cp, "age_s": 10.0}


def test_foreign_reports_are_counted_not_folded() -> None:
    state = MonitorState()
    state.receive({"kind": "weather"})
    state.receive("not a dict")  # type: ignore[arg-type]
    assert (state.rejected, state.reports) == (2, 0)


def test_shard_stats_survive_the_report_round_trip() -> None:
    report = store_report(rows=7)["shards"][0]
    stats = shard_stats_from_report(report)
    assert stats.table("a").rows == 7
    assert stats.lookup_latency is not None
    assert stats.lookup_latency.count == 20


def test_metrics_expose_every_rank_partition_and_shard() -> None:
    state = MonitorState()
    parts = {"t/0": {"position": 90, "end": 100, "deadletter": {"bad_json": 2}}}
    state.receive(trainer(time=1.0, samples_total=10, events_total=10, partitions=parts))
    state.receive(
        trainer(
            time=2.0,
            samples_total=30,
            events_total=32,
            partitions=parts,
            missed_pushes={"0": 3, "1": 1},
            checkpoint={"step": 4, "time": 1.5, "seconds": 0.5, "bytes": 100},
        )
    )
    state.receive(store_report(rows=40))
    registry = CollectorRegistry()
    registry.register(JobMetricsCollector(state, lambda: 3.0))
    text = generate_latest(registry).decode()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }
    assert samples[("streamrec_trainer_samples_total", (("rank", "0"),))] == 30
    assert samples[("streamrec_trainer_samples_per_second", (("rank", "0"),))] == 20
    assert samples[("streamrec_source_lag", (("partition", "t/0"), ("rank", "0")))] == 10
    key = ("streamrec_deadletter_records_total", (("partition", "t/0"), ("reason", "bad_json")))
    assert samples[key] == 2
    assert samples[("streamrec_trainer_staleness_bucket", (("le", "0.0"), ("rank", "0")))] == 3
    assert samples[("streamrec_trainer_staleness_count", (("rank", "0"),))] == 4
    assert samples[("streamrec_checkpoint_age_seconds", ())] == 1.5
    assert samples[("streamrec_store_rows", (("shard", "127.0.0.1:2"), ("table", "a")))] == 40
    # One family per name, however many shards: a scrape must not repeat a name.
    names = [m.name for m in job_metric_families(state, now=3.0)]
    assert len(names) == len(set(names))


def test_metrics_expose_the_per_row_staleness_of_ranks_that_count_rows() -> None:
    state = MonitorState()
    state.receive(trainer(**FRESH))
    state.receive(trainer(rank=1, **{**FRESH, "missed_pushes_by_row": {}}))  # fresh rows off
    state.receive(trainer(rank=2))  # an older trainer
    registry = CollectorRegistry()
    registry.register(JobMetricsCollector(state, lambda: 100.0))
    text = generate_latest(registry).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    lookup = families["streamrec_trainer_row_staleness"]
    trained = families["streamrec_trainer_row_staleness_trained"]
    assert (lookup.type, trained.type) == ("histogram", "histogram")

    def samples(family: Any, suffix: str) -> dict[tuple[tuple[str, str], ...], float]:
        return {
            tuple(sorted(s.labels.items())): s.value
            for s in family.samples
            if s.name == family.name + suffix
        }

    # Buckets 0, 1, ... up to the bound (2) or the largest count seen (3), cumulative.
    assert samples(lookup, "_bucket") == {
        (("le", "0.0"), ("rank", "0")): 900,
        (("le", "1.0"), ("rank", "0")): 980,
        (("le", "2.0"), ("rank", "0")): 980,
        (("le", "3.0"), ("rank", "0")): 1000,
        (("le", "+Inf"), ("rank", "0")): 1000,
    }
    assert samples(lookup, "_sum") == {(("rank", "0"),): 80 + 3 * 20}
    assert samples(trained, "_bucket") == {
        (("le", "0.0"), ("rank", "0")): 995,
        (("le", "1.0"), ("rank", "0")): 1000,
        (("le", "2.0"), ("rank", "0")): 1000,
        (("le", "+Inf"), ("rank", "0")): 1000,
    }
    assert samples(trained, "_count") == {(("rank", "0"),): 1000}
    for name, value in (("rows_freshened", 100), ("rows_predicted", 40), ("fresh_waits", 2)):
        family = families[f"streamrec_trainer_{name}"]
        assert family.type == "counter"
        # Ranks 1 and 2 count no rows: no samples, rather than zeros that read as fresh.
        assert samples(family, "_total") == {(("rank", "0"),): value}


# --- prediction servers -------------------------------------------------------------------

BOUNDS = [0.001, 0.005, 0.01, math.inf]


def serve(**over: Any) -> dict[str, Any]:
    report: dict[str, Any] = {
        "kind": "serve",
        "server": "http://10.0.0.7:8080",
        "time": 100.0,
        "requests_total": 0,
        "errors_total": 0,
        "records_total": 0,
        "latency_buckets": BOUNDS,
        "latency_counts": [0, 0, 0, 0],
        "dense_version": 7,
        "dense_age_s": 30.0,
        "sparse_age_s": 0.5,
    }
    return {**report, **over}


def test_server_rates_come_from_two_reports_of_the_same_server() -> None:
    state = MonitorState()
    state.receive(serve(time=10.0, requests_total=100, records_total=300, errors_total=1))
    state.receive(serve(server="http://other:1", time=10.0))
    state.receive(serve(time=12.0, requests_total=500, records_total=1500, errors_total=5))
    servers = state.snapshot(now=12.0)["servers"]
    one = servers["http://10.0.0.7:8080"]
    assert one["series"]["requests_per_s"] == [200.0]
    assert one["series"]["records_per_s"] == [600.0]
    assert one["series"]["errors_per_s"] == [2.0]
    assert (one["requests_per_s"], one["records_per_s"], one["errors_per_s"]) == (200, 600, 2)
    assert (one["requests_total"], one["errors_total"], one["records_total"]) == (500, 5, 1500)
    # One report: the server is listed, with no rate yet.
    other = servers["http://other:1"]
    assert other["series"]["requests_per_s"] == []
    assert (other["requests_per_s"], other["p99_ms"]) == (None, None)
    assert state.reports == 3


def test_p99_is_the_bucket_bound_of_the_last_interval_not_of_all_time() -> None:
    state = MonitorState()
    # Before: 1,000 slow requests (all above 5 ms).
    state.receive(serve(time=10.0, requests_total=1000, latency_counts=[0, 0, 1000, 1000]))
    # In the interval: 100 requests, 99 of them within 5 ms, one within 10 ms.
    state.receive(serve(time=11.0, requests_total=1100, latency_counts=[50, 99, 1100, 1100]))
    # Then 200, of which 3 above 10 ms: 197 / 200 < 99% within 10 ms: the +Inf bucket,
    # shown as the largest finite bound (what Prometheus' histogram_quantile does).
    state.receive(serve(time=12.0, requests_total=1300, latency_counts=[150, 249, 1297, 1300]))
    # Exactly 99% within 1 ms reaches the threshold.
    state.receive(serve(time=13.0, requests_total=1400, latency_counts=[249, 349, 1397, 1400]))
    # No request at all: no p99, while the rate is 0.
    state.receive(serve(time=14.0, requests_total=1400, latency_counts=[249, 349, 1397, 1400]))
    s = state.serving(now=14.0)["http://10.0.0.7:8080"]
    assert s["series"]["p99_ms"] == [5.0, 10.0, 1.0, None]
    assert s["series"]["requests_per_s"] == [100.0, 200.0, 100.0, 0.0]
    assert (s["p99_ms"], s["requests_per_s"]) == (None, 0.0)


def test_a_restarted_server_or_a_late_report_gives_no_rate() -> None:
    state = MonitorState()
    state.receive(serve(time=10.0, requests_total=1000, latency_counts=[900, 1000, 1000, 1000]))
    # Restarted: every counter from 0 again.
    state.receive(serve(time=11.0, requests_total=10, latency_counts=[10, 10, 10, 10]))
    # Late: older than the newest report; folded in, it would read as a restart.
    state.receive(serve(time=10.5, requests_total=1050, latency_counts=[950, 1050, 1050, 1050]))
    state.receive(serve(time=12.0, requests_total=110, latency_counts=[110, 110, 110, 110]))
    s = state.serving(now=12.0)["http://10.0.0.7:8080"]
    assert s["series"]["requests_per_s"] == [100.0]
    assert s["series"]["p99_ms"] == [1.0]
    assert s["requests_total"] == 110


def test_a_histogram_going_back_alone_is_a_restart_and_new_buckets_give_no_p99() -> None:
    state = MonitorState()
    state.receive(serve(time=10.0, requests_total=5, latency_counts=[5, 5, 5, 5]))
    # A restart that answered as many requests since: only the histogram says so.
    state.receive(serve(time=11.0, requests_total=6, latency_counts=[0, 6, 6, 6]))
    # A server that changed its buckets: rates, but no p99 from counts that do not match.
    state.receive(
        serve(
            time=12.0, requests_total=16, latency_buckets=[0.002, math.inf], latency_counts=[16, 16]
        )
    )
    s = state.serving(now=12.0)["http://10.0.0.7:8080"]
    assert s["series"]["requests_per_s"] == [10.0]
    assert s["series"]["p99_ms"] == [None]


def test_serving_freshness_is_the_latest_reported_aged_to_now() -> None:
    state = MonitorState()
    state.receive(serve(time=10.0, dense_version=6, dense_age_s=100.0, sparse_age_s=2.0))
    state.receive(serve(time=11.0, dense_version=7, dense_age_s=1.0, sparse_age_s=0.25))
    state.receive(serve(time=10.5, dense_version=6, dense_age_s=100.5, sparse_age_s=2.5))  # late
    s = state.serving(now=14.0)["http://10.0.0.7:8080"]
    assert (s["dense_version"], s["dense_age_s"], s["sparse_age_s"], s["age_s"]) == (
        7,
        4.0,
        3.25,
        3.0,
    )
    # A server with nothing published yet and rows never current: None, not 0.
    state.receive(
        serve(server="http://new:1", dense_version=None, dense_age_s=None, sparse_age_s=None)
    )
    new = state.serving(now=101.0)["http://new:1"]
    assert (new["dense_version"], new["dense_age_s"], new["sparse_age_s"]) == (None, None, None)


def test_server_history_is_bounded_and_the_snapshot_is_json() -> None:
    state = MonitorState(history=5)
    for i in range(20):
        n = 10 * i
        state.receive(serve(time=float(i), requests_total=n, latency_counts=[n, n, n, n]))
    snap = state.snapshot(now=20.0, points=3)
    assert len(state.servers["http://10.0.0.7:8080"].series["t"]) == 5
    assert snap["servers"]["http://10.0.0.7:8080"]["series"]["t"] == [17.0, 18.0, 19.0]
    assert json.loads(json.dumps(snap, allow_nan=False))["servers"]  # the page's data.json


def test_a_serve_report_without_every_field_is_rejected() -> None:
    state = MonitorState()
    incomplete = serve()
    del incomplete["sparse_age_s"]
    state.receive(incomplete)
    assert (state.rejected, state.reports, state.servers) == (1, 0, {})
    assert state.snapshot(now=100.0)["servers"] == {}


def test_metrics_expose_every_server_labelled_by_its_url() -> None:
    state = MonitorState()
    state.receive(serve(time=10.0))
    state.receive(
        serve(time=12.0, requests_total=200, errors_total=2, latency_counts=[198, 200, 200, 200])
    )
    state.receive(
        serve(server="http://new:1", dense_version=None, dense_age_s=None, sparse_age_s=None)
    )
    registry = CollectorRegistry()
    registry.register(JobMetricsCollector(state, lambda: 13.0))
    text = generate_latest(registry).decode()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }
    one = (("server", "http://10.0.0.7:8080"),)
    assert samples[("streamrec_serve_requests_per_second", one)] == 100
    assert samples[("streamrec_serve_errors_per_second", one)] == 1
    assert samples[("streamrec_serve_infer_latency_p99_seconds", one)] == 0.001
    assert samples[("streamrec_serve_dense_version", one)] == 7
    assert samples[("streamrec_serve_dense_age_seconds", one)] == 31
    assert samples[("streamrec_serve_sparse_age_seconds", one)] == 1.5
    assert samples[("streamrec_serve_report_age_seconds", one)] == 1
    # The new server: only what it has (a report age), no made-up zeros.
    new = [name for name, labels in samples if labels == (("server", "http://new:1"),)]
    assert new == ["streamrec_serve_report_age_seconds"]
