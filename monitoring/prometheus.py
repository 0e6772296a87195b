"""The job's figures as Prometheus metrics, for the scheduler's ``/metrics``.

``job_metric_families(state, now)`` turns a ``MonitorState`` into metric
families (pure); ``JobMetricsCollector`` hands them to a prometheus_client
registry. The store shards' families come from ``monitoring.store_metrics``,
the same function each shard process uses for its own ``/metrics``, so a
figure has one name wherever it is scraped. The prediction servers' figures
that their own ``/metrics`` cannot give (requests/s and the p99 of the last
report interval) and their freshness gauges are here too, labelled ``server``.

>>> from monitoring.state import MonitorState
>>> state = MonitorState()
>>> state.receive(dict(kind="trainer", rank=0, time=1.0, step=1, samples_total=10,
...     events_total=10, loss=0.6, auc=0.7, logloss=0.6, calibration=1.0, best_auc=None,
...     missed_pushes={"1": 2}, staleness_bound=2, pushes_queued=1, wait_s=0.0,
...     compute_s=1.0, checkpoint=None, mode="hybrid", partitions={}))
>>> names = [m.name for m in job_metric_families(state, now=2.0)]
>>> "streamrec_trainer_auc" in names, "streamrec_trainer_staleness" in names
(True, True)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TypeVar

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from monitoring.state import MonitorState
from monitoring.store_metrics import merge_families, store_metric_families
from monitoring.types import TrainerReport
from monitoring.wire import shard_stats_from_report


def job_metric_families(state: MonitorState, now: float) -> list[Metric]:
    """Trainer, source, checkpoint, serving and store metrics of the job, as the state
    holds them."""
    return [
        *trainer_metric_families(state, now),
        *source_metric_families(state),
        *checkpoint_metric_families(state, now),
        *serve_metric_families(state, now),
        *store_families(state),
    ]


_F = TypeVar("_F", bound=Metric)

_TRAINER_GAUGES = (
    ("step", "Training steps taken by the job (restored ones included)."),
    ("samples_per_second", "Samples learned per second over the last report interval."),
    ("events_per_second", "Records read per second over the last report interval."),
    ("loss", "Mean training loss of the recent steps."),
    ("auc", "Progressive-validation AUC over the sliding window."),
    ("logloss", "Progressive-validation log loss over the sliding window."),
    ("calibration", "Mean prediction over mean label in the window (1 is calibrated)."),
    ("pushes_queued", "Row-gradient pushes handed to the store and not yet applied."),
    ("staleness_bound", "The configured staleness: pushes a lookup may miss at most."),
    ("report_age_seconds", "Seconds since this rank last reported."),
)
_TRAINER_COUNTERS = (
    ("samples", "Samples learned by the job, restored checkpoints included."),
    ("events", "Records read by this run of the rank, dead-lettered ones included."),
    ("wait_seconds", "Seconds this run of the rank waited for prepared batches."),
    ("compute_seconds", "Seconds this run of the rank spent in forward, backward, step."),
)
_FRESH_COUNTERS = (
    ("rows_freshened", "Rows trained with a pushed value instead of the looked-up one."),
    ("rows_predicted", "Of the rows freshened, those computed for the push in flight."),
    ("fresh_waits", "Pushes in flight waited for (a row's state was not remembered)."),
)
_STALENESS_HISTOGRAMS = (
    ("staleness", "Batches by how many earlier pushes their lookup missed (observed staleness)."),
    (
        "row_staleness",
        "Embedding rows by how many of their rank's own pushes their lookup missed "
        "(fresh rows on).",
    ),
    (
        "row_staleness_trained",
        "Embedding rows by how many of their rank's own pushes they still missed when "
        "trained (fresh rows on).",
    ),
)


def trainer_metric_families(state: MonitorState, now: float) -> list[Metric]:
    """Per trainer rank: its last report's gauges and counters, and its staleness."""
    g = _per_rank(GaugeMetricFamily, _TRAINER_GAUGES)
    c = _per_rank(CounterMetricFamily, _TRAINER_COUNTERS)
    hist = _per_rank(HistogramMetricFamily, _STALENESS_HISTOGRAMS)
    fresh = _per_rank(CounterMetricFamily, _FRESH_COUNTERS)
    for rank_id, r in sorted(state.ranks.items()):
        last, label = r.last, [str(rank_id)]
        rates = r.series
        values = {
            "step": last["step"],
            "samples_per_second": rates["samples_per_s"][-1] if rates["samples_per_s"] else None,
            "events_per_second": rates["events_per_s"][-1] if rates["events_per_s"] else None,
            "loss": last["loss"],
            "auc": last["auc"],
            "logloss": last["logloss"],
            "calibration": last["calibration"],
            "pushes_queued": last["pushes_queued"],
            "staleness_bound": last["staleness_bound"],
            "report_age_seconds": max(0.0, now - last["time"]),
        }
        for name, value in values.items():
            if value is not None:
                g[name].add_metric(label, float(value))
        c["samples"].add_metric(label, float(last["samples_total"]))
        c["events"].add_metric(label, float(last["events_total"]))
        c["wait_seconds"].add_metric(label, last["wait_s"])
        c["compute_seconds"].add_metric(label, last["compute_s"])
        _add_staleness(hist, fresh, label, last)
    return [*g.values(), *c.values(), *hist.values(), *fresh.values()]


