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
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.hosts import Host, dask_scheduler, dask_worker
from tests.support.jobs import (
    assert_learned_once,
    trainer_section,
    wait_for_checkpoint,
    write_synthetic_training_job,
)
from tests.support.ports import free_port
from tests.support.processes import finish, kill_group, start_job

EVENTS = 6_000  # per partition
PARTITIONS = 2


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


@pytest.mark.processes
def test_a_job_finds_its_restarted_scheduler_and_goes_on(tmp_path: Path, dask_host: Host) -> None:
    port = free_port()
    start_dask(dask_host, port)
    scheduler = f"tcp://{dask_host.address}:{port}"
    cluster = {"scheduler": scheduler, "store_shards": 2, "wait_for_services_s": 120}
    trainer = trainer_section(batch_size=200, hidden=[16], every_steps=4, mode="hybrid",
                              staleness=2, ranks=1)  # fmt: skip
    job = write_synthetic_training_job(
        tmp_path, trainer=trainer, events=EVENTS, partitions=PARTITIONS, seed=4, cluster=cluster
    )
    proc = start_job(job)
    run_dir = tmp_path / "run"
    try:
        wait_for_checkpoint(run_dir, 4, proc)
        dask_host.crash()  # the scheduler and its worker, as a machine dies
        time.sleep(2)
        dask_host.replace()
        start_dask(dask_host, port)
        out = finish(proc, timeout=300)
    finally:
        kill_group(proc)
    assert f"the Dask scheduler at {scheduler}" in out, out[-4000:]
    assert "ended the world; starting the 1 rank(s) again" in out, out[-4000:]
    assert "started the trainer ranks again 1 time(s)" in out, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    assert_learned_once(run_dir, {f"synthetic/{p}": EVENTS for p in range(PARTITIONS)})
    # The restarted scheduler got the job's plugins again: its page, the span pruner and
    # the trims that keep its memory and its workers' flat (pipeline.scheduler_spans,
    # pipeline.scheduler_memory, pipeline.worker_memory).
    own, workers = scheduler_plugins(scheduler)
    assert {"streamrec", "streamrec-span-pruner", "streamrec-scheduler-trim"} <= own
    assert "streamrec-worker-trim" in workers


def scheduler_plugins(address: str) -> tuple[set[str], set[str]]:
    """The plugins of the scheduler at ``address``, and those it gives every worker."""
    from distributed import Client

    def names(dask_scheduler: Any) -> tuple[list[str], list[str]]:
        return list(dask_scheduler.plugins), list(dask_scheduler.worker_plugins)

    with Client(address, timeout=30) as client:
        own, workers = client.run_on_scheduler(names)
    return set(own), set(workers)


def test_a_lost_scheduler_s_expected_errors_are_not_reported(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Dask's records of the loss the job recovers from are dropped while the job runs:
    the dead world's client's reconnect cancelled as it is closed (ERROR, three
    tracebacks, seen when the new scheduler answered before the client gave up) and
    the client's batched comm closed as the scheduler dies (INFO with a traceback, seen
    in the restart test above). Any other record of theirs still shows."""
    import asyncio
    import logging

    from distributed.comm.core import CommClosedError

    from deploy.job.world import _quiet_expected_losses

    client = logging.getLogger("distributed.client")
    batched = logging.getLogger("distributed.batched")

    def logged(log: logging.Logger, error: BaseException, text: str) -> None:
        # each at the level Dask logs it: the client's at ERROR, the comm's at INFO
        level = logging.ERROR if log is client else logging.INFO
        try:
            raise error
        except BaseException:
            log.log(level, text, exc_info=True)

    with caplog.at_level(logging.INFO, logger="distributed.batched"):
        with _quiet_expected_losses():
            logged(client, asyncio.CancelledError(), "a reconnect cancelled by close")
            logged(batched, CommClosedError(), "Batched Comm Closed")
            logged(batched, OSError("disk"), "another batched error")
            client.error("another error")
        logged(client, asyncio.CancelledError(), "after the job")
        logged(batched, CommClosedError(), "closed after the job")
    assert [r.getMessage() for r in caplog.records] == [
        "another batched error",
        "another error",
        "after the job",
        "closed after the job",
    ]
