"""The job's local Dask cluster: the scheduler in a process of its own, workers with nannies.

``LocalCluster`` runs the scheduler (and the nannies) on an event loop in the
process that starts it: here the trainer's. Every task's transitions, every
heartbeat and the dashboard's periodic callbacks then take the trainer's GIL
while its step runs. With a short step that cost shows: the hybrid trainer of
a small model (MLP 64-32, 2 ms per store call, 2 cores) ran at 109k samples/s
with the scheduler in its process and at 140k with the scheduler (and the
workers, without nannies) in processes of their own, back to back; the default
model's 70 ms step hid it (58k either way).

:func:`local_dask_cluster` is a ``SpecCluster`` as ``LocalCluster`` builds one
(a ``Nanny`` per worker, the same memory limits), except that the scheduler is
a ``python -m dask spec`` process. That process dies with the thread that
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
import uuid
from pathlib import Path
from typing import IO, Any

from distributed import LocalCluster, Nanny, SpecCluster
from distributed.deploy.subprocess import SubprocessScheduler
from distributed.utils import Deadline
from distributed.worker_memory import parse_memory_limit

from deploy.local.shards import signal_when_parent_dies

log = logging.getLogger(__name__)

__all__ = ["SchedulerProcess", "local_dask_cluster"]


def _kill_with_parent() -> None:
    signal_when_parent_dies(signal.SIGKILL)


class SchedulerProcess(SubprocessScheduler):
    """A Dask scheduler in a ``python -m dask spec`` process that dies with its starter.

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
        cmd = [sys.executable, "-m", "dask", "spec", "--spec", json.dumps(spec)]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in close()
        deadline = Deadline.after(self.timeout)
        self.process = await asyncio.create_subprocess_exec(
            *cmd,
            stdout=self._log,
            stderr=self._log,
            preexec_fn=_kill_with_parent,
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
        "cls": Nanny,
        "options": {
            "host": host,
            "nthreads": threads_per_worker,
            # As LocalCluster shares the memory: each worker its part of the host's.
            "memory_limit": parse_memory_limit("auto", 1, workers, logger=log),
            "silence_logs": logging.WARN,
        },
    }
    return SpecCluster(  # type: ignore[no-untyped-call]
        scheduler=scheduler,
        workers={i: worker for i in range(workers)},
        worker=worker,
        silence_logs=logging.WARN,
        name="streamrec",
    )
