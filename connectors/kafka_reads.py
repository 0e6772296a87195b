"""The two ways a :class:`~connectors.kafka.KafkaSource` reads a chunk of a partition,
a step at a time: kafka-python's assigned consumer (:class:`ConsumerReads`), or Fetch
requests of its own parsed in one compiled pass (:class:`RawReads`, the default).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import numpy.typing as npt

from connectors import kafka_fetch, kafka_records
from connectors.kafka_client import REQUEST_TIMEOUT_MS

if TYPE_CHECKING:
    from connectors.kafka import KafkaSource

# The raw reader's fetch sizes: sized to the records a chunk still wants, within these
# bounds (a larger fetch saves round trips; a smaller one reads less past the chunk).
RAW_FETCH_MIN_BYTES = 64 << 10
RAW_FETCH_MAX_BYTES = 16 << 20
# A single message may be this large at most (fetches double up to it to take one whole).
RAW_FETCH_LIMIT_BYTES = 1 << 30
# kafka-python's default fetch_max_wait_ms: how long the broker may hold a fetch.
FETCH_MAX_WAIT_MS = 500


class Reads(Protocol):
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


class ConsumerReads:
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


class RawReads:
    """Fetch requests of our own to the leader, parsed by :mod:`connectors.kafka_records`."""

    def __init__(self, source: KafkaSource, topic: str, partition: int) -> None:
        options = source.config.client_options
        self.source, self.topic, self.partition = source, topic, partition
        self.fixed_bytes: int | None = options.get("max_partition_fetch_bytes")
        self.min_bytes = int(options.get("fetch_min_bytes", 1))
        self.at_once = False  # the next fetch asks for 1 byte (see step)
        self.max_wait_ms = int(options.get("fetch_max_wait_ms", FETCH_MAX_WAIT_MS))
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
            want = min(max(want, RAW_FETCH_MIN_BYTES), RAW_FETCH_MAX_BYTES)
        return min(want * self.grow, RAW_FETCH_LIMIT_BYTES)

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
            found = kafka_records.parse_records(
                body,
                part.set_start,
                part.set_end,
                from_offset=position,
                to_offset=end,
                check_crcs=self.check_crcs,
            )
        except kafka_records.CorruptBatch as exc:
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
                kafka_records.aborted_ranges(body, part.set_start, part.set_end, part.aborted)
            )
        if found.status == "past":
            after = end  # the next record is past the chunk (compaction may leave gaps)
        elif found.status in ("compressed", "corrupt"):
            self.hand_over = True
        elif found.status == "truncated" and not len(found) and found.stop == part.set_start:
            # Not one whole message fits: ask for more at once (kafka-python 0.9 would fail).
            if max_bytes >= RAW_FETCH_LIMIT_BYTES:
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
