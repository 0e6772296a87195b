"""The job's local Dask cluster: the scheduler in a process of its own that dies with its parent."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import pytest
from distributed import Client

from deploy.local.dask_cluster import LOW_LEVEL_LOG_LENGTH, SchedulerProcess, local_dask_cluster

pytestmark = pytest.mark.processes


def _history_kept(client: Client) -> set[tuple[int | None, int | None]]:
    """Per worker: how many per-second profiles and recent stimuli it keeps."""

    def kept(dask_worker: Any) -> tuple[int | None, int | None]:
        return dask_worker.profile_history.maxlen, dask_worker.state.stimulus_log.maxlen

    return set(client.run(kept).values())


def _gone(pid: int, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


def test_the_scheduler_runs_in_a_process_of_its_own(tmp_path: Path) -> None:
    log_path = tmp_path / "dask-scheduler.log"
    with (
        local_dask_cluster(
            workers=2, threads_per_worker=1, dashboard_address=":0", log_path=log_path
        ) as cluster,
        Client(cluster) as client,
    ):
        scheduler_pid = client.run_on_scheduler(os.getpid)
        assert scheduler_pid != os.getpid()
        assert psutil.Process(scheduler_pid).parent().pid == os.getpid()
        workers = client.run(os.getpid)
        assert len(workers) == 2
        assert os.getpid() not in workers.values()
        assert client.submit(sum, [1, 2, 3]).result(timeout=30) == 6
        # Few enough that a worker's memory is flat within minutes (Dask's 1,000 grew
        # it for the first 17 minutes of every worker's life).
        assert _history_kept(client) == {(LOW_LEVEL_LOG_LENGTH, LOW_LEVEL_LOG_LENGTH)}
        # The dashboard is the scheduler's, as LocalCluster's is.
        with urllib.request.urlopen(cluster.dashboard_link, timeout=10) as reply:
            assert reply.status == 200
        scheduler_file = Path(cluster.scheduler.scheduler_kwargs["scheduler_file"])
        assert scheduler_file.exists()
    assert _gone(scheduler_pid)
    assert not scheduler_file.exists()
    assert log_path.exists()


def test_in_process_scheduler_when_asked(tmp_path: Path) -> None:
    with (
        local_dask_cluster(
            workers=1,
            threads_per_worker=1,
            dashboard_address=":0",
            log_path=tmp_path / "log",
            scheduler_process=False,
        ) as cluster,
        Client(cluster) as client,
    ):
        assert client.run_on_scheduler(os.getpid) == os.getpid()
        assert _history_kept(client) == {(LOW_LEVEL_LOG_LENGTH, LOW_LEVEL_LOG_LENGTH)}
    assert not (tmp_path / "log").exists()


def test_a_killed_parent_leaves_no_scheduler_behind(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import os, sys, time
        from pathlib import Path
        sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
        from distributed import Client
        from deploy.local.dask_cluster import local_dask_cluster
        if __name__ == "__main__":
            cluster = local_dask_cluster(workers=1, threads_per_worker=1,
                                         dashboard_address=":0",
                                         log_path=Path({str(tmp_path / "log")!r}))
            client = Client(cluster)
            print(client.run_on_scheduler(os.getpid), flush=True)
            time.sleep(600)
        """
    )
    path = tmp_path / "starter.py"
    path.write_text(script)
    proc = subprocess.Popen(
        [sys.executable, str(path)], stdout=subprocess.PIPE, text=True, cwd=tmp_path
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip().isdigit(), f"the starter printed {line!r}"
        scheduler_pid = int(line)
        assert psutil.pid_exists(scheduler_pid)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        assert _gone(scheduler_pid), "the scheduler outlived its parent's SIGKILL"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_scheduler_that_cannot_start_says_why(tmp_path: Path) -> None:
    log_path = tmp_path / "dask-scheduler.log"
    scheduler = SchedulerProcess({"no_such_option": 1}, log_path=log_path, timeout=30)
    with pytest.raises(RuntimeError, match=r"exited with code \d+ before it served") as info:
        asyncio.run(scheduler._start())
    assert str(log_path) in str(info.value)
    assert "no_such_option" in str(info.value)  # the log's tail says what was wrong
    asyncio.run(scheduler.close())
    assert not Path(scheduler.scheduler_kwargs["scheduler_file"]).exists()


# Closes the workers as the cluster's close does first, while the scheduler gets no CPU
# (SIGSTOP): as a loaded machine's scheduler, it answers every worker's heartbeat late.
_CLOSE_WHILE_HEARTBEATS_WAIT = """
import asyncio, sys, time
from pathlib import Path
sys.path.insert(0, {root!r})
import psutil
from distributed.core import rpc
from distributed.protocol.pickle import dumps
from deploy.local.dask_cluster import local_dask_cluster

def heartbeat_waits(dask_worker):
    pool, scheduler = dask_worker.rpc, dask_worker.scheduler.address
    return bool(pool.occupied.get(scheduler) or pool._connecting.get(scheduler))

def gone(pid):
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True

if __name__ == "__main__":
    cluster = local_dask_cluster(workers=2, threads_per_worker=1, dashboard_address=":0",
                                 log_path=Path({log!r}))
    nannies = list(cluster.workers.values())
    scheduler = psutil.Process(cluster.scheduler.process.pid)
    scheduler.suspend()

    async def until_each_heartbeat_waits():
        for nanny in nannies:
            async with rpc(nanny.worker_address) as worker:
                while not (await worker.run(function=dumps(heartbeat_waits)))["result"]:
                    await asyncio.sleep(0.05)

    async def close_workers():
        await asyncio.gather(*(nanny.close(timeout=60) for nanny in nannies))

    cluster.sync(until_each_heartbeat_waits)
    pids = [nanny.process.pid for nanny in nannies]
    closing = asyncio.run_coroutine_threadsafe(close_workers(), cluster.loop.asyncio_loop)
    # A worker that does not wait for its heartbeat exits at once; one that waits is
    # answered once the scheduler runs again.
    deadline = time.monotonic() + 3
    while not all(gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    scheduler.resume()
    closing.result(timeout=60)
    cluster.close()
    print("closed", flush=True)
"""


def test_workers_closed_while_their_heartbeats_wait_print_nothing(tmp_path: Path) -> None:
    """A loaded machine's scheduler answers heartbeats late; closing the cluster stays quiet.

    Each worker's heartbeat waiting for the reply used to be cut by its own close:
    "distributed.worker - ERROR - Failed to communicate with scheduler during
    heartbeat" and a traceback, on the stderr of a job stopped with Ctrl-C.
    """
    script = tmp_path / "close_while_heartbeats_wait.py"
    script.write_text(
        _CLOSE_WHILE_HEARTBEATS_WAIT.format(
            root=str(Path(__file__).resolve().parents[2]), log=str(tmp_path / "log")
        )
    )
    out = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "closed" in out.stdout, text
    assert "ERROR" not in text, text
    assert "Traceback" not in text, text


def test_a_worker_busy_with_a_task_closes_without_being_killed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A task still running when the cluster closes (a batch being prepared, a read
    waiting for the broker) is not waited for: its worker used to hold on until the
    nanny's timeout, "Worker process still alive after 4.0 seconds, killing", 4 s of
    every such job's end."""
    with (
        local_dask_cluster(
            workers=1, threads_per_worker=1, dashboard_address=":0", log_path=tmp_path / "log"
        ) as cluster,
        Client(cluster) as client,
    ):
        busy = client.submit(time.sleep, 60)
        (nanny,) = cluster.workers.values()
        deadline = time.monotonic() + 30
        while not client.processing()[nanny.worker_address]:
            assert time.monotonic() < deadline, "the task never started"
            time.sleep(0.05)
        time.sleep(0.2)  # in the worker's thread by now
        (pid,) = client.run(os.getpid).values()
        del busy
    assert _gone(pid, timeout_s=1.0)
    killed = [r.getMessage() for r in caplog.records if "still alive" in r.getMessage()]
    assert not killed, killed
