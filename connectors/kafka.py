"""Kafka as a stream source and a producer helper (kafka-python).

The driver *plans*: it lists partitions (``"topic/partition"``), asks where each
starts (the consumer group's committed offset, else ``auto_offset_reset``) and
cuts chunks ``[position, min(position + max_records, log end))``. A Dask worker
*reads* a chunk from ``start`` until its position reaches ``end``, keeping only
offsets inside the chunk, so a chunk read twice, or chunks read in any order,
yield exactly the same records. By default (``reader: raw``) it sends Kafka's
Fetch request to the partition's leader itself and parses the answer in one
compiled pass (:mod:`connectors.kafka_fetch`: no Python object per record);
``reader: kafka-python``, and whatever the raw reader does not handle
(compressed message sets, TLS/SASL, brokers 0.11+), uses an assigned
kafka-python consumer (no group membership, no auto-commit). Offsets reach the
group only through :meth:`KafkaSource.commit`, which the checkpoint coordinator
calls once a checkpoint naming them is durable.

A broker that goes away (restart, network) delays planning and reading: every
call retries with backoff for up to ``retry_timeout_s`` and then raises
:class:`KafkaUnavailable`; a chunk being read keeps what it already has and
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
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel, ConfigDict, Field, field_validator

from connectors import kafka_fetch
from connectors.kafka_client import (
    REQUEST_TIMEOUT_MS,
    Backoff,
    Transient,
    check_client_options,
    is_transient,
    make_producer,
    reachable,
    retrying,
)
from connectors.kafka_client import ApiVersion as ApiVersion  # noqa: PLC0414
from connectors.kafka_client import ApiVersionSpec as ApiVersionSpec  # noqa: PLC0414
from connectors.kafka_client import KafkaUnavailable as KafkaUnavailable  # noqa: PLC0414
from connectors.kafka_client import bootstrap_hosts as bootstrap_hosts  # noqa: PLC0414
from connectors.kafka_client import parse_api_version as parse_api_version  # noqa: PLC0414
from connectors.kafka_client import (
    resolve_api_version as resolve_api_version,  # noqa: PLC0414
)
from connectors.types import Chunk, RawChunk, Source

log = logging.getLogger(__name__)

T = TypeVar("T")

# A chunk read that gets nothing for this long drops its consumer and opens a new one
# (fresh connections and metadata after a broker restart).
_READ_STALL_S = 5.0
# The raw reader's fetch sizes: sized to the records a chunk still wants, within these
# bounds (a larger fetch saves round trips; a smaller one reads less past the chunk).
_RAW_FETCH_MIN_BYTES = 64 << 10
_RAW_FETCH_MAX_BYTES = 16 << 20
# A single message may be this large at most (fetches double up to it to take one whole).
_RAW_FETCH_LIMIT_BYTES = 1 << 30
# kafka-python's default fetch_max_wait_ms: how long the broker may hold a fetch.
_FETCH_MAX_WAIT_MS = 500
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
    topics: tuple[str, ...] = Field(min_length=1)
    group_id: str = Field(min_length=1, description="consumer group that holds committed offsets")
    api_version: Literal["auto"] | ApiVersion = "auto"
    # Where a partition without a committed offset starts. "earliest" by default
    # (Kafka's own default is "latest"): a new job trains on what the topic holds
    # rather than silently skipping it.
    auto_offset_reset: Literal["earliest", "latest"] = "earliest"
    max_records: int = Field(10_000, gt=0, description="records per chunk at most")
    poll_timeout_ms: int = Field(1000, gt=0, description="one poll of a chunk read")
    retry_timeout_s: float = Field(300.0, gt=0, description="how long to wait out a broker")
    reader: Literal["raw", "kafka-python"] = Field(
        "raw",
        description=(
            "how workers read chunks: 'raw' sends Kafka's Fetch request itself and parses "
            "what it returns in one compiled pass (connectors.kafka_fetch; several times "
            "faster) over PLAINTEXT: legacy message sets and record batches, compressed "
            "batches inflated; compressed legacy message sets, TLS/SASL and proxies are "
            "read with kafka-python all the same. "
            "'kafka-python': always a KafkaConsumer (one Python object per record)"
        ),
    )
    client_options: dict[str, Any] = Field(default_factory=dict)

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
        # fits under it needs no broker round trip (one per batch cost the trainer's
        # thread, which plans, about 8% of its time).
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
        reads: _Reads = (
            _RawReads(self, topic, number)
            if self._raw_applies(chunk.partition)
            else _ConsumerReads(self, topic, number)
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
                    reads = _ConsumerReads(self, topic, number)
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
        return float(ms + options.get("fetch_max_wait_ms", _FETCH_MAX_WAIT_MS)) / 1000

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


class _Reads(Protocol):
    """One way of reading a partition's records: a step at a time from a position.

    ``step(position, end)`` returns the offsets and values of ``[position, end)`` it
    got and where the next step starts (past offsets compaction removed, too).
    ``hand_over`` says the rest of the chunk needs kafka-python; ``retry_now`` that
    the step made no progress but knows what to change (no stall). ``reset`` drops
    connections after an error; ``finish`` ends the chunk.
    """

    hand_over: bool
    retry_now: bool

    def step(
        self, position: int, end: int
    ) -> tuple[Sequence[int] | npt.NDArray[np.int64], list[bytes], int]: ...

    def reset(self) -> None: ...

    def finish(self) -> None: ...


class _ConsumerReads:
    """kafka-python's assigned consumer: seek once, then poll."""

    hand_over = False
    retry_now = False

    def __init__(self, source: KafkaSource, topic: str, partition: int) -> None:
        from kafka import TopicPartition

        self.source = source
        self.tp = TopicPartition(topic, partition)
        self.client: Any = None

    def step(
        self, position: int, end: int
    ) -> tuple[Sequence[int] | npt.NDArray[np.int64], list[bytes], int]:
        tp = self.tp
        if self.client is None:
            self.client = self.source._client("read")
            self.client.assign([tp])
            self.client.seek(tp, position)
        client = self.client
        batch = client.poll(
            timeout_ms=self.source.config.poll_timeout_ms,
            max_records=max(1, min(end - position, 10_000)),
        )
        offsets: list[int] = []
        payloads: list[bytes] = []
        for record in batch.get(tp, []):
            if record.offset < position:
                continue  # a stale fetch: already taken
            if record.offset >= end:
                break
            offsets.append(record.offset)
            payloads.append(record.value if record.value is not None else b"")
            position = record.offset + 1
        # The consumer's position also moves past offsets compaction removed.
        consumer_at = client.position(tp, timeout_ms=REQUEST_TIMEOUT_MS)
        if consumer_at is not None and consumer_at > position:
            position = min(int(consumer_at), end)
        return offsets, payloads, position

    def reset(self) -> None:
        if self.client is not None:
            self.source._drop("read")
            self.client = None

    def finish(self) -> None:
        if self.client is not None:
            self.client.unsubscribe()  # no prefetching past the chunk; the client stays cached


