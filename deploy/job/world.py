"""The trainer ranks' torch world: rank processes started here, or ranks torchrun started.

Ranks share the dense model through ``torch.distributed`` (gloo on CPU, nccl on
GPU). With ``trainer.ranks > 1`` rank 0 trains in the job's process and the
others in spawned processes; under ``torchrun`` this process is the one rank
torchrun made it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import os
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, cast

from deploy.cluster import NotAnswering, TorchrunRank, scheduler_id
from deploy.config import JobConfig
from deploy.job.errors import JobError
from deploy.job.parts import checkpoint_location
from deploy.job.rank import run_rank
from deploy.job.recovery import await_store
from deploy.job.services import Services, batch_client, check_named_services
from deploy.local.kafka import free_port
from trainer.checkpoint import CheckpointBook, JobManifest
from trainer.config import RecoveryConfig
from trainer.device import pick_device
from trainer.progress import LoopStats, Progress

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

log = logging.getLogger(__name__)


def run_ranks(
    job: JobConfig,
    services: Services,
    *,
    max_events: int | None = None,
    deadline: float | None = None,
    stop: threading.Event | None = None,
    on_progress: Callable[[Progress], None] | None = None,
) -> tuple[LoopStats, JobManifest | None]:
    """Rank 0 here, ranks 1.. in spawned processes.

    A rank process killed by a signal (``kill -9``, out of memory) breaks the
    others' collectives; the job then starts every rank again from the newest
    checkpoint (store, dense state, source positions), as a second run of the
    same command would, and goes on. So it does when the Dask scheduler the job
    names (``cluster.scheduler``) was lost: once a scheduler answers there again
    (``cluster.wait_for_services_s``). ``trainer.recovery`` bounds both: off, or
    after ``max_in_a_row`` restarts without a new checkpoint in between, the job
    stops with a :class:`JobError` that names what was lost and says how to
    resume. A rank that fails on its own (an exception, exit code 1) is not
    restarted.
    """
    stop = stop or threading.Event()
    with _quiet_expected_losses():
        return _run_lives(job, services, max_events, deadline, stop, on_progress)


@contextlib.contextmanager
def _quiet_expected_losses() -> Iterator[None]:
    """Dask's records, with their tracebacks, of a lost scheduler the job recovers from.

    The job says itself that the scheduler ended the world and that it starts the
    ranks again; in the middle of its output Dask would add, each with a traceback:
    the client's batched comm closed as the scheduler dies (INFO, ``distributed.batched``)
    and the dead world's client's reconnect, cancelled as the job closes it (ERROR,
    three tracebacks, ``distributed.client``). Dask's other records still show.
    """
    from distributed.comm.core import CommClosedError

    from pipeline.worker_logs import ExpectedLoss

    quiet = {
        "distributed.client": ExpectedLoss(asyncio.CancelledError),
        "distributed.batched": ExpectedLoss(CommClosedError),
    }
    for name, drop in quiet.items():
        logging.getLogger(name).addFilter(drop)
    try:
        yield
    finally:
        for name, drop in quiet.items():
            logging.getLogger(name).removeFilter(drop)


def _run_lives(
    job: JobConfig,
    services: Services,
    max_events: int | None,
    deadline: float | None,
    stop: threading.Event,
    on_progress: Callable[[Progress], None] | None,
) -> tuple[LoopStats, JobManifest | None]:
    """The rank world's lives: one, then one more after each restart (see :func:`run_ranks`)."""
    world = job.trainer.ranks
    book = CheckpointBook(checkpoint_location(job)) if job.trainer.checkpoint.enabled else None
    start = book.latest() if book is not None else None
    budget = RankRestarts(job.trainer.recovery)
    known = services.scheduler_id
    while True:
        learned = _learned_since(start, book.latest() if book is not None else None)
        left = None if max_events is None else max(0, max_events - learned)
        try:
            stats, manifest = _run_world(job, services, left, deadline, stop, on_progress)
        except Exception as exc:
            lost = _scheduler_lost(job, known)
            if lost is None and not isinstance(exc, RanksFailed):
                raise
            failure = RanksFailed([lost], killed=True) if lost else cast(RanksFailed, exc)
            newest = book.latest() if book is not None else None
            why = budget.refuse(failure, newest, stopping=stop.is_set())
            if why is not None:
                raise _ranks_failed(job, failure.failed, newest, why) from exc
            log.warning(
                "%s ended the world; starting the %d rank(s) again from the newest checkpoint "
                "(step %d): restart %d in a row (trainer.recovery.max_in_a_row %d)",
                ", ".join(failure.failed),
                world,
                newest.step if newest is not None else -1,
                budget.in_a_row,
                job.trainer.recovery.max_in_a_row,
            )
            if lost:
                known = check_named_services(job, services.store, services.token, deadline=deadline)
            _await_quiet(job, services, stop)
            continue
        stats.rank_restarts = budget.restarts
        if manifest is not None and (world > 1 or budget.restarts):
            # The summary is the whole run's, every rank and every life of the world:
            # rank 0's own loop counts its samples since this life's checkpoint only.
            stats.samples = _learned_since(start, manifest)
            stats.steps = manifest.step - (start.step if start is not None else 0)
        return stats, manifest


