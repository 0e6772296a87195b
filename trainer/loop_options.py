"""The options of a :class:`trainer.loop.TrainLoop`, in groups: what it computes with,
where it starts, when it ends, how it recovers, and where it reports.

Every field has a default, so a loop in a test names only what it needs:

>>> Until(max_events=100).deadline is None, Start().step, Recovery().initial_checkpoint
(True, 0, False)
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from embedding_store.types import TableConfig
from trainer.job_checkpoint import JobCheckpointer
from trainer.progress import LoopStats, Progress
from trainer.publish import DensePublisher

__all__ = ["Compute", "Outputs", "Recovery", "Start", "Until"]


@dataclass(frozen=True)
class Compute:
    """What a step computes with besides the model.

    ``step_threads``: on a CPU, the threads each step's batch is split over
    (:class:`trainer.split_step.SplitStep`); 1 runs the whole batch on torch's
    intra-op threads; None: the config's ``step_threads``, else 1 (the job resolves
    its default for the host). ``store_tables``: the store's table configs (the
    job's ``store.tables``), with which fresh rows predict what the push in flight
    does instead of waiting for it; None: an in-process store's own, else the push
    in flight is not waited for.
    """

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    step_threads: int | None = None
    store_tables: Mapping[str, TableConfig] | None = None


@dataclass(frozen=True)
class Start:
    """Where the loop starts: a restored checkpoint's ``positions`` (per partition,
    every record before it was learned), ``step`` and ``samples``; ``stats``: carry on
    counting into these (a job that recovered keeps one summary)."""

    positions: Mapping[str, int] = field(default_factory=dict)
    step: int = 0
    samples: int = 0
    stats: LoopStats | None = None


@dataclass(frozen=True)
class Until:
    """When the loop ends, besides its stream's end.

    ``max_events``: this rank learns at most this many records (dead-lettered ones
    included) and then ends its stream (``stopped_by`` "max_events"). ``deadline``: a
    ``time.monotonic()`` value; the loop stops at the first step boundary after it
    ("max_time"). ``stop``: set, the loop stops at the next step boundary ("signal").
    """

    max_events: int | None = None
    deadline: float | None = None
    stop: threading.Event | None = None


@dataclass(frozen=True)
class Recovery:
    """How the ranks keep a checkpoint to go back to, and learn they must.

    ``before_checkpoint`` runs on every rank before its state goes into a checkpoint
    (e.g. flushing dead letters, so that no committed offset covers a record not yet
    durable). ``initial_checkpoint``: take one before the first step, so that a job
    always has a checkpoint to roll back to. ``store_changed()`` is asked every step
    and returns what happened when a store shard lost its rows (it was restarted):
    the ranks then roll back (:class:`trainer.errors.Rollback`).
    """

    checkpointer: JobCheckpointer | None = None
    before_checkpoint: Callable[[], None] | None = None
    initial_checkpoint: bool = False
    store_changed: Callable[[], str | None] | None = None


@dataclass(frozen=True)
class Outputs:
    """Where the loop writes: ``run_dir`` (its metrics and learned-offsets files),
    ``on_progress`` (every report), the synthetic stream's ``best_auc`` to report
    beside the figures, and ``publisher`` (the dense weights for prediction servers,
    rank 0's)."""

    run_dir: Path | None = None
    on_progress: Callable[[Progress], None] | None = None
    best_auc: float | None = None
    publisher: DensePublisher | None = None
