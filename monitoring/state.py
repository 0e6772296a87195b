"""``MonitorState``: the reports of a running job, folded into what the page shows.

A pure state machine: ``receive(report)`` with the dicts of ``monitoring.types``,
``snapshot()`` for the page's JSON. Rates (samples/s, events/s; a server's
requests/s and its p99 latency) come from the difference of two reports of the
same rank or server, so a report that is late or lost costs resolution, never
a wrong figure. Nothing here does I/O or reads a clock of its own: the
scheduler plugin is the thin shell around it.

>>> state = MonitorState()
>>> base = dict(kind="trainer", rank=0, step=1, loss=0.6, auc=0.7, logloss=0.6,
...     calibration=1.0, best_auc=0.8, missed_pushes={"0": 1, "2": 1}, staleness_bound=2,
...     pushes_queued=1, wait_s=0.0, compute_s=1.0, checkpoint=None, mode="hybrid",
...     partitions={"t/0": {"position": 100, "end": 150, "deadletter": {"bad_json": 2}}})
>>> state.receive({**base, "time": 10.0, "samples_total": 100, "events_total": 102})
>>> state.receive({**base, "time": 12.0, "samples_total": 300, "events_total": 310})
>>> snap = state.snapshot(now=12.5)
>>> snap["ranks"]["0"]["series"]["samples_per_s"], snap["partitions"][0]["lag"]
([100.0], 50)
>>> snap["staleness"]["hist"]
{'0': 1, '1': 0, '2': 1}
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, cast

from monitoring.types import LatencyReport, ServeReport, StoreReport, TrainerReport
from monitoring.wire import latency_from_report

SERIES = ("t", "samples_per_s", "events_per_s", "loss", "auc", "wait_share")
SERVE_SERIES = ("t", "requests_per_s", "records_per_s", "errors_per_s", "p99_ms")


@dataclass
class _Rank:
    last: TrainerReport
    series: dict[str, deque[float | None]]


@dataclass
class _Server:
    last: ServeReport
    series: dict[str, deque[float | None]]


@dataclass
class MonitorState:
    """Every rank's and server's recent history, and the store's last counters."""

    history: int = 3600  # points kept per rank (an hour at one report a second)
    ranks: dict[int, _Rank] = field(default_factory=dict)
    store: StoreReport | None = None
    servers: dict[str, _Server] = field(default_factory=dict)
    reports: int = 0
    rejected: int = 0

    def receive(self, report: dict[str, Any]) -> None:
        """Fold one report in; a report that is not one of ours is counted and dropped."""
        kind = report.get("kind") if isinstance(report, dict) else None
        if kind == "trainer":
            self._trainer(cast(TrainerReport, report))
        elif kind == "store":
            self.store = cast(StoreReport, report)
        elif kind == "serve" and ServeReport.__required_keys__ <= report.keys():
            # Checked: a server of another version must not break the page of all of them.
            self._serve(cast(ServeReport, report))
        else:
            self.rejected += 1
            return
        self.reports += 1

    def _trainer(self, report: TrainerReport) -> None:
        rank = self.ranks.get(report["rank"])
        if rank is None:
            series: dict[str, deque[float | None]] = {k: deque(maxlen=self.history) for k in SERIES}
            self.ranks[report["rank"]] = _Rank(report, series)
            return
        prev = rank.last
        dt = report["time"] - prev["time"]
        if dt <= 0:
            return  # out of order: the newer report already stands
        rank.last = report
        ds = report["samples_total"] - prev["samples_total"]
        de = report["events_total"] - prev["events_total"]
        if ds < 0 or de < 0:
            return  # a restarted run (its counters went back): no rate this once
        dw = report["wait_s"] - prev["wait_s"]
        dc = report["compute_s"] - prev["compute_s"]
        point = {
            "t": report["time"],
            "samples_per_s": ds / dt,
            "events_per_s": de / dt,
            "loss": report["loss"],
            "auc": report["auc"],
            "wait_share": dw / (dw + dc) if dw + dc > 0 else None,
        }
        for k in SERIES:
            rank.series[k].append(point[k])

    def _serve(self, report: ServeReport) -> None:
        server = self.servers.get(report["server"])
        if server is None:
            series: dict[str, deque[float | None]] = {
                k: deque(maxlen=self.history) for k in SERVE_SERIES
            }
            self.servers[report["server"]] = _Server(report, series)
            return
        prev = server.last
        dt = report["time"] - prev["time"]
        if dt <= 0:
            return  # out of order: the newer report already stands
        server.last = report
        dr = report["requests_total"] - prev["requests_total"]
        dn = report["records_total"] - prev["records_total"]
        de = report["errors_total"] - prev["errors_total"]
        same_buckets = report["latency_buckets"] == prev["latency_buckets"]
        counts = [
            c - p for c, p in zip(report["latency_counts"], prev["latency_counts"], strict=False)
        ]
        if dr < 0 or dn < 0 or de < 0 or (same_buckets and any(d < 0 for d in counts)):
            return  # a restarted server (its counters went back): no rate this once
        point = {
            "t": report["time"],
            "requests_per_s": dr / dt,
            "records_per_s": dn / dt,
            "errors_per_s": de / dt,
            "p99_ms": _p99_ms(report["latency_buckets"], counts) if same_buckets else None,
        }
        for k in SERVE_SERIES:
            server.series[k].append(point[k])

    # --- what the page and /metrics read ---------------------------------------------

    def staleness(self) -> dict[str, Any]:
        """Batches by missed pushes, summed over ranks, every count up to the max shown."""
        hist: dict[int, int] = {}
        bound = 0
        for r in self.ranks.values():
            bound = max(bound, r.last["staleness_bound"])
            for k, n in r.last["missed_pushes"].items():
                hist[int(k)] = hist.get(int(k), 0) + n
        top = max([bound, *hist])
        return {"bound": bound, "hist": {str(k): hist.get(k, 0) for k in range(top + 1)}}

    def row_staleness(self) -> dict[str, Any]:
        """Fresh rows, per embedding row, summed over the ranks that report them.

        ``lookup`` and ``trained``: rows by how many of their rank's own pushes they
        missed when looked up and still missed when trained, every count up to the
        bound or the max shown; ``*_stale_share``: the rows that missed one or more.
        ``ranks`` is 0 (and every share None) while no rank has per-row figures:
        fresh rows off, sync mode, a trainer older than them, or no batch yet.
        A rank with fresh rows off trains rows as stale as its lookups, but does not
        count them: it is left out, not shown as fresh.

        >>> state = MonitorState()
        >>> state.receive(dict(kind="trainer", rank=0, time=1.0, staleness_bound=2,
        ...     missed_pushes_by_row={"0": 90, "1": 10}, trained_missed_pushes_by_row={"0": 100},
        ...     rows_freshened=10, rows_predicted=4, fresh_waits=0))
        >>> rows = state.row_staleness()
        >>> rows["lookup"], rows["trained"], rows["lookup_stale_share"], rows["trained_stale_share"]
        ({'0': 90, '1': 10, '2': 0}, {'0': 100, '1': 0, '2': 0}, 0.1, 0.0)
        """
        lookup: dict[int, int] = {}
        trained: dict[int, int] = {}
        bound = ranks = freshened = predicted = waits = 0
        for r in self.ranks.values():
            last = r.last
            at_lookup = last.get("missed_pushes_by_row") or {}
            if not at_lookup:
                continue
            ranks += 1
            bound = max(bound, last["staleness_bound"])
            for into, hist in (
                (lookup, at_lookup),
                (trained, last.get("trained_missed_pushes_by_row") or {}),
            ):
                for k, n in hist.items():
                    into[int(k)] = into.get(int(k), 0) + n
            freshened += last.get("rows_freshened", 0)
            predicted += last.get("rows_predicted", 0)
            waits += last.get("fresh_waits", 0)
        top = max([bound, *lookup, *trained]) if ranks else -1
        return {
            "ranks": ranks,
            "bound": bound,
            "lookup": {str(k): lookup.get(k, 0) for k in range(top + 1)},
            "trained": {str(k): trained.get(k, 0) for k in range(top + 1)},
            "lookup_stale_share": _stale_share(lookup),
            "trained_stale_share": _stale_share(trained),
            "rows_freshened": freshened,
            "rows_predicted": predicted,
            "fresh_waits": waits,
        }

    def partitions(self) -> list[dict[str, Any]]:
        """Per source partition: the rank that trains it, position, end, lag, dead letters."""
        out = []
        for rank_id, r in sorted(self.ranks.items()):
            for name, p in sorted(r.last["partitions"].items()):
                end = p["end"]
                out.append(
                    {
                        "partition": name,
                        "rank": rank_id,
                        "position": p["position"],
                        "end": end,
                        "lag": None if end is None else max(0, end - p["position"]),
                        "deadletter": dict(p["deadletter"]),
                    }
                )
        return out

    def shards(self) -> list[dict[str, Any]]:
        """Per store shard: totals over its tables, latency quantiles, the tables."""
        if self.store is None:
            return []
        out = []
        for s in self.store["shards"]:
            tables = s["tables"]
            out.append(
                {
                    "shard": s["shard"],
                    "address": s["address"],
                    "rows": sum(t["rows"] for t in tables),
                    "memory_bytes": sum(t["memory_bytes"] for t in tables),
                    "admissions": sum(t["admissions"] for t in tables),
                    "evictions": sum(t["evictions"] for t in tables),
                    "expirations": sum(t["expirations"] for t in tables),
                    "lookup_ms": _quantiles_ms(s["lookup_latency"]),
                    "push_ms": _quantiles_ms(s["push_latency"]),
                    "tables": [dict(t) for t in tables],
                }
            )
        return out

    def best_auc(self) -> float | None:
        """The synthetic stream's best achievable AUC, as the first rank to know it said."""
        best = [r.last["best_auc"] for r in self.ranks.values() if r.last["best_auc"] is not None]
        return best[0] if best else None

    def checkpoint(self, now: float) -> dict[str, Any] | None:
        """The newest checkpoint any rank reported, with its age at ``now``."""
        cps = [r.last["checkpoint"] for r in self.ranks.values() if r.last["checkpoint"]]
        if not cps:
            return None
        cp = max(cps, key=lambda c: c["step"])
        return {**cp, "age_s": max(0.0, now - cp["time"])}

    def serving(self, now: float, points: int = 900) -> dict[str, dict[str, Any]]:
        """Per prediction server (by URL): its series, last rates and freshness at ``now``.

        The rates and the p99 are those of the last interval between two reports
        (None until there are two, and p99 None for an interval without
        requests); the ages are the reported ones plus the report's own age, so a
        server that stops reporting shows ever older figures, never fresh ones.

        >>> state = MonitorState()
        >>> base = dict(kind="serve", server="http://s:1", errors_total=0, dense_version=3,
        ...     dense_age_s=5.0, sparse_age_s=0.5, latency_buckets=[0.001, 0.01, math.inf])
        >>> state.receive({**base, "time": 10.0, "requests_total": 0, "records_total": 0,
        ...     "latency_counts": [0, 0, 0]})
        >>> state.receive({**base, "time": 12.0, "requests_total": 200, "records_total": 400,
        ...     "latency_counts": [150, 199, 200]})
        >>> s = state.serving(now=13.0)["http://s:1"]
        >>> s["requests_per_s"], s["p99_ms"], s["dense_age_s"], s["sparse_age_s"]
        (100.0, 10.0, 6.0, 1.5)
        """
        out = {}
        for url, s in sorted(self.servers.items()):
            last, series = s.last, s.series
            age = max(0.0, now - last["time"])

            def latest(key: str, series: dict[str, deque[float | None]] = series) -> Any:
                return series[key][-1] if series[key] else None

            out[url] = {
                "series": {k: list(v)[-points:] for k, v in series.items()},
                "requests_per_s": latest("requests_per_s"),
                "records_per_s": latest("records_per_s"),
                "errors_per_s": latest("errors_per_s"),
                "p99_ms": latest("p99_ms"),
                "requests_total": last["requests_total"],
                "errors_total": last["errors_total"],
                "records_total": last["records_total"],
                "dense_version": last["dense_version"],
                "dense_age_s": _aged(last["dense_age_s"], age),
                "sparse_age_s": _aged(last["sparse_age_s"], age),
                "age_s": age,
            }
        return out

    def snapshot(self, now: float, points: int = 900) -> dict[str, Any]:
        """Everything the page draws, JSON-able; ``points`` per series at most."""
        ranks = {}
        for rank_id, r in sorted(self.ranks.items()):
            last = r.last
            ranks[str(rank_id)] = {
                "series": {k: list(v)[-points:] for k, v in r.series.items()},
                "step": last["step"],
                "samples_total": last["samples_total"],
                "job_samples_total": last.get("job_samples_total", last["samples_total"]),
                "job_auc": last.get("job_auc"),
                "events_total": last["events_total"],
                "loss": last["loss"],
                "auc": last["auc"],
                "pushes_queued": last["pushes_queued"],
                "wait_s": last["wait_s"],
                "compute_s": last["compute_s"],
                "mode": last["mode"],
                "age_s": max(0.0, now - last["time"]),
            }
        return {
            "now": now,
            "ranks": ranks,
            "best_auc": self.best_auc(),
            "staleness": self.staleness(),
            "row_staleness": self.row_staleness(),
            "partitions": self.partitions(),
            "shards": self.shards(),
            "checkpoint": self.checkpoint(now),
            "servers": self.serving(now, points),
            "reports": self.reports,
        }


