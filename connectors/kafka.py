"""Kafka as a stream source (kafka-python, and Fetch requests of its own).

The driver *plans*: it lists partitions (``"topic/partition"``), asks where each
starts (the consumer group's committed offset, else ``auto_offset_reset``) and
cuts chunks ``[position, min(position + max_records, log end))``. A Dask worker
*reads* a chunk from ``start`` until its position reaches ``end``, keeping only
offsets inside the chunk, so a chunk read twice, or chunks read in any order,
yield exactly the same records. By default (``reader: raw``) it sends Kafka's
Fetch request to the partition's leader itself and parses the answer in one
compiled pass (:mod:`connectors.kafka_records`: no Python object per record);
``reader: kafka-python``, and whatever the raw reader does not handle
(compressed message sets, TLS/SASL, brokers 0.11+), uses an assigned
kafka-python consumer (no group membership, no auto-commit). Offsets reach the
group only through :meth:`KafkaSource.commit`, which the checkpoint coordinator
calls once a checkpoint naming them is durable.

A broker that goes away (restart, network) delays planning and reading: every
call retries with backoff for up to ``retry_timeout_s`` and then raises
:class:`~connectors.kafka_client.KafkaUnavailable`; a chunk being read keeps what it already has and
resumes after the last record it got, so nothing is lost or duplicated.

    >>> cfg = KafkaSourceConfig(
    ...     bootstrap_servers="127.0.0.1:9092", topics=["events"], group_id="trainer",
    ...     api_version="0.9", max_records=500)
    >>> cfg.api_version, cfg.auto_offset_reset
    ((0, 9), 'earliest')
    >>> source = KafkaSource(cfg)  # connects lazily, on the first call
    >>> split_partition("events/3")
    ('events', 3)
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel, ConfigDict, Field, field_validator

from connectors import kafka_fetch
from connectors.kafka_client import (
    REQUEST_TIMEOUT_MS,
    ApiVersion,
    Backoff,
    Transient,
    bootstrap_hosts,
    check_client_options,
    is_transient,
    parse_api_version,
    reachable,
    resolve_api_version,
    retrying,
)
from connectors.kafka_reads import FETCH_MAX_WAIT_MS, ConsumerReads, RawReads, Reads
from connectors.types import Chunk, RawChunk, Source

log = logging.getLogger(__name__)

T = TypeVar("T")

# A chunk read that gets nothing for this long drops its consumer and opens a new one
# (fresh connections and metadata after a broker restart).
_READ_STALL_S = 5.0
# How long a topic never seen by this source may be missing before it is an error.
_UNKNOWN_TOPIC_GRACE_S = 10.0

_TOPIC_NAME = re.compile(r"^[A-Za-z0-9._-]{1,249}$")


class UnknownTopic(RuntimeError):
    """A configured topic does not exist on the cluster."""


def split_partition(partition: str) -> tuple[str, int]:
    """``"topic/3"`` → ``("topic", 3)``: the source's partition names.

    >>> split_partition("clicks.v2/12")
    ('clicks.v2', 12)
    """
    topic, sep, number = partition.rpartition("/")
    if not sep or not topic or not number.isdigit():
        msg = f"a Kafka partition is named 'topic/number', got {partition!r}"
        raise ValueError(msg)
    return topic, int(number)


class KafkaSourceConfig(BaseModel):
    """Where and how :class:`KafkaSource` reads; one YAML mapping maps onto it.

    ``client_options`` go to kafka-python's ``KafkaConsumer`` unchanged: TLS and
    SASL (``security_protocol``, ``ssl_cafile``, ``sasl_mechanism``,
    ``sasl_plain_username``, ...) or tuning (``fetch_max_bytes``). Unknown keys are
    rejected, as are keys the fields below already set. Keep them picklable
    (file paths rather than an ``ssl_context``): the source travels to workers.
    The raw reader (``reader: raw``) honours the consumer's fetch tuning too:
    ``max_partition_fetch_bytes`` (a fixed fetch size instead of one sized to the
    chunk), ``fetch_min_bytes``, ``fetch_max_wait_ms``, ``check_crcs`` and
    ``isolation_level`` (``read_committed``: chunks end at the last stable offset,
    and the records of aborted transactions are not delivered).

    >>> try:
    ...     KafkaSourceConfig(bootstrap_servers="k:9092", topics=["t"], group_id="g", max_record=5)
    ... except ValueError as exc:  # pydantic's ValidationError
    ...     print(exc.errors()[0]["loc"], exc.errors()[0]["type"])
    ('max_record',) extra_forbidden
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    bootstrap_servers: str = Field(min_length=1, description="'host:port[,host:port...]'")
    topics: tuple[str, ...] = Field(min_length=1, description="the topics to train from")
    group_id: str = Field(min_length=1, description="consumer group that holds committed offsets")
    api_version: Literal["auto"] | ApiVersion = Field(
        "auto", description="the broker's protocol version; auto: asked of the broker"
    )
    # "earliest" by default (Kafka's own default is "latest"): a new job trains on
    # what the topic holds rather than silently skipping it.
    auto_offset_reset: Literal["earliest", "latest"] = Field(
        "earliest", description="where a partition without a committed offset starts"
    )
    max_records: int = Field(10_000, gt=0, description="records per chunk at most")
    poll_timeout_ms: int = Field(1000, gt=0, description="one poll of a chunk read")
    retry_timeout_s: float = Field(300.0, gt=0, description="how long to wait out a broker")
    reader: Literal["raw", "kafka-python"] = Field(
        "raw",
        description=(
            "how workers read chunks: 'raw' sends Kafka's Fetch request itself and parses "
            "what it returns in one compiled pass (connectors.kafka_records; faster, "
            "benchmarks/pipeline.py) over PLAINTEXT: legacy message sets and record "
            "batches, compressed batches inflated; compressed legacy message sets, "
            "TLS/SASL and proxies are read with kafka-python all the same. "
            "'kafka-python': always a KafkaConsumer (one Python object per record)"
        ),
    )
    client_options: dict[str, Any] = Field(
        default_factory=dict, description="kafka-python KafkaConsumer options: TLS, SASL, tuning"
    )

    @field_validator("bootstrap_servers", mode="before")
    @classmethod
    def _join_servers(cls, value: object) -> object:
        if isinstance(value, list | tuple):
            return ",".join(str(v) for v in value)
        return value

    @field_validator("topics")
    @classmethod
    def _check_topics(cls, topics: tuple[str, ...]) -> tuple[str, ...]:
        for topic in topics:
            if not _TOPIC_NAME.match(topic) or topic in {".", ".."}:
                msg = f"{topic!r} is not a Kafka topic name (letters, digits, '.', '_', '-')"
                raise ValueError(msg)
        if len(set(topics)) != len(topics):
            msg = f"topics are listed twice: {list(topics)}"
            raise ValueError(msg)
        return topics

    @field_validator("api_version", mode="before")
    @classmethod
    def _parse_version(cls, value: object) -> object:
        return parse_api_version(value)

    @field_validator("client_options")
    @classmethod
    def _check_options(cls, options: dict[str, Any]) -> dict[str, Any]:
        from kafka import KafkaConsumer

        check_client_options(options, KafkaConsumer.DEFAULT_CONFIG, "KafkaConsumer")
        return options


