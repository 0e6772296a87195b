"""KafkaSource, KafkaDeadLetterSink and produce() against a real Kafka 0.9 broker."""

from __future__ import annotations

import hashlib
import json
import pickle
import random
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cloudpickle  # type: ignore[import-untyped]
import numpy as np
import pytest
from pydantic import ValidationError

from connectors.deadletter import DeadLetterError, KafkaDeadLetterSink, read_dead_letters
from connectors.kafka import KafkaSource, KafkaSourceConfig, UnknownTopic
from connectors.kafka_client import KafkaUnavailable
from connectors.kafka_produce import produce
from connectors.types import BadRecord, Chunk, RawChunk
from deploy.local.kafka import API_VERSION, LocalKafka, free_port
from tests.connectors.contract import plan_all
from tests.support.kafka import SLOW_READS, KafkaForTests, make_kafka_source

# -- helpers ----------------------------------------------------------------------------


def fill(
    bootstrap: str, topic: str, counts: dict[int, int], api_version: tuple[int, ...] = API_VERSION
) -> dict[int, list[bytes]]:
    """Produce ``counts[p]`` distinct payloads into partition ``p``; returns them by partition."""
    produced = {}
    for p, n in counts.items():
        payloads = [f"{topic}/{p}/{i}".encode() for i in range(n)]
        produce(bootstrap, topic, payloads, api_version=api_version, partition=p)
        produced[p] = payloads
    return produced


def fill_small_batches(bootstrap: str, topic: str, n: int, keys: bool = False) -> list[bytes]:
    """Produce ``n`` records to partition 0 in batches that fit a 4 KB segment."""
    values = [f"v{i}".encode() for i in range(n)]
    produce(
        bootstrap,
        topic,
        values,
        api_version=API_VERSION,
        partition=0,
        keys=[f"k{i % 5}".encode() for i in range(n)] if keys else None,
        # A 0.9 segment must hold a whole batch: keep batches well under 4 KB.
        client_options={"batch_size": 512},
    )
    return values


def records_of(raws: list[RawChunk]) -> list[tuple[str, int, bytes]]:
    out = []
    for raw in raws:
        assert raw.payloads is not None
        assert raw.table is None
        assert raw.positions.dtype == np.int64
        assert len(raw.payloads) == len(raw.positions)
        for pos, payload in zip(raw.positions.tolist(), raw.payloads, strict=True):
            assert raw.chunk.start <= pos < raw.chunk.end
            out.append((raw.chunk.partition, pos, payload))
    return out


def expected(topic: str, produced: dict[int, list[bytes]]) -> list[tuple[str, int, bytes]]:
    return [(f"{topic}/{p}", i, v) for p, vs in sorted(produced.items()) for i, v in enumerate(vs)]


# -- configuration (no broker) ----------------------------------------------------------


def test_config_rejects_what_it_would_otherwise_ignore() -> None:
    base = {"bootstrap_servers": "127.0.0.1:9092", "topics": ["t"], "group_id": "g"}
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        KafkaSourceConfig(**base, max_record=5)  # type: ignore[call-arg]
    with pytest.raises(ValidationError, match="at least 1 item"):
        KafkaSourceConfig(**{**base, "topics": []})
    with pytest.raises(ValidationError, match="not a Kafka topic name"):
        KafkaSourceConfig(**{**base, "topics": ["a/b"]})
    with pytest.raises(ValidationError, match="does not know: \\['sasl_mechansim'\\]"):
        KafkaSourceConfig(**base, client_options={"sasl_mechansim": "PLAIN"})
    with pytest.raises(ValidationError, match="may not set \\['group_id'\\]"):
        KafkaSourceConfig(**base, client_options={"group_id": "other"})
    with pytest.raises(ValidationError, match='api_version must be "auto"'):
        KafkaSourceConfig(**base, api_version="latest")
    with pytest.raises(ValidationError, match="auto_offset_reset"):
        KafkaSourceConfig(**base, auto_offset_reset="smallest")
    with pytest.raises(ValidationError, match="frozen"):
        KafkaSourceConfig(**base).group_id = "x"  # type: ignore[misc]

    cfg = KafkaSourceConfig(
        **{**base, "bootstrap_servers": ["a:1", "b:2"]},
        api_version=[0, 10, 2],
        client_options={"security_protocol": "SSL", "ssl_cafile": "/etc/ca.pem"},
    )
    assert cfg.bootstrap_servers == "a:1,b:2"
    assert cfg.api_version == (0, 10, 2)
    assert KafkaSourceConfig(**base, api_version="0.9").api_version == (0, 9)
    assert KafkaSourceConfig(**base).api_version == "auto"


