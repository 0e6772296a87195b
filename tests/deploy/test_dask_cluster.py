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

import psutil
import pytest
from distributed import Client

from deploy.local.dask_cluster import SchedulerProcess, local_dask_cluster


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
