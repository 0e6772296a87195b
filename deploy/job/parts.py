"""A trainer rank's parts, assembled once and kept across rollbacks.

The store client, the Dask client, the dense model, the checkpoint book and
checkpointer, the dead-letter sink, the dense publisher and the reporter: each
built here in the order the rank needs them, each closed by the rank's
``ExitStack`` (in the reverse order).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING

from connectors.kafka import KafkaSource
from connectors.kafka_client import KafkaUnavailable
from connectors.synthetic import SyntheticSource
from connectors.types import DeadLetterSink, Source
from deploy.config import JobConfig
from deploy.job.services import Services, batch_client, install_dask_plugins
from deploy.job.sources import RankSource, build_deadletter, build_source, stop_waiting_when
from deploy.job.threads import step_threads_for, take_short_gil_turns, torch_threads_for
from embedding_store.client import StoreClient
from embedding_store.location import Location
from monitoring.reporter import Reporter
from monitoring.types import TOPIC
from pipeline.prepare import StoreAddress
from trainer import metrics
from trainer.checkpoint import CheckpointBook, JobManifest
from trainer.dense_model import DenseModel
from trainer.job_checkpoint import JobCheckpointer
from trainer.progress import Progress
from trainer.publish import DensePublisher

if TYPE_CHECKING:
    import torch
    from distributed import Client

    from connectors.spec import FeatureSpec
    from deploy.local.shards import ShardSupervisor

log = logging.getLogger(__name__)


def checkpoint_location(job: JobConfig) -> Location:
    """Where the job's manifests and dense states go: ``trainer.checkpoint.dir`` or the run's."""
    where = job.trainer.checkpoint.dir
    return Location.parse(where if where is not None else job.run_dir / "checkpoints")


def serving_location(job: JobConfig) -> Location:
    """Where rank 0 publishes the dense weights: ``serving.dir`` or the checkpoints' serving/."""
    if job.serving.dir is not None:
        return Location.parse(job.serving.dir)
    return checkpoint_location(job).child("serving")


@dataclass(frozen=True)
class Limits:
    """When a rank stops before its stream ends: ``max_events`` (the job's, all ranks
    together; ``--max-events``), ``deadline`` (a ``time.monotonic()`` value;
    ``--max-time``) or ``stop`` (a signal)."""

    max_events: int | None
    deadline: float | None
    stop: threading.Event

    def stopping(self) -> bool:
        return self.stop.is_set() or (
            self.deadline is not None and time.monotonic() >= self.deadline
        )


@dataclass(frozen=True)
class RankParts:
    """What trainer rank ``rank`` of ``world`` trains with.

    ``source`` is the partitions this rank trains (a :class:`RankSource` when
    there are other ranks); ``progress`` reports each step (and calls the job's
    ``on_progress``); ``book`` and ``checkpointer`` are None when checkpoints are off.
    """

    job: JobConfig
    spec: FeatureSpec
    services: Services
    rank: int
    world: int
    device: torch.device
    source: Source
    store: StoreClient
    dask: Client
    dense: DenseModel
    step_threads: int
    book: CheckpointBook | None
    checkpointer: JobCheckpointer | None
    deadletter: DeadLetterSink | None
    publisher: DensePublisher | None
    best_auc: float | None
    progress: Callable[[Progress], None]

    @property
    def supervisor(self) -> ShardSupervisor | None:
        """What restarts the job's local store shards (None: the job names its store)."""
        return self.services.supervisor

    def store_address(self) -> StoreAddress:
        """The store as the Dask workers' prepare tasks reach it."""
        return StoreAddress(
            self.services.store, token=self.services.token, latency_s=_latency_s(self.job)
        )