# -- planning and reading ---------------------------------------------------------------


@pytest.mark.processes
def test_plans_exact_ranges_and_reads_every_record_once(
    broker: KafkaForTests, sources: Callable[..., KafkaSource]
) -> None:
    topic = broker.new_topic(3)
    produced = fill(broker.bootstrap, topic, {0: 25, 1: 10, 2: 0}, broker.api_version)
    source = sources(broker.bootstrap, topic, max_records=10, api_version=broker.api_version)

    assert source.name == "kafka"
    assert source.partitions() == [f"{topic}/0", f"{topic}/1", f"{topic}/2"]
    assert [source.end_position(p) for p in source.partitions()] == [25, 10, 0]
    assert not source.is_finished(f"{topic}/0", 25)

    spans = {
        p: [(c.start, c.end) for c in plan_all(source, p, 0, 100)] for p in source.partitions()
    }
    # The config caps chunks at 10 records even though plan() was offered 100.
    assert spans == {
        f"{topic}/0": [(0, 10), (10, 20), (20, 25)],
        f"{topic}/1": [(0, 10)],
        f"{topic}/2": [],
    }
    assert source.plan(f"{topic}/0", 20, 3) == Chunk("kafka", f"{topic}/0", 20, 23)

    chunks = [c for p in source.partitions() for c in plan_all(source, p, 0, 10)]
    raws = [source.read(c) for c in chunks]
    assert records_of(raws) == expected(topic, produced)
    assert [len(r) for r in raws] == [10, 10, 5, 10]


@pytest.mark.processes
def test_chunks_read_in_any_order_or_twice_give_the_same_records(
    kafka: KafkaForTests, kafka_topic: Callable[..., str], sources: Callable[..., KafkaSource]
) -> None:
    topic = kafka_topic(2)
    produced = fill(kafka.bootstrap, topic, {0: 40, 1: 33})
    source = sources(kafka.bootstrap, topic, max_records=7)
    chunks = [c for p in source.partitions() for c in plan_all(source, p, 0, 7)]
    assert len(chunks) == 6 + 5

    shuffled = chunks[:]
    random.Random(7).shuffle(shuffled)
    # The same cached consumer seeks back and forth; each chunk is read twice.
    first = {c: source.read(c) for c in shuffled}
    second = {c: source.read(c) for c in reversed(shuffled)}
    for c in chunks:
        assert first[c].positions.tolist() == list(range(c.start, c.end))
        assert records_of([first[c]]) == records_of([second[c]])
    assert sorted(records_of(list(first.values()))) == sorted(expected(topic, produced))


@pytest.mark.processes
def test_read_stops_at_the_chunk_end_even_when_more_exist(
    kafka: KafkaForTests, kafka_topic: Callable[..., str], sources: Callable[..., KafkaSource]
) -> None:
    topic = kafka_topic()
    produced = fill(kafka.bootstrap, topic, {0: 50})
    source = sources(kafka.bootstrap, topic)
    raw = source.read(Chunk("kafka", f"{topic}/0", 17, 21))
    assert raw.positions.tolist() == [17, 18, 19, 20]
    assert list(raw.payloads or []) == produced[0][17:21]
    assert len(source.read(Chunk("kafka", f"{topic}/0", 5, 5))) == 0


@pytest.mark.processes
def test_plan_is_none_until_new_records_arrive(
    broker: KafkaForTests, sources: Callable[..., KafkaSource]
) -> None:
    """Every record is planned as soon as it is in the log, the last of a batch too
    (Tansu's ListOffsets says the newest batch's base offset plus one)."""
    topic = broker.new_topic()
    source = sources(broker.bootstrap, topic, api_version=broker.api_version)
    partition = f"{topic}/0"
    assert source.plan(partition, 0, 100) is None
    fill(broker.bootstrap, topic, {0: 3}, broker.api_version)
    chunk = source.plan(partition, 0, 100)
    assert chunk == Chunk("kafka", partition, 0, 3)
    assert source.plan(partition, 3, 100) is None
    fill(broker.bootstrap, topic, {0: 40}, broker.api_version)  # one batch of 40
    assert source.plan(partition, 3, 100) == Chunk("kafka", partition, 3, 43)
    assert source.read(Chunk("kafka", partition, 3, 43)).positions.tolist() == list(range(3, 43))


