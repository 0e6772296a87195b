"""``Reporter``: a trainer rank's reports to the scheduler's streamrec plugin.

Hooked on the training loop's progress callback: at most once every
``every_s`` (at least one second) it turns the rank's ``Progress`` into a
``TrainerReport``, with each partition's end asked of the source, and, on
rank 0, reads every store shard's counters into a ``StoreReport``. Sending
is best-effort: a scheduler that is slow or gone costs a warning, never
the training.

>>> sent = []
>>> reporter = Reporter(sent.append, rank=0, clock=iter([10.0, 10.5, 11.2]).__next__)
>>> from trainer.metrics import MetricsSnapshot
>>> p = Progress(rank=0, step=1, samples=8, samples_total=8, samples_per_s=8.0,
...     elapsed_s=1.0, loss=0.6, metrics=MetricsSnapshot(8, 8, 0.7, 0.6, 1.0, (0.7,)),
...     staleness=2, pushes_queued=0, wait_s=0.1, compute_s=0.5, positions={"s/0": 8})
>>> for _ in range(3):
...     reporter(p)
>>> [r["time"] for r in sent]  # the report at 10.5 s was too soon
[10.0, 11.2]
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from embedding_store.types import ShardStats
from monitoring.types import (
    CheckpointReport,
    PartitionReport,
    StoreReport,
    TrainerReport,
)
from monitoring.wire import shard_report
from trainer.progress import Progress

log = logging.getLogger(__name__)

MIN_INTERVAL_S = 1.0  # nothing reports (or polls the store) faster than this


def trainer_report(
    progress: Progress, now: float, ends: dict[str, int | None] | None = None
) -> TrainerReport:
    """``Progress`` as the plugin's dict; ``ends`` are the partitions' end positions."""
    ends = ends or {}
    m = progress.metrics
    cp = progress.last_checkpoint
    return TrainerReport(
        kind="trainer",
        rank=progress.rank,
        time=now,
        step=progress.step,
        samples_total=progress.samples_total,
        job_samples_total=max(progress.job_samples_total, progress.samples_total),
        job_auc=progress.job_metrics.auc if progress.job_metrics is not None else None,
        events_total=progress.events_total,
        loss=progress.loss,
        auc=m.auc,
        logloss=m.logloss,
        calibration=m.calibration,
        best_auc=progress.best_auc,
        missed_pushes=dict(progress.missed_pushes),
        missed_pushes_by_row=dict(progress.missed_pushes_by_row),
        trained_missed_pushes_by_row=dict(progress.trained_missed_pushes_by_row),
        rows_freshened=progress.rows_freshened,
        rows_predicted=progress.rows_predicted,
        fresh_waits=progress.fresh_waits,
        staleness_bound=progress.staleness,
        pushes_queued=progress.pushes_queued,
        wait_s=progress.wait_s,
        compute_s=progress.compute_s,
        partitions={
            p: PartitionReport(
                position=pos, end=ends.get(p), deadletter=dict(progress.deadletter.get(p, {}))
            )
            for p, pos in progress.positions.items()
        },
        checkpoint=None
        if cp is None
        else CheckpointReport(
            step=int(cp["step"]),
            time=float(cp["time"]),
            seconds=float(cp["seconds"]),
            bytes=int(cp["bytes"]),
        ),
        mode=progress.mode,
    )


def store_report(stats: Sequence[ShardStats], addresses: Sequence[str], now: float) -> StoreReport:
    """Every shard's counters, in shard order."""
    return StoreReport(
        kind="store",
        time=now,
        shards=[
            shard_report(i, a, s) for i, (a, s) in enumerate(zip(addresses, stats, strict=True))
        ],
    )


class Reporter:
    """Sends one rank's reports (see the module docstring); call it with each ``Progress``.

    ``background=True`` sends from a thread of its own (call ``close`` at the end).
    """

    def __init__(
        self,
        send: Callable[[Any], None],
        *,
        rank: int,
        every_s: float = MIN_INTERVAL_S,
        ends: Callable[[Sequence[str]], dict[str, int | None]] | None = None,
        store_stats: Callable[[], Sequence[ShardStats]] | None = None,
        store_addresses: Sequence[str] = (),
        clock: Callable[[], float] = time.time,
        background: bool = False,
    ) -> None:
        self.send = send
        self.rank = rank
        self.every_s = max(MIN_INTERVAL_S, every_s)
        self.ends = ends
        self.store_stats = store_stats
        self.store_addresses = list(store_addresses)
        self.clock = clock
        self.sent = 0
        self.failures = 0
        self._last = -float("inf")
        # In the background, the broker and store round trips of a report never
        # lengthen a training step; only the newest pending report is kept.
        self._wake = threading.Condition()
        self._pending: tuple[Progress, float] | None = None
        self._closed = False
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(
                target=self._run, name=f"streamrec-reporter-{rank}", daemon=True
            )
            self._thread.start()

    def __call__(self, progress: Progress) -> None:
        now = self.clock()
        if now - self._last < self.every_s:
            return
        self._last = now
        if self._thread is None:
            self._report(progress, now)
            return
        with self._wake:
            self._pending = (progress, now)  # a newer report replaces one not yet sent
            self._wake.notify()

    def close(self) -> None:
        """Stop the background thread (a report not yet sent is dropped)."""
        if self._thread is not None:
            with self._wake:
                self._closed = True
                self._wake.notify()
            self._thread.join(timeout=10)
            self._thread = None

    def _run(self) -> None:
        while True:
            with self._wake:
                while self._pending is None and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                progress, now = self._pending  # type: ignore[misc]
                self._pending = None
            self._report(progress, now)

    def _report(self, progress: Progress, now: float) -> None:
        try:
            ends = self.ends(list(progress.positions)) if self.ends is not None else None
            self.send(trainer_report(progress, now, ends))
            if self.store_stats is not None:
                self.send(store_report(self.store_stats(), self.store_addresses, now))
            self.sent += 1
        except Exception as exc:  # monitoring must never stop training
            self.failures += 1
            if self.failures == 1 or self.failures % 100 == 0:
                log.warning(
                    "streamrec: could not report to the scheduler (%d times): %s",
                    self.failures,
                    exc,
                )