def open_rank_parts(
    job: JobConfig,
    spec: FeatureSpec,
    services: Services,
    source: Source,
    stack: ExitStack,
    *,
    rank: int,
    world: int,
    device: torch.device,
    local_ranks: int,
    limits: Limits,
    on_progress: Callable[[Progress], None] | None,
) -> RankParts:
    """Assemble rank ``rank``'s parts around the job's ``source``; ``stack`` closes them."""
    cfg = job.trainer
    mine = RankSource(source, rank, world) if world > 1 else source
    store = stack.enter_context(
        StoreClient.connect(services.store, token=services.token, latency_s=_latency_s(job))
    )
    dask = stack.enter_context(batch_client(job.cluster, services.scheduler))
    dense = DenseModel(cfg, spec, store.dims, device)
    step_threads = _set_threads(job, local_ranks, device, dense)
    book = None
    if cfg.checkpoint.enabled:
        book = CheckpointBook(checkpoint_location(job), keep=cfg.checkpoint.keep)
    deadletter = build_deadletter(job, rank)
    if deadletter is not None:
        stack.callback(deadletter.close)
    publisher = _publisher(job, rank, stack)
    best_auc = None
    if rank == 0 and isinstance(source, SyntheticSource):
        best_auc = metrics.best_auc(source, n_samples=100_000)
    install_dask_plugins(dask)
    progress = _reporting(job, rank, store, dask, stack, limits.stopping, on_progress)
    checkpointer = None
    if book is not None:
        extra = {"mode": cfg.mode, "world": world}
        checkpointer = JobCheckpointer(book, store, on_saved=_offset_committer(source), extra=extra)
    return RankParts(
        job=job,
        spec=spec,
        services=services,
        rank=rank,
        world=world,
        device=device,
        source=mine,
        store=store,
        dask=dask,
        dense=dense,
        step_threads=step_threads,
        book=book,
        checkpointer=checkpointer,
        deadletter=deadletter,
        publisher=publisher,
        best_auc=best_auc,
        progress=progress,
    )


def _latency_s(job: JobConfig) -> float:
    return job.cluster.store_latency_ms / 1000.0


def _set_threads(job: JobConfig, local_ranks: int, device: torch.device, dense: DenseModel) -> int:
    """Set torch's intra-op threads for this rank (and its GIL turns: :func:`take_short_gil_turns`);
    returns the threads each step is split over."""
    import torch

    take_short_gil_turns()
    step_threads = step_threads_for(
        job, local_ranks, device.type, sum(p.numel() for p in dense.module.parameters())
    )
    # A split step's threads each run torch's ops on one intra-op thread.
    torch.set_num_threads(1 if step_threads > 1 else torch_threads_for(job, local_ranks))
    return step_threads


def _publisher(job: JobConfig, rank: int, stack: ExitStack) -> DensePublisher | None:
    """Rank 0's publisher of the dense weights for serving (``serving.publish_every_s``)."""
    if rank != 0 or job.serving.publish_every_s is None:
        return None
    publisher = DensePublisher(
        serving_location(job), every_s=job.serving.publish_every_s, keep=job.serving.keep
    )
    stack.callback(publisher.close)
    return publisher


def _offset_committer(source: Source) -> Callable[[JobManifest], None]:
    """What a durable checkpoint does to the source: a Kafka source commits its offsets."""

    def commit(m: JobManifest) -> None:
        if isinstance(source, KafkaSource):
            try:
                source.commit(m.positions)
            except KafkaUnavailable as exc:
                # The manifest is the commit point and a restart reads it first;
                # the group's offsets only serve a job started without it.
                log.warning("offsets of checkpoint step %d not committed: %s", m.step, exc)

    return commit


def _reporting(
    job: JobConfig,
    rank: int,
    store: StoreClient,
    dask: Client,
    stack: ExitStack,
    stopping: Callable[[], bool],
    on_progress: Callable[[Progress], None] | None,
) -> Callable[[Progress], None]:
    """Each step's progress to the Dask scheduler's streamrec page, then to ``on_progress``."""
    # Its own source object: Kafka clients are not thread-safe, and the reporter
    # asks for the partitions' ends from its own thread.
    ends_source = build_source(job)
    stop_waiting_when(ends_source, stopping)
    stack.callback(ends_source.close)
    reporter = Reporter(
        lambda report: dask.log_event(TOPIC, report),
        rank=rank,
        every_s=job.trainer.log_every_s,
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

    return progress
