"""One trainer rank, as the architecture draws it: restore, stream, learn, checkpoint.

::

    job source ─► this rank's partitions ─► StreamRunner (Dask prepare tasks,
    at most ``prefetch`` batches in flight) ─► TrainLoop (dense model, store
    pushes, checkpoints, reports) ─► the stats, or a rollback to the newest
    checkpoint when the store lost state, then again
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from typing import TYPE_CHECKING

from connectors.types import Source
from deploy.config import JobConfig
from deploy.job.errors import JobError
from deploy.job.parts import Limits, RankParts, open_rank_parts
from deploy.job.recovery import Rollbacks, restore, store_changed_since
from deploy.job.services import Services
from deploy.job.sources import RankSource, build_codec, build_source, stop_waiting_when
from trainer.checkpoint import JobManifest
from trainer.device import pick_device
from trainer.errors import Rollback
from trainer.loop import JobBudget, TrainLoop
from trainer.loop_options import Compute, Outputs, Recovery, Start, Until
from trainer.progress import LoopStats, Progress

if TYPE_CHECKING:
    import torch

    from connectors.spec import FeatureSpec
    from pipeline.runner import StreamRunner

log = logging.getLogger(__name__)


def run_rank(
    job: JobConfig,
    services: Services,
    *,
    rank: int = 0,
    world: int = 1,
    max_events: int | None = None,
    deadline: float | None = None,
    stop: threading.Event | None = None,
    on_progress: Callable[[Progress], None] | None = None,
    device_index: int = 0,
    local_ranks: int = 1,
) -> tuple[LoopStats, JobManifest | None]:
    """Train as rank ``rank``: restore, stream, learn, checkpoint. Returns the stats.

    When the store loses state (a shard died and was restarted), every rank
    rolls back to the newest job checkpoint and goes on (``trainer.recovery``).
    ``deadline`` is a ``time.monotonic()`` value (``--max-time``).
    """
    spec = _features(job)
    device = _rank_device(job, device_index, local_ranks)
    limits = Limits(max_events, deadline, stop or threading.Event())
    source = build_source(job)
    stop_waiting_when(source, limits.stopping)
    with ExitStack() as stack:
        stack.callback(source.close)
        parts = open_rank_parts(
            job,
            spec,
            services,
            source,
            stack,
            rank=rank,
            world=world,
            device=device,
            local_ranks=local_ranks,
            limits=limits,
            on_progress=on_progress,
        )
        stats = _train(parts, limits)
        latest = parts.book.latest() if parts.book is not None else None
        if latest is not None and stats.recoveries:
            log.warning(
                "rank %d recovered %d time(s) from a lost store shard (%s)",
                rank,
                stats.recoveries,
                ", ".join(f"{s:.1f}s" for s in stats.recovery_s),
            )
        return stats, latest


def _features(job: JobConfig) -> FeatureSpec:
    """The job's features, each sparse one feeding a table of the store."""
    if job.features is None:
        msg = "the job has no `features:` section (labels, dense and sparse fields)"
        raise JobError(msg)
    for f in job.features.sparse:
        if f.table not in job.store.tables:
            msg = (
                f"features.sparse[{f.name}].table: {f.table!r} is not a store table "
                f"(store.tables: {sorted(job.store.tables)})"
            )
            raise JobError(msg)
    return job.features


def _rank_device(job: JobConfig, device_index: int, local_ranks: int) -> torch.device:
    import torch

    device = pick_device(job.trainer.device, device_index, local_ranks)
    if device.type == "cuda":
        # Collectives (NCCL barrier, all_gather_object) use the current device.
        torch.cuda.set_device(device)
    return device


