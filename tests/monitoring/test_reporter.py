"""``Reporter``: what a trainer rank sends, throttled, in the background, never failing training."""

from __future__ import annotations

import math
import threading
from typing import Any

from embedding_store.types import LatencySnapshot, ShardStats
from monitoring.reporter import Reporter, trainer_report
from tests.monitoring.reports import table
from trainer.metrics import MetricsSnapshot
from trainer.progress import Progress


def progress(step: int = 1, **over: Any) -> Progress:
    fields: dict[str, Any] = {
        "rank": 0,
        "step": step,
        "samples": step * 10,
        "samples_total": step * 10,
        "samples_per_s": 10.0,
        "elapsed_s": float(step),
        "loss": 0.5,
        "metrics": MetricsSnapshot(10, 10, 0.7, 0.5, 1.0, (0.7,)),
        "staleness": 2,
        "pushes_queued": 1,
        "wait_s": 0.1,
        "compute_s": 0.9,
        "events_total": step * 10 + 1,
        "missed_pushes": {"0": 1, "2": step},
        "positions": {"t/0": step * 10},
        "deadletter": {"t/0": {"bad_json": 1}},
        "last_checkpoint": {"step": 1, "path": "x", "seconds": 0.2, "bytes": 10, "time": 5.0},
        "mode": "hybrid",
    }
    return Progress(**{**fields, **over})


def test_the_report_carries_positions_ends_dead_letters_and_the_checkpoint() -> None:
    report = trainer_report(progress(3), now=7.0, ends={"t/0": 100})
    assert report["partitions"] == {
        "t/0": {"position": 30, "end": 100, "deadletter": {"bad_json": 1}}
    }
    assert report["checkpoint"] == {"step": 1, "time": 5.0, "seconds": 0.2, "bytes": 10}
    assert report["missed_pushes"] == {"0": 1, "2": 3}
    assert (report["auc"], report["events_total"], report["staleness_bound"]) == (0.7, 31, 2)


def test_the_report_carries_the_per_row_staleness_of_fresh_rows() -> None:
    fresh = {
        "missed_pushes_by_row": {"0": 90, "2": 10},
        "trained_missed_pushes_by_row": {"0": 99, "1": 1},
        "rows_freshened": 10,
        "rows_predicted": 4,
        "fresh_waits": 1,
    }
    report = trainer_report(progress(3, **fresh), now=7.0)
    assert {k: report[k] for k in fresh} == fresh  # type: ignore[literal-required]
    # Fresh rows off, or sync: the trainer sends empty figures.
    off = trainer_report(progress(3), now=7.0)
    assert (off["missed_pushes_by_row"], off["trained_missed_pushes_by_row"]) == ({}, {})
    assert (off["rows_freshened"], off["rows_predicted"], off["fresh_waits"]) == (0, 0, 0)


def test_in_the_background_the_newest_report_is_sent_with_the_store() -> None:
    sent: list[dict[str, Any]] = []
    sending, gate = threading.Event(), threading.Event()

    def send(report: dict[str, Any]) -> None:
        sending.set()
        gate.wait(10)  # a slow scheduler: reports pile up behind this one
        sent.append(report)

    clock = iter(float(t) for t in range(100))
    lat = LatencySnapshot((0.001, math.inf), (1, 1), 0.0005, 1)
    reporter = Reporter(
        send,
        rank=0,
        clock=clock.__next__,
        ends=lambda parts: dict.fromkeys(parts, 1000),
        store_stats=lambda: [ShardStats((table("a", 5),), lookup_latency=lat)],
        store_addresses=["127.0.0.1:1"],
        background=True,
    )
    try:
        reporter(progress(1))
        assert sending.wait(10)
        for step in range(2, 6):
            reporter(progress(step))  # returns at once though send is blocked
        gate.set()
        deadline = threading.Event()
        for _ in range(100):
            if len(sent) >= 4:
                break
            deadline.wait(0.05)
    finally:
        reporter.close()
    trainers = [r for r in sent if r["kind"] == "trainer"]
    stores = [r for r in sent if r["kind"] == "store"]
    # The first report was being sent; of the four queued behind it only the newest.
    assert [r["step"] for r in trainers] == [1, 5]
    assert trainers[-1]["partitions"]["t/0"]["end"] == 1000
    assert stores[-1]["shards"][0]["tables"][0]["rows"] == 5
    assert stores[-1]["shards"][0]["lookup_latency"]["count"] == 1


def test_a_failing_scheduler_costs_a_count_not_the_training() -> None:
    def send(report: Any) -> None:
        raise ConnectionError("scheduler gone")

    reporter = Reporter(send, rank=1, clock=iter([0.0, 5.0]).__next__)
    reporter(progress(1))
    reporter(progress(2))
    assert (reporter.failures, reporter.sent) == (2, 0)


def test_a_rank_of_several_reports_every_rank_s_samples_and_auc() -> None:
    everyone = MetricsSnapshot(60, 60, 0.71, 0.5, 1.0, (0.71,))
    report = trainer_report(
        progress(3, ranks=2, job_samples=50, job_samples_total=60, job_metrics=everyone), now=7.0
    )
    assert (report["samples_total"], report["job_samples_total"]) == (30, 60)
    assert (report["auc"], report["job_auc"]) == (0.7, 0.71)
    alone = trainer_report(progress(3), now=7.0)  # one rank: its own are the job's
    assert (alone["job_samples_total"], alone["job_auc"]) == (30, None)
