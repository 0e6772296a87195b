"""A compiled parser of what a Fetch returns: legacy message sets and record batches.

One numba pass turns a Fetch answer's records into ``offsets`` and value ``[start,
end)`` spans over the response buffer, with no Python object per record: legacy
messages (magic 0 and 1, brokers before 0.11) and uncompressed record batches
(magic 2: varint-framed records, headers skipped, CRC-32C checked per batch,
control batches of transactions skipped). Compressed ones are inflated
(:func:`inflate_batch`) or left to kafka-python. The requests and the socket are
:mod:`connectors.kafka_fetch`'s.

A message set, as Kafka 0.9/0.10 sends it (all integers big-endian)::

    offset int64 | size int32 | crc int32 | magic int8 | attributes int8
    | timestamp int64 (magic 1 only) | key bytes | value bytes

where ``bytes`` is an int32 length (-1: null) and the content.

>>> data = encode_message(5, b"hello", key=b"k") + encode_message(6, None, magic=1)
>>> ms = parse_message_set(data, from_offset=0, to_offset=100)
>>> ms.offsets.tolist(), ms.status, ms.payloads(data)
([5, 6], 'end', [b'hello', b''])
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import Literal

import numba as nb
import numpy as np
import numpy.typing as npt
from crc32c import crc32c  # CRC-32C in C (SSE 4.2 where there is one), as Kafka's batches use

I64 = npt.NDArray[np.int64]
U8 = npt.NDArray[np.uint8]

# The smallest message: crc, magic, attributes, key length, value length.
_MIN_MESSAGE = 4 + 1 + 1 + 4 + 4
# An entry's header before the message: offset and size.
_ENTRY_HEADER = 8 + 4
# The attribute bits naming a codec (gzip 1, snappy 2, lz4 3, zstd 4): a wrapper
# message whose value is a whole compressed message set, or a compressed record batch.
_CODEC_MASK = 0x07
# A record batch (magic 2) after its offset and length: leader epoch 4, magic 1,
# crc 4, attributes 2, last offset delta 4, timestamps 8 + 8, producer id 8 and
# epoch 2, base sequence 4, record count 4.
_BATCH_HEAD = 49
_CONTROL_BATCH = 0x20  # a transaction marker, not data
_TRANSACTIONAL_BATCH = 0x10  # records of a transaction (committed or aborted by a marker)
_NO_PRODUCER = -1
# The smallest record: length, attributes, timestamp and offset deltas, key and
# value lengths, header count.
_MIN_RECORD = 7


# What a parse ended on (numba returns the code; Python sees the name).
_END, _TRUNCATED, _PAST, _COMPRESSED, _CORRUPT, _FULL = 0, 1, 2, 3, 4, 5
ParseStatus = Literal["end", "truncated", "past", "compressed", "corrupt"]
# A parse whose output arrays filled up stops as a truncated one does: the next fetch
# starts after the last record taken.
_STATUS: tuple[ParseStatus, ...] = (
    "end", "truncated", "past", "compressed", "corrupt", "truncated",
)  # fmt: skip


# -- the message set -----------------------------------------------------------------------


@nb.njit(nogil=True, cache=True, inline="always")
def _u32(data: U8, p: int) -> np.int64:
    return (
        (np.int64(data[p]) << 24)
        | (np.int64(data[p + 1]) << 16)
        | (np.int64(data[p + 2]) << 8)
        | np.int64(data[p + 3])
    )


@nb.njit(nogil=True, cache=True, inline="always")
def _i32(data: U8, p: int) -> np.int64:
    v = _u32(data, p)
    return v - (np.int64(1) << 32) if v >= (np.int64(1) << 31) else v


@nb.njit(nogil=True, cache=True, inline="always")
def _i64(data: U8, p: int) -> np.int64:
    # Offsets are below 2**63 by the protocol; the high word is never "negative".
    return (_u32(data, p) << 32) | _u32(data, p + 4)


@nb.njit(nogil=True, cache=True, inline="always")
def _varint(data: U8, p: int, end: int) -> tuple[np.int64, int]:
    """A zigzag varint at ``p``; returns it and the position after it (-1: it runs past
    ``end`` or over 64 bits)."""
    raw = np.uint64(0)
    shift = 0
    while True:
        if p >= end or shift > 63:
            return np.int64(0), -1
        b = data[p]
        p += 1
        raw |= np.uint64(b & 0x7F) << np.uint64(shift)
        if b < 0x80:
            break
        shift += 7
    value = np.int64(raw >> np.uint64(1)) ^ -np.int64(raw & np.uint64(1))
    return value, p


@nb.njit(nogil=True, cache=True)
def _scan_batch(
    data: U8,
    m: int,
    batch_end: int,
    base: int,
    from_offset: int,
    to_offset: int,
    n: int,
    offsets: I64,
    value_starts: I64,
    value_ends: I64,
    crc_starts: I64,
    crcs: I64,
) -> tuple[int, int]:
    """The records of an uncompressed record batch whose head starts at ``m`` (after its
    offset and length); returns the new count and a status (_END: the batch is done).
    """
    count = int(_i32(data, m + 45))
    q = m + _BATCH_HEAD
    for _ in range(count):
        length, q = _varint(data, q, batch_end)
        if q < 0 or length < _MIN_RECORD - 1 or q + length > batch_end:
            return n, _CORRUPT
        record_end = q + int(length)
        q += 1  # attributes
        _, q = _varint(data, q, record_end)  # timestamp delta
        if q < 0:
            return n, _CORRUPT
        delta, q = _varint(data, q, record_end)
        if q < 0:
            return n, _CORRUPT
        key_len, q = _varint(data, q, record_end)
        if q < 0:
            return n, _CORRUPT
        q += int(key_len) if key_len > 0 else 0  # -1: a null key
        value_len, q = _varint(data, q, record_end)
        if q < 0:
            return n, _CORRUPT
        value_end = q + (int(value_len) if value_len > 0 else 0)
        if value_end > record_end:
            return n, _CORRUPT
        offset = base + int(delta)
        if offset >= to_offset:
            return n, _PAST
        if offset >= from_offset:
            if n == offsets.shape[0]:
                return n, _FULL
            offsets[n] = offset
            value_starts[n] = q
            value_ends[n] = value_end
            crc_starts[n] = -1  # the batch's CRC covers it
            crcs[n] = 1  # until parse_message_set finds the batch's CRC wrong
            n += 1
        q = record_end  # past the headers
    return n, _END


@nb.njit(nogil=True, cache=True)
def _scan(
    data: U8,
    start: int,
    end: int,
    from_offset: int,
    to_offset: int,
    offsets: I64,
    value_starts: I64,
    value_ends: I64,
    crc_starts: I64,
    crcs: I64,
    batches: I64,
    passed: I64,
) -> tuple[int, int, int, int]:
    """Messages of ``data[start:end]`` with offsets in ``[from_offset, to_offset)``.

    Fills the arrays; returns (count, where parsing stopped, status code, record
    batches). Stops at the first message at or past ``to_offset``, at a
    compressed wrapper or batch that may hold wanted offsets, at a partial tail,
    or at bytes that are no message. Each record batch (magic 2) read from is a
    row of ``batches``: where its CRC-32C's bytes begin and end, its CRC, and the
    index of its first record taken. ``passed[0]``: the last offset of the last
    entry parsed whole, records taken or not (a transaction marker holds none).
    """
    k = 0
    n = 0
    p = start
    while True:
        if p == end:
            return n, p, _END, k
        if p + _ENTRY_HEADER > end:
            return n, p, _TRUNCATED, k
        offset = int(_i64(data, p))
        size = int(_i32(data, p + 8))
        m = p + _ENTRY_HEADER
        if size < _MIN_MESSAGE:
            return n, p, _CORRUPT, k
        if m + size > end:
            return n, p, _TRUNCATED, k
        magic = data[m + 4]
        if magic == 2:
            if size < _BATCH_HEAD:
                return n, p, _CORRUPT, k
            if offset >= to_offset:
                return n, p, _PAST, k
            flags = (int(data[m + 9]) << 8) | int(data[m + 10])
            last = offset + int(_i32(data, m + 11))
            if last >= from_offset and not flags & _CONTROL_BATCH:
                if flags & _CODEC_MASK:
                    return n, p, _COMPRESSED, k
                if k == batches.shape[0]:
                    return n, p, _FULL, k
                batches[k, 0], batches[k, 1] = m + 9, m + size
                batches[k, 2], batches[k, 3] = _u32(data, m + 5), n
                k += 1
                n, status = _scan_batch(
                    data, m, m + size, offset, from_offset, to_offset, n,
                    offsets, value_starts, value_ends, crc_starts, crcs,
                )  # fmt: skip
                if status != _END:
                    return n, p, status, k
            passed[0] = last
            p = m + size
            continue
        if n == offsets.shape[0]:
            return n, p, _FULL, k
        attributes = data[m + 5]
        q = m + 6
        if magic == 1:
            q += 8  # the timestamp
        elif magic != 0:
            return n, p, _CORRUPT, k
        if offset >= to_offset:
            return n, p, _PAST, k
        key_len = int(_i32(data, q))
        q += 4 + (key_len if key_len > 0 else 0)  # -1: a null key
        if q + 4 > m + size:
            return n, p, _CORRUPT, k
        value_len = int(_i32(data, q))
        q += 4
        value_end = q + (value_len if value_len > 0 else 0)
        if value_end != m + size:
            return n, p, _CORRUPT, k
        if attributes & _CODEC_MASK:
            # A wrapper's offset is its last inner message's: below from_offset, all are.
            if offset >= from_offset:
                return n, p, _COMPRESSED, k
        elif offset >= from_offset:
            offsets[n] = offset
            value_starts[n] = q
            value_ends[n] = value_end
            crc_starts[n] = m + 4
            crcs[n] = _u32(data, m)
            n += 1
        passed[0] = offset
        p = m + size


@dataclass(frozen=True)
class MessageSet:
    """What :func:`parse_message_set` found: the wanted messages, where and why it stopped.

    ``status``: ``"end"`` (the whole set parsed), ``"truncated"`` (a partial
    message at the end, as a size-capped fetch leaves), ``"past"`` (a message at
    or past ``to_offset``), ``"compressed"`` (a compressed wrapper holding
    wanted offsets starts at ``stop``: read those another way), ``"corrupt"``.
    ``value_starts``/``value_ends`` index the buffer parsed (a null value is an
    empty span).
    """

    offsets: I64
    value_starts: I64
    value_ends: I64
    crc_starts: I64
    crcs: I64
    stop: int
    status: ParseStatus
    # One past the last offset of the last entry parsed whole (0: none), records taken or
    # not: a read goes on from there past a transaction marker, which holds no record.
    next_offset: int = 0

    def __len__(self) -> int:
        return int(self.offsets.shape[0])

    def payloads(self, data: bytes | bytearray | memoryview) -> list[bytes]:
        """The values as ``bytes`` (a null value as ``b""``), copied out of ``data``."""
        view = memoryview(data)
        return [
            view[s:e].tobytes()
            for s, e in zip(self.value_starts.tolist(), self.value_ends.tolist(), strict=True)
        ]

    def bad_crcs(self, data: bytes | bytearray | memoryview) -> list[int]:
        """The offsets whose message CRC does not match (a corrupted message); a record
        batch's records as the parse found their batch."""
        view = memoryview(data)
        return [
            o
            for o, s, e, c in zip(
                self.offsets.tolist(),
                self.crc_starts.tolist(),
                self.value_ends.tolist(),
                self.crcs.tolist(),
                strict=True,
            )
            if (c == 0 if s < 0 else zlib.crc32(view[s:e]) != c)
        ]