class _RawReads:
    """Fetch requests of our own to the leader, parsed by :mod:`connectors.kafka_fetch`."""

    def __init__(self, source: KafkaSource, topic: str, partition: int) -> None:
        options = source.config.client_options
        self.source, self.topic, self.partition = source, topic, partition
        self.fixed_bytes: int | None = options.get("max_partition_fetch_bytes")
        self.min_bytes = int(options.get("fetch_min_bytes", 1))
        self.at_once = False  # the next fetch asks for 1 byte (see step)
        self.max_wait_ms = int(options.get("fetch_max_wait_ms", _FETCH_MAX_WAIT_MS))
        self.check_crcs = bool(options.get("check_crcs", True))
        self.isolation = source._isolation()
        self.grow = 1  # doubles while one message is larger than a whole fetch
        self.hand_over = False
        self.retry_now = False

    def fetch_bytes(self, records: int) -> int:
        """How much to ask for: ``records`` at the size seen so far, or the configured size."""
        if self.fixed_bytes is not None:
            want = self.fixed_bytes
        else:
            want = int(self.source._record_bytes * records * 1.05) + 4096
            want = min(max(want, _RAW_FETCH_MIN_BYTES), _RAW_FETCH_MAX_BYTES)
        return min(want * self.grow, _RAW_FETCH_LIMIT_BYTES)

    def step(
        self, position: int, end: int
    ) -> tuple[Sequence[int] | npt.NDArray[np.int64], list[bytes], int]:
        from kafka.errors import CorruptRecordError, for_code

        self.retry_now = False
        conn = self.source._connection(*self.source._leader(self.topic, self.partition))
        version = kafka_fetch.fetch_version(self.source.api_version(), conn.fetch_versions)
        if version < 0:
            # No Fetch version this reader speaks is one the broker answers.
            self.hand_over = True
            return [], [], position
        max_bytes = self.fetch_bytes(end - position)
        body = conn.request(
            lambda cid: kafka_fetch.encode_fetch_request(
                cid,
                self.topic,
                self.partition,
                position,
                max_bytes=max_bytes,
                max_wait_ms=self.max_wait_ms,
                min_bytes=1 if self.at_once else self.min_bytes,
                version=version,
                isolation_level=self.isolation,
            )
        )
        answer = [
            p
            for p in kafka_fetch.decode_fetch_response(body, version)
            if (p.topic, p.partition) == (self.topic, self.partition)
        ]
        if len(answer) != 1:
            msg = f"a Fetch answer for {self.topic}/{self.partition} holds {len(answer)} answers"
            raise kafka_fetch.ProtocolError(msg)
        part = answer[0]
        if part.error_code:
            # NOT_LEADER, UNKNOWN_TOPIC_OR_PARTITION, ... are retriable (reset() forgets the
            # leader); OFFSET_OUT_OF_RANGE goes to read()'s own handling.
            raise for_code(part.error_code)(f"fetching {self.topic}/{self.partition} @{position}")
        waited, self.at_once = self.at_once, False
        if part.set_end == part.set_start and part.high_watermark > position and not waited:
            # Nothing, though the log holds records here: a broker that answers a fetch
            # whose min_bytes it does not reach with none of them (Tansu 0.6; Apache
            # Kafka gives what it has). Ask again at once for whatever there is.
            self.at_once = self.retry_now = True
            return [], [], position
        try:
            found = kafka_fetch.parse_records(
                body,
                part.set_start,
                part.set_end,
                from_offset=position,
                to_offset=end,
                check_crcs=self.check_crcs,
            )
        except kafka_fetch.CorruptBatch as exc:
            raise CorruptRecordError(f"{self.topic}/{self.partition}: {exc}") from exc
        except NotImplementedError:
            # A codec whose package is missing: kafka-python reads on (and says which).
            self.hand_over = True
            return [], [], position
        if found.bad_crcs:
            bad = found.bad_crcs
            raise CorruptRecordError(f"{self.topic}/{self.partition}: offsets {bad[:5]} fail CRC")
        # Past the last entry read whole: records, or a transaction marker holding none
        # (a chunk that ends on a marker would otherwise never be read to its end).
        after = max(int(found.offsets[-1]) + 1 if len(found) else position, found.next_offset)
        after = min(after, end)
        if len(found):
            spent = found.stop - part.set_start
            self.source._record_bytes = spent / len(found)
        if part.aborted:
            # Read committed: the records of aborted transactions are not delivered.
            found = found.without(
                kafka_fetch.aborted_ranges(body, part.set_start, part.set_end, part.aborted)
            )
        if found.status == "past":
            after = end  # the next record is past the chunk (compaction may leave gaps)
        elif found.status in ("compressed", "corrupt"):
            self.hand_over = True
        elif found.status == "truncated" and not len(found) and found.stop == part.set_start:
            # Not one whole message fits: ask for more at once (kafka-python 0.9 would fail).
            if max_bytes >= _RAW_FETCH_LIMIT_BYTES:
                msg = (
                    f"a message of {self.topic}/{self.partition} at offset {position} is over "
                    f"{max_bytes:,} bytes"
                )
                raise ValueError(msg)
            self.grow *= 2
            self.retry_now = True
        return found.offsets, found.payloads, after

    def reset(self) -> None:
        self.source._forget(self.topic, self.partition)

    def finish(self) -> None:
        pass


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


