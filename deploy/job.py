"""Runs a training job: store shards, a Dask cluster, trainer ranks, on loopback by default.

``run_job`` is what ``streamrec demo``, ``run`` and ``backfill`` call. It starts
what the job's ``cluster`` section does not name (local store shard processes,
a Dask ``LocalCluster``), restores the newest job checkpoint if there is one,
and runs the trainer ranks: rank 0 in this process, the others (``ranks > 1``)
in spawned processes joined by ``torch.distributed`` (gloo on CPU, nccl on
GPU). On the way out (end of stream, ``--max-events``, ``--max-time``,
SIGTERM or Ctrl-C) the ranks take a last checkpoint, then everything stops.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import multiprocessing as mp
import os
import secrets
import signal
import threading
import time
import zlib
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from dataclasses import field as dc_field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import yaml

from connectors.codecs import Codec, make_codec
from connectors.deadletter import JsonlDeadLetterSink
from connectors.kafka import (
    KafkaDeadLetterSink,
    KafkaSource,
    KafkaSourceConfig,
    KafkaUnavailable,
)
from connectors.parquet import ParquetSource
from connectors.synthetic import SyntheticConfig, SyntheticSource
from connectors.types import Chunk, DeadLetterSink, RawChunk, Source
from deploy.cluster import (
    ClusterError,
    TorchrunRank,
    check_scheduler,
    check_store,
    check_torchrun_job,
    environment,
    store_token,
)
from deploy.config import ClusterConfig, JobConfig, KafkaJobSource, ParquetJobSource
from deploy.local.kafka import free_port
from embedding_store.client import StoreClient
from embedding_store.errors import StoreUnavailable
from embedding_store.location import Location
from monitoring.plugin import StreamrecPlugin
from monitoring.reporter import Reporter
from monitoring.types import TOPIC
from pipeline.prepare import StoreAddress
from trainer.checkpoint import CheckpointBook, JobManifest
from trainer.loop import (
    DenseModel,
    JobCheckpointer,
    LoopStats,
    Progress,
    Rollback,
    TrainLoop,
    pick_device,
    restore_job,
)
from trainer.publish import DensePublisher

if TYPE_CHECKING:
    from distributed import Client

    from deploy.local.shards import ShardSupervisor

log = logging.getLogger(__name__)


class JobError(RuntimeError):
    """A job that cannot start as configured (the message says what to change)."""


# --- sources ------------------------------------------------------------------------


def build_source(job: JobConfig) -> Source:
    """The source of the job's ``source`` section."""
    cfg = job.source
    if cfg is None:
        msg = "the job has no `source:` section (kafka, parquet or synthetic)"
        raise JobError(msg)
    if isinstance(cfg, KafkaJobSource):
        fields = set(KafkaSourceConfig.model_fields)
        return KafkaSource(KafkaSourceConfig(**cfg.model_dump(include=fields)))
    if isinstance(cfg, ParquetJobSource):
        return ParquetSource(cfg.paths, columns=cfg.columns, name=cfg.name)
    fields = set(SyntheticConfig.model_fields)
    return SyntheticSource(SyntheticConfig(**cfg.model_dump(include=fields)))


def build_codec(job: JobConfig) -> Codec | None:
    """Kafka payloads need a codec; Parquet and synthetic chunks arrive as Arrow tables."""
    if isinstance(job.source, KafkaJobSource):
        return make_codec(job.source.codec)
    return None


def build_deadletter(job: JobConfig, rank: int) -> DeadLetterSink | None:
    cfg = job.source
    if cfg is None or cfg.deadletter == "none":
        return None
    if cfg.deadletter == "kafka" and isinstance(cfg, KafkaJobSource):
        return KafkaDeadLetterSink(
            cfg.bootstrap_servers,
            f"{cfg.topics[0]}.deadletter",
            api_version=cfg.api_version,
            client_options=cfg.client_options,
            # Oversize or refused records are kept whole here: nothing is lost.
            spill_path=job.run_dir / f"deadletter-rank{rank}.jsonl",
        )
    return JsonlDeadLetterSink(job.run_dir / f"deadletter-rank{rank}.jsonl")


