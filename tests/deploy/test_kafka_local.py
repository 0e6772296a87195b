"""The local Kafka 0.9.0.1: it starts, makes topics, carries records; `up`/`down`; clear errors."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kafka import KafkaConsumer

from connectors.kafka_produce import produce
from deploy.local.kafka import (
    API_VERSION,
    REPO_ROOT,
    down,
    find_java,
    pid_alive,
    up,
)
from deploy.local.kafka.broker import _BROKER_MAIN, _ZK_MAIN
from tests.support.kafka import KafkaForTests, read_partition

pytestmark = pytest.mark.processes


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


def test_a_fixed_heap_broker_holds_its_whole_heap_from_the_start(tmp_path: Path) -> None:
    """A long run watches the broker's memory: its heap must not grow toward the cap
    (what the soak measured as the broker's RSS growing 69% in 30 minutes)."""
    import psutil

    from deploy.local.kafka import LocalKafka

    local = LocalKafka.start(tmp_path / "kafka", heap="160m", fixed_heap=True)
    try:
        assert local.broker_process is not None
        broker = psutil.Process(local.broker_process.pid)
        argv = broker.cmdline()
        assert {"-Xmx160m", "-Xms160m", "-XX:+AlwaysPreTouch"} <= set(argv), argv
        # Touched at start: the heap alone is resident before any record arrives.
        assert broker.memory_info().rss >= 160 << 20
        topic = f"fixed-{uuid.uuid4().hex[:8]}"
        local.create_topic(topic, partitions=1)
        assert produce(local.bootstrap, topic, [b"x"], api_version=API_VERSION, partition=0) == 1
        assert consume_all(local.bootstrap, topic, 0, 1) == [(0, b"x")]
    finally:
        local.stop()


def test_up_records_state_and_down_stops_it(tmp_path: Path) -> None:
    state = up(tmp_path)
    state_file = tmp_path / "kafka.json"
    try:
        assert json.loads(state_file.read_text()) == state
        assert state["bootstrap"].startswith("127.0.0.1:")
        assert state["api_version"] == list(API_VERSION)
        pids = [state["broker_pid"], state["zookeeper_pid"]]
        assert all(pid_alive(pid) for pid in pids)

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
    assert not any(pid_alive(pid) for pid in pids)
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
    # A new Kafka on any free port: `kafka up` would take 9092, the port a developer's own uses.
    port = ["--port", "0"] if command == "up" else []
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "deploy.cli",
            "kafka",
            command,
            "--state-dir",
            str(state_dir),
            *port,
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )


def _servers_of(state_dir: Path) -> dict[int, str]:
    """pid -> main class of every Java server whose command line names ``state_dir``."""
    found: dict[int, str] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if any(str(state_dir) in arg for arg in argv) and pid_alive(int(proc.name)):
            main = next((m for m in (_BROKER_MAIN, _ZK_MAIN) if m in argv), "")
            if main:
                found[int(proc.name)] = main
    return found


@pytest.fixture
def state_dir(tmp_path: Path) -> Iterator[Path]:
    """A `--state-dir` for `streamrec kafka`; whatever Kafka ran from it is gone afterwards."""
    path = (tmp_path / "state").resolve()
    try:
        yield path
    finally:
        if (path / "kafka.json").exists():
            _kafka_cli(path, "down")
        for pid in _servers_of(path):  # e.g. when `down` itself failed
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)


