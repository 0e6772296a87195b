"""StreamRunner reading Kafka: bad records dead-lettered and counted, a worker killed, a restart.

Everything is real: a Kafka broker, a Dask LocalCluster of worker processes and
a store shard process over gRPC. Each good record carries a unique id in its
``age`` field (a dense feature, exact in float32), so a test reads back, per
partition, which good records arrived and in which order.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from distributed import Client

from connectors.codecs import JsonLinesCodec
from connectors.deadletter import JsonlDeadLetterSink, KafkaDeadLetterSink, read_dead_letters
from connectors.kafka import KafkaSource
from connectors.kafka_produce import produce
from connectors.types import BadRecord, Chunk, DeadLetterSink
from deploy.local.kafka import API_VERSION, LocalKafka
from pipeline.prepare import StoreAddress, prepare
from pipeline.runner import StreamRunner
from pipeline.types import PreparedBatch
from tests.support.bad_records import JSON_BAD_CASES, SPEC, j
from tests.support.kafka import SLOW_READS, KafkaForTests, make_kafka_source, read_partition
from tests.support.processes import dask_cluster

pytestmark = pytest.mark.processes

CODEC = JsonLinesCodec()
ID_COLUMN = [d.name for d in SPEC.dense].index("age")
# A partition's ids start at this multiple of its number: ids are unique across partitions.
ID_STRIDE = 100_000

BadCase = tuple[bytes, str, str | None]


def good_payload(i: int) -> bytes:
    """Good record ``i``: its id in ``age``, its other fields derived from it."""
    return j(
        {
            "click": i % 2,
            "price": float(i % 1000),
            "age": float(i),
            "user": f"u{i % 97}",
            "item": i,
            "tags": [f"t{i % 5}", f"t{i % 3}"],
            "cats": [i % 7],
        }
    )


class Stream:
    """What a test produced into a topic, hence what the runner must yield.

    Per partition: the ids of the good records in offset order, the log end, and
    the bad records by (partition, offset) with their payload, reason and field.
    """

    def __init__(self, kafka_bootstrap: str, api_version: tuple[int, ...], topic: str) -> None:
        self.bootstrap, self.api_version, self.topic = kafka_bootstrap, api_version, topic
        self.ids: dict[str, list[int]] = {}
        self.ends: dict[str, int] = {}
        self.bad: dict[tuple[str, int], BadCase] = {}
        self.payloads: dict[str, list[bytes]] = {}  # in offset order
        self._next_id: dict[str, int] = {}

    def plan(self, partition: int, n_good: int, cases: Sequence[BadCase] = ()) -> list[bytes]:
        """Record (but do not send) ``n_good`` good records with ``cases`` spread among them."""
        name = f"{self.topic}/{partition}"
        ids = self.ids.setdefault(name, [])
        offset = self.ends.get(name, 0)
        next_id = self._next_id.get(name, partition * ID_STRIDE)
        # Case c goes after good record at[c]: spread evenly, none at the very end.
        at = Counter(int((c + 0.5) * n_good / len(cases)) for c in range(len(cases)))
        pending = iter(cases)
        payloads = []
        for k in range(n_good + 1):
            for _ in range(at.get(k, 0)):
                case = next(pending)
                self.bad[(name, offset)] = case
                payloads.append(case[0])
                offset += 1
            if k < n_good:
                ids.append(next_id)
                payloads.append(good_payload(next_id))
                next_id += 1
                offset += 1
        self.ends[name] = offset
        self._next_id[name] = next_id
        self.payloads.setdefault(name, []).extend(payloads)
        return payloads

    def send(self, partition: int, payloads: list[bytes]) -> None:
        # One request in flight: a batch retried (the broker just restarted) cannot land
        # after a later one. produce() alone keeps kafka-python's 5 with retries and, on
        # brokers before 0.11, no idempotence, so it may reorder records.
        produce(
            self.bootstrap,
            self.topic,
            payloads,
            api_version=self.api_version,
            partition=partition,
            client_options={"max_in_flight_requests_per_connection": 1},
        )

    def add(self, partition: int, n_good: int, cases: Sequence[BadCase] = ()) -> None:
        self.send(partition, self.plan(partition, n_good, cases))

    def bad_counts(self) -> dict[str, int]:
        return dict(Counter(reason for _, reason, _ in self.bad.values()))

    def assert_in_the_log(self) -> None:
        """The topic holds what was planned, at the planned offsets (the test's premise)."""
        source = make_source(self)
        try:
            for name, payloads in self.payloads.items():
                raw = source.read(Chunk("kafka", name, 0, len(payloads)))
                assert raw.positions.tolist() == list(range(len(payloads)))
                got = list(raw.payloads or [])
                wrong = [k for k, (a, b) in enumerate(zip(got, payloads, strict=True)) if a != b]
                assert not wrong, f"{name}: the producer wrote offsets {wrong[:10]} out of order"
        finally:
            source.close()


def make_source(stream: Stream, **options: Any) -> KafkaSource:
    """A source of the stream's topic; ``options`` go to kafka-python's consumer."""
    return make_kafka_source(
        stream.bootstrap, stream.topic, api_version=stream.api_version, client_options=options
    )


def consume(
    runner: StreamRunner, until: Callable[[], bool], on_batch: Callable[[int], None] | None = None
) -> list[PreparedBatch]:
    """Batches until ``until()`` holds after one (a Kafka stream never ends by itself)."""
    batches: list[PreparedBatch] = []
    for batch in runner:
        batches.append(batch)
        if on_batch is not None:
            on_batch(len(batches))
        if until():
            break
    runner.close()
    return batches


def assert_exactly_once(batches: list[PreparedBatch], stream: Stream) -> None:
    """Per partition: ranges tile the log; every good record arrives once, in offset order."""
    assert {b.partition for b in batches} == set(stream.ends)
    for p, end in stream.ends.items():
        mine = [b for b in batches if b.partition == p]
        ranges = [(b.start, b.end) for b in mine]
        assert ranges[0][0] == 0, f"{p} starts at {ranges[0][0]}"
        assert ranges[-1][1] == end, f"{p} ends at {ranges[-1][1]}, not {end}"
        for (_, e), (s, _) in itertools.pairwise(ranges):
            assert e == s, f"{p}: gap or overlap at {e} -> {s}"
        got = np.concatenate([b.dense[:, ID_COLUMN] for b in mine]).astype(np.int64).tolist()
        if got != stream.ids[p]:
            pairs = enumerate(zip(got, stream.ids[p], strict=False))
            k = next((k for k, (a, b) in pairs if a != b), min(len(got), len(stream.ids[p])))
            msg = (
                f"{p}: {len(got)} ids, {len(stream.ids[p])} expected; lost "
                f"{sorted(set(stream.ids[p]) - set(got))[:10]}; at {k}: got {got[k - 2 : k + 5]}, "
                f"expected {stream.ids[p][k - 2 : k + 5]}"
            )
            raise AssertionError(msg)
        labels = np.concatenate([b.labels[:, 0] for b in mine])
        np.testing.assert_array_equal(labels, np.asarray(got) % 2)


def assert_dead_letters(letters: list[BadRecord], stream: Stream) -> None:
    """Each bad record once, with its reason, field, partition, offset and exact raw bytes."""
    got = {(b.partition, b.position): (b.raw, b.reason, b.field) for b in letters}
    assert len(got) == len(letters), "a bad record was dead-lettered twice"
    assert got.keys() == stream.bad.keys()
    for key, expected in stream.bad.items():
        assert got[key] == expected, key
    assert all(b.source == "kafka" and b.detail for b in letters)
    for p in stream.ends:
        offsets = [b.position for b in letters if b.partition == p]
        assert offsets == sorted(offsets), f"{p}: dead letters out of order"


@pytest.fixture(scope="module")
def store(start_store: Callable[[dict[str, Any]], StoreAddress]) -> StoreAddress:
    table = {"dim": 4, "optimizer": {"kind": "sgd", "lr": 0.1}, "capacity": 100_000}
    return start_store({"tables": dict.fromkeys(SPEC.tables(), table), "row_dtype": "float32"})


# -- bad records -------------------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sink_kind", ["jsonl", "kafka"])
def test_bad_records_are_dead_lettered_and_counted_and_good_ones_arrive_once(
    cluster: Client,
    store: StoreAddress,
    kafka: KafkaForTests,
    kafka_topic: Callable[..., str],
    tmp_path: Path,
    sink_kind: str,
) -> None:
    # Every kind of bad JSON record (56 kinds, 19 reasons), half in each partition.
    assert len(JSON_BAD_CASES) >= 20
    assert len({reason for _, reason, _ in JSON_BAD_CASES}) == 19
    topic = kafka_topic(2)
    stream = Stream(kafka.bootstrap, kafka.api_version, topic)
    # Partition 0: its half of the cases spread among 300 good records.
    stream.add(0, 300, JSON_BAD_CASES[0::2])
    # Partition 1: 25 bad records first (a chunk without one good record), then the rest.
    cases_1 = JSON_BAD_CASES[1::2]
    stream.add(1, 0, cases_1[:25])
    stream.add(1, 300, cases_1[25:])
    assert len(stream.bad) == len(JSON_BAD_CASES)

    deadletter: DeadLetterSink
    if sink_kind == "jsonl":
        deadletter = JsonlDeadLetterSink(tmp_path / "dead" / f"{topic}.jsonl")
    else:
        kafka.create_topic(f"{topic}.deadletter")
        deadletter = KafkaDeadLetterSink(
            kafka.bootstrap, f"{topic}.deadletter", api_version=kafka.api_version
        )
    source = make_source(stream)
    runner = StreamRunner(
        cluster,
        source,
        SPEC,
        store,
        staleness=2,
        codec=CODEC,
        max_records=25,
        deadletter=deadletter,
    )
    batches = consume(runner, lambda: runner.positions == stream.ends)
    deadletter.close()

    assert len(batches) == sum(-(-end // 25) for end in stream.ends.values()) == 28
    stream.assert_in_the_log()
    assert_exactly_once(batches, stream)
    expected_counts = stream.bad_counts()
    assert runner.stats.bad_by_reason == expected_counts
    assert runner.stats.bad_records == sum(b.bad_records for b in batches) == len(stream.bad)
    per_batch: Counter[str] = Counter()
    for b in batches:
        per_batch.update(b.bad_by_reason)
    assert dict(per_batch) == expected_counts
    assert runner.stats.records == sum(len(s) for s in stream.ids.values())
    # The chunk of partition 1 that holds bad records only is an empty batch.
    assert [len(b) for b in batches if (b.partition, b.start) == (f"{topic}/1", 0)] == [0]

    # Rows came from the store; ids, bags and values equal a preparation in this process.
    for b in batches:
        local, bad = prepare(
            Chunk("kafka", b.partition, b.start, b.end), source, SPEC, CODEC, lookup=False
        )
        assert len(bad) == b.bad_records
        np.testing.assert_array_equal(b.dense, local.dense)
        for name, t in b.tables.items():
            np.testing.assert_array_equal(t.unique_ids, local.tables[name].unique_ids)
            np.testing.assert_array_equal(t.inverse, local.tables[name].inverse)
            np.testing.assert_array_equal(t.offsets, local.tables[name].offsets)
            if len(b):  # an empty batch: see test_a_chunk_of_bad_records_only_*
                assert t.rows is not None
                assert t.rows.shape == (len(t.unique_ids), 4)
    source.close()

    if sink_kind == "jsonl":
        assert isinstance(deadletter, JsonlDeadLetterSink)
        letters = read_dead_letters(deadletter.path)
    else:
        assert isinstance(deadletter, KafkaDeadLetterSink)
        assert (deadletter.written, deadletter.failed) == (len(stream.bad), 0)
        records = read_partition(
            kafka.bootstrap,
            f"{topic}.deadletter",
            0,
            len(stream.bad),
            api_version=kafka.api_version,
        )
        letters = []
        for r in records:
            letter = BadRecord.from_json(json.loads(r.value))
            # Keyed by source partition, so one partition's dead letters stay in order.
            assert r.key == f"kafka/{letter.partition}".encode()
            letters.append(letter)
    assert_dead_letters(letters, stream)


@pytest.mark.timeout(60)
def test_a_chunk_of_bad_records_only_still_has_rows_of_every_table(
    cluster: Client, store: StoreAddress, kafka: KafkaForTests, kafka_topic: Callable[..., str]
) -> None:
    """A batch's rows are ``[U, dim]`` after the lookup, also when U is 0 (no good record).

    A trainer takes every batch the runner yields; one made of bad records only
    must not look like a batch nobody looked up (rows None).
    """
    topic = kafka_topic(1)
    stream = Stream(kafka.bootstrap, kafka.api_version, topic)
    stream.add(0, 0, JSON_BAD_CASES[:10])
    stream.add(0, 10)
    source = make_source(stream)
    runner = StreamRunner(cluster, source, SPEC, store, staleness=1, codec=CODEC, max_records=10)
    empty, full = consume(runner, lambda: runner.positions == stream.ends)
    source.close()
    assert (len(empty), empty.bad_records, len(full), full.bad_records) == (0, 10, 10, 0)
    assert sorted(empty.tables) == sorted(full.tables) == sorted(SPEC.tables())
    for name, t in full.tables.items():
        assert t.rows is not None
        assert t.rows.shape == (len(t.unique_ids), 4)
        rows = empty.tables[name].rows
        assert rows is not None, f"table {name!r} of the batch without good records has no rows"
        assert rows.shape == (0, 4)


# -- a worker killed mid-chunk -------------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_worker_killed_while_reading_kafka_costs_a_retry_not_a_record(
    store: StoreAddress, broker: KafkaForTests
) -> None:
    """On Kafka 0.9 and on Tansu (record batches through the raw reader)."""
    topic = broker.new_topic(2)
    stream = Stream(broker.bootstrap, broker.api_version, topic)
    stream.add(0, 400, JSON_BAD_CASES[:10])
    stream.add(1, 400, JSON_BAD_CASES[10:20])
    source = make_source(stream, **SLOW_READS)
    killed: list[int] = []
    lost: list[tuple[str, int, int]] = []  # the chunks the killed worker held
    with dask_cluster() as client:
        runner = StreamRunner(client, source, SPEC, store, staleness=4, codec=CODEC, max_records=40)

        pids = client.run(os.getpid)
        stop_watching = threading.Event()
        errors: list[BaseException] = []

        def kill_a_busy_worker() -> None:
            # Watches while the runner goes on submitting: a check from the consumer's
            # thread would hold submission up, so on a fast broker or a loaded machine
            # every chunk in flight could be done before it looked.
            try:
                while not stop_watching.is_set():
                    busy = [(w, ks) for w, ks in client.processing().items() if ks and w in pids]
                    if busy:
                        break
                    time.sleep(0.01)
                else:
                    return
                worker, keys = busy[0]
                for key in keys:
                    # prepare-<partition name>-<start>-<end>-<runner token>
                    name, start, end = str(key).removeprefix("prepare-").rsplit("-", 3)[:3]
                    lost.append((name, int(start), int(end)))
                killed.append(pids[worker])
                os.kill(pids[worker], signal.SIGKILL)
            except BaseException as e:  # surfaced by the test's thread
                errors.append(e)

        watcher = threading.Thread(target=kill_a_busy_worker, daemon=True)

        def start_watching(n: int) -> None:
            if n == 3:  # a few batches in: the runner is well under way
                watcher.start()

        try:
            batches = consume(runner, lambda: runner.positions == stream.ends, start_watching)
        finally:
            stop_watching.set()
            watcher.join(timeout=30)
        assert not errors, errors
        # The process is gone; its nanny started another worker in its place.
        assert killed, "no worker was preparing a chunk while the stream was read"
        assert killed[0] not in client.run(os.getpid).values()
    source.close()
    stream.assert_in_the_log()
    assert_exactly_once(batches, stream)
    # The chunks lost with the worker were prepared again and yielded once.
    yielded = [(b.partition.replace("/", "-"), b.start, b.end) for b in batches]
    assert lost
    assert all(yielded.count(chunk) == 1 for chunk in lost), (lost, yielded)
    assert runner.stats.bad_by_reason == stream.bad_counts()
    assert sum(b.bad_records for b in batches) == len(stream.bad) == 20


# -- the broker restarted mid-stream -------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kill", [False, True], ids=["stop", "kill-9"])
def test_a_broker_restart_mid_stream_delays_it_but_loses_nothing(
    cluster: Client, store: StoreAddress, restartable: LocalKafka, kill: bool
) -> None:
    topic = f"restart-{uuid.uuid4().hex[:8]}"
    restartable.create_topic(topic, 2)
    stream = Stream(restartable.bootstrap, API_VERSION, topic)
    stream.add(0, 300, JSON_BAD_CASES[:3])
    stream.add(1, 300, JSON_BAD_CASES[3:6])
    first_ends = dict(stream.ends)
    source = make_source(stream, **SLOW_READS)
    runner = StreamRunner(cluster, source, SPEC, store, staleness=2, codec=CODEC, max_records=30)

    started = threading.Event()
    final = threading.Event()  # set once stream.ends holds every record to be produced
    at_stop: dict[str, int] = {}
    errors: list[BaseException] = []

    def restart() -> None:
        try:
            started.wait(60)
            at_stop.update(runner.positions)
            if kill:
                restartable.kill_broker()
            else:
                restartable.stop_broker()
            assert restartable.broker_process is not None
            assert not restartable.broker_process.alive()
            time.sleep(2.0)  # the driver plans and the workers read against no broker
            restartable.start_broker()
            # The stream goes on: records produced after the restart arrive too.
            more = [stream.plan(p, 50, JSON_BAD_CASES[6 + p : 7 + p]) for p in (0, 1)]
            final.set()
            for p, payloads in enumerate(more):
                stream.send(p, payloads)
        except BaseException as exc:
            errors.append(exc)
            final.set()

    restarter = threading.Thread(target=restart, daemon=True)
    restarter.start()
    batches = consume(
        runner,
        lambda: (final.is_set() and runner.positions == stream.ends) or bool(errors),
        lambda n: started.set() if n == 2 else None,
    )
    restarter.join(60)
    source.close()
    assert not errors, errors
    # The broker went away while the stream was under way, not after it.
    assert sum(at_stop.values()) < sum(first_ends.values())
    stream.assert_in_the_log()
    assert_exactly_once(batches, stream)
    assert runner.stats.bad_by_reason == stream.bad_counts()
    assert runner.stats.bad_records == len(stream.bad) == 8


# -- a stream that goes quiet and then goes on ----------------------------------------------


@pytest.mark.timeout(120)
def test_idle_ticks_go_on_when_a_quiet_stream_gets_new_records(
    store: StoreAddress, kafka: KafkaForTests, kafka_topic: Callable[..., str]
) -> None:
    """With ``idle_ticks`` the runner yields None while the topic is quiet, and the records
    produced later still arrive (the runner once stopped asking the broker after the first
    quiet tick when it was asked again sooner than its poll interval)."""
    topic = kafka_topic(1)
    stream = Stream(kafka.bootstrap, kafka.api_version, topic)
    stream.add(0, 100)
    source = make_source(stream)
    with dask_cluster() as client:
        runner = StreamRunner(
            client, source, SPEC, store, staleness=2, codec=CODEC, max_records=50, idle_ticks=True
        )
        batches: list[PreparedBatch] = []
        ticks = 0
        deadline = time.monotonic() + 60
        for item in runner:
            if item is None:
                ticks += 1
                if ticks == 20:  # quiet for a while: more records arrive
                    stream.add(0, 100)
                time.sleep(0.05)  # a trainer asks faster than the poll interval
            else:
                batches.append(item)
            if (ticks >= 20 and runner.positions == stream.ends) or time.monotonic() > deadline:
                break
        runner.close()
    source.close()
    assert ticks >= 20
    assert_exactly_once(batches, stream)
