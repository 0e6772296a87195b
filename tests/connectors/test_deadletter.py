"""Dead letters are never lost: flush() is the durability point of every sink.

The Kafka sink against a real Kafka 0.9 broker (and Tansu, the modern protocol,
for the oversized record): an envelope too large for the
topic goes there cut to fit and whole into the spill file; a record the broker
refuses is spilled once; a record that can be neither delivered nor spilled
makes every flush() raise until it is delivered. The JSON-lines sink: a disk
that refuses a write, tears a line or fails an fsync makes flush() raise
DeadLetterError, and the records are written once the disk takes them again.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from connectors.deadletter import (
    DEFAULT_MAX_MESSAGE_BYTES,
    DeadLetterError,
    JsonlDeadLetterSink,
    KafkaDeadLetterSink,
    read_dead_letters,
)
from connectors.types import BadRecord
from deploy.local.kafka import free_port
from tests.support.kafka import KafkaForTests, read_partition

# 921,600 bytes, every byte value: as JSON text (\u00XX escapes) about 3.7 MB.
BIG_RAW = bytes(range(256)) * 3600


def bad(position: int, raw: bytes = b"{", partition: str = "events/0") -> BadRecord:
    return BadRecord("kafka", partition, position, "not_json", None, "payload is not JSON", raw)


def letters(kafka: KafkaForTests, topic: str, n: int) -> list[dict[str, Any]]:
    """The first ``n`` envelopes of partition 0 of ``topic``, as JSON objects."""
    records = read_partition(kafka.bootstrap, topic, 0, n, api_version=kafka.api_version)
    return [json.loads(r.value) for r in records]


# -- Kafka: oversize, refused ----------------------------------------------------------------


@pytest.mark.processes
def test_a_900_kb_bad_record_reaches_the_topic_cut_to_fit_and_the_spill_file_whole(
    broker: KafkaForTests, tmp_path: Path
) -> None:
    """Its envelope used to be refused by the broker (MessageSizeTooLargeError) and lost."""
    kafka = broker
    topic = broker.new_topic()
    big, small = bad(41, BIG_RAW), bad(42, b"\xff{")
    spill = tmp_path / "deadletter-rank0.jsonl"
    sink = KafkaDeadLetterSink(
        kafka.bootstrap, topic, api_version=kafka.api_version, spill_path=spill
    )
    sink.write([big, small])
    sink.flush()  # no error: both durable
    assert (sink.written, sink.truncated, sink.spilled, sink.failed) == (2, 1, 0, 0)
    assert read_dead_letters(spill) == [big]  # the whole record, bytes exact
    sink.close()

    [cut, whole] = letters(kafka, topic, 2)
    assert cut["truncated"] is True
    assert cut["raw_bytes"] == len(BIG_RAW)
    assert cut["raw_sha256"] == hashlib.sha256(BIG_RAW).hexdigest()
    assert cut["whole_record_in"] == str(spill)
    assert (cut["partition"], cut["position"], cut["reason"]) == ("events/0", 41, "not_json")
    kept = cut["raw"].encode("latin-1")
    assert 0 < len(kept) < len(BIG_RAW)
    assert BIG_RAW.startswith(kept)
    # Cut to fit, not to a fraction: the envelope fills the broker's limit.
    size = len(json.dumps(cut).encode())
    assert DEFAULT_MAX_MESSAGE_BYTES - 2048 < size <= DEFAULT_MAX_MESSAGE_BYTES - 1024
    assert BadRecord.from_json(whole) == small  # a record that fits goes whole, after it


@pytest.mark.processes
def test_max_request_size_of_the_client_options_is_the_limit_too(
    kafka: KafkaForTests, kafka_topic: Callable[..., str], tmp_path: Path
) -> None:
    topic = kafka_topic()
    record = bad(7, b"\x01" * 30_000)  # 180 KB as JSON
    sink = KafkaDeadLetterSink(
        kafka.bootstrap,
        topic,
        api_version=kafka.api_version,
        client_options={"max_request_size": 50_000},
        spill_path=tmp_path / "spill.jsonl",
    )
    assert sink.max_message_bytes == 50_000
    sink.write([record])
    sink.close()
    assert (sink.written, sink.truncated) == (1, 1)
    [cut] = letters(kafka, topic, 1)
    assert cut["truncated"] is True
    assert 48_000 < len(json.dumps(cut)) <= 50_000
    assert read_dead_letters(tmp_path / "spill.jsonl") == [record]
    with pytest.raises(ValueError, match="at least 8192"):
        KafkaDeadLetterSink(kafka.bootstrap, topic, max_message_bytes=100)


@pytest.mark.processes
def test_a_record_the_broker_still_refuses_is_spilled_whole_once_and_the_rest_goes_on(
    kafka: KafkaForTests, kafka_topic: Callable[..., str], tmp_path: Path
) -> None:
    """A topic whose max.message.bytes is below the sink's limit refuses cut envelopes too."""
    topic = kafka_topic(config={"max.message.bytes": "30000"})
    big, medium, small = bad(1, BIG_RAW), bad(2, b"m" * 40_000), bad(3)
    spill = tmp_path / "spill.jsonl"
    sink = KafkaDeadLetterSink(
        kafka.bootstrap, topic, api_version=kafka.api_version, spill_path=spill
    )
    for record in (big, medium, small):  # one at a time: a refused batch holds one record
        sink.write([record])
        sink.flush()  # refused, but whole in the spill file: durable, no error
    assert (sink.written, sink.truncated, sink.spilled, sink.failed) == (1, 0, 2, 0)
    assert read_dead_letters(spill) == [big, medium]  # each once, bytes exact
    sink.close()
    assert [BadRecord.from_json(d) for d in letters(kafka, topic, 1)] == [small]