class RankSource:
    """The partitions of ``source`` that trainer rank ``rank`` of ``world`` owns.

    Partitions known at start are dealt out in order; ones that appear later
    (new Kafka partitions) go by a hash of their name, so every rank agrees.

    >>> src = SyntheticSource(SyntheticConfig(partitions=3, events=10))
    >>> RankSource(src, 0, 2).partitions(), RankSource(src, 1, 2).partitions()
    (['synthetic/0', 'synthetic/2'], ['synthetic/1'])
    """

    def __init__(self, source: Source, rank: int, world: int) -> None:
        self.source = source
        self.rank = rank
        self.world = world
        self.name = source.name
        self._initial = {p: i % world for i, p in enumerate(sorted(source.partitions()))}

    def owns(self, partition: str) -> bool:
        """Whether this rank trains ``partition``."""
        owner = self._initial.get(partition)
        if owner is None:
            owner = zlib.crc32(partition.encode()) % self.world
        return owner == self.rank

    def partitions(self) -> list[str]:
        return [p for p in self.source.partitions() if self.owns(p)]

    def start_position(self, partition: str) -> int:
        return self.source.start_position(partition)

    def end_position(self, partition: str) -> int | None:
        return self.source.end_position(partition)

    def plan(self, partition: str, start: int, max_records: int) -> Chunk | None:
        return self.source.plan(partition, start, max_records)

    def is_finished(self, partition: str, position: int) -> bool:
        return self.source.is_finished(partition, position)

    def read(self, chunk: Chunk) -> RawChunk:
        return self.source.read(chunk)

    def close(self) -> None:
        self.source.close()


def checkpoint_location(job: JobConfig) -> Location:
    """Where the job's manifests and dense states go: ``trainer.checkpoint.dir`` or the run's."""
    where = job.trainer.checkpoint.dir
    return Location.parse(where if where is not None else job.run_dir / "checkpoints")


def serving_location(job: JobConfig) -> Location:
    """Where rank 0 publishes the dense weights: ``serving.dir`` or the checkpoints' serving/."""
    if job.serving.dir is not None:
        return Location.parse(job.serving.dir)
    return checkpoint_location(job).child("serving")


# --- local services -----------------------------------------------------------------


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

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "supervisor": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


def check_named_services(job: JobConfig, store: str, token: str | None) -> None:
    """Refuse to start when a service the job names does not answer or does not fit it."""
    try:
        if job.cluster.scheduler is not None:
            check_scheduler(job.cluster.scheduler)
        if job.cluster.store is not None:
            check_store(job, store, token)
    except ClusterError as exc:
        raise JobError(str(exc)) from None


