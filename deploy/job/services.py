"""The services a job trains against: store shards and a Dask cluster, started or checked.

A job names the ones it does not want started here (``cluster.scheduler``,
``cluster.store``); those are checked before anything trains against them.
"""

from __future__ import annotations

import logging
import secrets
import sys
import time
from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from dataclasses import field as dc_field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import yaml

from deploy.cluster import (
    ClusterError,
    NotAnswering,
    check_store,
    environment,
    scheduler_id,
    store_token,
)
from deploy.config import ClusterConfig, JobConfig
from deploy.job.errors import JobError
from deploy.status_line import StatusLine
from monitoring.plugin import StreamrecPlugin

if TYPE_CHECKING:
    from distributed import Client

    from deploy.local.shards import ShardSupervisor, StartingShard

log = logging.getLogger(__name__)

# How often a service the job names is asked again while it does not answer.
_SERVICE_POLL_S = 1.0


@dataclass(frozen=True)
class Services:
    """Where a running job's parts are: the Dask scheduler and the store."""

    scheduler: str
    dashboard: str | None
    store: str
    token: str | None
    store_metrics: tuple[str, ...] = ()  # each local shard's Prometheus /metrics URL
    # Restarts local shards that die; lives in the job's process only (not pickled).
    supervisor: ShardSupervisor | None = dc_field(default=None, compare=False, repr=False)
    # The id of the scheduler the job names, as it answered at the start (a restarted
    # one answers with another); None for the job's own cluster.
    scheduler_id: str | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "supervisor": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


def check_named_services(
    job: JobConfig,
    store: str,
    token: str | None,
    *,
    out: TextIO | None = None,
    deadline: float | None = None,
) -> str | None:
    """Wait for the services the job names to answer, up to ``cluster.wait_for_services_s``
    or ``deadline`` (the job's ``--max-time``), whichever comes first (a status line
    on ``out``, stderr by default, says which and how long); refuse to start when
    one still does not, or does not fit the job. Returns the named scheduler's id."""
    wait_s, bound = job.cluster.wait_for_services_s, "cluster.wait_for_services_s"
    if deadline is not None and deadline - time.monotonic() < wait_s:
        wait_s, bound = max(0.0, deadline - time.monotonic()), "--max-time"
    deadline = time.monotonic() + wait_s
    status = StatusLine(out or sys.stderr, every_s=5.0)
    waited = False
    # Each attempt is short enough that the status line shows early in a short wait.
    attempt_s = min(10.0, max(1.0, wait_s / 4))
    try:
        while True:
            try:
                named = None
                if job.cluster.scheduler is not None:
                    named = scheduler_id(job.cluster.scheduler, timeout_s=attempt_s)
                if job.cluster.store is not None:
                    check_store(job, store, token, timeout_s=attempt_s)
                return named
            except NotAnswering as exc:
                left = deadline - time.monotonic()
                if left <= 0:
                    msg = f"{exc}; waited {wait_s:.0f}s for it ({bound})"
                    raise JobError(msg) from None
                waited = True
                status.show(f"waiting for the services the job names ({left:.0f}s left): {exc}")
                time.sleep(min(_SERVICE_POLL_S, left))
    except ClusterError as exc:
        raise JobError(str(exc)) from None
    finally:
        if waited:
            status.done()


def start_services(
    job: JobConfig,
    stack: ExitStack,
    *,
    env: Mapping[str, str] | None = None,
    deadline: float | None = None,
) -> Services:
    """Start the shards and the Dask cluster the job does not name; ``stack`` stops them.

    Services the job names (``cluster.scheduler``, ``cluster.store``) are checked
    first, waited for until ``deadline`` (``time.monotonic()``; the job's
    ``--max-time``) at most: a wrong address, token or table schema is a
    :class:`JobError`.
    """
    run_dir = job.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    job_file = run_dir / "job.yaml"
    job_file.write_text(yaml.safe_dump(job.model_dump(mode="json"), sort_keys=False))
    if job.cluster.store is not None:
        store = job.cluster.store
        token = store_token(job, env if env is not None else environment())
        named = check_named_services(job, store, token, deadline=deadline)
        scheduler, dashboard = _scheduler(job, stack)
        return Services(scheduler, dashboard, store, token, scheduler_id=named)
    token_file = job.cluster.token_file
    if token_file is None:
        token_file = _local_token_file(run_dir)
    # The shard processes import and restore while the Dask cluster starts: the job
    # waits for the slower of the two, not their sum.
    starting = _spawn_shards(job, job_file, token_file)
    try:
        scheduler, dashboard = _scheduler(job, stack)
    except BaseException:
        _kill_all(starting)
        raise
    store, store_metrics, supervisor = _wait_for_shards(starting, stack)
    token = token_file.read_text().strip()
    named = check_named_services(job, store, token, deadline=deadline)
    return Services(scheduler, dashboard, store, token, store_metrics, supervisor, named)


def _scheduler(job: JobConfig, stack: ExitStack) -> tuple[str, str | None]:
    """The scheduler the job names, else a local Dask cluster's: address and dashboard."""
    if job.cluster.scheduler is not None:
        return job.cluster.scheduler, None
    return _start_dask(job, stack)