def _per_rank(family: Callable[..., _F], specs: tuple[tuple[str, str], ...]) -> dict[str, _F]:
    """One trainer family per ``(name, doc)``, labelled by rank."""
    return {name: family(f"streamrec_trainer_{name}", doc, labels=["rank"]) for name, doc in specs}


def _add_staleness(
    hist: dict[str, HistogramMetricFamily],
    fresh: dict[str, CounterMetricFamily],
    label: list[str],
    last: TrainerReport,
) -> None:
    """A rank's staleness histograms and, where it sends per-row figures, its fresh rows."""
    bound = last["staleness_bound"]
    hist["staleness"].add_metric(label, *_buckets(last["missed_pushes"], bound))
    by_row = last.get("missed_pushes_by_row") or {}
    # No per-row figures (fresh rows off, sync, an older trainer) is not 0 stale
    # rows: such a rank has no samples in these families rather than zeros.
    if by_row:
        hist["row_staleness"].add_metric(label, *_buckets(by_row, bound))
        trained = last.get("trained_missed_pushes_by_row") or {}
        hist["row_staleness_trained"].add_metric(label, *_buckets(trained, bound))
        fresh["rows_freshened"].add_metric(label, float(last.get("rows_freshened", 0)))
        fresh["rows_predicted"].add_metric(label, float(last.get("rows_predicted", 0)))
        fresh["fresh_waits"].add_metric(label, float(last.get("fresh_waits", 0)))


def source_metric_families(state: MonitorState) -> list[Metric]:
    """The source's best AUC (synthetic streams), and per partition its position, end,
    lag and dead-lettered records."""
    out: list[Metric] = []
    best = state.best_auc()
    if best is not None:
        m = GaugeMetricFamily(
            "streamrec_source_best_auc", "The synthetic stream's best achievable AUC."
        )
        m.add_metric([], best)
        out.append(m)

    part = ["partition", "rank"]
    position = GaugeMetricFamily(
        "streamrec_source_position", "Every record below was learned.", labels=part
    )
    end = GaugeMetricFamily(
        "streamrec_source_end_offset", "The partition's end (Kafka log end offset).", labels=part
    )
    lag = GaugeMetricFamily(
        "streamrec_source_lag", "Records not learned yet: end minus position.", labels=part
    )
    dead = CounterMetricFamily(
        "streamrec_deadletter_records",
        "Records dead-lettered by this run, by partition and reason.",
        labels=["partition", "reason"],
    )
    for p in state.partitions():
        label = [p["partition"], str(p["rank"])]
        position.add_metric(label, p["position"])
        if p["end"] is not None:
            end.add_metric(label, p["end"])
            lag.add_metric(label, p["lag"])
        for reason, n in sorted(p["deadletter"].items()):
            dead.add_metric([p["partition"], reason], n)
    return [*out, position, end, lag, dead]


