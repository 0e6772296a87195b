"""The job's source, codec and dead-letter sink, and the partitions each trainer rank owns."""

from __future__ import annotations

import zlib
from collections.abc import Callable

from connectors.codecs import Codec, make_codec
from connectors.deadletter import JsonlDeadLetterSink, KafkaDeadLetterSink
from connectors.kafka import KafkaSource, KafkaSourceConfig
from connectors.parquet import ParquetSource
from connectors.synthetic import SyntheticConfig, SyntheticSource
from connectors.types import Chunk, DeadLetterSink, RawChunk, Source
from deploy.config import JobConfig, KafkaJobSource, ParquetJobSource
from deploy.job.errors import JobError


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


def stop_waiting_when(source: Source, stopping: Callable[[], bool]) -> None:
    """A Kafka source that waits for its brokers gives up once ``stopping()`` says so."""
    if isinstance(source, KafkaSource):
        source.stop_waiting_when(stopping)


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