def _scheduler_lost(job: JobConfig, known: str | None) -> str | None:
    """What became of the scheduler the job names since it answered as ``known``: None
    if it still does (or the job started its own, which lives and dies with it)."""
    address = job.cluster.scheduler
    if address is None:
        return None
    try:
        now = scheduler_id(address, timeout_s=10.0)
    except NotAnswering:
        return f"the Dask scheduler at {address} (gone)"
    if now != known:
        return f"the Dask scheduler at {address} (restarted)"
    return None


class RanksFailed(Exception):
    """Rank processes died while the world trained (``failed``: each one, described)."""

    def __init__(self, failed: list[str], *, killed: bool) -> None:
        super().__init__(", ".join(failed))
        self.failed = failed
        self.killed = killed  # every one of them ended by a signal


@dataclass
class RankRestarts:
    """When the rank world may start again after a rank process died.

    Only a death by a signal is restarted (an exception would come back), and
    at most ``max_in_a_row`` times to the same checkpoint: a rank that dies
    before the next checkpoint every time would otherwise loop for ever.

    >>> from trainer.config import RecoveryConfig
    >>> at = JobManifest(step=8, samples=0, positions={}, shard_seqs=[], dense_file="",
    ...                  created=0.0)
    >>> budget = RankRestarts(RecoveryConfig(max_in_a_row=2))
    >>> killed = RanksFailed(["streamrec-rank-1"], killed=True)
    >>> [budget.refuse(killed, at, stopping=False) for _ in range(2)]
    [None, None]
    >>> budget.refuse(killed, at, stopping=False)
    'it died 3 times without a checkpoint in between (trainer.recovery.max_in_a_row is 2)'
    >>> import dataclasses
    >>> later = dataclasses.replace(at, step=16)  # a new checkpoint: the count starts again
    >>> budget.refuse(killed, later, stopping=False), budget.restarts
    (None, 3)
    >>> budget.refuse(RanksFailed(["streamrec-rank-1"], killed=False), later, stopping=False)
    'it failed on its own'
    """

    recovery: RecoveryConfig
    restarts: int = 0
    in_a_row: int = 0
    restarted_to: int = -1

    def refuse(
        self, failure: RanksFailed, newest: JobManifest | None, *, stopping: bool
    ) -> str | None:
        """Why the world must not start again (None: it may; counted as a restart)."""
        if stopping:
            return "the job was stopping"
        if not failure.killed:
            return "it failed on its own"
        if not self.recovery.enabled:
            return "trainer.recovery is off"
        if newest is None:
            return "checkpoints are off"
        self.in_a_row = self.in_a_row + 1 if newest.step == self.restarted_to else 1
        self.restarted_to = newest.step
        if self.in_a_row > self.recovery.max_in_a_row:
            return (
                f"it died {self.in_a_row} times without a checkpoint in between "
                f"(trainer.recovery.max_in_a_row is {self.recovery.max_in_a_row})"
            )
        self.restarts += 1
        return None