def checkpoint_metric_families(state: MonitorState, now: float) -> list[Metric]:
    """The last job checkpoint's step, age, size, duration and time (none before one)."""
    cp = state.checkpoint(now)
    if cp is None:
        return []
    out: list[Metric] = []
    for name, doc, value in (
        ("step", "Step of the last job checkpoint.", cp["step"]),
        ("age_seconds", "Seconds since the last job checkpoint was written.", cp["age_s"]),
        ("bytes", "Bytes the store shards wrote for the last checkpoint.", cp["bytes"]),
        ("duration_seconds", "How long the last checkpoint took.", cp["seconds"]),
        ("timestamp_seconds", "Unix time of the last checkpoint.", cp["time"]),
    ):
        m = GaugeMetricFamily(f"streamrec_checkpoint_{name}", doc)
        m.add_metric([], float(value))
        out.append(m)
    return out


def store_families(state: MonitorState) -> list[Metric]:
    """The store shards' families, labelled by address as each shard labels its own
    ``/metrics`` (none before the store reports)."""
    if state.store is None:
        return []
    return merge_families(
        fam
        for s in state.store["shards"]
        for fam in store_metric_families(s["address"], shard_stats_from_report(s))
    )


def serve_metric_families(state: MonitorState, now: float) -> list[Metric]:
    """Per prediction server: rates and p99 of its last report interval, and its ages.

    The ages keep the names of the server's own gauges (``serving.freshness``),
    with a ``server`` label; its counters and histogram are not repeated here
    (scrape the server for them).
    """
    specs = (
        ("requests_per_second", "Infer requests per second over the last report interval."),
        ("records_per_second", "Records scored per second over the last report interval."),
        ("errors_per_second", "Requests refused or failed per second, last report interval."),
        (
            "infer_latency_p99_seconds",
            "p99 infer latency over the last report interval "
            "(histogram bucket bound; the largest finite bound when above it).",
        ),
        ("dense_version", "The published dense version served."),
        ("dense_age_seconds", "Seconds since the dense version served was published."),
        (
            "sparse_age_seconds",
            "Seconds since the rows served were last current with the training shards.",
        ),
        ("report_age_seconds", "Seconds since this server last reported."),
    )
    g = {
        name: GaugeMetricFamily(f"streamrec_serve_{name}", doc, labels=["server"])
        for name, doc in specs
    }
    for url, s in state.serving(now, points=1).items():
        p99 = s["p99_ms"]
        values = {
            "requests_per_second": s["requests_per_s"],
            "records_per_second": s["records_per_s"],
            "errors_per_second": s["errors_per_s"],
            "infer_latency_p99_seconds": None if p99 is None else p99 / 1000.0,
            "dense_version": s["dense_version"],
            "dense_age_seconds": s["dense_age_s"],
            "sparse_age_seconds": s["sparse_age_s"],
            "report_age_seconds": s["age_s"],
        }
        for name, value in values.items():
            if value is not None:
                g[name].add_metric([url], float(value))
    return list(g.values())


def _buckets(counts: dict[str, int], bound: int) -> tuple[list[tuple[str, float]], float]:
    """Cumulative buckets 0, 1, ... (to the bound or the largest seen), +Inf, and the sum."""
    hist = {int(k): n for k, n in counts.items()}
    buckets, cum = [], 0
    for k in range(max([bound, *hist]) + 1):
        cum += hist.get(k, 0)
        buckets.append((str(float(k)), float(cum)))
    buckets.append(("+Inf", float(cum)))
    return buckets, float(sum(k * n for k, n in hist.items()))


class JobMetricsCollector(Collector):
    """A prometheus_client collector over a ``MonitorState`` (read at scrape time)."""

    def __init__(self, state: MonitorState, clock: Callable[[], float]) -> None:
        self.state = state
        self.clock = clock

    def describe(self) -> list[Metric]:
        # Nothing up front: the registry would otherwise collect() to learn the names
        # and refuse a second job's collector in the same process as a duplicate.
        return []

    def collect(self) -> Iterator[Metric]:
        yield from job_metric_families(self.state, self.clock())
