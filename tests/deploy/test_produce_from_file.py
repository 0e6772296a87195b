"""`streamrec produce --from FILE`, `streamrec kafka topic create/list`, and where `kafka up`
keeps its cache and state: against a real broker (the session's), through the CLI."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from deploy.local.kafka import (
    REPO_ROOT,
    default_cache_dir,
    default_state_dir,
    down,
    free_port,
)
from tests.support.kafka import KafkaForTests
from tests.support.ports import held_port
from tests.support.processes import streamrec


def _version(kafka: KafkaForTests) -> str:
    return ".".join(map(str, kafka.api_version))


def _records_by_partition(kafka: KafkaForTests, topic: str) -> dict[int, list[Any]]:
    """Every record of every partition of ``topic`` (kafka-python records), in offset order.

    Read up to the high watermark each fetch reports: Tansu's ListOffsets does not
    give the log end (see ``deploy.local.tansu``).
    """
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(
        bootstrap_servers=kafka.bootstrap, api_version=kafka.api_version, enable_auto_commit=False
    )
    try:
        parts = sorted(consumer.partitions_for_topic(topic) or ())
        tps = [TopicPartition(topic, p) for p in parts]
        consumer.assign(tps)
        consumer.seek_to_beginning()
        got: dict[int, list[Any]] = {p: [] for p in parts}
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            for tp, records in consumer.poll(timeout_ms=200).items():
                got[tp.partition] += records
            marks = [(consumer.position(tp), consumer.highwater(tp)) for tp in tps]
            if all(hw is not None and at >= hw for at, hw in marks):
                break
        return got
    finally:
        consumer.close(autocommit=False)


def _one_line_error(result: Any, *, waited: bool = False) -> str:
    """The stderr of a failed command: exactly one line (besides notes), no traceback.

    ``waited``: before it, the lines saying that the broker is being waited for.
    """
    assert result.returncode != 0, result.stdout
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if not line.startswith("note: ")]
    if waited:
        lines = [line for line in lines if "; retrying for up to" not in line]
    assert len(lines) == 1, result.stderr
    return str(lines[0])


@pytest.fixture
def two_partitions(broker: KafkaForTests) -> str:
    """A 2-partition topic made with `streamrec kafka topic create`, on each broker."""
    kafka = broker
    name = f"file-{uuid.uuid4().hex[:10]}"
    args = ["--bootstrap", kafka.bootstrap, "--api-version", _version(kafka)]
    if kafka.zookeeper is not None:
        args += ["--zookeeper", kafka.zookeeper]
    made = streamrec("kafka", "topic", "create", name, "--partitions", "2", *args)
    assert made.returncode == 0, made.stderr
    assert made.stdout.strip() == f"created topic {name} on {kafka.bootstrap} with 2 partitions"
    return name


def _in_file_order(parts: dict[int, list[Any]], order: dict[bytes, int]) -> None:
    """Each partition holds its records in the order the file has them."""
    for p, records in parts.items():
        positions = [order[r.value] for r in records]
        assert positions == sorted(positions), f"partition {p} is out of file order"


@pytest.mark.processes
def test_json_lines_go_in_once_each_in_file_order(
    broker: KafkaForTests, two_partitions: str, tmp_path: Path
) -> None:
    kafka = broker
    n = 3000
    # Odd spacing and key order: the lines must arrive as they are, not re-encoded.
    lines = [f'{{"id": {i},  "click":{i % 2}, "C1":"u{i % 7}"}}'.encode() for i in range(n)]
    lines.insert(1000, b"not json at all")  # sent all the same: the job dead-letters it
    path = tmp_path / "clicks.jsonl"
    path.write_bytes(b"\n".join(lines[:500]) + b"\n\n" + b"\n".join(lines[500:]) + b"\n")

    url = f"kafka://{kafka.bootstrap}/{two_partitions}"
    result = streamrec(
        "produce", "--from", str(path), "--to", url, "--api-version", _version(kafka)
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(
        f"sent {n + 1:,} records from {path} to {url} (2 partitions) in "
    ), result.stdout
    assert "skipped 1 blank line(s)" in result.stderr

    parts = _records_by_partition(kafka, two_partitions)
    got = [r.value for records in parts.values() for r in records]
    assert sorted(got) == sorted(lines)  # every record, exactly once, byte for byte
    assert all(parts.values()), "both partitions got records"
    _in_file_order(parts, {line: i for i, line in enumerate(lines)})


@pytest.mark.processes
def test_parquet_rows_go_in_as_json_objects_keyed_by_a_field(
    broker: KafkaForTests, two_partitions: str, tmp_path: Path
) -> None:
    kafka = broker
    n = 2000
    table = pa.table(
        {
            "id": list(range(n)),
            "user": [f"user-{i % 13}" for i in range(n)],
            "click": [float(i % 2) for i in range(n)],
            "I1": [None if i % 5 == 0 else i * 0.5 for i in range(n)],
        }
    )
    path = tmp_path / "clicks.parquet"
    pq.write_table(table, path, row_group_size=700)  # several row groups, one order

    url = f"kafka://{kafka.bootstrap}/{two_partitions}"
    result = streamrec(
        "produce",
        *("--from", str(path), "--to", url, "--key-field", "user"),
        *("--api-version", _version(kafka)),
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"sent {n:,} records from {path} to {url} (2 partitions)")

    parts = _records_by_partition(kafka, two_partitions)
    rows = table.to_pylist()
    decoded = {p: [json.loads(r.value) for r in records] for p, records in parts.items()}
    assert sorted(r["id"] for rs in decoded.values() for r in rs) == list(range(n))
    for p, records in parts.items():
        for record, row in zip(records, decoded[p], strict=True):
            assert row == rows[row["id"]]  # the row itself, as the JSON codec reads it
            assert record.key == row["user"].encode()
        ids = [r["id"] for r in decoded[p]]
        assert ids == sorted(ids), f"partition {p} is out of file order"
    # One key, one partition.
    where = {r["user"]: p for p, rs in decoded.items() for r in rs}
    assert all(where[r["user"]] == p for p, rs in decoded.items() for r in rs)


@pytest.mark.processes
def test_partition_pins_the_whole_file_in_order(
    broker: KafkaForTests, two_partitions: str, tmp_path: Path
) -> None:
    kafka = broker
    lines = [json.dumps({"id": i}).encode() for i in range(300)]
    path = tmp_path / "pinned.json"
    path.write_bytes(b"\n".join(lines))  # no newline after the last line
    url = f"kafka://{kafka.bootstrap}/{two_partitions}"
    result = streamrec(
        "produce",
        *("--from", str(path), "--to", url, "--partition", "1"),
        *("--api-version", _version(kafka)),
    )
    assert result.returncode == 0, result.stderr
    assert f"sent 300 records from {path} to {url} (partition 1 of 2)" in result.stdout
    parts = _records_by_partition(kafka, two_partitions)
    assert parts[0] == []
    assert [r.value for r in parts[1]] == lines


@pytest.mark.processes
def test_bad_input_is_one_clear_line(
    broker: KafkaForTests, two_partitions: str, tmp_path: Path
) -> None:
    kafka = broker
    good = tmp_path / "ok.jsonl"
    good.write_text('{"id": 1}\n')
    url = f"kafka://{kafka.bootstrap}/{two_partitions}"
    version = ("--api-version", _version(kafka))

    missing = _one_line_error(
        streamrec("produce", "--from", str(tmp_path / "nope.jsonl"), "--to", url, *version)
    )
    assert missing == f"streamrec produce: --from {tmp_path / 'nope.jsonl'}: no such file"

    for bad_url in ("http://127.0.0.1:9092/t", "kafka://127.0.0.1:9092/", "kafka://h:99999/t"):
        err = _one_line_error(streamrec("produce", "--from", str(good), "--to", bad_url))
        assert f"--to {bad_url!r}: expected kafka://HOST:PORT/TOPIC" in err

    not_parquet = tmp_path / "fake.parquet"
    not_parquet.write_text("{}\n")
    err = _one_line_error(streamrec("produce", "--from", str(not_parquet), "--to", url))
    assert f"--from {not_parquet}: not a Parquet file" in err

    err = _one_line_error(
        streamrec("produce", "--from", str(good), "--to", url, "--partition", "5", *version)
    )
    assert f"partition 5: topic {two_partitions!r} has partitions 0-1" in err

    nobody = f"kafka://127.0.0.1:{free_port()}/t"
    err = _one_line_error(
        streamrec("produce", "--from", str(good), "--to", nobody, "--timeout", "2"), waited=True
    )
    assert "still failing after" in err
    assert "check that the broker runs" in err

    err = _one_line_error(streamrec("produce", "--to", url))
    assert "give either --from FILE" in err


@pytest.mark.processes
def test_topic_create_and_list_on_the_recorded_local_kafka(
    kafka: KafkaForTests, tmp_path: Path
) -> None:
    """Without --bootstrap the topic commands use the Kafka recorded in the state dir."""
    if kafka.local is None:
        pytest.skip("the session uses an outside Kafka")
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    # What `streamrec kafka up` records, for the session's broker (not stopped by anyone).
    (state_dir / "kafka.json").write_text(json.dumps(kafka.local.state()))
    name = f"made-{uuid.uuid4().hex[:10]}"
    where = ("--state-dir", str(state_dir))

    made = streamrec("kafka", "topic", "create", name, "--partitions", "3", *where)
    assert made.returncode == 0, made.stderr
    assert made.stdout == f"created topic {name} on {kafka.bootstrap} with 3 partitions\n"

    listed = streamrec("kafka", "topic", "list", *where)
    assert listed.returncode == 0, listed.stderr
    mine = [line for line in listed.stdout.splitlines() if line.split()[0] == name]
    assert len(mine) == 1, listed.stdout
    assert mine[0].split()[1:] == ["3", "partitions"], listed.stdout
    assert "__consumer_offsets" not in listed.stdout

    again = _one_line_error(streamrec("kafka", "topic", "create", name, *where))
    assert f"topic {name!r} already exists on {kafka.bootstrap} with 3 partition(s)" in again

    nothing = _one_line_error(
        streamrec("kafka", "topic", "list", "--state-dir", str(tmp_path / "empty"))
    )
    assert "give the broker with --bootstrap HOST:PORT" in nothing


# -- where `streamrec kafka up` keeps things --------------------------------------------------


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No streamrec or XDG variables; HOME is ``tmp_path/home``."""
    for name in ("STREAMREC_CACHE_DIR", "STREAMREC_STATE_DIR", "XDG_CACHE_HOME", "XDG_STATE_HOME"):
        monkeypatch.delenv(name, raising=False)
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    return home