def _local_token_file(run_dir: Path) -> Path:
    """The run's own store token (made once, kept for restarts of the same run)."""
    token_file = run_dir / "store.token"
    if not token_file.exists():
        token_file.write_text(secrets.token_hex(16))
        token_file.chmod(0o600)
    return token_file


def _spawn_shards(job: JobConfig, job_file: Path, token_file: Path) -> list[StartingShard]:
    """Start the job's store shard processes, without waiting for them to serve."""
    from deploy.local.shards import ShardProcess

    # Every shard's process is started before any is waited for: they import and
    # restore side by side, and the job waits for its slowest shard, not their sum.
    return [
        ShardProcess.spawn(
            job_file,
            job.run_dir / "store" / f"shard-{i:03d}",
            token_file=token_file,
            die_with_parent=True,
            metrics_port=0 if job.cluster.store_metrics else None,
        )
        for i in range(job.cluster.store_shards)
    ]


def _kill_all(starting: list[StartingShard]) -> None:
    for one in starting:
        one.proc.kill()
        one.proc.wait()


def _wait_for_shards(
    starting: list[StartingShard], stack: ExitStack
) -> tuple[str, tuple[str, ...], ShardSupervisor]:
    """Until every started shard serves: the store's address, metrics URLs and supervisor."""
    from deploy.local.shards import ShardSupervisor

    shards = []
    for i, one in enumerate(starting):
        try:
            shard = one.wait()
        except BaseException:
            _kill_all(starting[i + 1 :])
            raise
        stack.callback(shard.stop)
        shards.append(shard)
    store = "grpc://" + ",".join(s.address for s in shards)
    store_metrics = tuple(s.metrics_url for s in shards if s.metrics_url)
    supervisor = ShardSupervisor(shards)
    # Stops the shards as they are then (restarted ones included), before the
    # callbacks above reach the original processes.
    stack.callback(supervisor.stop)
    return store, store_metrics, supervisor


def _start_dask(job: JobConfig, stack: ExitStack) -> tuple[str, str | None]:
    """Start a local Dask cluster with the streamrec page: its scheduler and dashboard."""
    from distributed import Client

    from deploy.local.dask_cluster import local_dask_cluster

    cluster = stack.enter_context(
        local_dask_cluster(
            workers=job.cluster.workers,
            threads_per_worker=job.cluster.threads_per_worker,
            dashboard_address=job.cluster.dashboard_address,
            log_path=job.run_dir / "dask-scheduler.log",
            scheduler_process=job.cluster.scheduler_process,
        )
    )
    # Before the page's address is printed, so that the page answers from the start
    # rather than 404 until the first rank registers the plugin.
    with Client(cluster, timeout=30) as client:
        install_dask_plugins(client)
    return cluster.scheduler_address, cluster.dashboard_link


def batch_client(cluster: ClusterConfig, scheduler: str) -> Client:
    """The trainer's Dask client: it fetches each prepared batch from the worker that made it.

    Through the scheduler (``cluster.direct_to_workers: false``) every batch is
    pickled in-band (the scheduler's comms speak pickle protocol 4) and relayed
    once more, which a small model's rate pays for. A worker the
    trainer cannot reach still answers through the scheduler (Dask falls back).
    """
    from distributed import Client

    return Client(scheduler, direct_to_workers=cluster.direct_to_workers)


def install_dask_plugins(client: Any) -> None:
    """Register the job's plugins on the client's scheduler and workers: the "streamrec"
    dashboard page and metrics, the pruner that keeps the scheduler's finished spans
    from piling up (see :mod:`pipeline.scheduler_spans`), the trim of the scheduler's
    key cache and heap (see :mod:`pipeline.scheduler_memory`), that of every
    worker's metrics by span, key cache and heap (see :mod:`pipeline.worker_memory`),
    and the filter that keeps a killed rank's hang-up out of the workers' logs (see
    :mod:`pipeline.worker_logs`).

    Idempotent (the first registration of each stays). A scheduler that cannot load
    one (an external one without streamrec installed) costs a warning, not the job.
    """
    from pipeline.scheduler_memory import SchedulerTrim
    from pipeline.scheduler_spans import SpanPruner
    from pipeline.worker_logs import QuietLostPeers
    from pipeline.worker_memory import WorkerTrim

    plugins: list[tuple[Any, str]] = [
        (StreamrecPlugin(), "no /streamrec page and no streamrec_ metrics"),
        (SpanPruner(), "its memory grows with every finished span"),
        (SchedulerTrim(), "its memory grows with every task name and freed block"),
        (WorkerTrim(), "the workers' memory grows with every span and task name"),
        (QuietLostPeers(), "a killed rank's hang-up shows as a worker's traceback"),
    ]
    for plugin, without in plugins:
        try:
            client.register_plugin(plugin)
        except Exception as exc:
            log.warning(
                "Dask could not load streamrec's %s plugin (%s): %s; "
                "install streamrec where it runs",
                plugin.name,
                exc,
                without,
            )