def start_services(
    job: JobConfig, stack: ExitStack, *, env: Mapping[str, str] | None = None
) -> Services:
    """Start the shards and the Dask cluster the job does not name; ``stack`` stops them.

    Services the job names (``cluster.scheduler``, ``cluster.store``) are checked
    first: a wrong address, token or table schema is a :class:`JobError`.
    """
    from distributed import Client

    from deploy.local.dask_cluster import local_dask_cluster
    from deploy.local.shards import ShardProcess, ShardSupervisor

    run_dir = job.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    job_file = run_dir / "job.yaml"
    job_file.write_text(yaml.safe_dump(job.model_dump(mode="json"), sort_keys=False))
    token_file = job.cluster.token_file
    if job.cluster.store is None:
        if token_file is None:
            token_file = run_dir / "store.token"
            if not token_file.exists():
                token_file.write_text(secrets.token_hex(16))
                token_file.chmod(0o600)
        shards = []
        for i in range(job.cluster.store_shards):
            shard = ShardProcess.start(
                job_file,
                run_dir / "store" / f"shard-{i:03d}",
                token_file=token_file,
                die_with_parent=True,
                metrics_port=0 if job.cluster.store_metrics else None,
            )
            stack.callback(shard.stop)
            shards.append(shard)
        store = "grpc://" + ",".join(s.address for s in shards)
        store_metrics = tuple(s.metrics_url for s in shards if s.metrics_url)
        supervisor = ShardSupervisor(shards)
        # Stops the shards as they are then (restarted ones included), before the
        # callbacks above reach the original processes.
        stack.callback(supervisor.stop)
    else:
        store = job.cluster.store
        store_metrics = ()
        supervisor = None
    if job.cluster.store is None:
        token = token_file.read_text().strip() if token_file is not None else None
    else:
        token = store_token(job, env if env is not None else environment())
    check_named_services(job, store, token)
    if job.cluster.scheduler is not None:
        return Services(job.cluster.scheduler, None, store, token, store_metrics, supervisor)
    cluster = stack.enter_context(
        local_dask_cluster(
            workers=job.cluster.workers,
            threads_per_worker=job.cluster.threads_per_worker,
            dashboard_address=job.cluster.dashboard_address,
            log_path=run_dir / "dask-scheduler.log",
            scheduler_process=job.cluster.scheduler_process,
        )
    )
    # Before the page's address is printed: it used to answer 404 for seconds, until
    # the first rank registered the plugin.
    with Client(cluster, timeout=30) as client:
        install_page(client)
    return Services(
        cluster.scheduler_address, cluster.dashboard_link, store, token, store_metrics, supervisor
    )


def batch_client(cluster: ClusterConfig, scheduler: str) -> Client:
    """The trainer's Dask client: it fetches each prepared batch from the worker that made it.

    Through the scheduler (``cluster.direct_to_workers: false``) every batch, about
    2 MB, is pickled in-band (the scheduler's comms speak pickle protocol 4) and
    relayed once more: about 5% of a small model's rate on 2 cores. A worker the
    trainer cannot reach still answers through the scheduler (Dask falls back).
    """
    from distributed import Client

    return Client(scheduler, direct_to_workers=cluster.direct_to_workers)


def install_page(client: Any) -> None:
    """Serve the "streamrec" dashboard page and metrics from the client's scheduler.

    Idempotent (the first registration stays). A scheduler that cannot load the
    plugin (an external one without streamrec installed) costs a warning, not the job.
    """
    try:
        client.register_plugin(StreamrecPlugin())
    except Exception as exc:
        log.warning(
            "the Dask scheduler could not load the streamrec plugin (%s): no /streamrec "
            "page and no streamrec_ metrics; install streamrec where it runs",
            exc,
        )


# --- one rank -----------------------------------------------------------------------


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