def _p99_ms(bounds: list[float], deltas: list[int]) -> float | None:
    """The smallest bound with 99% of the interval's requests at or below it, in ms.

    ``deltas`` are the cumulative bucket counts of the interval (one report's
    minus the previous one's). None without requests. When the p99 lies in the
    +Inf bucket, the largest finite bound (as Prometheus' ``histogram_quantile``
    does): the p99 is at least that.
    """
    if not deltas or len(deltas) != len(bounds) or deltas[-1] <= 0:
        return None
    total = deltas[-1]
    for bound, cum in zip(bounds, deltas, strict=True):
        if cum * 100 >= total * 99:  # in integers: no rounding at the threshold
            if math.isinf(bound):
                finite = [b for b in bounds if math.isfinite(b)]
                return finite[-1] * 1000.0 if finite else None
            return bound * 1000.0
    return None


def _aged(age_s: float | None, since_report_s: float) -> float | None:
    return None if age_s is None else age_s + since_report_s


def _stale_share(hist: dict[int, int]) -> float | None:
    rows = sum(hist.values())
    return (rows - hist.get(0, 0)) / rows if rows else None


def _quantiles_ms(lat: LatencyReport | None) -> dict[str, float | None] | None:
    if lat is None:
        return None
    snap = latency_from_report(lat)
    values = {"p50": snap.quantile(0.5), "p99": snap.quantile(0.99), "mean": snap.mean_s}
    # NaN (nothing observed yet) is not JSON: the page shows a dash for None.
    return {k: None if math.isnan(v) else v * 1000.0 for k, v in values.items()}
