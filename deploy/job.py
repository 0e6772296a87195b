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

import functools
import logging
import multiprocessing as mp
import os
import secrets
import signal
import threading
import zlib
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass

import yaml

from connectors.codecs import Codec, make_codec
from connectors.deadletter import JsonlDeadLetterSink
from connectors.kafka import KafkaDeadLetterSink, KafkaSource, KafkaSourceConfig
from connectors.parquet import ParquetSource
from connectors.synthetic import SyntheticConfig, SyntheticSource
from connectors.types import Chunk, DeadLetterSink, RawChunk, Source
from deploy.config import JobConfig, KafkaJobSource, ParquetJobSource
from deploy.local.kafka import free_port
from embedding_store.client import StoreClient
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
    TrainLoop,
    pick_device,
    restore_job,
)

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


# --- local services -----------------------------------------------------------------


@dataclass(frozen=True)
class Services:
    """Where a running job's parts are: the Dask scheduler and the store."""

    scheduler: str
    dashboard: str | None
    store: str
    token: str | None
    store_metrics: tuple[str, ...] = ()  # each local shard's Prometheus /metrics URL


def start_services(job: JobConfig, stack: ExitStack) -> Services:
    """Start the shards and the Dask cluster the job does not name; ``stack`` stops them."""
    from distributed import LocalCluster

    from deploy.local.shards import ShardProcess

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
    else:
        store = job.cluster.store
        store_metrics = ()
    token = token_file.read_text().strip() if token_file is not None else None
    if job.cluster.scheduler is not None:
        return Services(job.cluster.scheduler, None, store, token, store_metrics)
    cluster = stack.enter_context(
        LocalCluster(
            n_workers=job.cluster.workers,
            threads_per_worker=job.cluster.threads_per_worker,
            processes=True,
            dashboard_address=job.cluster.dashboard_address,
        )
    )
    return Services(cluster.scheduler_address, cluster.dashboard_link, store, token, store_metrics)


# --- one rank -----------------------------------------------------------------------


def run_rank(
    job: JobConfig,
    services: Services,
    *,
    rank: int = 0,
    world: int = 1,
    max_events: int | None = None,
    max_time_s: float | None = None,
    stop: threading.Event | None = None,
    on_progress: Callable[[Progress], None] | None = None,
) -> tuple[LoopStats, JobManifest | None]:
    """Train as rank ``rank``: restore, stream, learn, checkpoint. Returns the stats."""
    from distributed import Client

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
    if cfg.torch_threads is not None:
        import torch

        torch.set_num_threads(cfg.torch_threads)
    device = pick_device(cfg.device)
    source = build_source(job)
    mine = RankSource(source, rank, world) if world > 1 else source
    with ExitStack() as stack:
        latency_s = job.cluster.store_latency_ms / 1000.0
        store = stack.enter_context(
            StoreClient.connect(services.store, token=services.token, latency_s=latency_s)
        )
        dask = stack.enter_context(Client(services.scheduler))
        dense = DenseModel(cfg, spec, store.dims, device)
        book = None
        manifest = None
        if cfg.checkpoint.enabled:
            book = CheckpointBook(
                cfg.checkpoint.dir or job.run_dir / "checkpoints", keep=cfg.checkpoint.keep
            )
            # Rank 0 rolls the store back; the others load their dense state after it.
            if rank != 0:
                _barrier(world)
            manifest = restore_job(book, store, dense, rank=rank)
            if rank == 0:
                _barrier(world)
        positions = dict(manifest.positions) if manifest is not None else {}
        if isinstance(mine, RankSource):
            # The manifest holds every rank's partitions; a rank carrying another's
            # (stale) position into its checkpoints would move that one back.
            positions = {p: n for p, n in positions.items() if mine.owns(p)}
        deadletter = build_deadletter(job, rank)
        if deadletter is not None:
            stack.callback(deadletter.close)
        stack.callback(source.close)

        def commit(m: JobManifest) -> None:
            if isinstance(source, KafkaSource):
                source.commit(m.positions)

        best_auc = None
        if rank == 0 and isinstance(source, SyntheticSource):
            best_auc = source.best_auc(n_samples=100_000)
        try:
            dask.register_plugin(StreamrecPlugin())  # idempotent: the first rank's stays
        except Exception as exc:  # an external scheduler without streamrec installed
            log.warning(
                "the Dask scheduler could not load the streamrec plugin (%s): no /streamrec "
                "page and no streamrec_ metrics; install streamrec where it runs",
                exc,
            )
        # Its own source object: Kafka clients are not thread-safe, and the reporter
        # asks for the partitions' ends from its own thread.
        ends_source = build_source(job)
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
            max_samples=None if max_events is None else -(-max_events // world),
            max_time_s=max_time_s,
            stop=stop,
            on_progress=progress,
            best_auc=best_auc,
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
            stop_when=lambda: bool(loop.stop_reason()),
            # A rank whose partitions are quiet must not hold the others' steps up.
            idle_ticks=world > 1,
        )
        stack.callback(runner.close)
        stats = loop.run(iter(runner))
        latest = book.latest() if book is not None else None
        return stats, latest