@pytest.mark.processes
def test_records_removed_by_compaction_are_absent(
    kafka: KafkaForTests, kafka_topic: Callable[..., str], sources: Callable[..., KafkaSource]
) -> None:
    if kafka.local is None:
        pytest.skip("needs the local broker's 1 s cleaner backoff")
    topic = kafka_topic(
        config={
            "cleanup.policy": "compact",
            "segment.bytes": "4096",  # many small segments: all but the last get cleaned
            "min.cleanable.dirty.ratio": "0.01",
            "delete.retention.ms": "100",
        }
    )
    values = fill_small_batches(kafka.bootstrap, topic, 200, keys=True)
    source = sources(kafka.bootstrap, topic)
    chunk = source.plan(f"{topic}/0", 0, 1000)
    assert chunk is not None
    assert (chunk.start, chunk.end) == (0, 200)

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        raw = source.read(chunk)
        if len(raw) < 150:
            break
        time.sleep(0.5)
    positions = raw.positions.tolist()
    assert len(positions) < 150, "the log cleaner did not compact the topic within 30 s"
    # What is left are the records the log kept, each at its own offset, in order.
    assert positions == sorted(set(positions))
    assert list(raw.payloads or []) == [values[p] for p in positions]
    # The newest record of every key survives compaction.
    assert set(range(195, 200)) <= set(positions)


@pytest.mark.processes
def test_a_chunk_beyond_the_log_is_an_error_not_an_empty_read(
    kafka: KafkaForTests, kafka_topic: Callable[..., str], sources: Callable[..., KafkaSource]
) -> None:
    topic = kafka_topic()
    fill(kafka.bootstrap, topic, {0: 5})
    source = sources(kafka.bootstrap, topic, retry_timeout_s=1)
    # Offsets 50..59 are not in the log: the broker says "out of range", and the
    # source waits for a recovering broker to catch up rather than return nothing.
    with pytest.raises(KafkaUnavailable, match="OffsetOutOfRange"):
        source.read(Chunk("kafka", f"{topic}/0", 50, 60))
    # The source is still fine for chunks that exist.
    assert source.read(Chunk("kafka", f"{topic}/0", 0, 5)).positions.tolist() == [0, 1, 2, 3, 4]


# -- offsets and the consumer group -----------------------------------------------------


@pytest.mark.processes
def test_start_position_uses_the_committed_offset_else_the_reset_policy(
    kafka: KafkaForTests, kafka_topic: Callable[..., str], sources: Callable[..., KafkaSource]
) -> None:
    topic = kafka_topic(2)
    fill(kafka.bootstrap, topic, {0: 12, 1: 8})
    group = f"g-{uuid.uuid4().hex[:8]}"
    earliest = sources(kafka.bootstrap, topic, group_id=group, auto_offset_reset="earliest")
    latest = sources(kafka.bootstrap, topic, group_id=group, auto_offset_reset="latest")
    p0, p1 = f"{topic}/0", f"{topic}/1"

    assert earliest.committed(p0) is None
    assert [earliest.start_position(p) for p in (p0, p1)] == [0, 0]
    assert [latest.start_position(p) for p in (p0, p1)] == [12, 8]

    earliest.commit({p0: 5})
    # The same group sees the commit, whatever its reset policy; other partitions do not.
    assert earliest.start_position(p0) == 5
    assert latest.start_position(p0) == 5
    assert latest.start_position(p1) == 8
    # Another group has its own offsets.
    other = sources(kafka.bootstrap, topic, auto_offset_reset="earliest")
    assert other.start_position(p0) == 0