def _learned_since(start: JobManifest | None, newest: JobManifest | None) -> int:
    """Samples the job's ``newest`` checkpoint holds beyond the one it started from: what
    its earlier lives of the rank world learned (``--max-events`` counts them)."""
    if newest is None:
        return 0
    return newest.samples - (start.samples if start is not None else 0)


def _run_world(
    job: JobConfig,
    services: Services,
    max_events: int | None,
    deadline: float | None,
    stop: threading.Event,
    on_progress: Callable[[Progress], None] | None,
) -> tuple[LoopStats, JobManifest | None]:
    """One life of the rank world: rank 0 here, the others spawned; :class:`RanksFailed`
    when rank processes died."""
    import torch.distributed as dist

    world = job.trainer.ranks
    if world == 1:
        return run_rank(
            job,
            services,
            max_events=max_events,
            deadline=deadline,
            stop=stop,
            on_progress=on_progress,
        )
    master = f"tcp://127.0.0.1:{free_port()}"
    procs = _spawn_ranks(job, services, master, max_events, deadline)
    threading.Thread(target=_forward_stop, args=(stop, procs), daemon=True).start()
    _join_world(job, master, 0, world, 0, world)
    error: BaseException | None = None
    try:
        result = run_rank(
            job,
            services,
            rank=0,
            world=world,
            local_ranks=world,
            max_events=max_events,
            deadline=deadline,
            stop=stop,
            on_progress=on_progress,
        )
    except Exception as exc:
        error = exc
    finally:
        # Which ranks died before rank 0 gave up: those reaped below were stopped by it.
        died = [p for p in procs if p.exitcode not in (0, None)]
        dist.destroy_process_group()
        _reap(procs, timeout=10 if error is not None else 60)
    failed = [
        f"trainer rank process {p.name} (pid {p.pid}, {_exit_text(p.exitcode)})"
        for p in procs
        if p.exitcode not in (0, None)
    ]
    if failed:
        killed = bool(died) and all((p.exitcode or 0) < 0 for p in died)
        raise RanksFailed(failed, killed=killed) from error
    if error is not None:
        raise error
    return result


def _await_quiet(job: JobConfig, services: Services, stop: threading.Event) -> None:
    """Until no prepare task of the dead world still runs and every shard answers: a
    task of a dead rank still running on a worker would look rows up in (and so create
    rows in) the store after rank 0 rolled it back."""
    from embedding_store.client import StoreClient

    with (
        StoreClient.connect(services.store, token=services.token) as store,
        batch_client(job.cluster, services.scheduler) as dask,
    ):
        await_store(
            store,
            dask,
            services.supervisor,
            timeout_s=job.trainer.recovery.timeout_s,
            stopping=stop.is_set,
        )


def _spawn_ranks(
    job: JobConfig, services: Services, master: str, max_events: int | None, deadline: float | None
) -> list[BaseProcess]:
    """Start ranks 1.. of ``trainer.ranks``, each in a spawned process (:func:`_rank_main`)."""
    ctx = mp.get_context("spawn")
    world = job.trainer.ranks
    procs: list[BaseProcess] = []
    for r in range(1, world):
        args = (job.model_dump_json(), services, r, world, master, max_events, deadline)
        name = f"streamrec-rank-{r}"
        procs.append(ctx.Process(target=_rank_main, args=args, name=name, daemon=True))
    for p in procs:
        p.start()
    return procs


def _forward_stop(stop: threading.Event, procs: list[BaseProcess]) -> None:
    """Once ``stop`` is set, SIGTERM each rank process still running (it then stops too)."""
    stop.wait()
    for p in procs:
        if p.pid is not None and p.is_alive():
            os.kill(p.pid, signal.SIGTERM)