def test_default_locations_follow_the_environment_at_call_time(
    clean_env: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert default_cache_dir() == clean_env / ".cache" / "streamrec" / "kafka"
    assert default_state_dir() == clean_env / ".local" / "state" / "streamrec" / "kafka"

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xc"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xs"))
    assert default_cache_dir() == tmp_path / "xc" / "streamrec" / "kafka"
    assert default_state_dir() == tmp_path / "xs" / "streamrec" / "kafka"

    monkeypatch.setenv("STREAMREC_CACHE_DIR", str(tmp_path / "c"))
    monkeypatch.setenv("STREAMREC_STATE_DIR", str(tmp_path / "s"))
    assert default_cache_dir() == tmp_path / "c" / "kafka"
    assert default_state_dir() == tmp_path / "s" / "kafka"

    # A relative XDG path is not one (the XDG rule): the home default applies.
    monkeypatch.delenv("STREAMREC_STATE_DIR")
    monkeypatch.setenv("XDG_STATE_HOME", "relative/state")
    assert default_state_dir() == clean_env / ".local" / "state" / "streamrec" / "kafka"


@pytest.fixture
def xdg_state(clean_env: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """``$XDG_STATE_HOME`` in ``tmp_path`` (the Kafka cache stays the tests' one); yields the
    state dir `streamrec kafka up` must use, and stops whatever Kafka ran from it."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg-state"))
    # The session's cache (the distribution is there already), as an explicit override.
    monkeypatch.setenv("STREAMREC_CACHE_DIR", str(REPO_ROOT / ".cache"))
    state_dir = tmp_path / "xdg-state" / "streamrec" / "kafka"
    try:
        yield state_dir
    finally:
        down(state_dir)


@pytest.mark.processes
def test_kafka_up_keeps_its_state_in_xdg_state_home_and_prints_usable_lines(
    xdg_state: Path, tmp_path: Path
) -> None:
    repo_state = REPO_ROOT / ".streamrec" / "kafka" / "kafka.json"
    before = repo_state.stat().st_mtime_ns if repo_state.exists() else None

    # --port 0: any free port (the default, 9092, may be a developer's own Kafka's).
    started = streamrec("kafka", "up", "--port", "0")
    assert started.returncode == 0, started.stderr
    state = json.loads((xdg_state / "kafka.json").read_text())
    bootstrap = state["bootstrap"]
    assert Path(state["work_dir"]).is_relative_to(tmp_path)
    assert f"bootstrap_servers: {bootstrap}\n" in started.stdout
    assert f"streamrec produce --to kafka://{bootstrap}/TOPIC" in started.stdout
    assert str(xdg_state) in started.stdout
    after = repo_state.stat().st_mtime_ns if repo_state.exists() else None
    assert after == before, "nothing written into the checkout's .streamrec"

    # Topics of it, found through the state (no --bootstrap).
    name = f"xdg-{uuid.uuid4().hex[:8]}"
    made = streamrec("kafka", "topic", "create", name, "--partitions", "2")
    assert made.returncode == 0, made.stderr
    assert f"{name}  2 partitions" in streamrec("kafka", "topic", "list").stdout

    # It stays where its clients look: another port is refused, naming both.
    port = int(bootstrap.rpartition(":")[2])
    moved = _one_line_error(streamrec("kafka", "up", "--port", str(port + 1)))
    assert f"is on port {port}" in moved
    assert f"not {port + 1}" in moved

    stopped = streamrec("kafka", "down")
    assert stopped.returncode == 0, stopped.stderr
    assert stopped.stdout.startswith("Kafka stopped")


@pytest.mark.processes
def test_kafka_up_on_a_taken_port_names_its_holder(xdg_state: Path) -> None:
    with held_port() as port:
        refused = _one_line_error(streamrec("kafka", "up", "--port", str(port)))
    assert f"cannot listen on 127.0.0.1:{port}" in refused
    assert "--port N" in refused
    assert not (xdg_state / "kafka.json").exists()


def test_the_tests_cache_is_the_checkouts(kafka_cache_in_checkout: Path) -> None:
    """`make test` from a fresh clone fetches Kafka once, into the git-ignored .cache/kafka."""
    assert default_cache_dir() == kafka_cache_in_checkout
    ignored = (REPO_ROOT / ".gitignore").read_text().split()
    if kafka_cache_in_checkout.is_relative_to(REPO_ROOT):
        assert ".cache/" in ignored