@pytest.mark.processes
def test_offsets_are_committed_only_when_asked(
    kafka: KafkaForTests, kafka_topic: Callable[..., str], sources: Callable[..., KafkaSource]
) -> None:
    topic = kafka_topic()
    fill(kafka.bootstrap, topic, {0: 30})
    group = f"g-{uuid.uuid4().hex[:8]}"
    source = sources(kafka.bootstrap, topic, group_id=group, max_records=10)
    partition = f"{topic}/0"
    for chunk in plan_all(source, partition, source.start_position(partition), 10):
        source.read(chunk)
    source.close()  # closing does not commit either

    fresh = sources(kafka.bootstrap, topic, group_id=group)
    assert fresh.committed(partition) is None
    assert fresh.start_position(partition) == 0

    source.commit({partition: 20})
    assert fresh.committed(partition) == 20
    assert sources(kafka.bootstrap, topic, group_id=group).start_position(partition) == 20
    source.commit({})  # nothing to commit: no call, no error
    assert fresh.committed(partition) == 20


@pytest.mark.processes
def test_partitions_added_later_are_picked_up(
    kafka: KafkaForTests, kafka_topic: Callable[..., str], sources: Callable[..., KafkaSource]
) -> None:
    topic = kafka_topic(1)
    source = sources(kafka.bootstrap, topic)
    assert source.partitions() == [f"{topic}/0"]

    kafka.add_partitions(topic, 3)
    assert source.partitions() == [f"{topic}/0", f"{topic}/1", f"{topic}/2"]
    produced = fill(kafka.bootstrap, topic, {2: 4})
    chunk = source.plan(f"{topic}/2", source.start_position(f"{topic}/2"), 100)
    assert chunk is not None
    assert list(source.read(chunk).payloads or []) == produced[2]


@pytest.mark.processes
def test_several_topics_are_one_source(
    kafka: KafkaForTests, kafka_topic: Callable[..., str], sources: Callable[..., KafkaSource]
) -> None:
    a, b = kafka_topic(2), kafka_topic(1)
    source = sources(kafka.bootstrap, a, topics=[a, b])
    assert source.partitions() == [f"{a}/0", f"{a}/1", f"{b}/0"]


@pytest.mark.processes
def test_unknown_topic_is_reported(
    kafka: KafkaForTests, sources: Callable[..., KafkaSource]
) -> None:
    source = sources(kafka.bootstrap, f"missing-{uuid.uuid4().hex[:8]}", retry_timeout_s=2)
    with pytest.raises(UnknownTopic, match=r"do not exist .* create them"):
        source.partitions()


# -- shipping to workers ----------------------------------------------------------------


@pytest.mark.processes
@pytest.mark.parametrize("dumps", [pickle.dumps, cloudpickle.dumps], ids=["pickle", "cloudpickle"])
def test_source_pickles_without_its_clients(
    kafka: KafkaForTests,
    kafka_topic: Callable[..., str],
    sources: Callable[..., KafkaSource],
    dumps: Callable[[Any], bytes],
) -> None:
    topic = kafka_topic()
    produced = fill(kafka.bootstrap, topic, {0: 6})
    source = sources(kafka.bootstrap, topic, client_options={"client_id": "streamrec-test"})
    chunk = source.plan(f"{topic}/0", 0, 100)
    assert chunk is not None
    before = source.read(chunk)  # the source now caches live clients

    copy = pickle.loads(dumps(source))
    try:
        assert copy.config == source.config
        assert copy.api_version() == API_VERSION
        assert copy._clients == {}
        after = copy.read(pickle.loads(dumps(chunk)))
        assert records_of([after]) == records_of([before])
        assert list(after.payloads or []) == produced[0]
        # client_options reach kafka-python.
        assert copy._client("read").config["client_id"] == "streamrec-test"
    finally:
        copy.close()


@pytest.mark.processes
def test_api_version_auto_detects_or_falls_back_to_0_9(
    kafka: KafkaForTests, kafka_topic: Callable[..., str], sources: Callable[..., KafkaSource]
) -> None:
    topic = kafka_topic()
    produced = fill(kafka.bootstrap, topic, {0: 3})
    source = sources(kafka.bootstrap, topic, api_version="auto")
    assert source.config.api_version == "auto"
    # kafka-python 3 cannot detect 0.9; "auto" falls back to (0, 9) and works.
    assert source.api_version() == kafka.api_version
    chunk = source.plan(f"{topic}/0", source.start_position(f"{topic}/0"), 100)
    assert chunk is not None
    assert list(source.read(chunk).payloads or []) == produced[0]
    # The detected version travels with the source: a worker does not detect again.
    assert pickle.loads(pickle.dumps(source))._api_version == kafka.api_version


