"""The job, as the architecture draws it: services first, then the trainer ranks.

::

    job config ─► start_services (store shards, Dask cluster; or check the named ones)
               ─► run_ranks (rank 0 here, 1.. spawned) or run_torchrun_rank
                  └─► run_rank per rank (restore, stream, learn, checkpoint)
               ─► everything stopped, in reverse
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from contextlib import ExitStack

from deploy.cluster import ClusterError, TorchrunRank, check_torchrun_job, environment
from deploy.config import JobConfig
from deploy.job.errors import JobError
from deploy.job.services import Services, start_services
from deploy.job.world import run_ranks, run_torchrun_rank
from trainer.checkpoint import JobManifest
from trainer.progress import LoopStats, Progress


def run_job(
    job: JobConfig,
    *,
    max_events: int | None = None,
    max_time_s: float | None = None,
    stop: threading.Event | None = None,
    on_progress: Callable[[Progress], None] | None = None,
    on_services: Callable[[Services], Callable[[], None] | None] | None = None,
    env: Mapping[str, str] | None = None,
) -> tuple[LoopStats, JobManifest | None]:
    """Start what the job needs, train, checkpoint, stop everything (see the module doc).

    ``max_time_s`` counts from this call: starting the services is part of it.
    Started by ``torchrun`` (``RANK`` in ``env``, default the process's), this
    process is one rank of torchrun's world and starts no services: the job must
    name them (:func:`deploy.cluster.check_torchrun_job`). ``on_services`` is told
    the services once they run, and may return what to do before they stop.
    """
    deadline = None if max_time_s is None else time.monotonic() + max_time_s
    env = env if env is not None else environment()
    try:
        launch = TorchrunRank.from_env(env)
        if launch is not None:
            check_torchrun_job(job, launch)
    except ClusterError as exc:
        raise JobError(str(exc)) from None
    with ExitStack() as stack:
        services = start_services(job, stack, env=env, deadline=deadline)
        if on_services is not None:
            before_stop = on_services(services)
            if before_stop is not None:
                stack.callback(before_stop)  # runs before the services' own teardown
        if launch is not None:
            return run_torchrun_rank(
                job,
                launch,
                services,
                max_events=max_events,
                deadline=deadline,
                stop=stop,
                on_progress=on_progress,
            )
        return run_ranks(
            job,
            services,
            max_events=max_events,
            deadline=deadline,
            stop=stop,
            on_progress=on_progress,
        )
