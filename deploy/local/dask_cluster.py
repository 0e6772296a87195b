"""The job's local Dask cluster: the scheduler in a process of its own, workers with nannies.

``LocalCluster`` runs the scheduler (and the nannies) on an event loop in the
process that starts it: here the trainer's. Every task's transitions, every
heartbeat and the dashboard's periodic callbacks then take the trainer's GIL
while its step runs. A long step hides that cost; a small model's short step
trains markedly slower for it.

:func:`local_dask_cluster` is a ``SpecCluster`` as ``LocalCluster`` builds one
(a ``Nanny`` per worker, the same memory limits), except that the scheduler is
a ``python -m distributed.cli.dask_spec`` process. That process dies with the thread that
started it (Linux ``PR_SET_PDEATHSIG``: the cluster's event loop, alive while
the cluster is), so a trainer killed with SIGKILL leaves no scheduler behind,
as its nannies' workers already do not; it runs in a session of its own, so a
terminal's Ctrl-C stops the job, not the scheduler under it. Its output goes to
a log file.
``cluster.scheduler_process: false`` keeps ``LocalCluster``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
import tempfile
import threading
import uuid
from pathlib import Path
from typing import IO, Any

from distributed import LocalCluster, Nanny, SpecCluster, Worker, WorkerPlugin
from distributed.core import Status
from distributed.deploy.subprocess import SubprocessScheduler
from distributed.utils import Deadline
from distributed.worker_memory import parse_memory_limit
from tornado.ioloop import PeriodicCallback

from deploy.local.parent_death import with_parent_death

log = logging.getLogger(__name__)

__all__ = [
    "HeartbeatStopsFirst",
    "IgnoreCtrlC",
    "QuickCloseNanny",
    "SchedulerProcess",
    "local_dask_cluster",
]


class SchedulerProcess(SubprocessScheduler):
    """A Dask scheduler in a ``distributed.cli.dask_spec`` process that dies with its starter.

    Unlike distributed's ``SubprocessScheduler`` its stderr goes to ``log_path``
    (a pipe nobody reads fills up and blocks the scheduler), and its scheduler
    file is removed when it closes.
    """

    def __init__(self, scheduler_kwargs: dict[str, Any], log_path: Path, timeout: int = 60) -> None:
        kwargs = {
            "scheduler_file": str(Path(tempfile.gettempdir()) / f"streamrec-dask-{uuid.uuid4()}"),
            **scheduler_kwargs,
        }
        super().__init__(scheduler_kwargs=kwargs, timeout=timeout)
        self.log_path = log_path
        self._log: IO[bytes] | None = None

    async def _start(self) -> None:
        spec = {"cls": "distributed.Scheduler", "opts": dict(self.scheduler_kwargs)}
        # distributed's own module, not `python -m dask spec`: that loads every
        # installed dask CLI plugin first (dask-kubernetes' heavy imports among them).
        cmd = [sys.executable, "-m", "distributed.cli.dask_spec", "--spec", json.dumps(spec)]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in close()
        deadline = Deadline.after(self.timeout)
        self.process = await asyncio.create_subprocess_exec(
            *with_parent_death(cmd, signal.SIGKILL),
            stdout=self._log,
            stderr=self._log,
            # Out of the job's process group: a terminal's Ctrl-C reaches the job, which
            # then takes its last checkpoint with the scheduler still there to serve it.
            start_new_session=True,
        )
        scheduler_file = Path(self.scheduler_kwargs["scheduler_file"])
        while not deadline.expired and self.process.returncode is None:
            try:
                identity = json.loads(scheduler_file.read_text())
                self.address = identity["address"]
                return
            except (OSError, json.JSONDecodeError, KeyError):
                # Not written yet, or not completely.
                await asyncio.sleep(0.05)
        tail = self.log_path.read_text(errors="replace")[-2000:]
        if deadline.expired:
            msg = f"the Dask scheduler did not start within {self.timeout}s; its log ends:\n{tail}"
        else:
            msg = (
                f"the Dask scheduler exited with code {self.process.returncode} before it "
                f"served; its log ({self.log_path}) ends:\n{tail}"
            )
        raise RuntimeError(msg)

    async def close(self) -> None:
        try:
            await super().close()
        finally:
            Path(self.scheduler_kwargs["scheduler_file"]).unlink(missing_ok=True)
            if self._log is not None:
                self._log.close()
                self._log = None


class QuickCloseNanny(Nanny):
    """A ``Nanny`` whose worker, told to stop, does not wait for the tasks it is running.

    Dask's nanny asks its worker process to close and to wait for its executor's
    threads first; a task still running then (a batch being prepared, a source's
    read waiting for the broker, a kernel compiling) held the process until the
    nanny's timeout (4 s of the cluster's 5) and a SIGKILL: "Worker process still
    alive after 4.0 seconds, killing", 4 s of every such job's end. Nobody wants
    those results when the cluster closes or the worker restarts, so the worker
    closes as it does on SIGTERM: it cancels them, tells the scheduler, closes its
    comms and exits; the running thread (a daemon) goes with the process.
    """

    async def kill(self, timeout: float = 5, reason: str = "nanny-kill") -> None:
        if self.process is not None:
            await self.process.kill(reason=reason, timeout=timeout, executor_wait=False)


class HeartbeatStopsFirst(WorkerPlugin):
    """A closing worker stops its heartbeat and lets one in flight finish before its comms close.

    ``Worker.close`` stops its periodic callbacks without waiting for the one
    running, then closes its connection pool: a heartbeat still waiting there
    for the scheduler's reply fails and logs "Failed to communicate with
    scheduler during heartbeat" with a ``CommClosedError`` traceback, on the
    job's stderr. The scheduler answers within milliseconds on an idle machine
    and much later on a loaded one, so a job's ordinary end or Ctrl-C printed
    that now and then. Plugins are torn down earlier in ``Worker.close``, with
    the scheduler still there to answer.

    Each worker process gets its own copy (the nanny pickles it into the worker).
    """

    name = "streamrec-heartbeat-first"

    def __init__(self) -> None:
        self._beat: asyncio.Task[None] | None = None

    def setup(self, worker: Worker) -> None:
        # Before the worker registers, when its heartbeat has not started yet.
        old = worker.periodic_callbacks["heartbeat"]
        running = old.is_running()
        old.stop()
        beat = PeriodicCallback(lambda: self._heartbeat(worker), old.callback_time)
        worker.periodic_callbacks["heartbeat"] = beat
        if running:
            beat.start()

    async def _heartbeat(self, worker: Worker) -> None:
        # A task of its own, so that teardown can wait for exactly this call.
        self._beat = asyncio.ensure_future(worker.heartbeat())
        try:
            await self._beat
        finally:
            self._beat = None

    async def teardown(self, worker: Worker) -> None:
        if worker.status != Status.closing:
            return  # removed from a worker that goes on: it must go on beating
        worker.periodic_callbacks["heartbeat"].stop()
        beat = self._beat
        # A heartbeat that closes its worker (the scheduler forgot it) is not waited for.
        if beat is not None and beat is not asyncio.current_task():
            await asyncio.wait([beat])


class IgnoreCtrlC(WorkerPlugin):
    """A worker process ignores SIGINT: the job closes it, after its last checkpoint.

    A terminal sends Ctrl-C to the job's whole process group, its worker
    processes included; each died of ``KeyboardInterrupt`` with a traceback
    while the job was still taking its last checkpoint. The scheduler and the
    store shards run in sessions of their own for the same reason; a worker is
    started by ``multiprocessing``, which offers no such choice, so it ignores
    SIGINT from its setup on (a Ctrl-C in the second or so before that still
    reaches it).
    """

    name = "streamrec-ignore-ctrl-c"

    def setup(self, worker: Worker) -> None:
        # A worker process runs its event loop in its main thread; a worker on another
        # thread shares its process with something that may want Ctrl-C.
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.SIG_IGN)


def _quiet_worker_plugins() -> tuple[WorkerPlugin, ...]:
    return (HeartbeatStopsFirst(), IgnoreCtrlC())


# A worker keeps its statistical profile of every second (the dashboard's profile
# page) and its recent transitions and stimuli, each as many as this. With Dask's
# 1,000 a worker's memory grows for a long time after it starts (the profiles' call
# trees), which in a continuous job looks like a leak; 300 (five minutes of
# profiles) levels off soon (``benchmarks/soak.py`` watches workers' memory).
LOW_LEVEL_LOG_LENGTH = 300
# Dotted: a Nanny merges its config over Dask's top-level keys only, and the worker
# process sets it (a nested {"distributed": ...} would replace all of Dask's own).
WORKER_CONFIG: dict[str, Any] = {"distributed.admin.low-level-log-length": LOW_LEVEL_LOG_LENGTH}


def local_dask_cluster(
    *,
    workers: int,
    threads_per_worker: int,
    dashboard_address: str,
    log_path: Path,
    scheduler_process: bool = True,
) -> SpecCluster:
    """The job's local cluster on loopback: ``workers`` worker processes under nannies.

    ``scheduler_process``: the scheduler runs in a process of its own (its log
    at ``log_path``), else in this one (``LocalCluster``).
    """
    if not scheduler_process:
        return LocalCluster(  # type: ignore[no-untyped-call]
            n_workers=workers,
            threads_per_worker=threads_per_worker,
            processes=True,
            dashboard_address=dashboard_address,
            plugins=_quiet_worker_plugins(),
            config=WORKER_CONFIG,
            worker_class=QuickCloseNanny,
        )
    host = "127.0.0.1"
    scheduler = {
        "cls": SchedulerProcess,
        "options": {
            "scheduler_kwargs": {
                "host": host,
                "port": 0,
                "dashboard": True,
                "dashboard_address": dashboard_address,
            },
            "log_path": log_path,
        },
    }
    worker = {
        "cls": QuickCloseNanny,
        "options": {
            "host": host,
            "nthreads": threads_per_worker,
            # As LocalCluster shares the memory: each worker its part of the host's.
            "memory_limit": parse_memory_limit("auto", 1, workers, logger=log),
            "silence_logs": logging.WARN,
            "plugins": _quiet_worker_plugins(),
            "config": WORKER_CONFIG,
        },
    }
    return SpecCluster(  # type: ignore[no-untyped-call]
        scheduler=scheduler,
        workers={i: worker for i in range(workers)},
        worker=worker,
        silence_logs=logging.WARN,
        name="streamrec",
    )