def test_unreachable_broker_raises_after_the_retry_timeout() -> None:
    source = make_kafka_source(f"127.0.0.1:{free_port()}", "t", retry_timeout_s=1.5)
    started = time.monotonic()
    try:
        with pytest.raises(KafkaUnavailable, match=r"still failing after 1\.5s"):
            source.partitions()
    finally:
        source.close()
    assert 1.4 < time.monotonic() - started < 10


# -- dead letters -----------------------------------------------------------------------


@pytest.mark.processes
def test_dead_letter_sink_round_trip(
    kafka: KafkaForTests, kafka_topic: Callable[..., str], sources: Callable[..., KafkaSource]
) -> None:
    topic = kafka_topic()
    dead_topic = f"{topic}.deadletter"
    kafka.create_topic(dead_topic)
    bad = [
        BadRecord("kafka", f"{topic}/0", 7, "not_json", None, "payload is not JSON", b"\xff\x00{"),
        BadRecord("kafka", f"{topic}/0", 9, "nan", "price", "price is NaN", b'{"price": NaN}'),
    ]
    sink = KafkaDeadLetterSink(kafka.bootstrap, dead_topic, api_version=kafka.api_version)
    sink.write(bad)
    sink.write([])
    sink.close()
    assert (sink.written, sink.failed) == (2, 0)

    reader = sources(kafka.bootstrap, dead_topic)
    chunk = reader.plan(f"{dead_topic}/0", 0, 100)
    assert chunk is not None
    got = [json.loads(v) for v in reader.read(chunk).payloads or []]
    assert got == [r.to_json() for r in bad]
    restored = [BadRecord.from_json(g) for g in got]  # raw bytes survive, UTF-8 or not
    assert restored == bad
    assert restored[0].raw == b"\xff\x00{"


def test_dead_letter_sink_without_a_spill_file_reports_losses_on_flush_and_close() -> None:
    sink = KafkaDeadLetterSink(
        f"127.0.0.1:{free_port()}",
        "nowhere.deadletter",
        api_version="0.9",
        client_options={"max_block_ms": 300},
    )
    record = BadRecord("kafka", "t/0", 1, "nan", "x", "x is NaN", b"{}")
    sink.write([record, record])  # the broker is unreachable: no exception here
    with pytest.raises(DeadLetterError, match="2 bad record\\(s\\) could not be written"):
        sink.flush()
    with pytest.raises(DeadLetterError, match="2 bad record\\(s\\) could not be written"):
        sink.close()
    assert pickle.loads(pickle.dumps(sink)).topic == "nowhere.deadletter"


@pytest.mark.processes
def test_an_oversize_bad_record_is_cut_to_fit_and_kept_whole_in_the_spill_file(
    kafka: KafkaForTests,
    kafka_topic: Callable[..., str],
    sources: Callable[..., KafkaSource],
    tmp_path: Path,
) -> None:
    """A 900 KB bad record: its 1.8 MB envelope used to be refused by the broker and lost."""
    topic = kafka_topic()
    dead_topic = f"{topic}.deadletter"
    kafka.create_topic(dead_topic)
    raw = bytes(range(256)) * 3600  # 921,600 bytes, half of them non-ASCII
    big = BadRecord("kafka", f"{topic}/0", 41, "not_json", None, "payload is not JSON", raw)
    small = BadRecord("kafka", f"{topic}/0", 42, "not_json", None, "payload is not JSON", b"{")
    spill = tmp_path / "deadletter-rank0.jsonl"
    sink = KafkaDeadLetterSink(
        kafka.bootstrap, dead_topic, api_version=kafka.api_version, spill_path=spill
    )
    sink.write([big, small])
    sink.flush()  # durable: acknowledged, or whole in the spill file
    assert (sink.written, sink.truncated, sink.spilled, sink.failed) == (2, 1, 0, 0)
    assert read_dead_letters(spill) == [big]  # the whole record, bytes exact
    sink.close()

    reader = sources(kafka.bootstrap, dead_topic)
    chunk = reader.plan(f"{dead_topic}/0", 0, 100)
    assert chunk is not None
    got = [json.loads(v) for v in reader.read(chunk).payloads or []]
    assert len(got) == 2
    cut, whole = got
    assert cut["truncated"] is True
    assert cut["raw_bytes"] == len(raw)
    assert cut["raw_sha256"] == hashlib.sha256(raw).hexdigest()
    assert cut["whole_record_in"] == str(spill)
    assert 0 < len(cut["raw"]) < len(raw)
    assert raw.startswith(cut["raw"].encode("latin-1"))
    assert (cut["partition"], cut["position"]) == (big.partition, big.position)
    assert BadRecord.from_json(whole) == small