def run_rank(
    job: JobConfig,
    services: Services,
    *,
    rank: int = 0,
    world: int = 1,
    max_events: int | None = None,
    deadline: float | None = None,
    stop: threading.Event | None = None,
    on_progress: Callable[[Progress], None] | None = None,
    device_index: int = 0,
    local_ranks: int = 1,
) -> tuple[LoopStats, JobManifest | None]:
    """Train as rank ``rank``: restore, stream, learn, checkpoint. Returns the stats.

    When the store loses state (a shard died and was restarted), every rank
    rolls back to the newest job checkpoint and goes on (``trainer.recovery``).
    ``deadline`` is a ``time.monotonic()`` value (``--max-time``).
    """
    from pipeline.runner import StreamRunner

    if job.features is None:
        msg = "the job has no `features:` section (labels, dense and sparse fields)"
        raise JobError(msg)
    spec = job.features
    for f in spec.sparse:
        if f.table not in job.store.tables:
            msg = (
                f"features.sparse[{f.name}].table: {f.table!r} is not a store table "
                f"(store.tables: {sorted(job.store.tables)})"
            )
            raise JobError(msg)
    cfg = job.trainer
    import torch

    device = pick_device(cfg.device, device_index, local_ranks)
    if device.type == "cuda":
        import torch

        # Collectives (NCCL barrier, all_gather_object) use the current device.
        torch.cuda.set_device(device)
    stop = stop or threading.Event()

    def stopping() -> bool:
        return stop.is_set() or (deadline is not None and time.monotonic() >= deadline)

    source = build_source(job)
    _stop_waiting_when(source, stopping)
    with ExitStack() as stack:
        stack.callback(source.close)
        mine = RankSource(source, rank, world) if world > 1 else source
        latency_s = job.cluster.store_latency_ms / 1000.0
        store = stack.enter_context(
            StoreClient.connect(services.store, token=services.token, latency_s=latency_s)
        )
        dask = stack.enter_context(batch_client(job.cluster, services.scheduler))
        dense = DenseModel(cfg, spec, store.dims, device)
        step_threads = step_threads_for(
            job, local_ranks, device.type, sum(p.numel() for p in dense.module.parameters())
        )
        # A split step's threads each run torch's ops on one intra-op thread.
        torch.set_num_threads(1 if step_threads > 1 else torch_threads_for(job, local_ranks))
        book = None
        if cfg.checkpoint.enabled:
            book = CheckpointBook(checkpoint_location(job), keep=cfg.checkpoint.keep)
        deadletter = build_deadletter(job, rank)
        if deadletter is not None:
            stack.callback(deadletter.close)
        publisher = None
        if rank == 0 and job.serving.publish_every_s is not None:
            publisher = DensePublisher(
                serving_location(job), every_s=job.serving.publish_every_s, keep=job.serving.keep
            )
            stack.callback(publisher.close)

        def commit(m: JobManifest) -> None:
            if isinstance(source, KafkaSource):
                try:
                    source.commit(m.positions)
                except KafkaUnavailable as exc:
                    # The manifest is the commit point and a restart reads it first;
                    # the group's offsets only serve a job started without it.
                    log.warning("offsets of checkpoint step %d not committed: %s", m.step, exc)

        best_auc = None
        if rank == 0 and isinstance(source, SyntheticSource):
            best_auc = source.best_auc(n_samples=100_000)
        install_page(dask)
        # Its own source object: Kafka clients are not thread-safe, and the reporter
        # asks for the partitions' ends from its own thread.
        ends_source = build_source(job)
        _stop_waiting_when(ends_source, stopping)
        stack.callback(ends_source.close)
        reporter = Reporter(
            lambda report: dask.log_event(TOPIC, report),
            rank=rank,
            every_s=cfg.log_every_s,
            ends=lambda parts: {p: ends_source.end_position(p) for p in parts},
            store_stats=store.stats if rank == 0 else None,
            store_addresses=store.addresses,
            background=True,
        )
        stack.callback(reporter.close)

        def progress(p: Progress) -> None:
            reporter(p)
            if on_progress is not None:
                on_progress(p)

        checkpointer = (
            JobCheckpointer(book, store, on_saved=commit, extra={"mode": cfg.mode, "world": world})
            if book is not None
            else None
        )
        supervisor = services.supervisor
        stats = LoopStats()
        # Net of what rollbacks took back: learned by this rank up to its newest checkpoint.
        kept_samples = kept_events = 0
        in_a_row, rolled_back_to = 0, -1
        while True:
            # Rank 0 rolls the store back; the others load their dense state after it.
            if rank != 0:
                _barrier(world)
            restarts = supervisor.restarts if supervisor is not None else 0
            manifest = None
            restore_started = time.monotonic()
            while book is not None:
                try:
                    manifest = restore_job(book, store, dense, rank=rank)
                    break
                except StoreUnavailable as exc:
                    # A shard that died while the store was being rolled back (rank 0
                    # alone restores the store): wait for it again, then roll back again.
                    waited = time.monotonic() - restore_started
                    if not cfg.recovery.enabled or waited > cfg.recovery.timeout_s:
                        raise
                    log.warning("rank %d: restoring the store failed (%s); retrying", rank, exc)
                    _await_store(
                        store,
                        dask,
                        supervisor,
                        timeout_s=max(1.0, cfg.recovery.timeout_s - waited),
                        stopping=stopping,
                    )
                    restarts = supervisor.restarts if supervisor is not None else 0
            if rank == 0:
                _barrier(world)
            else:
                # Rank 0 restored the store: the shards' processes now are the ones to
                # train against (a push that meets another one is a lost shard).
                store.accept_restarts()
            stats.samples, stats.events = kept_samples, kept_events
            positions = dict(manifest.positions) if manifest is not None else {}
            if isinstance(mine, RankSource):
                # The manifest holds every rank's partitions; a rank carrying another's
                # (stale) position into its checkpoints would move that one back.
                positions = {p: n for p, n in positions.items() if mine.owns(p)}

            def store_changed(seen: int = restarts) -> str | None:
                if supervisor is None or supervisor.restarts == seen:
                    return None
                return supervisor.events[-1]

            share = None
            if max_events is not None:
                share = max_events // world + (1 if rank < max_events % world else 0)
                share = max(0, share - kept_events)
            loop = TrainLoop(
                cfg,
                spec,
                store,
                dense,
                rank=rank,
                device=device,
                run_dir=job.run_dir,
                checkpointer=checkpointer,
                positions=positions,
                start_step=manifest.step if manifest is not None else 0,
                start_samples=manifest.samples if manifest is not None else 0,
                max_events=share,
                deadline=deadline,
                stop=stop,
                on_progress=progress,
                best_auc=best_auc,
                store_changed=store_changed,
                before_checkpoint=deadletter.flush if deadletter is not None else None,
                # A job always has a checkpoint to roll back to.
                initial_checkpoint=book is not None and manifest is None,
                stats=stats,
                step_threads=step_threads,
                store_tables=job.store.tables,
                publisher=publisher,
            )
            runner = StreamRunner(
                dask,
                mine,
                spec,
                StoreAddress(services.store, token=services.token, latency_s=latency_s),
                staleness=cfg.prefetch,
                codec=build_codec(job),
                max_records=cfg.batch_size,
                positions=positions,
                deadletter=deadletter,
                # A quiet stream still ends on the loop's stop (signal, --max-time).
                stop_when=functools.partial(_stop_requested, loop),
                # The loop reports and checks for stops while the stream is quiet, and
                # a quiet rank must not hold the others' steps up.
                idle_ticks=True,
                max_events=share,
            )
            try:
                stats = loop.run(iter(runner))
                break
            except Rollback as exc:
                t0 = time.monotonic()
                runner.close()
                if not cfg.recovery.enabled or book is None:
                    why = "checkpoints are off" if book is None else "trainer.recovery is off"
                    msg = (
                        f"the embedding store lost state ({exc}) and {why}; start the job "
                        "again to resume from its newest checkpoint"
                    )
                    raise JobError(msg) from exc
                kept_samples += loop.checkpointed[0]
                kept_events += loop.checkpointed[1]
                newest = book.latest()
                newest_step = newest.step if newest is not None else -1
                in_a_row = in_a_row + 1 if newest_step == rolled_back_to else 1
                rolled_back_to = newest_step
                if in_a_row > cfg.recovery.max_in_a_row:
                    msg = (
                        f"the embedding store lost state {in_a_row} times without a checkpoint "
                        f"in between (last: {exc}); giving up (trainer.recovery.max_in_a_row)"
                    )
                    raise JobError(msg) from exc
                log.warning("rank %d: %s; rolling back to the newest checkpoint", rank, exc)
                if rank == 0:
                    _await_store(
                        store, dask, supervisor, timeout_s=cfg.recovery.timeout_s, stopping=stopping
                    )
                stats.recoveries += 1
                stats.recovery_s.append(time.monotonic() - t0)
                log.warning(
                    "rank %d: store ready again after %.1fs; restoring checkpoint step %d",
                    rank,
                    stats.recovery_s[-1],
                    newest_step,
                )
            finally:
                runner.close()
        latest = book.latest() if book is not None else None
        if latest is not None and stats.recoveries:
            log.warning(
                "rank %d recovered %d time(s) from a lost store shard (%s)",
                rank,
                stats.recoveries,
                ", ".join(f"{s:.1f}s" for s in stats.recovery_s),
            )
        return stats, latest


