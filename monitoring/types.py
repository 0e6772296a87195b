"""What trainers and servers send to the scheduler's streamrec plugin, as plain dicts.

A trainer rank sends a ``TrainerReport`` about once a second through Dask's
event log (``Client.log_event("streamrec", report)``); rank 0 also sends a
``StoreReport`` with every store shard's counters; a prediction server sends
a ``ServeReport`` (``monitoring.serve_reporter``) on the same topic. Plain
dicts, because Dask events travel as msgpack: no classes of ours have to be
importable where the scheduler runs to carry them, only to draw them.

>>> r = TrainerReport(kind="trainer", rank=0, time=1.0, step=3, samples_total=30,
...     events_total=31, loss=0.5, auc=0.7, logloss=0.5, calibration=1.0,
...     best_auc=None, missed_pushes={"0": 3}, staleness_bound=2, pushes_queued=0,
...     wait_s=0.1, compute_s=0.2, partitions={}, checkpoint=None, mode="hybrid")
>>> r["samples_total"]
30
"""

from __future__ import annotations

from typing import Literal, NotRequired, TypedDict

TOPIC = "streamrec"  # the Dask event topic the reports travel on


class PartitionReport(TypedDict):
    """One source partition as its rank sees it."""

    position: int  # every record below was learned
    end: int | None  # the log end offset (Kafka) or the stream's end; None: unknown
    deadletter: dict[str, int]  # records dead-lettered by this run, by reason


class CheckpointReport(TypedDict):
    """The last job checkpoint this rank took part in."""

    step: int
    time: float  # unix s it was written
    seconds: float  # how long it took
    bytes: int  # what the store shards wrote


class TrainerReport(TypedDict):
    """One trainer rank, now; the counters are cumulative over this run."""

    kind: Literal["trainer"]
    rank: int
    time: float  # unix s
    step: int
    samples_total: int  # learned by the job, restored checkpoints included
    # Every rank's samples (restored included) and the progressive AUC over every
    # rank's predictions, from the ranks' per-step sums and report gathers; absent
    # from a trainer older than them.
    job_samples_total: NotRequired[int]
    job_auc: NotRequired[float | None]
    events_total: int  # records read by this rank in this run, dead-lettered included
    loss: float | None
    auc: float | None  # progressive, over the sliding window
    logloss: float | None
    calibration: float | None
    best_auc: float | None  # the synthetic stream's best achievable AUC
    missed_pushes: dict[str, int]  # batches by how many earlier pushes their lookup missed
    # Fresh rows, per embedding row: rows by how many of this rank's own pushes to
    # them their lookup missed, and by how many they still missed when trained; rows
    # trained with a pushed value, of those predicted for the push in flight, and
    # pushes in flight waited for. Empty and 0 with fresh rows off and in sync mode;
    # absent from a trainer older than them, which the scheduler may still hear from.
    missed_pushes_by_row: NotRequired[dict[str, int]]
    trained_missed_pushes_by_row: NotRequired[dict[str, int]]
    rows_freshened: NotRequired[int]
    rows_predicted: NotRequired[int]
    fresh_waits: NotRequired[int]
    staleness_bound: int
    pushes_queued: int
    wait_s: float  # waiting for prepared batches
    compute_s: float  # forward, backward, dense step
    partitions: dict[str, PartitionReport]
    checkpoint: CheckpointReport | None
    mode: str


class LatencyReport(TypedDict):
    """A latency histogram: ``counts[i]`` calls took at most ``buckets[i]`` seconds."""

    buckets: list[float]
    counts: list[int]
    sum_s: float
    count: int


class TableReport(TypedDict):
    """One table on one shard (``embedding_store.types.TableStats`` as a dict)."""

    name: str
    dim: int
    rows: int
    capacity: int
    memory_bytes: int
    lookup_ids: int
    push_ids: int
    admissions: int
    rejected_admissions: int
    evictions: int
    expirations: int


class ShardReport(TypedDict):
    """One store shard's counters."""

    shard: int
    address: str
    tables: list[TableReport]
    duplicate_pushes: int
    lookup_latency: LatencyReport | None
    push_latency: LatencyReport | None


class StoreReport(TypedDict):
    """Every store shard, as rank 0 read them."""

    kind: Literal["store"]
    time: float
    shards: list[ShardReport]


class ServeReport(TypedDict):
    """One prediction server, now; the counters are cumulative since it started.

    ``latency_counts[i]`` infer requests took at most ``latency_buckets[i]``
    seconds (the server's histogram as it is, the last bound +Inf): the
    scheduler takes the p99 of each interval from the difference of two reports.
    """

    kind: Literal["serve"]
    server: str  # the server's URL, http://host:port: one server, one line on the page
    time: float  # unix s
    requests_total: int  # infer requests answered, whatever their status code
    errors_total: int  # requests refused or failed, every endpoint and reason
    records_total: int  # records scored
    latency_buckets: list[float]  # upper bounds, seconds, ascending, the last +Inf
    latency_counts: list[int]  # cumulative, one per bound
    dense_version: int | None  # the published dense version served; None: none yet
    dense_age_s: float | None  # seconds since that version was published
    sparse_age_s: float | None  # seconds since the rows served were last current