def _train(parts: RankParts, limits: Limits) -> LoopStats:
    """Train from the newest checkpoint until the stream or a limit ends it; after a
    rollback (the store lost state), again from the checkpoint it rolled back to."""
    stats = LoopStats()
    rollbacks = Rollbacks()
    first: int | None = None  # the job's samples when this run started
    while True:
        manifest, restarts = restore(parts, limits.stopping)
        stats.samples, stats.events = rollbacks.kept_samples, rollbacks.kept_events
        restored = manifest.samples if manifest is not None else 0
        first = restored if first is None else first
        stats.job_samples = restored - first  # every rank's, kept by the checkpoint
        positions = _positions(parts.source, manifest)
        share = _share(limits.max_events, parts.rank, parts.world, rollbacks.kept_events)
        loop = _train_loop(parts, limits, manifest, positions, restarts, share, stats)
        shared = limits.max_events is not None and parts.world > 1
        runner = _stream_runner(parts, loop, positions, share, budget_open=shared)
        budget = (
            JobBudget(limits.max_events, rollbacks.kept_events, runner)
            if shared and limits.max_events is not None
            else None
        )
        try:
            return loop.run(iter(runner), budget)
        except Rollback as exc:
            started = time.monotonic()
            runner.close()
            rollbacks.roll_back(
                parts, exc, loop.checkpointed, stats, started=started, stopping=limits.stopping
            )
        finally:
            runner.close()


def _share(max_events: int | None, rank: int, world: int, kept_events: int) -> int | None:
    """What is left of rank ``rank``'s share of the job's ``max_events``.

    >>> _share(10, 0, 3, 0), _share(10, 1, 3, 0), _share(10, 0, 3, 3), _share(None, 0, 1, 5)
    (4, 3, 1, None)
    """
    if max_events is None:
        return None
    share = max_events // world + (1 if rank < max_events % world else 0)
    return max(0, share - kept_events)


def _train_loop(
    parts: RankParts,
    limits: Limits,
    manifest: JobManifest | None,
    positions: dict[str, int],
    restarts: int,
    share: int | None,
    stats: LoopStats,
) -> TrainLoop:
    """One attempt's loop: from ``manifest`` (this rank's ``positions`` of it) until the
    stream or a limit ends it, or a store shard restarts after the first ``restarts``."""
    job = parts.job
    return TrainLoop(
        job.trainer,
        parts.spec,
        parts.store,
        parts.dense,
        rank=parts.rank,
        compute=Compute(
            device=parts.device, step_threads=parts.step_threads, store_tables=job.store.tables
        ),
        start=Start(
            positions=positions,
            step=manifest.step if manifest is not None else 0,
            samples=manifest.samples if manifest is not None else 0,
            stats=stats,
        ),
        until=Until(max_events=share, deadline=limits.deadline, stop=limits.stop),
        recovery=Recovery(
            checkpointer=parts.checkpointer,
            before_checkpoint=parts.deadletter.flush if parts.deadletter is not None else None,
            # A job always has a checkpoint to roll back to.
            initial_checkpoint=parts.book is not None and manifest is None,
            store_changed=store_changed_since(parts.supervisor, restarts),
        ),
        outputs=Outputs(
            run_dir=job.run_dir,
            on_progress=parts.progress,
            best_auc=parts.best_auc,
            publisher=parts.publisher,
        ),
    )


def _positions(source: Source, manifest: JobManifest | None) -> dict[str, int]:
    """Where this rank's partitions resume: the manifest's positions of the ones it owns."""
    positions = dict(manifest.positions) if manifest is not None else {}
    if isinstance(source, RankSource):
        # The manifest holds every rank's partitions; a rank carrying another's
        # (stale) position into its checkpoints would move that one back.
        positions = {p: n for p, n in positions.items() if source.owns(p)}
    return positions


def _stream_runner(
    parts: RankParts,
    loop: TrainLoop,
    positions: dict[str, int],
    share: int | None,
    *,
    budget_open: bool = False,
) -> StreamRunner:
    """The Dask side of one attempt: prepared batches of this rank's partitions;
    ``budget_open``: its share of ``--max-events`` may move (several ranks)."""
    from pipeline.runner import StreamRunner

    job = parts.job
    return StreamRunner(
        parts.dask,
        parts.source,
        parts.spec,
        parts.store_address(),
        staleness=job.trainer.prefetch,
        codec=build_codec(job),
        max_records=job.trainer.batch_size,
        positions=positions,
        deadletter=parts.deadletter,
        # A quiet stream still ends on the loop's stop (signal, --max-time).
        stop_when=functools.partial(_stop_requested, loop),
        # The loop reports and checks for stops while the stream is quiet, and
        # a quiet rank must not hold the others' steps up.
        idle_ticks=True,
        max_events=share,
        budget_open=budget_open,
    )


def _stop_requested(loop: TrainLoop) -> bool:
    return bool(loop.stop_reason())