# -- Kafka: unreachable ----------------------------------------------------------------------


class Proxy:
    """A TCP forwarder from ``port`` (closed until :meth:`open`) to ``target``."""

    def __init__(self, port: int, target: tuple[str, int]) -> None:
        self.port = port
        self.target = target
        self._server: socket.socket | None = None
        self._sockets: list[socket.socket] = []

    def open(self) -> None:
        server = socket.create_server(("127.0.0.1", self.port))
        self._server = server
        threading.Thread(target=self._accept, args=(server,), daemon=True).start()

    def _accept(self, server: socket.socket) -> None:
        while True:
            try:
                client, _ = server.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            self._sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                s.close()

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for s in self._sockets:
            s.close()


@pytest.fixture
def proxy(kafka: KafkaForTests) -> Iterator[Proxy]:
    host, port = kafka.bootstrap.rsplit(":", 1)
    p = Proxy(free_port(), (host, int(port)))
    yield p
    p.close()


@pytest.mark.processes
def test_flush_raises_while_records_can_be_neither_delivered_nor_spilled_then_delivers(
    kafka: KafkaForTests, kafka_topic: Callable[..., str], proxy: Proxy
) -> None:
    topic = kafka_topic()
    sink = KafkaDeadLetterSink(
        f"127.0.0.1:{proxy.port}",  # nothing listens there yet
        topic,
        api_version=kafka.api_version,
        client_options={
            "max_block_ms": 1500,
            "reconnect_backoff_ms": 50,
            "reconnect_backoff_max_ms": 100,
        },
        flush_timeout_s=10,
    )
    records = [bad(1, b"\x00"), bad(2, b"\xff")]
    sink.write(records)  # no exception: the stream goes on
    for _ in range(2):  # it keeps saying so: the records are held, not dropped
        with pytest.raises(DeadLetterError, match="2 bad record\\(s\\) could not be written"):
            sink.flush()
        assert sink.failed == 2
    assert pickle.loads(pickle.dumps(sink)).failed == 0  # a copy is not responsible for them

    proxy.open()  # the broker is reachable again
    sink.flush()  # sent again and acknowledged
    assert (sink.written, sink.failed) == (2, 0)
    sink.close()
    assert [BadRecord.from_json(d) for d in letters(kafka, topic, 2)] == records


def test_an_oversize_record_without_a_spill_file_is_never_cut_and_flush_says_so() -> None:
    sink = KafkaDeadLetterSink(
        f"127.0.0.1:{free_port()}",
        "nowhere.deadletter",
        api_version="0.9",
        client_options={"max_block_ms": 300},
    )
    sink.write([bad(1, BIG_RAW)])
    with pytest.raises(DeadLetterError, match="1 bad record\\(s\\)"):
        sink.flush()
    with pytest.raises(DeadLetterError, match="no spill_path to keep it whole"):
        sink.close()


