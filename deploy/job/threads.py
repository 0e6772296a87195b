"""How many threads each trainer rank runs torch on: the cores its host's other parts leave."""

from __future__ import annotations

import os

from deploy.config import JobConfig


def auto_torch_threads(
    cpus: int, *, local_ranks: int = 1, local_worker_threads: int = 0, local_shards: int = 0
) -> int:
    """Intra-op threads for each trainer rank: the cores its host's other parts leave.

    Each local Dask worker thread keeps a core busy reading, decoding, hashing
    and looking up; two local store shards take about one. What is left is
    shared between the host's ranks, at least one thread each. Giving a rank
    every core instead makes each parallel matmul wait for whichever of its
    threads was pre-empted: on 2 cores with other work running, that ran the
    hybrid trainer about 3x slower than one thread did (on a quiet machine the
    two tie).

    >>> auto_torch_threads(2, local_worker_threads=2, local_shards=2)  # the demo on 2 cores
    1
    >>> auto_torch_threads(16, local_worker_threads=2, local_shards=2)
    13
    >>> auto_torch_threads(16, local_ranks=2)  # torchrun ranks, services elsewhere
    8
    """
    left = cpus - local_worker_threads - (local_shards + 1) // 2
    return max(1, left // max(1, local_ranks))


def _host_cpus() -> int:
    """The cores this process may run on (its affinity, where the OS tells it)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return cpus or 1


def torch_threads_for(job: JobConfig, local_ranks: int) -> int:
    """``trainer.torch_threads``, or the :func:`auto_torch_threads` of this host's parts."""
    if job.trainer.torch_threads is not None:
        return job.trainer.torch_threads
    cluster = job.cluster
    return auto_torch_threads(
        _host_cpus(),
        local_ranks=local_ranks,
        local_worker_threads=(
            cluster.workers * cluster.threads_per_worker if cluster.scheduler is None else 0
        ),
        local_shards=cluster.store_shards if cluster.store is None else 0,
    )


# A split step pays a thread hand-off and a forward and backward call per chunk: worth
# it for a step of about 20 ms or more on one core (dense weights x batch size, each
# weight one multiply-add per sample), not for a small network's few ms.
SPLIT_MIN_WORK = 1 << 29


def step_threads_for(
    job: JobConfig, local_ranks: int, device_type: str, dense_params: int | None = None
) -> int:
    """``trainer.step_threads``, or 2 where a CPU trainer shares its host's cores with
    the job's local workers and shards, gets one intra-op thread from them, and
    has a step long enough to split (``dense_params`` x batch size >=
    ``SPLIT_MIN_WORK``; None: not known, count it long enough).

    Split over 2 threads (:class:`trainer.split_step.SplitStep`), a step uses the
    second core whenever the workers and shards leave it idle, and none of it
    spinning when they do not.
    """
    cfg = job.trainer
    if cfg.step_threads is not None:
        return cfg.step_threads
    if device_type != "cpu" or cfg.torch_threads is not None:
        return 1
    if dense_params is not None and dense_params * cfg.batch_size < SPLIT_MIN_WORK:
        return 1
    per_rank = _host_cpus() // max(1, local_ranks)
    return 2 if per_rank >= 2 and torch_threads_for(job, local_ranks) == 1 else 1