class KafkaSource:
    """Kafka topics as a :class:`~connectors.types.Source` of ``"topic/partition"`` partitions.

    Positions are Kafka offsets; a committed offset is the next one to read, as in
    Kafka. Clients are made on first use and cached per (bootstrap, thread, role);
    pickling drops them, so the source ships to Dask workers as plain config.
    """

    name = "kafka"

    def __init__(self, config: KafkaSourceConfig) -> None:
        self.config = config
        version = config.api_version
        self._api_version: ApiVersion | None = None if version == "auto" else version
        self._init_runtime()

    def _init_runtime(self) -> None:
        self._lock = threading.Lock()
        self._clients: dict[tuple[str, int, str], Any] = {}
        self._known: dict[str, list[int]] = {}  # partitions seen per topic; never shrink
        # The log end last asked per partition: a log end only grows, so a chunk that
        # fits under it needs no broker round trip (one per batch would take the
        # planning thread, the trainer's, away from training).
        self._ends: dict[str, int] = {}
        self._should_stop: Callable[[], bool] | None = None  # stays on this side of a pickle
        # The raw reader's: partition leaders, connections per (thread, host, port), the
        # partitions kafka-python reads instead (compressed), and the bytes a record takes
        # in the log (sizes the next fetch to the chunk).
        self._leaders: dict[tuple[str, int], tuple[str, int]] = {}
        self._conns: dict[tuple[int, str, int], kafka_fetch.BrokerConnection] = {}
        self._not_raw: set[str] = set()
        self._record_bytes = 1024.0

    def stop_waiting_when(self, should_stop: Callable[[], bool] | None) -> None:
        """Make every wait for the broker give up (KafkaUnavailable) once ``should_stop()``.

        A job sets this to its stop condition (Ctrl-C, ``--max-time``), so a broker
        that is down never holds a stopping job for the whole ``retry_timeout_s``.
        """
        self._should_stop = should_stop

    def __getstate__(self) -> dict[str, Any]:
        # Clients hold sockets and threads; the resolved version is plain data and
        # spares every worker a detection.
        return {"config": self.config, "api_version": self._api_version}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.config = state["config"]
        self._api_version = state["api_version"]
        self._init_runtime()

    def __repr__(self) -> str:
        return (
            f"KafkaSource(bootstrap={self.config.bootstrap_servers!r}, "
            f"topics={list(self.config.topics)!r}, group_id={self.config.group_id!r})"
        )

    # -- clients --------------------------------------------------------------------------

    def api_version(self) -> ApiVersion:
        """The broker's API version (detected once when the config says ``"auto"``)."""
        with self._lock:
            resolved = self._api_version
        if resolved is None:
            resolved = resolve_api_version(
                self.config.bootstrap_servers,
                "auto",
                client_options=self.config.client_options,
                retry_timeout_s=self.config.retry_timeout_s,
                should_stop=self._should_stop,
            )
            with self._lock:
                self._api_version = resolved
        return resolved

    def _client(self, role: Literal["meta", "read"]) -> Any:
        """This thread's consumer: "meta" knows the group (offsets), "read" does not."""
        key = (self.config.bootstrap_servers, threading.get_ident(), role)
        with self._lock:
            client = self._clients.get(key)
        if client is not None:
            return client
        from kafka import KafkaConsumer

        options: dict[str, Any] = {
            "request_timeout_ms": max(REQUEST_TIMEOUT_MS, 2 * self.config.poll_timeout_ms),
            **self.config.client_options,
            "bootstrap_servers": self.config.bootstrap_servers,
            "api_version": self.api_version(),
            "enable_auto_commit": False,
        }
        if role == "meta":
            options["group_id"] = self.config.group_id
        else:
            # An offset outside the log raises instead of jumping elsewhere: read()
            # tells records deleted by retention from a broker still recovering.
            options["auto_offset_reset"] = "none"
        client = KafkaConsumer(**options)
        with self._lock:
            self._clients[key] = client
        return client

    def _drop(self, role: Literal["meta", "read"]) -> None:
        """Close this thread's client of ``role``; the next call opens a fresh one."""
        key = (self.config.bootstrap_servers, threading.get_ident(), role)
        with self._lock:
            client = self._clients.pop(key, None)
        if client is not None:
            _close_quietly(client)

    def close(self) -> None:
        """Close every cached client (of all threads)."""
        with self._lock:
            clients = list(self._clients.values())
            self._clients.clear()
            conns = list(self._conns.values())
            self._conns.clear()
            self._leaders.clear()
        for client in clients:
            _close_quietly(client)
        for conn in conns:
            conn.close()

    def _retry(self, what: str, fn: Callable[[], T], role: Literal["meta", "read"]) -> T:
        return retrying(
            what,
            fn,
            timeout_s=self.config.retry_timeout_s,
            bootstrap=self.config.bootstrap_servers,
            on_retry=lambda: self._drop(role),
            should_stop=self._should_stop,
        )

    # -- planning (driver) ----------------------------------------------------------------

    def _fetch_partitions(self) -> dict[str, list[int]]:
        client = self._client("meta")
        # topics() refreshes metadata, but in kafka-python 3 it waits forever for a
        # broker that is down: bound it (closing the client ends the wait).
        if not reachable(self.config.bootstrap_servers, self.config.client_options):
            msg = f"no bootstrap server of {self.config.bootstrap_servers} accepts connections"
            raise Transient(msg)
        _bounded(client.topics, REQUEST_TIMEOUT_MS / 1000, on_timeout=lambda: self._drop("meta"))
        found: dict[str, list[int]] = {}
        for topic in self.config.topics:
            numbers = client.partitions_for_topic(topic)
            if numbers:
                found[topic] = sorted(numbers)
        return found

    def partitions(self) -> list[str]:
        """``"topic/partition"`` for every partition of every topic, from fresh metadata.

        Partitions added to a topic later show up on the next call. A topic this
        source never saw that stays missing for a few seconds raises
        :class:`UnknownTopic`; one it saw before is taken as a broker still
        recovering (retried for ``retry_timeout_s``) since Kafka topics do not shrink.
        """
        started = time.monotonic()

        def attempt() -> dict[str, list[int]]:
            found = self._fetch_partitions()
            missing = [t for t in self.config.topics if t not in found]
            unseen = [t for t in missing if t not in self._known]
            # Half the retry budget at most, so this answer comes before KafkaUnavailable.
            grace = min(_UNKNOWN_TOPIC_GRACE_S, self.config.retry_timeout_s / 2)
            if unseen and time.monotonic() - started > grace:
                msg = (
                    f"topic(s) {unseen} do not exist on {self.config.bootstrap_servers}; "
                    f"create them (e.g. kafka-topics.sh --create) or fix `topics`"
                )
                raise UnknownTopic(msg)
            if missing:
                msg = f"no metadata yet for topic(s) {missing}"
                raise Transient(msg)
            return found

        found = self._retry("listing Kafka partitions", attempt, "meta")
        names = []
        for topic in self.config.topics:
            numbers = sorted(set(self._known.get(topic, [])) | set(found[topic]))
            self._known[topic] = numbers
            names += [f"{topic}/{n}" for n in numbers]
        return names

    def _offset(
        self,
        partition: str,
        which: Literal["beginning", "end"],
        role: Literal["meta", "read"] = "meta",
    ) -> int:
        from kafka import TopicPartition

        tp = TopicPartition(*split_partition(partition))

        def ask() -> int:
            client = self._client(role)
            fn = client.beginning_offsets if which == "beginning" else client.end_offsets
            return int(fn([tp], timeout_ms=REQUEST_TIMEOUT_MS)[tp])

        return self._retry(f"asking the {which} offset of {partition}", ask, role)

    def committed(self, partition: str) -> int | None:
        """The group's committed offset of ``partition`` (the next to read), or None."""
        from kafka import TopicPartition

        tp = TopicPartition(*split_partition(partition))

        def ask() -> int | None:
            value = self._client("meta").committed(tp, timeout_ms=REQUEST_TIMEOUT_MS)
            return None if value is None or value < 0 else int(value)

        return self._retry(f"asking the committed offset of {partition}", ask, "meta")

    def start_position(self, partition: str) -> int:
        """The group's committed offset; else (or when it left the log) ``auto_offset_reset``."""
        committed = self.committed(partition)
        beginning = self._offset(partition, "beginning")
        end = self._log_end(partition)
        if committed is not None and beginning <= committed <= end:
            return committed
        if committed is not None:
            log.warning(
                "committed offset %d of %s is outside the log [%d, %d]; starting at the %s",
                committed,
                partition,
                beginning,
                end,
                self.config.auto_offset_reset,
            )
        return beginning if self.config.auto_offset_reset == "earliest" else end

    def end_position(self, partition: str) -> int:
        """The log end offset now (one past the last record)."""
        end = self._log_end(partition)
        self._ends[partition] = end
        return end

    def _log_end(self, partition: str) -> int:
        """One past the last record: the larger of the broker's two answers to it, the
        ListOffsets "latest" offset and the high watermark of a Fetch from there.

        Apache Kafka gives the same in both. A broker that answers ListOffsets with
        the newest record batch's base offset plus one (Tansu 0.6) would leave the
        rest of that batch unplanned until more records come, and a job told to
        stop after them (``--max-events``) would wait for good. Read committed
        (``client_options: {isolation_level: read_committed}``) it is the last
        stable offset, where the first transaction still open begins.
        """
        end = self._offset(partition, "end")
        if self.api_version() < (0, 11) or not self._plain_connection():
            return end  # no record batches before 0.11; TLS/SASL: kafka-python's answer
        topic, number = split_partition(partition)
        try:
            fetched = self._high_watermark(topic, number, end)
            if self._isolation() == kafka_fetch.READ_COMMITTED and fetched >= 0:
                # The last stable offset: an open transaction's records wait for its end.
                return fetched
            return max(end, fetched)
        except (OSError, Transient) as exc:
            # ListOffsets' answer stands; the next plan asks again.
            log.debug("no high watermark of %s (%r): the log end is %d", partition, exc, end)
            self._forget(topic, number)
            return end

    def _isolation(self) -> int:
        """The Fetch isolation level that ``client_options``' ``isolation_level`` asks for."""
        committed = self.config.client_options.get("isolation_level") == "read_committed"
        return kafka_fetch.READ_COMMITTED if committed else kafka_fetch.READ_UNCOMMITTED

    def _high_watermark(self, topic: str, partition: int, offset: int) -> int:
        """The high watermark a Fetch from ``offset`` reports, read committed its last
        stable offset (-1: the broker said no)."""
        isolation = self._isolation()
        conn = self._connection(*self._leader(topic, partition))
        version = kafka_fetch.fetch_version(self.api_version(), conn.fetch_versions)
        if version < 0:
            return -1
        body = conn.request(
            lambda cid: kafka_fetch.encode_fetch_request(
                # min_bytes 0: an answer at once; max_wait 1, not 0, which Tansu
                # answers with no partitions at all.
                cid, topic, partition, offset, max_bytes=1, max_wait_ms=1, min_bytes=0,
                version=version, isolation_level=isolation,
            )
        )  # fmt: skip
        for part in kafka_fetch.decode_fetch_response(body, version):
            if part.topic == topic and part.partition == partition and part.error_code == 0:
                if isolation == kafka_fetch.READ_COMMITTED:
                    return part.last_stable_offset
                return part.high_watermark
        return -1

    def plan(self, partition: str, position: int, max_records: int) -> Chunk | None:
        """``[position, min(position + max_records, log end))``; None when nothing is new.

        The chunk is also capped at the config's ``max_records``. The broker is asked
        for the log end only when the one it last gave does not cover a whole chunk.
        """
        size = min(max_records, self.config.max_records)
        end = self._ends.get(partition, -1)
        if end < position + size:
            end = self.end_position(partition)
        if end <= position:
            return None
        return Chunk(
            source=self.name, partition=partition, start=position, end=min(position + size, end)
        )

    def is_finished(self, partition: str, position: int) -> bool:
        """Never: a Kafka topic is a stream."""
        return False

    def commit(self, offsets: Mapping[str, int]) -> None:
        """Commit ``{"topic/partition": next offset to read}`` to the consumer group.

        Call it only once a checkpoint holding these positions is durable: a job
        that restarts without its checkpoint resumes from the group's offsets.
        """
        if not offsets:
            return
        from kafka import TopicPartition
        from kafka.structs import OffsetAndMetadata

        request = {
            TopicPartition(*split_partition(p)): OffsetAndMetadata(int(o), "", -1)
            for p, o in offsets.items()
        }

        def send() -> None:
            self._client("meta").commit(request, timeout_ms=REQUEST_TIMEOUT_MS)

        self._retry(f"committing offsets of {sorted(offsets)}", send, "meta")

    # -- reading (worker) -----------------------------------------------------------------

    def read(self, chunk: Chunk) -> RawChunk:
        """Every record of ``[chunk.start, chunk.end)`` that the log holds, in offset order.

        Offsets missing from the log (compacted away, or deleted by retention
        before the read) are simply absent. Runs on a worker: it needs nothing
        from the driver but the chunk. ``reader`` in the config picks how (the
        records are the same either way); a raw read that meets a compressed
        message set reads the rest of the chunk with kafka-python.
        """
        from kafka.errors import OffsetOutOfRangeError

        if chunk.source != self.name:
            msg = f"KafkaSource cannot read a chunk of source {chunk.source!r}"
            raise ValueError(msg)
        topic, number = split_partition(chunk.partition)
        reads: Reads = (
            RawReads(self, topic, number)
            if self._raw_applies(chunk.partition)
            else ConsumerReads(self, topic, number)
        )
        offsets: list[npt.NDArray[np.int64]] = []
        payloads: list[bytes] = []
        position = chunk.start  # the next offset wanted; survives reconnects
        last_progress = time.monotonic()
        # The budget runs from the first failure since the last progress.
        backoff = Backoff(self.config.retry_timeout_s, should_stop=self._should_stop)

        def fail(exc: BaseException) -> None:
            nonlocal last_progress
            give_up = (
                f"reading {chunk.partition} [{chunk.start}, {chunk.end}): Kafka at "
                f"{self.config.bootstrap_servers} still failing after "
                f"{self.config.retry_timeout_s:g}s ({exc!r}); check that the broker runs"
            )
            # Fresh connections and metadata on the next attempt.
            backoff.wait(f"reading {chunk.name}", exc, give_up, reads.reset)
            last_progress = time.monotonic()

        while position < chunk.end:
            try:
                got, values, after = reads.step(position, chunk.end)
                if reads.hand_over:
                    # Compressed (or unknown) message sets: kafka-python reads them.
                    log.info("%s: reading on with kafka-python from offset %d", chunk.name, after)
                    with self._lock:
                        self._not_raw.add(chunk.partition)
                    reads = ConsumerReads(self, topic, number)
                if len(got):
                    offsets.append(np.asarray(got, dtype=np.int64))
                    payloads += values
                if after > position:
                    position = after
                    last_progress = time.monotonic()
                    backoff.reset()
                elif reads.hand_over or reads.retry_now:
                    continue
                elif time.monotonic() - last_progress > _READ_STALL_S:
                    # The records exist (the plan saw them): a broker away or recovering.
                    msg = f"no records of {chunk.partition} for {_READ_STALL_S:g}s"
                    raise Transient(msg)
            except OffsetOutOfRangeError as exc:
                # The next attempt starts afresh; _offset may replace this thread's client.
                reads.reset()
                beginning = self._offset(chunk.partition, "beginning", "read")
                if position < beginning:
                    log.warning(
                        "offsets %d..%d of %s were deleted before they were read",
                        position,
                        min(beginning, chunk.end) - 1,
                        chunk.partition,
                    )
                    position = min(beginning, chunk.end)
                else:
                    fail(exc)  # inside the log by the broker's own account: it is recovering
            except Exception as exc:
                if not is_transient(exc):
                    raise
                fail(exc)

        reads.finish()
        return RawChunk(
            chunk=chunk,
            positions=np.concatenate(offsets) if offsets else np.empty(0, dtype=np.int64),
            payloads=payloads,
        )

    # -- the raw reader (worker) ----------------------------------------------------------

    def _raw_applies(self, partition: str) -> bool:
        """Whether ``reader: raw`` reads ``partition`` here (else kafka-python does)."""
        if self.config.reader != "raw" or not self._plain_connection():
            return False
        with self._lock:
            return partition not in self._not_raw

    def _plain_connection(self) -> bool:
        """Whether this module's own connections reach the brokers (TLS, SASL and
        proxies are kafka-python's alone)."""
        options = self.config.client_options
        return options.get("security_protocol", "PLAINTEXT") == "PLAINTEXT" and not any(
            options.get(k) for k in ("proxy_url", "socks5_proxy")
        )

    def _request_timeout_s(self) -> float:
        """How long the raw reader waits for an answer: as kafka-python would, plus the
        time the broker may hold a fetch on purpose."""
        options = self.config.client_options
        ms = options.get(
            "request_timeout_ms", max(REQUEST_TIMEOUT_MS, 2 * self.config.poll_timeout_ms)
        )
        return float(ms + options.get("fetch_max_wait_ms", FETCH_MAX_WAIT_MS)) / 1000

    def _leader(self, topic: str, partition: int) -> tuple[str, int]:
        """``(host, port)`` of the partition's leader: cached, else a Metadata request."""
        from kafka.errors import (
            LeaderNotAvailableError,
            UnknownError,
            UnknownTopicOrPartitionError,
            for_code,
        )

        key = (topic, partition)
        with self._lock:
            known = self._leaders.get(key)
        if known is not None:
            return known
        last: OSError | None = None
        for host, port in bootstrap_hosts(self.config.bootstrap_servers):
            try:
                conn = kafka_fetch.BrokerConnection(host, port, self._request_timeout_s())
            except OSError as exc:
                last = exc
                continue
            try:
                body = conn.request(lambda cid: kafka_fetch.encode_metadata_request(cid, [topic]))
            finally:
                conn.close()
            topics, leaders = kafka_fetch.decode_metadata_response(body)
            if topics.get(topic, 0):
                error = for_code(topics[topic])
                what = f"metadata of topic {topic}: {error.__name__} (code {topics[topic]})"
                if error.retriable or error is UnknownError:
                    # A broker back from a kill -9 answers UNKNOWN (-1) or leader errors
                    # for a while: the retry and its deadline decide, as for a broker
                    # that does not answer at all.
                    raise Transient(what)
                raise error(what)
            leader = leaders.get(key)
            if leader is None:
                raise UnknownTopicOrPartitionError(f"{topic}/{partition}")
            if leader.host is None:
                code = leader.error_code or LeaderNotAvailableError.errno
                raise for_code(code)(f"the leader of {topic}/{partition}")
            found = (leader.host, leader.port)
            with self._lock:
                self._leaders[key] = found
            return found
        msg = f"no bootstrap server of {self.config.bootstrap_servers} accepts connections"
        raise Transient(msg) from last

    def _connection(self, host: str, port: int) -> kafka_fetch.BrokerConnection:
        """This thread's connection to a broker (a fresh one after :meth:`_forget`)."""
        key = (threading.get_ident(), host, port)
        with self._lock:
            conn = self._conns.get(key)
        if conn is None:
            conn = kafka_fetch.BrokerConnection(host, port, self._request_timeout_s())
            if self.api_version() >= (0, 10):
                try:
                    conn.ask_versions()  # which Fetch versions this broker answers
                except BaseException:
                    conn.close()
                    raise
            with self._lock:
                self._conns[key] = conn
        return conn

    def _forget(self, topic: str, partition: int) -> None:
        """Drop the partition's leader and this thread's connection to it."""
        with self._lock:
            leader = self._leaders.pop((topic, partition), None)
            conn = (
                None if leader is None else self._conns.pop((threading.get_ident(), *leader), None)
            )
        if conn is not None:
            conn.close()


def _close_quietly(consumer: Any) -> None:
    try:
        consumer.close(autocommit=False, timeout_ms=1000)
    except Exception as exc:  # closing a client of a dead broker must not mask the real error
        log.debug("closing a Kafka client failed: %r", exc)


def _bounded(fn: Callable[[], T], timeout_s: float, *, on_timeout: Callable[[], Any]) -> T:
    """Run ``fn`` in a helper thread; past ``timeout_s`` call ``on_timeout`` and raise.

    For the few kafka-python calls that take no timeout; ``on_timeout`` must make
    ``fn`` return (closing its client does).
    """
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as exc:
            error.append(exc)

    thread = threading.Thread(target=run, name="kafka-bounded-call", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        on_timeout()
        thread.join(5.0)
        msg = f"Kafka did not answer within {timeout_s:g}s"
        raise Transient(msg)
    if error:
        raise error[0]
    return result[0]


if TYPE_CHECKING:  # mypy proves that the classes implement the shared protocols

    def _is_source(source: KafkaSource) -> Source:
        return source