def test_unreachable_broker_and_failing_spill_disk_raise_until_the_disk_takes_them(
    tmp_path: Path,
) -> None:
    blocker = tmp_path / "run"
    blocker.write_text("a file where the run directory should be")
    spill = blocker / "deadletter-rank0.jsonl"
    sink = KafkaDeadLetterSink(
        f"127.0.0.1:{free_port()}",
        "nowhere.deadletter",
        api_version="0.9",
        client_options={"max_block_ms": 300},
        spill_path=spill,
        flush_timeout_s=2.0,
    )
    records = [bad(1), bad(2, BIG_RAW)]
    sink.write(records)  # neither the broker nor the disk takes them: no exception
    for _ in range(2):
        with pytest.raises(DeadLetterError, match="2 bad record\\(s\\) could not be made durable"):
            sink.flush()
    assert sink.failed == 2
    blocker.unlink()
    blocker.mkdir()
    sink.flush()
    assert (sink.spilled, sink.failed) == (2, 0)
    assert pickle.loads(pickle.dumps(sink)).topic == "nowhere.deadletter"  # spill file open
    sink.close()
    assert read_dead_letters(spill) == records


# -- JSON lines: a failing disk --------------------------------------------------------------


def test_jsonl_sink_keeps_what_the_disk_refused_and_flush_raises_until_it_is_written(
    tmp_path: Path,
) -> None:
    blocker = tmp_path / "dead"
    blocker.write_text("")
    path = blocker / "letters.jsonl"
    sink = JsonlDeadLetterSink(path)
    sink.write([bad(0), bad(1)])  # the directory cannot be made: no exception
    assert sink.failed == 2
    for _ in range(2):
        with pytest.raises(DeadLetterError, match="2 bad record\\(s\\) could not be made durable"):
            sink.flush()
    blocker.unlink()
    sink.write([bad(2)])  # the held records go first
    sink.flush()
    assert sink.failed == 0
    sink.close()
    assert [r.position for r in read_dead_letters(path)] == [0, 1, 2]


def test_jsonl_sink_takes_a_torn_line_back_and_writes_it_whole_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_write = os.write
    full = {"disk": True}

    def write(fd: int, data: Any) -> int:
        if full["disk"]:
            if len(data) > 10:
                return real_write(fd, bytes(data[:10]))  # a partial write...
            raise OSError(errno.ENOSPC, "No space left on device")  # ...then the disk is full
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)
    path = tmp_path / "letters.jsonl"
    sink = JsonlDeadLetterSink(path)
    sink.write([bad(0, BIG_RAW[:1000])])
    assert path.read_bytes() == b""  # no half line left behind
    with pytest.raises(DeadLetterError, match="No space left on device"):
        sink.flush()
    full["disk"] = False
    sink.close()
    assert read_dead_letters(path) == [bad(0, BIG_RAW[:1000])]


def test_jsonl_sink_writes_again_what_a_failed_fsync_may_have_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_fsync = os.fsync
    failures = [OSError(errno.EIO, "Input/output error")]

    def fsync(fd: int) -> None:
        if failures:
            raise failures.pop()
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    path = tmp_path / "letters.jsonl"
    sink = JsonlDeadLetterSink(path)
    sink.write([bad(0)])
    with pytest.raises(DeadLetterError, match="Input/output error"):
        sink.flush()
    assert (sink.failed, sink.written) == (1, 0)
    sink.flush()  # appended again, then synced: a duplicate, never a loss
    assert (sink.failed, sink.written) == (0, 1)
    sink.close()
    assert read_dead_letters(path) == [bad(0), bad(0)]


def test_jsonl_sink_syncs_by_itself_past_sync_every_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[int] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    sink = JsonlDeadLetterSink(tmp_path / "letters.jsonl", sync_every_bytes=5000)
    for i in range(10):
        sink.write([bad(i, b"x" * 1000)])  # about 1.1 KB per line
    assert len(synced) == 2  # what waits for an fsync stays bounded
    sink.close()
    assert len(read_dead_letters(tmp_path / "letters.jsonl")) == 10


def test_jsonl_sink_starts_its_own_line_after_one_a_killed_writer_left_unfinished(
    tmp_path: Path,
) -> None:
    path = tmp_path / "letters.jsonl"
    torn = json.dumps(bad(0, b"a" * 100).to_json())[:50]  # no newline: the writer died
    path.write_text(torn)
    with JsonlDeadLetterSink(path) as sink:
        sink.write([bad(1)])
        sink.write([bad(2)])
    lines = path.read_text().splitlines()
    assert lines[0] == torn  # left as it was: read_dead_letters names it
    assert [BadRecord.from_json(json.loads(line)) for line in lines[1:]] == [bad(1), bad(2)]
