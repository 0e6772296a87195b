"""Kafka's Fetch, Metadata and ApiVersions requests by hand, and their answers.

kafka-python turns every record into a ``ConsumerRecord`` (several Python objects
per record), so that a large chunk costs more to *read* than to decode. The Fetch
request of the protocol is small and stable (v4 from Kafka 0.11 to 4.x), so
:class:`~connectors.kafka.KafkaSource` sends it itself, and
:mod:`connectors.kafka_records` parses the message sets and record batches of the
answer in one numba pass. kafka-python still does everything else (offsets,
commits, producing, version detection) and reads what the raw reader does not
handle (compressed message sets and batches, TLS/SASL).

The module is a pure core — :func:`encode_fetch_request`,
:func:`decode_fetch_response`, :func:`encode_metadata_request`,
:func:`decode_metadata_response` work on bytes — and one thin socket shell,
:class:`BrokerConnection`.

>>> body = encode_metadata_request(7, ["events"])
>>> int.from_bytes(body[:4], "big") == len(body) - 4
True
"""

from __future__ import annotations

import contextlib
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass

FETCH_API_KEY = 1
METADATA_API_KEY = 3
API_VERSIONS_API_KEY = 18
CLIENT_ID = b"streamrec-raw"
# A Fetch's isolation level (v4 on): every record, or only those of committed transactions.
READ_UNCOMMITTED, READ_COMMITTED = 0, 1


class ProtocolError(OSError):
    """A broker's answer does not parse (a broken connection or a protocol mismatch).

    An ``OSError``: the reader treats it as transient (drops the connection, retries).
    """


_FETCH_VERSIONS = (0, 4)  # the Fetch versions this reader speaks


def fetch_version(api_version: tuple[int, ...], supported: tuple[int, int] | None = None) -> int:
    """The Fetch version to send: the highest this reader speaks (v0-v4) within
    ``supported``, the broker's (lowest, highest) from its ApiVersions answer; -1
    when none is (a broker that dropped v4 one day: kafka-python reads on).

    Without an answer (Kafka 0.9 has no ApiVersions) by ``api_version``: 4 from
    0.11 (record batches, the last stable offset), 2 from 0.10 (message format
    v1), 1 on 0.9, else 0. A lower version than the broker's would make it
    convert every message down; Kafka 4 no longer answers Fetch below v4.

    >>> fetch_version((0, 9)), fetch_version((0, 10, 1)), fetch_version((0, 8, 2))
    (1, 2, 0)
    >>> fetch_version((3, 9)), fetch_version((0, 10), (4, 17)), fetch_version((3, 9), (0, 3))
    (4, 4, 3)
    >>> fetch_version((4, 0), (5, 18))
    -1
    """
    if supported is not None:
        low, high = supported
        version = min(_FETCH_VERSIONS[1], high)
        return version if version >= max(low, _FETCH_VERSIONS[0]) else -1
    if api_version >= (0, 11):
        return 4
    if api_version >= (0, 10):
        return 2
    return 1 if api_version >= (0, 9) else 0


# -- requests ------------------------------------------------------------------------------


def _string(value: bytes) -> bytes:
    return struct.pack(">h", len(value)) + value


def _request(api_key: int, version: int, correlation_id: int, body: bytes) -> bytes:
    """A size-prefixed request: header (api key, version, correlation id, client id) + body."""
    header = struct.pack(">hhi", api_key, version, correlation_id) + _string(CLIENT_ID)
    return struct.pack(">i", len(header) + len(body)) + header + body


def encode_fetch_request(
    correlation_id: int,
    topic: str,
    partition: int,
    offset: int,
    *,
    max_bytes: int,
    max_wait_ms: int,
    min_bytes: int = 1,
    version: int = 1,
    isolation_level: int = READ_UNCOMMITTED,
) -> bytes:
    """A Fetch request (v0-v4) for one topic-partition from ``offset``, size-prefixed.

    The broker answers once it has ``min_bytes`` or after ``max_wait_ms``, with at
    most ``max_bytes`` of the partition's log (possibly ending in a partial message).
    From v3 the response as a whole is capped at ``max_bytes`` too. From v4 it
    carries an ``isolation_level``: uncommitted by default, as kafka-python's
    consumer reads; :data:`READ_COMMITTED` makes the broker report the last stable
    offset and the aborted transactions among the records it returns.

    >>> req = encode_fetch_request(7, "t", 0, 42, max_bytes=1024, max_wait_ms=100)
    >>> len(req), req[4:6], req[-12:]
    (66, b'\\x00\\x01', b'\\x00\\x00\\x00\\x00\\x00\\x00\\x00*\\x00\\x00\\x04\\x00')
    >>> len(encode_fetch_request(7, "t", 0, 42, max_bytes=1024, max_wait_ms=100, version=4))
    71
    """
    if not 0 <= version <= 4:
        msg = f"this reader speaks Fetch v0-v4, not v{version}"
        raise ValueError(msg)
    body = (
        struct.pack(">iii", -1, max_wait_ms, min_bytes)  # replica id -1: a consumer
        + (struct.pack(">i", max_bytes) if version >= 3 else b"")
        + (struct.pack(">b", isolation_level) if version >= 4 else b"")
        + struct.pack(">i", 1)
        + _string(topic.encode())
        + struct.pack(">iiqi", 1, partition, offset, max_bytes)
    )
    return _request(FETCH_API_KEY, version, correlation_id, body)