# -- writing ------------------------------------------------------------------------------


class ProduceError(RuntimeError):
    """The broker refused a record, or a record cannot go where it was asked to."""


def produce(
    bootstrap_servers: str,
    topic: str,
    payloads: Iterable[bytes],
    *,
    api_version: ApiVersionSpec,
    partition: int | None = None,
    keys: Iterable[bytes | None] | None = None,
    client_options: Mapping[str, Any] | None = None,
    timeout_s: float = 60.0,
    progress: Callable[[int], None] | None = None,
    flush_every: int = 10_000,
) -> int:
    """Write ``payloads`` to ``topic``, wait for the broker to acknowledge all; return the count.

    ``partition`` pins every record to one partition; otherwise kafka-python's
    partitioner spreads them (by key when ``keys`` are given, else at random).
    Records of one partition land in the order given. Every ``flush_every``
    records the producer waits for the broker's acknowledgements (bounding the
    memory a long stream takes) and calls ``progress`` with the count so far.
    Raises :class:`ProduceError` naming the first record (1-based) the broker
    refused, or a ``partition`` the topic does not have.
    """
    from kafka.errors import KafkaError

    version = resolve_api_version(
        bootstrap_servers, api_version, client_options=client_options, retry_timeout_s=timeout_s
    )
    producer = make_producer(bootstrap_servers, version, client_options)
    try:
        if partition is not None:
            known = producer.partitions_for(topic)
            if partition not in known:
                msg = (
                    f"partition {partition}: topic {topic!r} has partitions 0-{max(known)}"
                    if known
                    else f"partition {partition}: topic {topic!r} has no partitions"
                )
                raise ProduceError(msg)
        key_iter = iter(keys) if keys is not None else None
        futures: list[Any] = []
        done = 0
        for payload in payloads:
            key = next(key_iter) if key_iter is not None else None
            try:
                futures.append(producer.send(topic, value=payload, key=key, partition=partition))
            except KafkaError as exc:  # e.g. a record over max_request_size
                msg = f"record {done + len(futures) + 1}: cannot send it: {exc}"
                raise ProduceError(msg) from exc
            if len(futures) >= flush_every:
                done += _acknowledged(producer, futures, done, timeout_s)
                futures = []
                if progress is not None:
                    progress(done)
        done += _acknowledged(producer, futures, done, timeout_s)
        if progress is not None:
            progress(done)
        return done
    finally:
        producer.close(timeout=timeout_s)