class Up:
    """`streamrec kafka up` on one state dir, timed; the state it recorded."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.times: list[tuple[str, float]] = []

    def __call__(self, what: str = "") -> dict[str, Any]:
        began = time.monotonic()
        result = _kafka_cli(self.state_dir, "up")
        self.times.append((what, time.monotonic() - began))
        assert result.returncode == 0, result.stdout + result.stderr
        self.stdout = result.stdout
        state: dict[str, Any] = json.loads((self.state_dir / "kafka.json").read_text())
        return state


def _values(bootstrap: str, topic: str, n: int) -> list[bytes]:
    return [v for _, v in consume_all(bootstrap, topic, 0, n)]


def _log_end(bootstrap: str, topic: str) -> int:
    """One past the last offset of partition 0, as the broker answers it."""
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(
        bootstrap_servers=bootstrap, api_version=API_VERSION, enable_auto_commit=False
    )
    try:
        tp = TopicPartition(topic, 0)
        return int(consumer.end_offsets([tp])[tp])
    finally:
        consumer.close(autocommit=False)


def test_kafka_up_brings_a_killed_broker_back_where_clients_look(state_dir: Path) -> None:
    """`kafka up` after kill -9 of the broker, of both servers, of ZooKeeper alone, and
    after `down`: same address, the data kept, new records go in and come out.

    It used to refuse while a stale pid was recorded, and `down` then `up` moved the
    broker to a new port, where a running job never looked.
    """
    up = Up(state_dir)
    state = up("start")
    bootstrap = state["bootstrap"]
    topic = f"back-{uuid.uuid4().hex[:8]}"
    produce(bootstrap, topic, [b"0", b"1"], api_version=API_VERSION)
    expected = [b"0", b"1"]
    steps: list[tuple[str, list[str], str]] = [
        # (what happens, pids killed with -9 or "down", what `up` says it restarted)
        ("broker killed", ["broker_pid"], "(broker)"),
        ("both killed", ["broker_pid", "zookeeper_pid"], "(ZooKeeper and broker)"),
        ("ZooKeeper killed", ["zookeeper_pid"], "(ZooKeeper)"),
        ("down", [], "(ZooKeeper and broker)"),
    ]
    for what, victims, restarted in steps:
        if what == "down":
            stopped = _kafka_cli(state_dir, "down")
            assert stopped.returncode == 0, stopped.stderr
            assert not _servers_of(state_dir)
        for key in victims:
            os.kill(state[key], signal.SIGKILL)
        before = state
        state = up(what)
        assert f"on {bootstrap} " in up.stdout, up.stdout
        assert f"restarted {restarted}" in up.stdout, up.stdout
        assert state["bootstrap"] == bootstrap
        # What was not restarted is the same process; only recorded servers run.
        for key in ("broker_pid", "zookeeper_pid"):
            assert (state[key] == before[key]) == (key not in victims and what != "down")
        assert set(_servers_of(state_dir)) == {state["broker_pid"], state["zookeeper_pid"]}
        assert _values(bootstrap, topic, len(expected)) == expected  # the data stayed
        expected.append(str(len(expected)).encode())
        produce(bootstrap, topic, [expected[-1]], api_version=API_VERSION)
    # Nothing lost or doubled: the records, and the log ends right after them. (Asking
    # for one record more waited out the read's whole 10 s to find none.)
    assert _values(bootstrap, topic, len(expected)) == expected
    assert _log_end(bootstrap, topic) == len(expected)

    assert up("running") == state  # idempotent: nothing to do, nothing restarted
    assert "already running" in up.stdout
    print("\n".join(f"kafka up ({what}): {s:.1f}s" for what, s in up.times))


def test_two_ups_at_once_restart_the_broker_once(state_dir: Path) -> None:
    up = Up(state_dir)
    state = up()
    os.kill(state["broker_pid"], signal.SIGKILL)
    command = [sys.executable, "-m", "deploy.cli", "kafka", "up", "--state-dir", str(state_dir)]
    both = [
        subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    said = sorted(p.communicate(timeout=180)[0] for p in both)
    assert [p.returncode for p in both] == [0, 0], said
    assert "already running" in said[0], said
    assert "restarted (broker)" in said[1], said
    state = json.loads((state_dir / "kafka.json").read_text())
    assert _servers_of(state_dir) == {
        state["broker_pid"]: _BROKER_MAIN,
        state["zookeeper_pid"]: _ZK_MAIN,
    }


def test_up_names_the_process_that_took_a_recorded_port(state_dir: Path) -> None:
    """Kafka does not move to a new port behind its clients' backs: `up` refuses and says
    who holds the port; once it is free, `up` brings Kafka back there."""
    up = Up(state_dir)
    state = up()
    assert _kafka_cli(state_dir, "down").returncode == 0
    port = int(state["bootstrap"].rpartition(":")[2])
    squatter = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import socket, sys, time\n"
            "s = socket.socket()\n"
            "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
            f"s.bind(('127.0.0.1', {port})); s.listen(); print('ok', flush=True)\n"
            "time.sleep(60)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert squatter.stdout is not None
        assert squatter.stdout.readline() == "ok\n"
        refused = _kafka_cli(state_dir, "up")
        assert refused.returncode == 1
        assert f"127.0.0.1:{port}" in refused.stderr, refused.stderr
        assert f"pid {squatter.pid} (" in refused.stderr, refused.stderr
        assert "Traceback" not in refused.stderr
        assert not _servers_of(state_dir)  # nothing started in vain, nothing left behind
        kept = json.loads((state_dir / "kafka.json").read_text())
        assert kept["bootstrap"] == state["bootstrap"]  # still the address clients know
    finally:
        squatter.kill()
        squatter.wait()
    assert up()["bootstrap"] == state["bootstrap"]


def test_a_source_reading_across_kafka_up_gets_every_record_once(state_dir: Path) -> None:
    """A KafkaSource (the job's reader) that is in the middle of a chunk when the broker
    is killed waits, and once `streamrec kafka up` brought it back it carries on where
    it was: every offset exactly once, the records produced after the restart too."""
    from tests.support.kafka import SLOW_READS, make_kafka_source

    up = Up(state_dir)
    state = up()
    bootstrap = state["bootstrap"]
    topic = f"reader-{uuid.uuid4().hex[:8]}"
    records = [f"{i:06d}".encode() * 40 for i in range(400)]  # 240 bytes: ~4 a slow fetch
    produce(bootstrap, topic, records[:200], api_version=API_VERSION)
    partition = f"{topic}/0"
    source = make_kafka_source(
        bootstrap, topic, client_options=SLOW_READS, retry_timeout_s=300, max_records=100
    )
    got: list[tuple[int, bytes]] = []
    failed: list[BaseException] = []

    def read_all() -> None:
        try:
            position = 0
            while position < len(records):
                chunk = source.plan(partition, position, 100)
                if chunk is None:
                    time.sleep(0.1)
                    continue
                raw = source.read(chunk)
                got.extend(zip(raw.positions, raw.payloads or [], strict=True))
                position = chunk.end
        except BaseException as exc:
            failed.append(exc)

    reader = threading.Thread(target=read_all, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 60
        while len(got) < 20 and reader.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert 0 < len(got) < 200, "the kill should land in the middle of the reading"
        os.kill(state["broker_pid"], signal.SIGKILL)
        up("broker killed")
        produce(bootstrap, topic, records[200:], api_version=API_VERSION)
        reader.join(120)
        assert not reader.is_alive()
        assert not failed, failed
    finally:
        source.close()
    assert [offset for offset, _ in got] == list(range(len(records)))
    assert [value for _, value in got] == records
    print(f"kafka up (broker killed): {up.times[-1][1]:.1f}s")


def test_a_job_carries_on_by_itself_when_kafka_up_brings_its_broker_back(
    state_dir: Path, tmp_path: Path
) -> None:
    """`streamrec run` from the broker of `streamrec kafka up`; the broker is killed with
    -9 mid-run and `kafka up` brings it back. The job is never restarted by hand, and
    its ledger shows every offset learned exactly once, those produced after too."""
    from connectors.synthetic import SyntheticConfig, iter_json_lines, synthetic_store_section
    from deploy.local.kafka import create_topic
    from tests.support.jobs import write_synthetic_job
    from tests.support.processes import STREAMREC
    from trainer.ledger import learned_ranges

    up = Up(state_dir)
    state = up()
    bootstrap = state["bootstrap"]
    topic = f"job-{uuid.uuid4().hex[:8]}"
    create_topic(state["zookeeper"], bootstrap, topic, 2)
    lines = iter(iter_json_lines(SyntheticConfig(seed=11), 6000))
    ends = {f"{topic}/{p}": 0 for p in range(2)}

    def produce_more(n: int) -> None:
        for p in range(2):
            batch = [next(lines) for _ in range(n)]
            assert produce(bootstrap, topic, batch, api_version=API_VERSION, partition=p) == n
            ends[f"{topic}/{p}"] += n

    produce_more(2000)
    run_dir = tmp_path / "run"
    job = write_synthetic_job(
        tmp_path,
        store=synthetic_store_section(dim=4),
        source={
            "kind": "kafka",
            "bootstrap_servers": bootstrap,
            "topics": [topic],
            "group_id": f"{topic}-trainer",
            "api_version": "0.9",
            "deadletter": "file",
            "max_records": 250,
        },
        trainer={
            "mode": "hybrid",
            "staleness": 2,
            "batch_size": 250,
            "model": {"kind": "ffnn", "hidden": [16]},
            "torch_threads": 1,
            "checkpoint": {"every_steps": 3, "every_s": None},
        },
        cluster={"workers": 1, "store_shards": 1, "dashboard_address": ":0"},
    )
    ledger = run_dir / "learned-rank0.log"

    def learned() -> dict[str, list[int]]:
        """Per partition, how many times each offset was learned (rollbacks applied)."""
        counts = {p: [0] * n for p, n in ends.items()}
        for partition, ranges in (learned_ranges(ledger) if ledger.exists() else {}).items():
            for start, end in ranges:
                for offset in range(start, end):
                    counts[partition][offset] += 1
        return counts

    log_path = tmp_path / "job.log"
    with log_path.open("w") as log:
        job_proc = subprocess.Popen(
            [*STREAMREC, "run", str(job), "--max-time", "300"],
            cwd=REPO_ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 180
        while not any(1 in c for c in learned().values()) and time.monotonic() < deadline:
            assert job_proc.poll() is None, log_path.read_text()
            time.sleep(0.2)
        before = learned()
        assert any(1 in c for c in before.values()), log_path.read_text()
        produced_before = sum(ends.values())
        os.kill(state["broker_pid"], signal.SIGKILL)
        up("broker killed, job running")
        produce_more(1000)  # only the restarted broker has these
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and job_proc.poll() is None:
            if all(min(c) >= 1 for c in learned().values()):
                break
            time.sleep(0.5)
        job_proc.send_signal(signal.SIGINT)  # Ctrl-C: stop after this step, checkpoint
        assert job_proc.wait(120) == 0, log_path.read_text()
    finally:
        if job_proc.poll() is None:
            job_proc.kill()
            job_proc.wait()
    counts = learned()
    for partition, per_offset in counts.items():
        twice = [o for o, c in enumerate(per_offset) if c > 1]
        never = [o for o, c in enumerate(per_offset) if c == 0]
        assert (twice[:5], never[:5]) == ([], []), (partition, len(twice), len(never))
    learned_before = sum(c.count(1) for c in before.values())
    print(
        f"kafka up with a job running: {up.times[-1][1]:.1f}s; the job had learned "
        f"{learned_before} of {produced_before} records when the broker died"
    )