def encode_api_versions_request(correlation_id: int) -> bytes:
    """An ApiVersions v0 request (brokers from 0.10), size-prefixed.

    >>> encode_api_versions_request(1)[4:8]
    b'\\x00\\x12\\x00\\x00'
    """
    return _request(API_VERSIONS_API_KEY, 0, correlation_id, b"")


def decode_api_versions_response(
    body: bytes | bytearray | memoryview,
) -> dict[int, tuple[int, int]]:
    """``{api key: (lowest, highest version)}`` from an ApiVersions v0 response ``body``.

    >>> body = struct.pack(">ihi", 1, 0, 1) + struct.pack(">hhh", 1, 0, 17)
    >>> decode_api_versions_response(body)
    {1: (0, 17)}
    """
    cur = _Cursor(body, 4)
    error = cur.int(">h")
    if error:
        msg = f"ApiVersions answered error code {error}"
        raise ProtocolError(msg)
    out: dict[int, tuple[int, int]] = {}
    for _ in range(cur.int(">i")):
        key, low, high = cur.take(">hhh")
        out[key] = (low, high)
    return out


def encode_metadata_request(correlation_id: int, topics: list[str]) -> bytes:
    """A Metadata v0 request for ``topics``, size-prefixed.

    >>> encode_metadata_request(1, ["t"])[4:8]
    b'\\x00\\x03\\x00\\x00'
    """
    body = struct.pack(">i", len(topics)) + b"".join(_string(t.encode()) for t in topics)
    return _request(METADATA_API_KEY, 0, correlation_id, body)


# -- responses -----------------------------------------------------------------------------


class _Cursor:
    """Reads big-endian fields of a response body in order; short data is a ProtocolError."""

    def __init__(self, data: bytes | bytearray | memoryview, pos: int = 0) -> None:
        self.data, self.pos = data, pos

    def take(self, fmt: str) -> tuple[int, ...]:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.data):
            msg = f"a Kafka response ends early (at byte {self.pos} of {len(self.data)})"
            raise ProtocolError(msg)
        values = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += size
        return values

    def int(self, fmt: str) -> int:
        return self.take(fmt)[0]

    def string(self) -> str:
        n = self.int(">h")
        if n < 0:
            return ""
        if self.pos + n > len(self.data):
            msg = f"a Kafka response ends inside a string (at byte {self.pos})"
            raise ProtocolError(msg)
        value = bytes(self.data[self.pos : self.pos + n]).decode()
        self.pos += n
        return value


@dataclass(frozen=True)
class FetchedPartition:
    """One partition of a Fetch response; its message set is ``body[set_start:set_end]``."""

    topic: str
    partition: int
    error_code: int
    high_watermark: int
    set_start: int
    set_end: int
    last_stable_offset: int = -1  # v4 on: where committed transactions end
    # v4 read_committed: (producer id, first offset) of each aborted transaction in the set.
    aborted: tuple[tuple[int, int], ...] = ()


def decode_fetch_response(
    body: bytes | bytearray | memoryview, version: int
) -> list[FetchedPartition]:
    """The partitions of a Fetch response ``body`` (the answer after its size prefix).

    ``body`` starts with the correlation id (the connection checks it); each
    partition's message set is ``body[set_start:set_end]``.

    >>> body = (struct.pack(">ii", 7, 0) + struct.pack(">ih", 1, 1) + b"t"
    ...         + struct.pack(">iihqi", 1, 0, 0, 10, 3) + b"abc")
    >>> [part] = decode_fetch_response(body, 1)
    >>> part.error_code, part.high_watermark, body[part.set_start : part.set_end]
    (0, 10, b'abc')

    From v4 each partition also carries its last stable offset and, read
    committed, the aborted transactions among the records returned (see
    :func:`aborted_ranges`).
    """
    cur = _Cursor(body, 4)
    if version >= 1:
        cur.take(">i")  # throttle time
    out = []
    for _ in range(cur.int(">i")):
        topic = cur.string()
        for _ in range(cur.int(">i")):
            partition, error, high_watermark = cur.take(">ihq")
            stable = -1
            aborted: tuple[tuple[int, int], ...] = ()
            if version >= 4:
                stable = cur.int(">q")
                count = cur.int(">i")  # -1: null
                pairs = [cur.take(">qq") for _ in range(max(count, 0))]
                aborted = tuple((producer, first) for producer, first in pairs)
            size = cur.int(">i")
            start = cur.pos
            if size < 0 or start + size > len(body):
                msg = f"a Fetch response's message set runs past its end ({size} bytes at {start})"
                raise ProtocolError(msg)
            cur.pos += size
            out.append(
                FetchedPartition(
                    topic, partition, error, high_watermark, start, cur.pos, stable, aborted
                )
            )
    return out


