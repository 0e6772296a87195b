"""Starting and stopping the processes tests run: ``streamrec`` commands, jobs, ranks, Dask.

Also :func:`forbid_processes`, the fast tier's check that a test which starts
a process carries the ``processes`` marker.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.process
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import pytest

from deploy.local.kafka import REPO_ROOT
from tests.support.ports import free_port

if TYPE_CHECKING:
    from distributed import Client

    from deploy.local.shards import ShardProcess

# The ``streamrec`` command of this checkout (what the console script runs).
STREAMREC = [sys.executable, "-m", "deploy.cli"]

__all__ = [
    "REPO_ROOT",
    "STREAMREC",
    "dask_cluster",
    "finish",
    "forbid_processes",
    "grpc_address",
    "kill_group",
    "run_ranks",
    "start_job",
    "streamrec",
]


def streamrec(
    *args: str, timeout: float = 240, check: bool = False
) -> subprocess.CompletedProcess[str]:
    """Run ``streamrec <args>`` from the repository root; stdout and stderr come back as text."""
    return subprocess.run(
        [*STREAMREC, *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=check,
    )


def grpc_address(procs: list[ShardProcess]) -> str:
    """The store address of these shard processes, ``grpc://host:port,host:port...``."""
    return "grpc://" + ",".join(p.address for p in procs)


def start_job(job: Path, *args: str) -> subprocess.Popen[str]:
    """``streamrec run <job> <args>`` in a process group of its own, output piped.

    Its own group, as a shell gives a command: :func:`kill_group` then ends the
    job with every store shard and Dask worker it started. stderr goes to stdout.
    """
    return subprocess.Popen(
        [*STREAMREC, "run", str(job), *args],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        encoding="utf-8",
        errors="replace",
        start_new_session=True,
    )


def finish(proc: subprocess.Popen[str], timeout: float = 240) -> str:
    """The output of a job from :func:`start_job` once it has ended, which it must with 0.

    A job still running after ``timeout`` seconds is killed, group and all.
    """
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            kill_group(proc)
    assert proc.returncode == 0, out[-4000:]
    return out


def kill_group(proc: subprocess.Popen[Any]) -> None:
    """SIGKILL to ``proc``'s process group (what it left running too), then reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def run_ranks(
    target: Callable[..., None], world: int, *args: Any, timeout_s: float = 90
) -> dict[int, Any]:
    """Run ``target(rank, init, *args, out)`` in ``world`` spawned processes (a gloo
    group at ``init``); each puts ``(rank, results)`` on ``out``, or its traceback."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=target, args=(r, init, *args, out)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in procs:
            rank, res = out.get(timeout=timeout_s)  # a hung collective fails here
            assert not isinstance(res, str), f"rank {rank} failed:\n{res}"
            results[rank] = res
    except queue.Empty:
        pytest.fail(f"the ranks did not finish within {timeout_s} s (a hung collective?)")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    assert [p.exitcode for p in procs] == [0] * world
    return results


@contextmanager
def dask_cluster() -> Iterator[Client]:
    """A client of a new LocalCluster of 2 worker processes (1 thread each)."""
    from distributed import Client, LocalCluster  # about a second: only where it is used

    with (
        LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as lc,
        Client(lc) as client,
    ):
        yield client


@contextmanager
def forbid_processes(test: str) -> Iterator[None]:
    """Fail ``test`` the moment it starts a process (subprocess, multiprocessing, fork).

    The fast tier (``-m "not processes"``) wraps each unmarked test in this, so a
    test that starts real processes without the ``processes`` marker fails there
    with a message saying to mark it, rather than slowing the fast tier down.
    """
    message = (
        f"{test} starts a process ({{how}}) but is not marked `processes`: add "
        "@pytest.mark.processes to it (or `pytestmark = pytest.mark.processes` to its "
        "module), so that the fast tier (`make test-fast`) leaves it out."
    )
    refused: list[str] = []
    main = threading.main_thread()

    def refuse(how: str) -> NoReturn:
        refused.append(message.format(how=how))
        if threading.current_thread() is not main:
            # A process started from another thread (Dask starts its workers from its
            # event loop's): the test waits on that thread, and would only time out.
            signal.pthread_kill(main.ident or 0, signal.SIGUSR1)
        pytest.fail(refused[-1], pytrace=False)

    def in_main(signum: int, frame: object) -> None:
        pytest.fail(refused[-1], pytrace=False)

    def popen(self: subprocess.Popen[Any], args: Any, *rest: Any, **kw: Any) -> NoReturn:
        refuse(f"subprocess: {args!r}"[:200])

    def start(self: multiprocessing.process.BaseProcess) -> NoReturn:
        refuse(f"multiprocessing: {self.name}")

    def fork() -> NoReturn:
        refuse("os.fork")

    before = signal.signal(signal.SIGUSR1, in_main)
    try:
        with pytest.MonkeyPatch.context() as patch:
            # _execute_child: every Popen goes through it, however the caller imported it.
            patch.setattr(subprocess.Popen, "_execute_child", popen)
            patch.setattr(multiprocessing.process.BaseProcess, "start", start)
            patch.setattr(os, "fork", fork)
            yield
    finally:
        signal.signal(signal.SIGUSR1, before)
