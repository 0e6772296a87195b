"""Runs a training job: store shards, a Dask cluster, trainer ranks, on loopback by default.

``run_job`` is what ``streamrec demo``, ``run`` and ``backfill`` call. It starts
what the job's ``cluster`` section does not name (local store shard processes,
a Dask ``LocalCluster``), restores the newest job checkpoint if there is one,
and runs the trainer ranks: rank 0 in this process, the others (``ranks > 1``)
in spawned processes joined by ``torch.distributed`` (gloo on CPU, nccl on
GPU). On the way out (end of stream, ``--max-events``, ``--max-time``,
SIGTERM or Ctrl-C) the ranks take a last checkpoint, then everything stops.

The modules, by concern:

- :mod:`deploy.job.run`: the job (``run_job``): services, then the ranks.
- :mod:`deploy.job.services`: the store shards and the Dask cluster, started or checked.
- :mod:`deploy.job.world`: the ranks' torch world (spawned ranks or torchrun's).
- :mod:`deploy.job.rank`: one rank (``run_rank``): restore, stream, learn, checkpoint.
- :mod:`deploy.job.parts`: a rank's parts, assembled once (:class:`RankParts`).
- :mod:`deploy.job.recovery`: restoring checkpoints and rolling back a lost store.
- :mod:`deploy.job.sources`: the job's source, codec, dead letters; a rank's partitions.
- :mod:`deploy.job.threads`: torch's threads per rank on a shared host.
"""

from deploy.job.errors import JobError
from deploy.job.parts import checkpoint_location, serving_location
from deploy.job.rank import run_rank
from deploy.job.run import run_job
from deploy.job.services import (
    Services,
    batch_client,
    check_named_services,
    install_dask_plugins,
    start_services,
)
from deploy.job.sources import RankSource, build_codec, build_deadletter, build_source
from deploy.job.threads import (
    SPLIT_MIN_WORK,
    auto_torch_threads,
    step_threads_for,
    torch_threads_for,
)
from deploy.job.world import run_ranks, run_torchrun_rank

__all__ = [
    "SPLIT_MIN_WORK",
    "JobError",
    "RankSource",
    "Services",
    "auto_torch_threads",
    "batch_client",
    "build_codec",
    "build_deadletter",
    "build_source",
    "check_named_services",
    "checkpoint_location",
    "install_dask_plugins",
    "run_job",
    "run_rank",
    "run_ranks",
    "run_torchrun_rank",
    "serving_location",
    "start_services",
    "step_threads_for",
    "torch_threads_for",
]
