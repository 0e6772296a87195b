"""`streamrec kafka up --broker tansu`: a detached modern-protocol broker for a user.

Through the CLI, as a user runs it: up (idempotent), a job's records in and
out, kill -9 and up again on the same address, down; and the clear errors.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from connectors.kafka_produce import produce
from deploy.local.kafka import free_port, pid_alive
from deploy.local.tansu import API_VERSION
from tests.support.kafka import make_kafka_source
from tests.support.processes import streamrec

pytestmark = pytest.mark.processes


def _cli(state_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return streamrec("kafka", *args, "--broker", "tansu", "--state-dir", str(state_dir))


@pytest.fixture
def state_dir(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "tansu"
    try:
        yield path
    finally:
        _cli(path, "down")


def _read(bootstrap: str, topic: str) -> list[bytes]:
    """Every record of partition 0 of ``topic``, through the job's own source."""
    source = make_kafka_source(bootstrap, topic, api_version=API_VERSION)
    try:
        chunk = source.plan(f"{topic}/0", 0, 100)
        assert chunk is not None
        return list(source.read(chunk).payloads or [])
    finally:
        source.close()


def _state(state_dir: Path) -> dict[str, object]:
    state: dict[str, object] = json.loads((state_dir / "tansu.json").read_text())
    return state


def test_up_is_idempotent_comes_back_after_kill_9_and_down_stops_it(state_dir: Path) -> None:
    port = free_port()
    first = _cli(state_dir, "up", "--port", str(port))
    assert first.returncode == 0, first.stderr
    bootstrap = f"127.0.0.1:{port}"
    assert f"Tansu (Kafka 3.9 protocol) on {bootstrap}, log in memory://tansu/: started" in (
        first.stdout
    )
    state = _state(state_dir)
    pid = state["pid"]
    assert isinstance(pid, int)
    assert pid_alive(pid)
    topic = f"t-{uuid.uuid4().hex[:8]}"
    # As the printed hint says: `kafka topic create ... --broker tansu` finds it.
    hint = (
        f"streamrec kafka topic create TOPIC --partitions N --broker tansu --state-dir {state_dir}"
    )
    assert hint in first.stdout, first.stdout
    made = streamrec(
        "kafka", "topic", "create", topic, "--broker", "tansu", "--state-dir", str(state_dir)
    )
    assert made.returncode == 0, made.stderr
    assert f"created topic {topic} on {bootstrap}" in made.stdout
    listed = streamrec("kafka", "topic", "list", "--broker", "tansu", "--state-dir", str(state_dir))
    assert topic in listed.stdout, listed.stdout + listed.stderr
    produce(bootstrap, topic, [b"a", b"b"], api_version=API_VERSION, partition=0)
    assert _read(bootstrap, topic) == [b"a", b"b"]

    again = _cli(state_dir, "up")
    assert "already running" in again.stdout, again.stdout
    assert _state(state_dir)["pid"] == pid

    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    back = _cli(state_dir, "up")
    assert back.returncode == 0, back.stderr
    assert f"on {bootstrap}" in back.stdout
    assert "restarted on the same address" in back.stdout
    # The broker answers there (its log was in memory: the topic is made again).
    produce(bootstrap, topic, [b"c"], api_version=API_VERSION, partition=0)
    assert _read(bootstrap, topic) == [b"c"]
    restarted = _state(state_dir)["pid"]
    assert isinstance(restarted, int)
    assert restarted != pid

    moved = _cli(state_dir, "up", "--port", str(free_port()))
    assert moved.returncode == 1
    assert f"is on port {port}" in moved.stderr

    stopped = _cli(state_dir, "down")
    assert "Tansu stopped" in stopped.stdout
    assert _state(state_dir)["pid"] is None
    assert not pid_alive(restarted)
    assert "no Tansu running" in _cli(state_dir, "down").stdout


def test_a_taken_port_and_storage_without_tansu_are_clear_errors(state_dir: Path) -> None:
    import socket

    with socket.create_server(("127.0.0.1", 0)) as holder:
        port = holder.getsockname()[1]
        taken = _cli(state_dir, "up", "--port", str(port))
    assert taken.returncode == 1
    assert f"port {port} is taken by pid {os.getpid()}" in taken.stderr
    wrong = streamrec("kafka", "up", "--storage", "memory://x/")
    assert wrong.returncode == 2
    assert "--storage is Tansu's" in wrong.stderr
