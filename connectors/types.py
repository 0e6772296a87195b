"""The types every connector shares: chunks, raw records, bad records, sources, sinks.

A source is a factory of partitions (as in bytewax): the driver asks it for the
partitions and *plans* chunks — half-open position ranges ``[start, end)`` in one
partition — and a Dask worker *reads* a chunk on its own, without the driver.
A chunk is plain data (it pickles), so a chunk lost with a dead worker is read
again elsewhere and yields the same records.

Positions are integers: Kafka offsets, row indices within a Parquet file
(chunked by row group), or sample indices of the synthetic stream.

>>> c = Chunk(source="kafka", partition="events/0", start=100, end=200)
>>> c.name, len(c)
('events-0', 100)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import pyarrow as pa


@dataclass(frozen=True)
class Chunk:
    """Records ``[start, end)`` of one partition of one source."""

    source: str
    partition: str
    start: int
    end: int
    # Whatever the source needs to read the chunk on a worker (e.g. a file path).
    extra: tuple[tuple[str, Any], ...] = ()

    def __len__(self) -> int:
        return self.end - self.start

    @property
    def name(self) -> str:
        """A name for dashboards and task keys (``/`` and ``:`` replaced)."""
        return self.partition.replace("/", "-").replace(":", "-")


@dataclass
class RawChunk:
    """What reading a chunk gives: undecoded payloads or an Arrow table, with positions.

    Exactly one of ``payloads`` (bytes per record, for codecs to decode) and
    ``table`` (already columnar: Parquet, synthetic) is set. ``positions[i]`` is
    the source position of record ``i``. A chunk may hold fewer records than its
    range when positions are missing (compacted or aborted Kafka records).
    """

    chunk: Chunk
    positions: npt.NDArray[np.int64]
    payloads: Sequence[bytes] | None = None
    table: pa.Table | None = None

    def __len__(self) -> int:
        return int(self.positions.shape[0])


@dataclass(frozen=True)
class BadRecord:
    """A record that failed to decode or validate, kept with everything needed to replay it."""

    source: str
    partition: str
    position: int
    reason: str  # a short machine-readable kind, e.g. "missing_label", "nan", "not_json"
    field: str | None  # the offending field, when there is one
    detail: str  # a human-readable sentence naming the value
    raw: bytes = dataclasses.field(repr=False, default=b"")

    def to_json(self) -> dict[str, Any]:
        """The dead-letter form: raw bytes as latin-1 text so any payload round-trips."""
        return {
            "source": self.source,
            "partition": self.partition,
            "position": self.position,
            "reason": self.reason,
            "field": self.field,
            "detail": self.detail,
            "raw": self.raw.decode("latin-1"),
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> BadRecord:
        """The record whose dead-letter form is ``d`` (raw bytes restored exactly).

        >>> r = BadRecord("kafka", "t/0", 7, "not_json", None, "not JSON", b"\\xff{")
        >>> BadRecord.from_json(r.to_json()) == r
        True
        """
        return cls(
            source=d["source"],
            partition=d["partition"],
            position=d["position"],
            reason=d["reason"],
            field=d["field"],
            detail=d["detail"],
            raw=d["raw"].encode("latin-1"),
        )


class Source(Protocol):
    """A stream or a history, as partitions of positioned records."""

    name: str

    def partitions(self) -> list[str]:
        """The partitions now (a live source may grow new ones)."""
        ...

    def start_position(self, partition: str) -> int:
        """Where a partition starts when no checkpoint names a position for it."""
        ...

    def end_position(self, partition: str) -> int | None:
        """One past the last position available now; None if unknown."""
        ...

    def plan(self, partition: str, position: int, max_records: int) -> Chunk | None:
        """The next chunk from ``position`` (at most ``max_records``); None if none yet."""
        ...

    def is_finished(self, partition: str, position: int) -> bool:
        """True when a finite partition has nothing at or after ``position``."""
        ...

    def read(self, chunk: Chunk) -> RawChunk:
        """Read one chunk (runs on a worker; must not depend on driver state)."""
        ...

    def close(self) -> None:
        """Release connections."""
        ...


class DeadLetterSink(Protocol):
    """Where bad records go: ``write`` never fails the stream; ``flush`` is the durability point.

    - ``write(records)`` hands records over and returns; it does not raise for a
      record, a broker or a disk (a sink keeps what it could not deliver and
      tries again), so one bad record never stops the stream. Delivery may be
      asynchronous.
    - ``flush()`` returns only once every record written so far is durable:
      acknowledged by a broker, or appended and fsynced to a file. It raises
      :class:`~connectors.deadletter.DeadLetterError` when a record cannot be
      made so, and keeps raising at every call until that record is durable: a
      record is never dropped silently.
    - ``close()`` flushes (raising as ``flush`` does), then releases the sink.

    A job calls ``flush`` on every rank before each checkpoint's manifest is
    saved, and a failing flush fails that checkpoint: a Kafka offset is
    committed only once every record below it is learned or durably dead-lettered.
    """

    def write(self, records: Sequence[BadRecord]) -> None:
        """Hand ``records`` over (never raises for a record, a broker or a disk)."""
        ...

    def flush(self) -> None:
        """Block until every record written so far is durable; raise DeadLetterError if not."""
        ...

    def close(self) -> None:
        """Flush, then release connections and files."""
        ...
