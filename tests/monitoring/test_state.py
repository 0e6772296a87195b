"""``MonitorState`` and the Prometheus families built from it: pure, no network."""

from __future__ import annotations

import math
from dataclasses import fields
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from embedding_store.types import LatencySnapshot, ShardStats, TableStats
from monitoring.prometheus import JobMetricsCollector, job_metric_families
from monitoring.state import MonitorState
from monitoring.wire import shard_report, shard_stats_from_report


def trainer(**over: Any) -> dict[str, Any]:
    report: dict[str, Any] = {
        "kind": "trainer",
        "rank": 0,
        "time": 100.0,
        "step": 1,
        "samples_total": 0,
        "events_total": 0,
        "loss": 0.6,
        "auc": 0.7,
        "logloss": 0.6,
        "calibration": 1.0,
        "best_auc": None,
        "missed_pushes": {},
        "staleness_bound": 2,
        "pushes_queued": 0,
        "wait_s": 0.0,
        "compute_s": 0.0,
        "partitions": {},
        "checkpoint": None,
        "mode": "hybrid",
    }
    return {**report, **over}


def table(name: str, rows: int) -> TableStats:
    sizes = {"name": name, "dim": 4, "rows": rows, "capacity": 1000, "memory_bytes": rows * 32}
    counters = {f.name: 3 for f in fields(TableStats) if f.name not in sizes}
    return TableStats(**sizes, **counters)  # type: ignore[arg-type]


def store_report(rows: int) -> dict[str, Any]:
    lat = LatencySnapshot((0.001, 0.01, math.inf), (10, 20, 20), 0.1, 20)
    stats = ShardStats(tables=(table("a", rows), table("b", 1)), lookup_latency=lat)
    return {
        "kind": "store",
        "time": 100.0,
        "shards": [shard_report(0, "127.0.0.1:1", stats), shard_report(1, "127.0.0.1:2", stats)],
    }


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


FRESH = {
    "missed_pushes_by_row": {"0": 900, "1": 80, "3": 20},
    "trained_missed_pushes_by_row": {"0": 995, "1": 5},
    "rows_freshened": 100,
    "rows_predicted": 40,
    "fresh_waits": 2,
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
