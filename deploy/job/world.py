"""The trainer ranks' torch world: rank processes started here, or ranks torchrun started.

Ranks share the dense model through ``torch.distributed`` (gloo on CPU, nccl on
GPU). With ``trainer.ranks > 1`` rank 0 trains in the job's process and the
others in spawned processes; under ``torchrun`` this process is the one rank
torchrun made it.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing as mp
import os
import signal
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING

from deploy.cluster import TorchrunRank
from deploy.config import JobConfig
from deploy.job.errors import JobError
from deploy.job.parts import checkpoint_location
from deploy.job.rank import run_rank
from deploy.job.services import Services
from deploy.local.kafka import free_port
from trainer.checkpoint import CheckpointBook, JobManifest
from trainer.loop import LoopStats, Progress, pick_device

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess


def run_ranks(
    job: JobConfig,
    services: Services,
    *,
    max_events: int | None = None,
    deadline: float | None = None,
    stop: threading.Event | None = None,
    on_progress: Callable[[Progress], None] | None = None,
) -> tuple[LoopStats, JobManifest | None]:
    """Rank 0 here, ranks 1.. in spawned processes; a rank that fails stops the job.

    A rank process that dies (``kill -9``, out of memory) breaks the others'
    collectives; the job then stops with a :class:`JobError` that names the rank
    and says how to resume: the newest checkpoint holds everything learned.
    """
    import torch.distributed as dist

    world = job.trainer.ranks
    stop = stop or threading.Event()
    train = functools.partial(
        run_rank,
        job,
        services,
        world=world,
        local_ranks=world,
        max_events=max_events,
        deadline=deadline,
        stop=stop,
        on_progress=on_progress,
    )
    if world == 1:
        return train()
    master = f"tcp://127.0.0.1:{free_port()}"
    procs = _spawn_ranks(job, services, master, max_events, deadline)
    threading.Thread(target=_forward_stop, args=(stop, procs), daemon=True).start()
    _join_world(job, master, 0, world, 0, world)
    error: BaseException | None = None
    try:
        result = train(rank=0)
    except Exception as exc:
        error = exc
    finally:
        dist.destroy_process_group()
        _reap(procs, timeout=10 if error is not None else 60)
    failed = [
        f"{p.name} (pid {p.pid}, {_exit_text(p.exitcode)})"
        for p in procs
        if p.exitcode not in (0, None)
    ]
    if failed:
        raise _ranks_failed(job, failed) from error
    if error is not None:
        raise error
    return result


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


def _ranks_failed(job: JobConfig, failed: list[str]) -> JobError:
    """The error for rank processes that ended the job: which, and how to resume."""
    book = CheckpointBook(checkpoint_location(job))
    newest = book.latest() if job.trainer.checkpoint.enabled else None
    resume = (
        f"the newest checkpoint (step {newest.step}) holds everything learned; "
        "run the same command again to resume from it"
        if newest is not None
        else "no checkpoint was taken; run the same command again to start over"
    )
    msg = f"trainer rank process {', '.join(failed)} ended the job; {resume}"
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