def _reap(procs: list[BaseProcess], *, timeout: float) -> None:
    """Wait for the rank processes to end, at most ``timeout`` seconds each; kill the rest."""
    for p in procs:
        p.join(timeout=timeout)
        if p.is_alive():
            p.kill()
            p.join(timeout=10)


def _ranks_failed(
    job: JobConfig, failed: list[str], newest: JobManifest | None, why: str
) -> JobError:
    """The error for what ended the job (rank processes, the scheduler): which, why not
    again, how to resume."""
    resume = (
        f"the newest checkpoint (step {newest.step}) holds everything learned; "
        "run the same command again to resume from it"
        if newest is not None
        else "no checkpoint was taken; run the same command again to start over"
    )
    msg = f"{', '.join(failed)} ended the job (not started again: {why}); {resume}"
    return JobError(msg)


def _exit_text(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def _rank_main(
    job_json: str,
    services: Services,
    rank: int,
    world: int,
    master: str,
    max_events: int | None,
    deadline: float | None,
) -> None:
    """A spawned rank process (``spawn`` pickles this function by its module path)."""
    import torch.distributed as dist

    job = JobConfig.model_validate_json(job_json)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    _join_world(job, master, rank, world, rank, world)
    try:
        run_rank(
            job,
            services,
            rank=rank,
            world=world,
            max_events=max_events,
            deadline=deadline,
            stop=stop,
            device_index=rank,
            local_ranks=world,
        )
    finally:
        dist.destroy_process_group()


def run_torchrun_rank(
    job: JobConfig,
    launch: TorchrunRank,
    services: Services,
    *,
    max_events: int | None = None,
    deadline: float | None = None,
    stop: threading.Event | None = None,
    on_progress: Callable[[Progress], None] | None = None,
) -> tuple[LoopStats, JobManifest | None]:
    """Train as the rank torchrun started: join its world (``env://``), then :func:`run_rank`.

    A rank whose peer dies (its host lost) gets an error from the next collective
    and ends with a :class:`JobError`; torchrun then starts the world again when
    ``--max-restarts`` allows, and every rank resumes from the newest checkpoint.
    """
    import torch.distributed as dist

    _join_world(job, "env://", launch.rank, launch.world, launch.local_rank, launch.local_world)
    try:
        return run_rank(
            job,
            services,
            rank=launch.rank,
            world=launch.world,
            max_events=max_events,
            deadline=deadline,
            stop=stop,
            on_progress=on_progress,
            device_index=launch.local_rank,
            local_ranks=launch.local_world,
        )
    except (RuntimeError, dist.DistError) as exc:
        if isinstance(exc, JobError) or not _collective_failure(exc):
            raise
        msg = (
            f"rank {launch.rank} of {launch.world}: another rank of the torchrun world is gone "
            f"({str(exc).splitlines()[0][:200]}); torchrun starts the world again when "
            "--max-restarts allows, and the ranks resume from the newest checkpoint"
        )
        raise JobError(msg) from exc
    finally:
        # A peer that is gone makes the collective teardown fail too.
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _join_world(
    job: JobConfig, init_method: str, rank: int, world: int, local_rank: int, local_world: int
) -> None:
    """Join the ranks' process group: NCCL, on this rank's own GPU, when ranks train on GPUs.

    Every rank of a host picks its device the same way (``pick_device``), so they
    agree on the backend; each is pinned to its GPU before NCCL starts.
    """
    import torch
    import torch.distributed as dist

    device = pick_device(job.trainer.device, local_rank, local_world)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=init_method,
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=job.trainer.collective_timeout_s),
        device_id=device if device.type == "cuda" else None,
    )


def _collective_failure(exc: BaseException) -> bool:
    """Whether ``exc`` comes from torch.distributed losing a peer (not from our own code)."""
    import torch.distributed as dist

    if isinstance(exc, dist.DistError):
        return True
    text = str(exc)
    return any(
        marker in text
        for marker in ("Connection closed by peer", "Connection reset", "gloo", "NCCL", "Timed out")
    )