def _acknowledged(producer: Any, futures: list[Any], before: int, timeout_s: float) -> int:
    """Flush, then wait for each of ``futures``; raises :class:`ProduceError` on a refusal."""
    producer.flush(timeout=timeout_s)
    for i, future in enumerate(futures):
        try:
            future.get(timeout=timeout_s)
        except Exception as exc:
            msg = f"record {before + i + 1}: the broker did not take it: {exc}"
            raise ProduceError(msg) from exc
    return len(futures)


FileFormat = Literal["jsonl", "parquet"]
_PARQUET_SUFFIXES = (".parquet", ".pq")


def file_format(path: str, requested: str = "auto") -> FileFormat:
    """The format of a file for :class:`FileRecords`: ``requested``, or for ``"auto"`` its suffix
    (``.parquet`` / ``.pq``: Parquet, anything else: JSON lines).

    >>> file_format("clicks.parquet"), file_format("clicks.jsonl"), file_format("x", "parquet")
    ('parquet', 'jsonl', 'parquet')
    """
    if requested == "auto":
        return "parquet" if path.lower().endswith(_PARQUET_SUFFIXES) else "jsonl"
    if requested not in ("jsonl", "parquet"):
        msg = f"--format {requested!r}: expected auto, jsonl or parquet"
        raise ValueError(msg)
    return "jsonl" if requested == "jsonl" else "parquet"