def test_dead_letters_a_broker_cannot_take_are_spilled_and_flush_says_so(tmp_path: Path) -> None:
    spill = tmp_path / "spill.jsonl"
    sink = KafkaDeadLetterSink(
        f"127.0.0.1:{free_port()}",
        "nowhere.deadletter",
        api_version="0.9",
        client_options={"max_block_ms": 300},
        spill_path=spill,
        flush_timeout_s=2.0,
    )
    record = BadRecord("kafka", "t/0", 1, "nan", "x", "x is NaN", b"{}")
    sink.write([record, record])  # the broker is unreachable: no exception here
    sink.flush()  # kept whole in the spill file: durable, so no error
    assert sink.spilled == 2
    assert sink.failed == 0
    assert read_dead_letters(spill) == [record, record]
    sink.close()


# -- broker restarts --------------------------------------------------------------------


class Reader(threading.Thread):
    """Reads chunks in the background, as a Dask worker would."""

    def __init__(self, source: KafkaSource, chunks: list[Chunk]) -> None:
        super().__init__(daemon=True)
        self.source, self.chunks = source, chunks
        self.raws: list[RawChunk] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.raws = [self.source.read(c) for c in self.chunks]
        except BaseException as exc:
            self.error = exc


@pytest.mark.processes
@pytest.mark.parametrize(
    ("kill", "reader"),
    [(False, "raw"), (True, "raw"), (False, "kafka-python")],
    ids=["stop", "kill-9", "stop-kafka-python"],
)
def test_broker_restart_mid_read_delays_but_loses_nothing(
    restartable: LocalKafka, sources: Callable[..., KafkaSource], kill: bool, reader: str
) -> None:
    topic = f"restart-{uuid.uuid4().hex[:8]}"
    restartable.create_topic(topic, 2)
    produced = fill(restartable.bootstrap, topic, {0: 150, 1: 150})
    source = sources(
        restartable.bootstrap,
        topic,
        max_records=100,
        client_options=SLOW_READS,  # reading takes a few seconds
        reader=reader,
    )
    group_partition = f"{topic}/0"
    chunks = [c for p in source.partitions() for c in plan_all(source, p, 0, 100)]
    assert len(chunks) == 4
    first = source.read(chunks[0])  # one chunk before the trouble

    reader = Reader(source, chunks[1:])
    reader.start()
    time.sleep(0.3)
    assert reader.is_alive(), "the read finished before the broker went away"
    if kill:
        restartable.kill_broker()
    else:
        restartable.stop_broker()
    assert not restartable.broker_process or not restartable.broker_process.alive()

    # Planning while the broker is away waits for it, too.
    planned: list[Chunk | None] = []
    planner = threading.Thread(
        target=lambda: planned.append(source.plan(group_partition, 100, 100)), daemon=True
    )
    planner.start()
    time.sleep(1.0)
    assert reader.is_alive()  # waiting, not failed
    assert planner.is_alive()
    restartable.start_broker()

    reader.join(90)
    planner.join(90)
    assert not reader.is_alive()
    assert reader.error is None, reader.error
    assert planned == [Chunk("kafka", group_partition, 100, 150)]
    assert records_of([first, *reader.raws]) == expected(topic, produced)

    # After the restart, offsets commit and survive, and new records flow.
    source.commit({group_partition: 150})
    assert source.start_position(group_partition) == 150
    fill(restartable.bootstrap, topic, {0: 1})
    assert source.plan(group_partition, 150, 100) == Chunk("kafka", group_partition, 150, 151)