def parse_message_set(
    data: bytes | bytearray | memoryview | U8,
    start: int = 0,
    end: int | None = None,
    *,
    from_offset: int,
    to_offset: int,
    check_crcs: bool = True,
) -> MessageSet:
    """Parse the message set ``data[start:end]``, keeping offsets ``[from_offset, to_offset)``.

    One compiled pass: no object per message. A partial last message (the
    broker cuts fetches at ``max_bytes``) is left out with status ``"truncated"``.
    Legacy messages (magic 0 and 1) and uncompressed record batches (magic 2,
    Kafka 0.11 on) alike; control batches (transaction markers) hold no records.
    ``check_crcs``: check each record batch's CRC-32C while parsing (a legacy
    message's CRC is checked by :meth:`MessageSet.bad_crcs`).

    >>> data = encode_message(3, b"a") + encode_message(4, b"b") + encode_message(5, b"c")[:-2]
    >>> ms = parse_message_set(data, from_offset=4, to_offset=10)
    >>> ms.offsets.tolist(), ms.payloads(data), ms.status
    ([4], [b'b'], 'truncated')
    >>> parse_message_set(data, from_offset=0, to_offset=4).status
    'past'
    """
    buf = data if isinstance(data, np.ndarray) else np.frombuffer(data, dtype=np.uint8)
    stop_at = buf.shape[0] if end is None else end
    # Room for as many legacy messages as fit; records of a batch are smaller, and a
    # parse that fills the room stops there (the next fetch goes on from it).
    room = max(1, (stop_at - start) // (_ENTRY_HEADER + _MIN_MESSAGE))
    offsets = np.empty(room, dtype=np.int64)
    value_starts = np.empty(room, dtype=np.int64)
    value_ends = np.empty(room, dtype=np.int64)
    crc_starts = np.empty(room, dtype=np.int64)
    crcs = np.empty(room, dtype=np.int64)
    batches = np.empty((max(1, (stop_at - start) // (_ENTRY_HEADER + _BATCH_HEAD)), 4), np.int64)
    passed = np.full(1, -1, dtype=np.int64)
    n, stop, status, k = _scan(
        buf, start, stop_at, from_offset, to_offset, offsets, value_starts, value_ends,
        crc_starts, crcs, batches, passed,
    )  # fmt: skip
    if check_crcs:
        view = memoryview(buf.data)
        firsts = [*batches[:k, 3].tolist(), n]
        for b, (lo, hi, crc, first) in enumerate(batches[:k].tolist()):
            if crc32c(view[lo:hi]) != crc:
                crcs[first : firsts[b + 1]] = 0
    return MessageSet(
        offsets[:n].copy(),
        value_starts[:n].copy(),
        value_ends[:n].copy(),
        crc_starts[:n].copy(),
        crcs[:n].copy(),
        int(stop),
        _STATUS[status],
        int(passed[0]) + 1,
    )


_CODEC_NAMES = {1: "gzip", 2: "snappy", 3: "lz4", 4: "zstd"}


def inflate_batch(
    data: bytes | bytearray | memoryview, at: int, *, check_crc: bool = True
) -> bytes:
    """The compressed record batch at ``data[at:]`` as an uncompressed one: its head
    with no codec and its records inflated (by the codecs kafka-python uses: gzip
    from the standard library, snappy, lz4 and zstd from their packages).

    ``check_crc``: the batch's CRC-32C (over its compressed bytes) is checked first;
    a mismatch is a :class:`CorruptBatch`. A codec whose package is missing raises
    ``NotImplementedError`` (kafka-python then cannot read the batch either).
    """
    view = memoryview(data)
    size = struct.unpack_from(">i", view, at + 8)[0]
    m, end = at + _ENTRY_HEADER, at + _ENTRY_HEADER + size
    if check_crc and crc32c(view[m + 9 : end]) != struct.unpack_from(">I", view, m + 5)[0]:
        offset = struct.unpack_from(">q", view, at)[0]
        msg = f"the record batch at offset {offset} fails its CRC-32C"
        raise CorruptBatch(msg)
    codec = view[m + 10] & _CODEC_MASK
    packed = bytes(view[m + _BATCH_HEAD : end])
    from kafka import codec as kafka_codec

    inflate = {
        1: kafka_codec.gzip_decode,
        2: kafka_codec.snappy_decode,
        3: kafka_codec.lz4_decode,
        4: kafka_codec.zstd_decode,
    }.get(codec)
    if inflate is None:
        msg = f"record batch codec {codec} is not one of {_CODEC_NAMES}"
        raise CorruptBatch(msg)
    try:
        records = bytes(inflate(packed))
    except NotImplementedError:
        raise
    except Exception as exc:  # each library has its own error for bad input
        msg = f"a {_CODEC_NAMES[codec]} record batch does not inflate: {exc}"
        raise CorruptBatch(msg) from exc
    head = bytearray(view[at : m + _BATCH_HEAD])
    head[_ENTRY_HEADER + 10] &= ~_CODEC_MASK & 0xFF
    struct.pack_into(">i", head, 8, _BATCH_HEAD + len(records))
    return bytes(head) + records


class CorruptBatch(ValueError):
    """A record batch that fails its CRC or does not inflate."""


@dataclass(frozen=True)
class Records:
    """What :func:`parse_records` found: offsets and values, where and why it stopped
    (``status`` as :class:`MessageSet`'s), and the offsets that failed a CRC."""

    offsets: I64
    payloads: list[bytes]
    stop: int
    status: ParseStatus
    bad_crcs: list[int]
    next_offset: int = 0  # as MessageSet's

    def __len__(self) -> int:
        return int(self.offsets.shape[0])

    def without(self, ranges: list[tuple[int, int]]) -> Records:
        """These records less those with an offset in one of ``ranges`` (``[start, end)``,
        sorted, not overlapping), as :func:`aborted_ranges` gives them.

        >>> found = Records(np.arange(5, dtype=np.int64), [b"a", b"b", b"c", b"d", b"e"],
        ...                 0, "end", [])
        >>> kept = found.without([(1, 3)])
        >>> kept.offsets.tolist(), kept.payloads
        ([0, 3, 4], [b'a', b'd', b'e'])
        """
        if not ranges or not len(self):
            return self
        starts = np.array([s for s, _ in ranges], dtype=np.int64)
        ends = np.array([e for _, e in ranges], dtype=np.int64)
        # The range starting at or before each offset, if any, and whether it covers it.
        at = np.searchsorted(starts, self.offsets, side="right") - 1
        keep = (at < 0) | (self.offsets >= ends[np.maximum(at, 0)])
        payloads = [p for p, k in zip(self.payloads, keep.tolist(), strict=True) if k]
        return Records(
            self.offsets[keep], payloads, self.stop, self.status, self.bad_crcs, self.next_offset
        )


def aborted_ranges(
    data: bytes | bytearray | memoryview,
    start: int,
    end: int,
    aborted: tuple[tuple[int, int], ...],
) -> list[tuple[int, int]]:
    """The offsets ``[base, last + 1)`` of the record batches in ``data[start:end]`` that
    belong to aborted transactions, from a read-committed Fetch's list of them
    (``(producer id, first offset)``,
    :class:`~connectors.kafka_fetch.FetchedPartition`'s ``aborted``).

    Kafka's consumer's rule: a producer's transactional batches are aborted from
    the first offset of one of its aborted transactions until its ABORT marker
    (a control batch). Only batch heads are read, compressed batches' included;
    a partial batch at the end is left to the next fetch.

    >>> from kafka.record.default_records import DefaultRecordBatchBuilder
    >>> def batch(base: int, producer: int, n: int) -> bytes:
    ...     b = DefaultRecordBatchBuilder(2, 0, True, producer, 0, 0, 1 << 20)
    ...     for i in range(n):
    ...         b.append(i, timestamp=0, key=None, value=b"v", headers=[])
    ...     return struct.pack(">q", base) + bytes(b.build())[8:]
    >>> data = batch(0, 7, 2) + batch(2, 8, 3) + batch(5, 7, 1)
    >>> aborted_ranges(data, 0, len(data), ((7, 0),))
    [(0, 2), (5, 6)]
    >>> aborted_ranges(data, 0, len(data), ())
    []
    """
    if not aborted:
        return []
    waiting = sorted(aborted, key=lambda a: a[1])  # by first offset
    aborting: set[int] = set()
    out: list[tuple[int, int]] = []
    view = memoryview(data)
    p = start
    while p + _ENTRY_HEADER <= end:
        base, size = struct.unpack_from(">qi", view, p)
        m = p + _ENTRY_HEADER
        if size < _MIN_MESSAGE or m + size > end:
            break
        if view[m + 4] != 2 or size < _BATCH_HEAD:
            p = m + size  # a legacy message: no transactions
            continue
        flags, last_delta = struct.unpack_from(">hi", view, m + 9)
        (producer,) = struct.unpack_from(">q", view, m + 31)
        last = base + last_delta
        if producer != _NO_PRODUCER:
            while waiting and waiting[0][1] <= last:
                aborting.add(waiting.pop(0)[0])
            if flags & _CONTROL_BATCH:
                if _is_abort_marker(view, m + _BATCH_HEAD, m + size):
                    aborting.discard(producer)
            elif flags & _TRANSACTIONAL_BATCH and producer in aborting:
                if out and out[-1][1] == base:
                    out[-1] = (out[-1][0], last + 1)
                else:
                    out.append((base, last + 1))
        p = m + size
    return out


def _is_abort_marker(view: memoryview, q: int, end: int) -> bool:
    """Whether the control record at ``view[q:end]`` is an ABORT marker: its key is a
    version (int16) and a type (int16), 0 for ABORT and 1 for COMMIT."""
    data = np.frombuffer(view, dtype=np.uint8)
    _, q = _varint(data, q, end)  # the record's length
    q = q + 1 if q >= 0 else q  # attributes (one byte)
    _, q = _varint(data, q, end) if q >= 0 else (0, q)  # timestamp delta
    _, q = _varint(data, q, end) if q >= 0 else (0, q)  # offset delta
    key_len, q = _varint(data, q, end) if q >= 0 else (0, q)
    if q < 0 or key_len < 4 or q + 4 > end:
        return False
    (kind,) = struct.unpack_from(">h", view, q + 2)
    return bool(kind == 0)


def parse_records(
    data: bytes | bytearray | memoryview,
    start: int,
    end: int,
    *,
    from_offset: int,
    to_offset: int,
    check_crcs: bool = True,
) -> Records:
    """:func:`parse_message_set`, with compressed record batches inflated and read on
    (a compressed legacy wrapper still stops it, status ``"compressed"``).

    >>> data = encode_message(3, b"a") + encode_message(4, b"b")
    >>> found = parse_records(data, 0, len(data), from_offset=4, to_offset=9)
    >>> found.offsets.tolist(), found.payloads, found.status
    ([4], [b'b'], 'end')
    """
    offsets: list[I64] = []
    payloads: list[bytes] = []
    bad: list[int] = []
    at = start
    passed = 0
    while True:
        found = parse_message_set(
            data, at, end, from_offset=from_offset, to_offset=to_offset, check_crcs=check_crcs
        )
        passed = max(passed, found.next_offset)
        offsets.append(found.offsets)
        payloads += found.payloads(data)
        if check_crcs:
            bad += found.bad_crcs(data)
        status, stop = found.status, found.stop
        if status != "compressed" or data[stop + _ENTRY_HEADER + 4] != 2:
            break
        size = struct.unpack_from(">i", data, stop + 8)[0]
        inner = inflate_batch(data, stop, check_crc=check_crcs)
        got = parse_message_set(
            inner, from_offset=from_offset, to_offset=to_offset, check_crcs=False
        )
        offsets.append(got.offsets)
        payloads += got.payloads(inner)
        at = stop + _ENTRY_HEADER + size
        if got.status == "past":
            status, stop = "past", at
            break
        if got.status != "end":
            status = "corrupt"
            break
        passed = max(passed, got.next_offset)
    return Records(np.concatenate(offsets), payloads, stop, status, bad, passed)


def encode_message(
    offset: int,
    value: bytes | None,
    *,
    key: bytes | None = None,
    magic: int = 0,
    attributes: int = 0,
    timestamp: int = 0,
) -> bytes:
    """One message-set entry, as a broker stores it (for tests and examples).

    >>> entry = encode_message(9, b"v", key=b"k", magic=1, timestamp=5)
    >>> len(entry), parse_message_set(entry, from_offset=0, to_offset=10).offsets.tolist()
    (36, [9])
    """

    def field(b: bytes | None) -> bytes:
        return struct.pack(">i", -1) if b is None else struct.pack(">i", len(b)) + b

    rest = struct.pack(">bb", magic, attributes)
    if magic == 1:
        rest += struct.pack(">q", timestamp)
    rest += field(key) + field(value)
    message = struct.pack(">I", zlib.crc32(rest)) + rest
    return struct.pack(">qi", offset, len(message)) + message
