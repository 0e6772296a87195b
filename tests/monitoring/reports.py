"""Reports as the monitor receives them, for the monitoring tests: a trainer's, a store's.

The figures are small and fixed (one rank, two shards of two tables), so a test
states what it expects from them directly.
"""

from __future__ import annotations

import math
from dataclasses import fields
from typing import Any

from embedding_store.types import LatencySnapshot, ShardStats, TableStats
from monitoring.wire import shard_report

# A rank's per-row freshness counts, for the report fields of ``trainer``.
FRESH = {
    "missed_pushes_by_row": {"0": 900, "1": 80, "3": 20},
    "trained_missed_pushes_by_row": {"0": 995, "1": 5},
    "rows_freshened": 100,
    "rows_predicted": 40,
    "fresh_waits": 2,
}


def trainer(**over: Any) -> dict[str, Any]:
    """Rank 0's report at step 1 of a hybrid run (time 100), ``over`` replacing fields."""
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
    """A 4-wide table of ``rows`` rows (capacity 1,000), every counter at 3."""
    sizes = {"name": name, "dim": 4, "rows": rows, "capacity": 1000, "memory_bytes": rows * 32}
    counters = {f.name: 3 for f in fields(TableStats) if f.name not in sizes}
    return TableStats(**sizes, **counters)  # type: ignore[arg-type]


def store_report(rows: int) -> dict[str, Any]:
    """The store's report (time 100): two shards, each with table ``a`` of ``rows`` rows and
    ``b`` of one, and 20 lookups."""
    lat = LatencySnapshot((0.001, 0.01, math.inf), (10, 20, 20), 0.1, 20)
    stats = ShardStats(tables=(table("a", rows), table("b", 1)), lookup_latency=lat)
    return {
        "kind": "store",
        "time": 100.0,
        "shards": [shard_report(0, "127.0.0.1:1", stats), shard_report(1, "127.0.0.1:2", stats)],
    }