def _stop_requested(loop: TrainLoop) -> bool:
    return bool(loop.stop_reason())


def _stop_waiting_when(source: Source, stopping: Callable[[], bool]) -> None:
    if isinstance(source, KafkaSource):
        source.stop_waiting_when(stopping)


def _executing(dask_worker: Any) -> int:
    return int(dask_worker.state.executing_count)


def _await_store(
    store: StoreClient,
    dask: Any,
    supervisor: ShardSupervisor | None,
    *,
    timeout_s: float,
    stopping: Callable[[], bool],
) -> None:
    """Until no prepare task of the failed attempt runs and every shard answers.

    A cancelled task still running on a worker would look rows up in (and so
    create rows in) the store after it was rolled back.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        if stopping():
            msg = "the job was stopped while it waited for the embedding store to recover"
            raise JobError(msg)
        if supervisor is not None and supervisor.failed:
            raise JobError(supervisor.failed)
        try:
            busy = sum(dask.run(_executing).values())
            if not busy:
                store.stats()
                return
            problem = f"{busy} cancelled prepare task(s) still running"
        except StoreUnavailable as exc:
            problem = str(exc)
        if time.monotonic() > deadline:
            msg = (
                f"the embedding store did not recover within {timeout_s:g}s ({problem}); "
                "check the shards and start the job again (trainer.recovery.timeout_s)"
            )
            raise JobError(msg)
        time.sleep(0.2)


def _barrier(world: int) -> None:
    if world > 1:
        import torch.distributed as dist

        dist.barrier()


def _join_world(
    job: JobConfig, init_method: str, rank: int, world: int, local_rank: int, local_world: int
) -> None:
    """Join the ranks' process group: NCCL, on this rank's own GPU, when ranks train on GPUs.

    Every rank of a host picks its device the same way (``pick_device``), so they
    agree on the backend; each is pinned to its GPU before NCCL starts.
    """
    import torch
    import torch.distributed as dist

    device = pick_device(job.trainer.device, local_rank, local_world)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=init_method,
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=job.trainer.collective_timeout_s),
        device_id=device if device.type == "cuda" else None,
    )


def _rank_main(
    job_json: str,
    services: Services,
    rank: int,
    world: int,
    master: str,
    max_events: int | None,
    deadline: float | None,
) -> None:
    import torch.distributed as dist

    job = JobConfig.model_validate_json(job_json)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    _join_world(job, master, rank, world, rank, world)
    try:
        run_rank(
            job,
            services,
            rank=rank,
            world=world,
            max_events=max_events,
            deadline=deadline,
            stop=stop,
            device_index=rank,
            local_ranks=world,
        )
    finally:
        dist.destroy_process_group()


def _exit_text(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def run_ranks(
    job: JobConfig,
    services: Services,
    *,
    max_events: int | None = None,
    deadline: float | None = None,
    stop: threading.Event | None = None,
    on_progress: Callable[[Progress], None] | None = None,
) -> tuple[LoopStats, JobManifest | None]:
    """Rank 0 here, ranks 1.. in spawned processes; a rank that fails stops the job.

    A rank process that dies (``kill -9``, out of memory) breaks the others'
    collectives; the job then stops with a :class:`JobError` that names the rank
    and says how to resume: the newest checkpoint holds everything learned.
    """
    import torch.distributed as dist

    world = job.trainer.ranks
    stop = stop or threading.Event()
    train = functools.partial(
        run_rank,
        job,
        services,
        world=world,
        local_ranks=world,
        max_events=max_events,
        deadline=deadline,
        stop=stop,
        on_progress=on_progress,
    )
    if world == 1:
        return train()
    master = f"tcp://127.0.0.1:{free_port()}"
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(job.model_dump_json(), services, r, world, master, max_events, deadline),
            name=f"streamrec-rank-{r}",
            daemon=True,
        )
        for r in range(1, world)
    ]
    for p in procs:
        p.start()

    def forward_stop() -> None:
        stop.wait()
        for p in procs:
            if p.pid is not None and p.is_alive():
                os.kill(p.pid, signal.SIGTERM)

    threading.Thread(target=forward_stop, daemon=True).start()
    _join_world(job, master, 0, world, 0, world)
    error: BaseException | None = None
    try:
        result = train(rank=0)
    except Exception as exc:
        error = exc
    finally:
        dist.destroy_process_group()
        for p in procs:
            p.join(timeout=10 if error is not None else 60)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    failed = [
        f"{p.name} (pid {p.pid}, {_exit_text(p.exitcode)})"
        for p in procs
        if p.exitcode not in (0, None)
    ]
    if failed:
        book = CheckpointBook(checkpoint_location(job))
        newest = book.latest() if job.trainer.checkpoint.enabled else None
        resume = (
            f"the newest checkpoint (step {newest.step}) holds everything learned; "
            "run the same command again to resume from it"
            if newest is not None
            else "no checkpoint was taken; run the same command again to start over"
        )
        msg = f"trainer rank process {', '.join(failed)} ended the job; {resume}"
        raise JobError(msg) from error
    if error is not None:
        raise error
    return result


def run_torchrun_rank(
    job: JobConfig,
    launch: TorchrunRank,
    services: Services,
    *,
    max_events: int | None = None,
    deadline: float | None = None,
    stop: threading.Event | None = None,
    on_progress: Callable[[Progress], None] | None = None,
) -> tuple[LoopStats, JobManifest | None]:
    """Train as the rank torchrun started: join its world (``env://``), then :func:`run_rank`.

    A rank whose peer dies (its host lost) gets an error from the next collective
    and ends with a :class:`JobError`; torchrun then starts the world again when
    ``--max-restarts`` allows, and every rank resumes from the newest checkpoint.
    """
    import torch.distributed as dist

    _join_world(job, "env://", launch.rank, launch.world, launch.local_rank, launch.local_world)
    try:
        return run_rank(
            job,
            services,
            rank=launch.rank,
            world=launch.world,
            max_events=max_events,
            deadline=deadline,
            stop=stop,
            on_progress=on_progress,
            device_index=launch.local_rank,
            local_ranks=launch.local_world,
        )
    except (RuntimeError, dist.DistError) as exc:
        if isinstance(exc, JobError) or not _collective_failure(exc):
            raise
        msg = (
            f"rank {launch.rank} of {launch.world}: another rank of the torchrun world is gone "
            f"({str(exc).splitlines()[0][:200]}); torchrun starts the world again when "
            "--max-restarts allows, and the ranks resume from the newest checkpoint"
        )
        raise JobError(msg) from exc
    finally:
        # A peer that is gone makes the collective teardown fail too.
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _collective_failure(exc: BaseException) -> bool:
    """Whether ``exc`` comes from torch.distributed losing a peer (not from our own code)."""
    import torch.distributed as dist

    if isinstance(exc, dist.DistError):
        return True
    text = str(exc)
    return any(
        marker in text
        for marker in ("Connection closed by peer", "Connection reset", "gloo", "NCCL", "Timed out")
    )


def run_job(
    job: JobConfig,
    *,
    max_events: int | None = None,
    max_time_s: float | None = None,
    stop: threading.Event | None = None,
    on_progress: Callable[[Progress], None] | None = None,
    on_services: Callable[[Services], None] | None = None,
    env: Mapping[str, str] | None = None,
) -> tuple[LoopStats, JobManifest | None]:
    """Start what the job needs, train, checkpoint, stop everything (see the module doc).

    ``max_time_s`` counts from this call: starting the services is part of it.
    Started by ``torchrun`` (``RANK`` in ``env``, default the process's), this
    process is one rank of torchrun's world and starts no services: the job must
    name them (:func:`deploy.cluster.check_torchrun_job`).
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
        services = start_services(job, stack, env=env)
        if on_services is not None:
            on_services(services)
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
