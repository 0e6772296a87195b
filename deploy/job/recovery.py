"""Restoring a rank from the newest job checkpoint, and rolling back when the store lost state.

When a store shard dies and is restarted, the rows pushed to it since the last
checkpoint are gone: every rank rolls back to the newest job checkpoint and goes
on (``trainer.recovery``). Rank 0 rolls the store back; the other ranks load
their dense state after it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from deploy.job.errors import JobError
from deploy.job.parts import RankParts
from embedding_store.client import StoreClient
from embedding_store.errors import StoreUnavailable
from trainer.checkpoint import JobManifest
from trainer.errors import Rollback
from trainer.job_checkpoint import restore_job
from trainer.progress import LoopStats

if TYPE_CHECKING:
    from deploy.local.shards import ShardSupervisor

log = logging.getLogger(__name__)


def barrier(world: int) -> None:
    """Wait for every rank of the torch world (nothing to wait for with one rank)."""
    if world > 1:
        import torch.distributed as dist

        dist.barrier()


def restore(parts: RankParts, stopping: Callable[[], bool]) -> tuple[JobManifest | None, int]:
    """Restore the newest job checkpoint, if any (rank 0 restores the store, every rank
    its dense state). Returns the manifest and the shard restarts seen at that point.
    """
    rank, world, supervisor = parts.rank, parts.world, parts.supervisor
    # Rank 0 rolls the store back; the others load their dense state after it.
    if rank != 0:
        barrier(world)
    restarts = supervisor.restarts if supervisor is not None else 0
    manifest = None
    restore_started = time.monotonic()
    while parts.book is not None:
        try:
            manifest = restore_job(parts.book, parts.store, parts.dense, rank=rank)
            break
        except StoreUnavailable as exc:
            # A shard that died while the store was being rolled back (rank 0
            # alone restores the store): wait for it again, then roll back again.
            waited = time.monotonic() - restore_started
            recovery = parts.job.trainer.recovery
            if not recovery.enabled or waited > recovery.timeout_s:
                raise
            log.warning("rank %d: restoring the store failed (%s); retrying", rank, exc)
            await_store(
                parts.store,
                parts.dask,
                supervisor,
                timeout_s=max(1.0, recovery.timeout_s - waited),
                stopping=stopping,
            )
            restarts = supervisor.restarts if supervisor is not None else 0
    if rank == 0:
        barrier(world)
    else:
        # Rank 0 restored the store: the shards' processes now are the ones to
        # train against (a push that meets another one is a lost shard).
        parts.store.accept_restarts()
    return manifest, restarts


def store_changed_since(supervisor: ShardSupervisor | None, seen: int) -> Callable[[], str | None]:
    """What the loop asks every step: the last shard restart after the ``seen`` first, if any."""

    def store_changed() -> str | None:
        if supervisor is None or supervisor.restarts == seen:
            return None
        return supervisor.events[-1]

    return store_changed


@dataclass
class Rollbacks:
    """A rank's rollbacks so far.

    ``kept_samples`` and ``kept_events``: net of what rollbacks took back, learned by
    this rank up to its newest checkpoint. ``in_a_row``: rollbacks to the same
    checkpoint (``rolled_back_to``, a step) with no checkpoint in between.
    """

    kept_samples: int = 0
    kept_events: int = 0
    in_a_row: int = 0
    rolled_back_to: int = -1

    def roll_back(
        self,
        parts: RankParts,
        exc: Rollback,
        checkpointed: tuple[int, int],
        stats: LoopStats,
        *,
        started: float,
        stopping: Callable[[], bool],
    ) -> None:
        """Get ready to train again from the newest checkpoint after ``exc``, or raise a
        :class:`JobError` that says why not. ``checkpointed``: the (samples, events)
        the failed attempt's newest checkpoint holds; ``started``: when the rollback
        began (``time.monotonic()``), counted into ``stats.recovery_s``.
        """
        cfg, rank, book = parts.job.trainer, parts.rank, parts.book
        if not cfg.recovery.enabled or book is None:
            why = "checkpoints are off" if book is None else "trainer.recovery is off"
            msg = (
                f"the embedding store lost state ({exc}) and {why}; start the job "
                "again to resume from its newest checkpoint"
            )
            raise JobError(msg) from exc
        self.kept_samples += checkpointed[0]
        self.kept_events += checkpointed[1]
        newest = book.latest()
        newest_step = newest.step if newest is not None else -1
        self.in_a_row = self.in_a_row + 1 if newest_step == self.rolled_back_to else 1
        self.rolled_back_to = newest_step
        if self.in_a_row > cfg.recovery.max_in_a_row:
            msg = (
                f"the embedding store lost state {self.in_a_row} times without a checkpoint "
                f"in between (last: {exc}); giving up (trainer.recovery.max_in_a_row)"
            )
            raise JobError(msg) from exc
        log.warning("rank %d: %s; rolling back to the newest checkpoint", rank, exc)
        if rank == 0:
            await_store(
                parts.store,
                parts.dask,
                parts.supervisor,
                timeout_s=cfg.recovery.timeout_s,
                stopping=stopping,
            )
        stats.recoveries += 1
        stats.recovery_s.append(time.monotonic() - started)
        log.warning(
            "rank %d: store ready again after %.1fs; restoring checkpoint step %d",
            rank,
            stats.recovery_s[-1],
            newest_step,
        )


def _executing(dask_worker: Any) -> int:
    return int(dask_worker.state.executing_count)


def await_store(
    store: StoreClient,
    dask: Any,
    supervisor: ShardSupervisor | None,
    *,
    timeout_s: float,
    stopping: Callable[[], bool],
) -> None:
    """Until no prepare task of the failed attempt runs and every shard answers.

    A cancelled task still running on a worker would look rows up in (and so
    create rows in) the store after it was rolled back.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        if stopping():
            msg = "the job was stopped while it waited for the embedding store to recover"
            raise JobError(msg)
        if supervisor is not None and supervisor.failed:
            raise JobError(supervisor.failed)
        try:
            busy = sum(dask.run(_executing).values())
            if not busy:
                store.stats()
                return
            problem = f"{busy} cancelled prepare task(s) still running"
        except StoreUnavailable as exc:
            problem = str(exc)
        if time.monotonic() > deadline:
            msg = (
                f"the embedding store did not recover within {timeout_s:g}s ({problem}); "
                "check the shards and start the job again (trainer.recovery.timeout_s)"
            )
            raise JobError(msg)
        time.sleep(0.2)
