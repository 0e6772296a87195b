"""What a trainer rank reports: its running stats and one progress report per line of
``metrics-rank<R>.jsonl``."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from trainer.metrics import MetricsSnapshot


@dataclass
class LoopStats:
    """What the loop has done; the summary of a run."""

    steps: int = 0
    samples: int = 0
    # Every rank's samples in this run, from each step's sums (the same on every rank).
    job_samples: int = 0
    bad_records: int = 0
    events: int = 0  # records learned: samples plus dead-lettered ones
    checkpoints: int = 0
    wait_s: float = 0.0  # waiting for prepared batches
    compute_s: float = 0.0  # forward, backward, dense step
    push_wait_s: float = 0.0  # waiting for the push queue to fall to its bound
    sync_s: float = 0.0  # the per-step collective
    started: float = field(default_factory=time.monotonic)
    last_checkpoint: dict[str, Any] | None = None
    stopped_by: str = ""
    # Observed staleness: batches by how many earlier pushes their lookup missed.
    missed_pushes: dict[int, int] = field(default_factory=dict)
    # Per row (fresh_rows): rows by how many of this rank's pushes to them their lookup
    # missed, by how many they still missed when trained (pushes in flight), and how
    # many rows were trained with a push's value instead of the looked-up one.
    missed_pushes_by_row: dict[int, int] = field(default_factory=dict)
    trained_missed_pushes_by_row: dict[int, int] = field(default_factory=dict)
    rows_freshened: int = 0
    rows_predicted: int = 0  # of those, rows the push in flight changes, computed ahead
    fresh_waits: int = 0  # pushes in flight waited for (a row's state was not remembered)
    # Dead-lettered records by partition, then by reason.
    bad_by_partition: dict[str, dict[str, int]] = field(default_factory=dict)
    # Rollbacks to the newest checkpoint after the store lost state, and how long each took.
    recoveries: int = 0
    recovery_s: list[float] = field(default_factory=list)
    # Times the job started its rank world again after a rank process was killed.
    rank_restarts: int = 0

    def elapsed(self) -> float:
        return time.monotonic() - self.started


@dataclass(frozen=True)
class Progress:
    """One progress report (also one line of ``metrics-rank<R>.jsonl``)."""

    rank: int
    step: int
    samples: int  # learned in this run (this rank's)
    samples_total: int  # learned by the job, restored checkpoints included
    samples_per_s: float
    elapsed_s: float
    loss: float | None
    metrics: MetricsSnapshot
    staleness: int
    pushes_queued: int
    wait_s: float
    compute_s: float
    events_total: int = 0  # records read in this run, dead-lettered ones included
    missed_pushes: dict[str, int] = field(default_factory=dict)  # see LoopStats
    missed_pushes_by_row: dict[str, int] = field(default_factory=dict)  # see LoopStats
    trained_missed_pushes_by_row: dict[str, int] = field(default_factory=dict)
    rows_freshened: int = 0
    rows_predicted: int = 0
    fresh_waits: int = 0
    positions: dict[str, int] = field(default_factory=dict)  # learned up to, per partition
    deadletter: dict[str, dict[str, int]] = field(default_factory=dict)
    best_auc: float | None = None  # the synthetic stream's best achievable AUC
    last_checkpoint: dict[str, Any] | None = None
    mode: str = ""
    # Empty while the rank trains; its last report says why it stopped (signal,
    # max_time, max_events, end_of_stream, another rank, error).
    stopped_by: str = ""
    recoveries: int = 0
    # Every rank's: samples learned in this run, their rate, and the job's total
    # (restored checkpoints included); with one rank the same as this rank's.
    ranks: int = 1
    job_samples: int = 0
    job_samples_per_s: float = 0.0
    job_samples_total: int = 0
    # The progressive figures over every rank's predictions (None: one rank, whose
    # ``metrics`` they are, or a report of this rank alone).
    job_metrics: MetricsSnapshot | None = None
