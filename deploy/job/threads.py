"""How many threads each trainer rank runs torch on: the cores its host's other parts leave;
and how often its Python threads take turns.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

from deploy.config import JobConfig

# A rank's trainer thread makes many short numpy, numba and torch calls, each letting go
# of the GIL, while its Dask client's event loop (receiving batches) and its push thread
# run Python too. Each time the trainer thread wants the GIL back it may wait out a
# whole switch interval (5 ms by default) of another thread's: a shorter turn gives the
# trainer its GIL back sooner, so a hybrid run trains faster. The Dask workers gain
# nothing from it and keep the default.
RANK_SWITCH_INTERVAL_S = 0.0005


def take_short_gil_turns() -> None:
    """Set this process's thread switch interval to :data:`RANK_SWITCH_INTERVAL_S`
    (a trainer rank's, and ``streamrec serve``'s; see its comment).

    >>> take_short_gil_turns()
    >>> sys.getswitchinterval() == RANK_SWITCH_INTERVAL_S
    True
    """
    sys.setswitchinterval(RANK_SWITCH_INTERVAL_S)


def auto_torch_threads(
    cpus: int, *, local_ranks: int = 1, local_worker_threads: int = 0, local_shards: int = 0
) -> int:
    """Intra-op threads for each trainer rank: the cores its host's other parts leave.

    Each local Dask worker thread keeps a core busy reading, decoding, hashing
    and looking up; two local store shards take about one. What is left is
    shared between the host's ranks, at least one thread each. Giving a rank
    every core instead makes each parallel matmul wait for whichever of its
    threads was pre-empted, which on a host with other work running costs far
    more than the extra threads gain (``benchmarks/e2e.py --torch-threads``
    compares).

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
    """The cores this process may use: its affinity, capped by its cgroup's CPU quota.

    In a container the affinity is every core of the node, while the quota
    (``resources.limits.cpu``) is what the process gets: sizing threads by the
    affinity would run many times more threads than the quota lets run at once.
    """
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    quota = cgroup_cpu_quota()
    if quota is not None:
        cpus = min(cpus or 1, max(1, math.ceil(quota)))
    return cpus or 1


def cgroup_cpu_quota(
    root: Path = Path("/sys/fs/cgroup"), self_cgroup: str | None = None
) -> float | None:
    """The CPU quota of this process's cgroup in cores (``cpu.max`` of cgroup v2, else
    ``cpu.cfs_quota_us / cpu.cfs_period_us`` of v1), or None when there is none.

    ``self_cgroup``: the text of ``/proc/self/cgroup`` (read when None).

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as d:
    ...     _ = (Path(d) / "pod" / "cpu.max").parent.mkdir()
    ...     _ = (Path(d) / "pod" / "cpu.max").write_text("150000 100000")
    ...     quota = cgroup_cpu_quota(Path(d), "0::/pod")
    >>> quota
    1.5
    >>> parse_cpu_max("max 100000"), parse_cpu_max("200000 100000")
    (None, 2.0)
    """
    if self_cgroup is None:
        try:
            self_cgroup = Path("/proc/self/cgroup").read_text()
        except OSError:
            self_cgroup = ""
    v2, v1 = "", ""
    for line in self_cgroup.splitlines():
        controllers, _, path = line.partition(":")[2].partition(":")
        if not controllers:
            v2 = path
        elif "cpu" in controllers.split(","):
            v1 = path
    # The process's own cgroup first; inside a container it is often mounted at the root.
    for directory in (root / v2.lstrip("/"), root):
        try:
            return parse_cpu_max((directory / "cpu.max").read_text())
        except OSError:
            continue
    for directory in (root / "cpu" / v1.lstrip("/"), root / "cpu", root / "cpu,cpuacct"):
        try:
            quota = int((directory / "cpu.cfs_quota_us").read_text())
            period = int((directory / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
        return quota / period if quota > 0 and period > 0 else None
    return None


def parse_cpu_max(text: str) -> float | None:
    """Cores from cgroup v2's ``cpu.max`` (``"quota period"``, ``max``: no quota)."""
    quota, _, period = text.strip().partition(" ")
    if quota == "max" or not period:
        return None
    try:
        cores = int(quota) / int(period)
    except (ValueError, ZeroDivisionError):
        return None
    return cores if cores > 0 else None


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
# it only when a step's work (dense weights x batch size, each weight one multiply-add
# per sample) is at least this much, not for a small network.
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