def _key_bytes(value: object) -> bytes | None:
    """A record key from a field's value: a string's UTF-8, else its compact JSON; None: none.

    >>> _key_bytes("u1"), _key_bytes(7), _key_bytes(None)
    (b'u1', b'7', None)
    """
    import json

    if value is None:
        return None
    if isinstance(value, str):
        return value.encode()
    return json.dumps(value, separators=(",", ":"), sort_keys=True).encode()


class FileRecords:
    """The records of a JSON-lines or Parquet file, in file order, for :func:`produce`.

    Iterating yields ``(value, key)`` pairs. A JSON line's value is the line's
    bytes as they are (no newline; a blank line is skipped and counted in
    ``blank_lines``; a line that is not JSON is sent all the same: the job's
    codec dead-letters it). A Parquet row becomes one compact JSON object, as
    the JSON codec reads it (``JsonLinesCodec.encode``). With ``key_field`` the
    key is that field's value (a string's UTF-8, else compact JSON); records
    without it (or JSON lines that are not objects) go without a key and are
    counted in ``keyless``. ``total`` is the number of records, known upfront.
    """

    def __init__(
        self, path: str, *, fmt: str = "auto", key_field: str | None = None, batch_rows: int = 8192
    ) -> None:
        import os

        self.path = path
        self.format: FileFormat = file_format(path, fmt)
        self.key_field = key_field
        self.batch_rows = batch_rows
        self.blank_lines = 0
        self.keyless = 0
        if not os.path.isfile(path):
            what = "is a folder, not a file" if os.path.isdir(path) else "no such file"
            msg = f"--from {path}: {what}"
            raise ValueError(msg)
        self.total = self._count()

    def _count(self) -> int:
        if self.format == "parquet":
            import pyarrow.parquet as pq

            try:
                meta = pq.ParquetFile(self.path).metadata
            except Exception as exc:  # pyarrow says ArrowInvalid, OSError, ...
                msg = f"--from {self.path}: not a Parquet file ({exc})"
                raise ValueError(msg) from exc
            if self.key_field is not None and self.key_field not in meta.schema.names:
                msg = (
                    f"--key-field {self.key_field!r}: {self.path} has no such column "
                    f"(its columns: {', '.join(meta.schema.names)})"
                )
                raise ValueError(msg)
            return int(meta.num_rows)
        with open(self.path, "rb") as f:
            return sum(1 for line in f if line.strip())

    def __iter__(self) -> Iterator[tuple[bytes, bytes | None]]:
        if self.format == "parquet":
            yield from self._parquet()
        else:
            yield from self._json_lines()

    def _json_lines(self) -> Iterator[tuple[bytes, bytes | None]]:
        import json

        self.blank_lines = self.keyless = 0
        with open(self.path, "rb") as f:
            for line in f:
                value = line.rstrip(b"\r\n")
                if not value.strip():
                    self.blank_lines += 1
                    continue
                key = None
                if self.key_field is not None:
                    try:
                        record = json.loads(value)
                    except ValueError:
                        record = None
                    if isinstance(record, dict):
                        key = _key_bytes(record.get(self.key_field))
                    if key is None:
                        self.keyless += 1
                yield value, key

    def _parquet(self) -> Iterator[tuple[bytes, bytes | None]]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        from connectors.codecs import JsonLinesCodec

        codec = JsonLinesCodec()
        self.blank_lines = self.keyless = 0
        row = 0
        for batch in pq.ParquetFile(self.path).iter_batches(batch_size=self.batch_rows):
            try:
                values = codec.encode(pa.Table.from_batches([batch]))
            except TypeError as exc:
                msg = f"--from {self.path}: rows {row + 1}-{row + batch.num_rows}: {exc}"
                raise ValueError(msg) from exc
            if self.key_field is None:
                yield from ((v, None) for v in values)
            else:
                keys = [_key_bytes(k) for k in batch.column(self.key_field).to_pylist()]
                self.keyless += sum(k is None for k in keys)
                yield from zip(values, keys, strict=True)
            row += batch.num_rows


if TYPE_CHECKING:  # mypy proves that the classes implement the shared protocols

    def _is_source(source: KafkaSource) -> Source:
        return source