@dataclass(frozen=True)
class PartitionLeader:
    """Where a partition's leader is (``host`` None: no leader now), and the partition's error."""

    error_code: int
    host: str | None
    port: int


def decode_metadata_response(
    body: bytes | bytearray | memoryview,
) -> tuple[dict[str, int], dict[tuple[str, int], PartitionLeader]]:
    """Topic error codes, and every partition's leader, from a Metadata v0 response ``body``.

    >>> brokers = struct.pack(">ii", 1, 0) + struct.pack(">h", 9) + b"127.0.0.1"
    >>> topics = struct.pack(">ihh", 1, 0, 1) + b"t" + struct.pack(">ihiiiii", 1, 0, 0, 0, 1, 0, 0)
    >>> body = struct.pack(">i", 1) + brokers + struct.pack(">i", 9092) + topics
    >>> decode_metadata_response(body)
    ({'t': 0}, {('t', 0): PartitionLeader(error_code=0, host='127.0.0.1', port=9092)})
    """
    cur = _Cursor(body, 4)
    brokers: dict[int, tuple[str, int]] = {}
    for _ in range(cur.int(">i")):
        node = cur.int(">i")
        host = cur.string()
        brokers[node] = (host, cur.int(">i"))
    topics: dict[str, int] = {}
    leaders: dict[tuple[str, int], PartitionLeader] = {}
    for _ in range(cur.int(">i")):
        topic_error = cur.int(">h")
        topic = cur.string()
        topics[topic] = topic_error
        for _ in range(cur.int(">i")):
            error, partition, leader = cur.take(">hii")
            for _ in range(2):  # replicas, then in-sync replicas: skipped
                count = cur.int(">i")  # (read before moving on: it moves the cursor)
                cur.pos += 4 * count
            where = brokers.get(leader)
            leaders[(topic, partition)] = (
                PartitionLeader(error, *where) if where else PartitionLeader(error, None, -1)
            )
    return topics, leaders


# -- the socket shell ----------------------------------------------------------------------


class BrokerConnection:
    """One plain TCP connection to a broker; one request at a time (the caller's thread).

    Any socket error, timeout or unparseable answer raises ``OSError``: the
    caller drops the connection and opens a new one.
    """

    def __init__(self, host: str, port: int, timeout_s: float) -> None:
        self.host, self.port = host, port
        self._sock = socket.create_connection((host, port), timeout=timeout_s)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._correlation = 0
        # The broker's (lowest, highest) Fetch versions, once asked (see ask_versions).
        self.fetch_versions: tuple[int, int] | None = None

    def ask_versions(self) -> None:
        """Ask the broker which versions it speaks (ApiVersions, brokers from 0.10; a
        0.9 broker closes the connection on it) and keep Fetch's in ``fetch_versions``."""
        versions = decode_api_versions_response(self.request(encode_api_versions_request))
        self.fetch_versions = versions.get(FETCH_API_KEY, (-1, -1))

    def request(self, make: Callable[[int], bytes]) -> bytearray:
        """Send ``make(correlation_id)`` (a size-prefixed request); the answer's body.

        The body starts with the correlation id, checked here against the request's.
        """
        self._correlation = (self._correlation + 1) & 0x7FFFFFFF
        self._sock.sendall(make(self._correlation))
        size = struct.unpack(">i", self._recv_exactly(4))[0]
        if size < 4:
            msg = f"broker {self.host}:{self.port} sent a {size}-byte answer"
            raise ProtocolError(msg)
        body = self._recv_exactly(size)
        got = struct.unpack_from(">i", body, 0)[0]
        if got != self._correlation:
            msg = f"broker {self.host}:{self.port} answered request {got}, not {self._correlation}"
            raise ProtocolError(msg)
        return body

    def _recv_exactly(self, size: int) -> bytearray:
        buf = bytearray(size)
        view = memoryview(buf)
        got = 0
        while got < size:
            n = self._sock.recv_into(view[got:], size - got)
            if n == 0:
                msg = f"broker {self.host}:{self.port} closed the connection"
                raise ProtocolError(msg)
            got += n
        return buf

    def close(self) -> None:
        """Close the socket (errors ignored: it may be dead already)."""
        with contextlib.suppress(OSError):
            self._sock.close()
