"""The Dask scheduler a job names dies and a new one starts at the same address: the job
finds it and goes on by itself, learning every offset once.

Real processes: ``dask scheduler`` and ``dask worker`` on a "host" of their own
(:mod:`tests.cluster.hosts`), ``streamrec run`` with ``cluster.scheduler`` naming
it (its store shards its own). The scheduler host is killed with ``kill -9``
(its worker exits with it, as Dask workers do when their scheduler goes) and
started again on the same address, as a supervisor (systemd, a Kubernetes
Deployment) would do.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster.hosts import Host, dask_scheduler, dask_worker, free_port_on
from tests.conftest import REPO_ROOT, STREAMREC
from tests.trainer.test_job import wait_for_checkpoint
from tests.trainer.test_job_faults import (
    assert_every_offset_learned_once,
    finish,
    kill_leftovers,
    write_job,
)


@pytest.fixture
def dask_host(tmp_path: Path) -> Iterator[Host]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    host = Host("dask", "127.0.0.2", tmp_path / "hosts", env)
    yield host
    host.crash()


def start_dask(host: Host, port: int) -> None:
    host.start("scheduler", dask_scheduler(host, port))
    host.wait_log("scheduler", r"Scheduler at:")
    host.start("worker", dask_worker(host, f"tcp://{host.address}:{port}"))
    host.wait_log("worker", r"Registered to:")


def test_a_job_finds_its_restarted_scheduler_and_goes_on(tmp_path: Path, dask_host: Host) -> None:
    port = free_port_on(dask_host.address)
    start_dask(dask_host, port)
    scheduler = f"tcp://{dask_host.address}:{port}"
    cluster = {"scheduler": scheduler, "store_shards": 2, "wait_for_services_s": 120}
    job = write_job(tmp_path, cluster, ranks=1)
    proc = subprocess.Popen(
        [*STREAMREC, "run", str(job)],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    run_dir = tmp_path / "run"
    try:
        wait_for_checkpoint(run_dir, 4, proc)  # type: ignore[arg-type]
        dask_host.crash()  # the scheduler and its worker, as a machine dies
        time.sleep(2)
        dask_host.replace()
        start_dask(dask_host, port)
        code, out = finish(proc)
    finally:
        kill_leftovers(proc)
    assert code == 0, out[-4000:]
    assert f"the Dask scheduler at {scheduler}" in out, out[-4000:]
    assert "ended the world; starting the 1 rank(s) again" in out, out[-4000:]
    assert "started the trainer ranks again 1 time(s)" in out, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    assert_every_offset_learned_once(run_dir)


def test_a_cancelled_reconnect_is_not_reported_as_an_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The dead world's client is closed while it still tries to reconnect to the lost
    scheduler: Dask's ERROR for that cancelled attempt (three tracebacks, in the job's
    output, seen when the new scheduler answered before the client gave up) is dropped;
    any other error of the client still shows."""
    import asyncio
    import logging

    from deploy.job.world import _quiet_cancelled_reconnects

    log = logging.getLogger("distributed.client")

    def cancelled(text: str) -> None:
        try:
            raise asyncio.CancelledError
        except asyncio.CancelledError:
            log.exception(text)

    with caplog.at_level(logging.ERROR, logger="distributed.client"):
        with _quiet_cancelled_reconnects():
            cancelled("a reconnect cancelled by close")
            log.error("another error")
        cancelled("after the job")
    assert [r.getMessage() for r in caplog.records] == ["another error", "after the job"]
