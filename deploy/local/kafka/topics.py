"""Topics of any broker: :func:`make_topic` and :func:`list_topics`, and for the 0.9 broker
(no admin API) Kafka's own ``kafka-topics.sh`` through ZooKeeper (:func:`topic_command`,
:func:`create_topic`)."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

from deploy.local.kafka.distribution import API_VERSION, find_java, java_command, kafka_home
from deploy.local.kafka.errors import KafkaStartError

_TOPIC_MAIN = "kafka.admin.TopicCommand"

# Kafka got its CreateTopics request (what KafkaAdminClient.create_topics sends) in 0.10.1.
_ADMIN_API_VERSION = (0, 10, 1)


def topic_command(
    zookeeper: str,
    *args: str,
    home: Path | None = None,
    java: str | None = None,
    timeout_s: float = 60.0,
) -> str:
    """Run Kafka's ``kafka-topics.sh --zookeeper <zookeeper> <args>``; returns its output.

    kafka-python's admin API needs Kafka 0.10+, so on 0.9 topics are managed
    through ZooKeeper with Kafka's own tool (run as ``java`` directly).
    """
    java = java or find_java()
    home = home or kafka_home()
    argv = java_command(
        java,
        home,
        _TOPIC_MAIN,
        ["--zookeeper", zookeeper, *args],
        # A short-lived tool: the client compiler alone starts it faster.
        jvm=[
            "-Xmx128m",
            "-XX:+UseSerialGC",
            "-XX:TieredStopAtLevel=1",
            f"-Dlog4j.configuration=file:{home / 'config' / 'tools-log4j.properties'}",
        ],
    )
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    output = result.stdout + result.stderr
    # TopicCommand reports some failures with exit code 0 and an "Error" line.
    if result.returncode != 0 or "Error while executing topic command" in output:
        msg = f"kafka-topics.sh {' '.join(args)} failed (exit {result.returncode}):\n{output}"
        raise KafkaStartError(msg)
    return output


def wait_for_partitions(
    bootstrap: str,
    name: str,
    partitions: int,
    *,
    api_version: tuple[int, ...] = API_VERSION,
    timeout_s: float = 60.0,
) -> None:
    """Wait until the broker serves offsets for partitions ``0..partitions-1`` of ``name``."""
    from kafka import KafkaConsumer, TopicPartition

    deadline = time.monotonic() + timeout_s
    last_error: Exception | None = None
    probe = KafkaConsumer(
        bootstrap_servers=bootstrap,
        api_version=api_version,
        enable_auto_commit=False,
        request_timeout_ms=5000,
    )
    try:
        while time.monotonic() < deadline:
            try:
                # A fresh look at the metadata (partitions_for_topic alone may be cached).
                probe.topics()
                known = probe.partitions_for_topic(name) or set()
                if len(known) >= partitions:
                    tps = [TopicPartition(name, p) for p in range(partitions)]
                    # Only the partitions' leader answers this: proof they are ready.
                    probe.end_offsets(tps, timeout_ms=2000)
                    return
            except Exception as exc:  # the broker is still electing leaders: ask again
                last_error = exc
            time.sleep(0.1)
    finally:
        probe.close(autocommit=False)
    msg = f"topic {name!r} has no leader for all {partitions} partitions after {timeout_s}s"
    if last_error is not None:
        msg += f" (last error: {last_error!r})"
    raise KafkaStartError(msg)


def create_topic(
    zookeeper: str,
    bootstrap: str,
    name: str,
    partitions: int = 1,
    *,
    config: Mapping[str, str] | None = None,
    home: Path | None = None,
    java: str | None = None,
    api_version: tuple[int, ...] = API_VERSION,
    timeout_s: float = 60.0,
) -> None:
    """Create a topic through ZooKeeper and wait until all its partitions have a leader."""
    extra: list[str] = []
    for key, value in (config or {}).items():
        extra += ["--config", f"{key}={value}"]
    topic_command(
        zookeeper,
        "--create",
        "--topic",
        name,
        "--partitions",
        str(partitions),
        "--replication-factor",
        "1",
        *extra,
        home=home,
        java=java,
        timeout_s=timeout_s,
    )
    wait_for_partitions(bootstrap, name, partitions, api_version=api_version, timeout_s=timeout_s)


def list_topics(
    bootstrap: str, *, api_version: tuple[int, ...] = API_VERSION, timeout_s: float = 30.0
) -> dict[str, int]:
    """Every topic of the broker at ``bootstrap`` with its number of partitions, by name.

    Kafka's internal topics (``__consumer_offsets``) are left out. Asks for the
    metadata of all topics, which never creates one (a broker with
    ``auto.create.topics.enable`` creates a topic asked for by name).
    """
    from kafka import KafkaConsumer

    consumer = KafkaConsumer(
        bootstrap_servers=bootstrap,
        api_version=api_version,
        enable_auto_commit=False,
        # kafka-python wants it between fetch_max_wait_ms (500) and connections_max_idle_ms.
        request_timeout_ms=int(min(max(timeout_s, 5.0), 300.0) * 1000),
    )
    try:
        names = consumer.topics()
        return {
            name: len(consumer.partitions_for_topic(name))
            for name in sorted(names)
            if not name.startswith("__")
        }
    finally:
        consumer.close(autocommit=False)


def make_topic(
    bootstrap: str,
    name: str,
    partitions: int,
    *,
    api_version: tuple[int, ...],
    zookeeper: str | None = None,
    config: Mapping[str, str] | None = None,
    home: Path | None = None,
    java: str | None = None,
    timeout_s: float = 60.0,
) -> None:
    """Create ``name`` with ``partitions`` partitions (replication 1) on any broker and wait
    until every partition has a leader.

    Brokers 0.10.1 and newer are asked with the admin API (``KafkaAdminClient``);
    older ones (the local Kafka 0.9) through their ZooKeeper with Kafka's own
    ``kafka-topics.sh`` (:func:`create_topic`), so ``zookeeper`` is needed there.
    A topic that exists already is a :class:`KafkaStartError` saying how many
    partitions it has.
    """
    if partitions < 1:
        msg = f"--partitions {partitions}: expected 1 or more"
        raise KafkaStartError(msg)
    existing = list_topics(bootstrap, api_version=api_version).get(name)
    if existing is not None:
        msg = f"topic {name!r} already exists on {bootstrap} with {existing} partition(s)"
        raise KafkaStartError(msg)
    if tuple(api_version) >= _ADMIN_API_VERSION:
        from kafka import KafkaAdminClient
        from kafka.admin import NewTopic

        admin = KafkaAdminClient(bootstrap_servers=bootstrap, api_version=api_version)
        try:
            admin.create_topics([NewTopic(name, partitions, 1, topic_configs=dict(config or {}))])
        finally:
            admin.close()
        wait_for_partitions(
            bootstrap, name, partitions, api_version=api_version, timeout_s=timeout_s
        )
        return
    if zookeeper is None:
        version = ".".join(map(str, api_version))
        msg = (
            f"the broker at {bootstrap} speaks Kafka {version}, which has no CreateTopics "
            f"request (it came in 0.10.1): give its ZooKeeper with --zookeeper HOST:PORT"
        )
        raise KafkaStartError(msg)
    create_topic(
        zookeeper,
        bootstrap,
        name,
        partitions,
        config=config,
        home=home,
        java=java,
        api_version=api_version,
        timeout_s=timeout_s,
    )
