"""Between the store's and trainer's types and the report dicts of ``monitoring.types``.

>>> import math
>>> from embedding_store.types import LatencySnapshot
>>> snap = LatencySnapshot((0.001, math.inf), (3, 4), 0.01, 4)
>>> latency_from_report(latency_report(snap)) == snap
True
"""

from __future__ import annotations

from dataclasses import fields

from embedding_store.types import LatencySnapshot, ShardStats, TableStats
from monitoring.types import LatencyReport, ShardReport, TableReport

_TABLE_FIELDS = tuple(TableReport.__annotations__)


def latency_report(snap: LatencySnapshot | None) -> LatencyReport | None:
    if snap is None:
        return None
    return LatencyReport(
        buckets=list(snap.buckets), counts=list(snap.counts), sum_s=snap.sum_s, count=snap.count
    )


def latency_from_report(lat: LatencyReport) -> LatencySnapshot:
    return LatencySnapshot(
        tuple(float(b) for b in lat["buckets"]),
        tuple(int(c) for c in lat["counts"]),
        float(lat["sum_s"]),
        int(lat["count"]),
    )


def shard_report(shard: int, address: str, stats: ShardStats) -> ShardReport:
    """One shard's ``ShardStats`` as the dict a ``StoreReport`` carries."""
    tables = [
        TableReport(**{f: getattr(t, f) for f in _TABLE_FIELDS})  # type: ignore[typeddict-item]
        for t in stats.tables
    ]
    return ShardReport(
        shard=shard,
        address=address,
        tables=tables,
        duplicate_pushes=stats.duplicate_pushes,
        lookup_latency=latency_report(stats.lookup_latency),
        push_latency=latency_report(stats.push_latency),
    )


def shard_stats_from_report(report: ShardReport) -> ShardStats:
    """Back to ``ShardStats`` (counters a report does not carry are 0), for the metrics."""
    names = {f.name for f in fields(TableStats)}
    tables = tuple(
        TableStats(**{n: t.get(n, 0) for n in names})  # type: ignore[arg-type]
        for t in report["tables"]
    )
    lookup, push = report["lookup_latency"], report["push_latency"]
    return ShardStats(
        tables=tables,
        duplicate_pushes=report["duplicate_pushes"],
        last_checkpoint=None,
        lookup_latency=None if lookup is None else latency_from_report(lookup),
        push_latency=None if push is None else latency_from_report(push),
    )