def _barrier(world: int) -> None:
    if world > 1:
        import torch.distributed as dist

        dist.barrier()


def _backend(job: JobConfig) -> str:
    """Every rank must agree: nccl when the ranks train on GPUs, else gloo."""
    import torch

    return "nccl" if torch.cuda.is_available() and job.trainer.device != "cpu" else "gloo"


def _rank_main(
    job_json: str,
    services: Services,
    rank: int,
    world: int,
    master: str,
    max_events: int | None,
    max_time_s: float | None,
) -> None:
    import torch.distributed as dist

    job = JobConfig.model_validate_json(job_json)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    dist.init_process_group(_backend(job), init_method=master, rank=rank, world_size=world)
    try:
        run_rank(
            job,
            services,
            rank=rank,
            world=world,
            max_events=max_events,
            max_time_s=max_time_s,
            stop=stop,
        )
    finally:
        dist.destroy_process_group()


def run_ranks(
    job: JobConfig,
    services: Services,
    *,
    max_events: int | None = None,
    max_time_s: float | None = None,
    stop: threading.Event | None = None,
    on_progress: Callable[[Progress], None] | None = None,
) -> tuple[LoopStats, JobManifest | None]:
    """Rank 0 here, ranks 1.. in spawned processes; a rank that fails stops the job."""
    import torch.distributed as dist

    world = job.trainer.ranks
    stop = stop or threading.Event()
    train = functools.partial(
        run_rank,
        job,
        services,
        world=world,
        max_events=max_events,
        max_time_s=max_time_s,
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
            args=(job.model_dump_json(), services, r, world, master, max_events, max_time_s),
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
    dist.init_process_group(_backend(job), init_method=master, rank=0, world_size=world)
    try:
        result = train(rank=0)
    finally:
        dist.destroy_process_group()
        for p in procs:
            p.join(timeout=60)
    failed = [p.name for p in procs if p.exitcode not in (0, None)]
    if failed:
        msg = f"trainer rank process(es) {failed} failed; see the log above"
        raise JobError(msg)
    return result


def run_job(
    job: JobConfig,
    *,
    max_events: int | None = None,
    max_time_s: float | None = None,
    stop: threading.Event | None = None,
    on_progress: Callable[[Progress], None] | None = None,
    on_services: Callable[[Services], None] | None = None,
) -> tuple[LoopStats, JobManifest | None]:
    """Start what the job needs, train, checkpoint, stop everything (see the module doc)."""
    with ExitStack() as stack:
        services = start_services(job, stack)
        if on_services is not None:
            on_services(services)
        return run_ranks(
            job,
            services,
            max_events=max_events,
            max_time_s=max_time_s,
            stop=stop,
            on_progress=on_progress,
        )
