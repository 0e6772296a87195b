"""The local Kafka 0.9.0.1: it starts, makes topics, carries records; `up`/`down`; clear errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from kafka import KafkaConsumer

from connectors.kafka import produce
from deploy.local.kafka import (
    API_VERSION,
    REPO_ROOT,
    _pid_alive,
    down,
    find_java,
    up,
)
from tests.kafka_fixtures import KafkaForTests, read_partition


def consume_all(bootstrap: str, topic: str, partition: int, n: int) -> list[tuple[int, bytes]]:
    """(offset, value) of the first ``n`` records of one partition, via an assigned consumer."""
    return [
        (r.offset, r.value) for r in read_partition(bootstrap, topic, partition, n, timeout_s=10)
    ]


def test_topic_with_three_partitions_round_trips_records(
    kafka: KafkaForTests, kafka_topic: Callable[..., str]
) -> None:
    topic = kafka_topic(3)
    probe = KafkaConsumer(bootstrap_servers=kafka.bootstrap, api_version=kafka.api_version)
    try:
        assert probe.partitions_for_topic(topic) == {0, 1, 2}
    finally:
        probe.close()
    for p in range(3):
        payloads = [f"p{p}-{i}".encode() for i in range(5 + p)]
        assert produce(
            kafka.bootstrap, topic, payloads, api_version=kafka.api_version, partition=p
        ) == len(payloads)
    for p in range(3):
        got = consume_all(kafka.bootstrap, topic, p, 5 + p)
        assert got == [(i, f"p{p}-{i}".encode()) for i in range(5 + p)]


def test_local_kafka_listens_on_loopback_only(kafka: KafkaForTests) -> None:
    if kafka.local is None:
        pytest.skip("the session uses an outside Kafka")
    config = (kafka.local.work_dir / "server.properties").read_text()
    assert f"listeners=PLAINTEXT://127.0.0.1:{kafka.local.broker_port}\n" in config
    assert "advertised.host.name=127.0.0.1\n" in config
    assert (
        "clientPortAddress=127.0.0.1\n"
        in (kafka.local.work_dir / "zookeeper.properties").read_text()
    )
    assert kafka.bootstrap == f"127.0.0.1:{kafka.local.broker_port}"


def test_up_records_state_and_down_stops_it(tmp_path: Path) -> None:
    state = up(tmp_path)
    state_file = tmp_path / "kafka.json"
    try:
        assert json.loads(state_file.read_text()) == state
        assert state["bootstrap"].startswith("127.0.0.1:")
        assert state["api_version"] == list(API_VERSION)
        pids = [state["broker_pid"], state["zookeeper_pid"]]
        assert all(_pid_alive(pid) for pid in pids)

        # The recorded broker works: a record goes in and comes back out.
        topic = f"up-{uuid.uuid4().hex[:8]}"
        produce(state["bootstrap"], topic, [b"hello"], api_version=API_VERSION)
        assert consume_all(state["bootstrap"], topic, 0, 1) == [(0, b"hello")]

        again = up(tmp_path)  # idempotent: both run, nothing to do
        assert again["action"] == "running"
        assert again["bootstrap"] == state["bootstrap"]
    finally:
        stopped = down(tmp_path)
    assert stopped is True
    assert not any(_pid_alive(pid) for pid in pids)
    assert down(tmp_path) is False  # nothing runs any more
    kept = json.loads(state_file.read_text())  # the address stays for the next up
    assert (kept["bootstrap"], kept["broker_pid"]) == (state["bootstrap"], None)


def test_down_leaves_unrelated_processes_alone(tmp_path: Path) -> None:
    # A stale state file whose pid now belongs to someone else (here: a sleep).
    other = subprocess.Popen(["sleep", "30"])
    try:
        (tmp_path / "kafka.json").write_text(
            json.dumps({"broker_pid": other.pid, "zookeeper_pid": None})
        )
        assert down(tmp_path) is False  # nothing of ours ran
        assert other.poll() is None  # not a Kafka broker: not signalled
    finally:
        other.kill()
        other.wait()


def _run_start(env: dict[str, str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    code = textwrap.dedent(
        f"""
        from pathlib import Path
        from deploy.local.kafka import LocalKafka
        LocalKafka.start(cache_dir=Path({str(tmp_path / "cache")!r}))
        """
    )
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_missing_java_says_to_install_it(tmp_path: Path) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "JAVA_HOME"}
    env["PATH"] = str(empty)
    result = _run_start(env, tmp_path)
    assert result.returncode != 0
    assert "KafkaSetupError: java not found: install Java 17" in result.stderr


def test_missing_npm_says_to_install_it(tmp_path: Path) -> None:
    # Java is there, npm is not, and the (empty) cache has no Kafka yet.
    java_path = Path(find_java())
    only_java = tmp_path / "bin"
    only_java.mkdir()
    (only_java / "java").symlink_to(java_path.resolve())
    env = {k: v for k, v in os.environ.items() if k != "JAVA_HOME"}
    env["PATH"] = str(only_java)
    result = _run_start(env, tmp_path)
    assert result.returncode != 0
    assert "KafkaSetupError: npm not found: install Node.js with npm" in result.stderr
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


def _kafka_cli(state_dir: Path, command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "deploy.cli", "kafka", command, "--state-dir", str(state_dir)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_kafka_up_brings_a_killed_broker_back_where_clients_look(tmp_path: Path) -> None:
    """`kafka up` after a kill -9 (broker; then broker and ZooKeeper; then `down`): same
    address, same data, and a consumer that was reading carries on by itself.

    It used to refuse while a stale pid was recorded, and `down` then `up` moved the
    broker to a new port, where a running job never looked.
    """
    first = _kafka_cli(tmp_path, "up")
    assert first.returncode == 0, first.stderr
    state = json.loads((tmp_path / "kafka.json").read_text())
    bootstrap = state["bootstrap"]
    topic = f"back-{uuid.uuid4().hex[:8]}"
    try:
        produce(bootstrap, topic, [b"0", b"1"], api_version=API_VERSION)
        for i, victims in enumerate((["broker_pid"], ["broker_pid", "zookeeper_pid"], "down")):
            if victims == "down":
                assert _kafka_cli(tmp_path, "down").returncode == 0
            else:
                for key in victims:
                    os.kill(state[key], signal.SIGKILL)
            again = _kafka_cli(tmp_path, "up")
            assert again.returncode == 0, again.stderr
            assert f"on {bootstrap} " in again.stdout, again.stdout
            assert "restarted" in again.stdout, again.stdout
            state = json.loads((tmp_path / "kafka.json").read_text())
            assert state["bootstrap"] == bootstrap
            assert len(consume_all(bootstrap, topic, 0, 2 + i)) == 2 + i  # the data stayed
            produce(bootstrap, topic, [str(2 + i).encode()], api_version=API_VERSION)
        got = consume_all(bootstrap, topic, 0, 5)
        assert [v for _, v in got] == [b"0", b"1", b"2", b"3", b"4"]  # nothing lost
        assert "already running" in _kafka_cli(tmp_path, "up").stdout

        # A source that was reading when the broker died carries on once it is back.
        from tests.kafka_fixtures import make_kafka_source

        source = make_kafka_source(bootstrap, topic, api_version=API_VERSION)
        os.kill(state["broker_pid"], signal.SIGKILL)
        restarter = threading.Timer(3.0, lambda: _kafka_cli(tmp_path, "up"))
        restarter.start()
        try:
            chunk = source.plan(f"{topic}/0", 0, 100)  # waits for the broker
            assert chunk is not None
            assert len(source.read(chunk).payloads or []) == 5
        finally:
            restarter.join()
            source.close()
    finally:
        _kafka_cli(tmp_path, "down")
