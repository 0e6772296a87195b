"""Dead-letter sinks: where bad records go, with everything needed to replay them.

- :class:`JsonlDeadLetterSink` appends one JSON line per record
  (:meth:`BadRecord.to_json <connectors.types.BadRecord.to_json>`: the raw bytes as
  latin-1 text, so any payload round-trips) and fsyncs on flush and close;
- :class:`KafkaDeadLetterSink` sends them to a dead-letter topic, an oversize
  one cut to fit with the whole record in a spill file;
- :class:`CountingDeadLetterSink` counts records per reason and forwards them;
- :class:`NullDeadLetterSink` drops them.

Every sink follows :class:`~connectors.types.DeadLetterSink`: ``write`` never
fails the stream, ``flush`` returns only once every record written so far is
durable and raises :class:`DeadLetterError` (again at every call) while one is
not. A job flushes before each checkpoint, so a committed offset never covers
a bad record that could still be lost.

>>> import tempfile, pathlib
>>> from connectors.types import BadRecord
>>> bad = BadRecord("kafka", "events/0", 7, "not_json", None, "the payload is not JSON", b"\\xff{")
>>> path = pathlib.Path(tempfile.mkdtemp()) / "dead" / "letters.jsonl"
>>> sink = CountingDeadLetterSink(JsonlDeadLetterSink(path))
>>> sink.write([bad, bad])
>>> sink.flush()
>>> sink.close()
>>> sink.counts, read_dead_letters(path)[0].raw
({'not_json': 2}, b'\\xff{')
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from connectors.kafka_client import (
    KafkaUnavailable,
    make_producer,
    parse_api_version,
    resolve_api_version,
)
from connectors.types import BadRecord, DeadLetterSink

if TYPE_CHECKING:
    from connectors.kafka_client import ApiVersionSpec

log = logging.getLogger(__name__)

# Kafka 0.9's default message.max.bytes (the broker's limit on one message).
DEFAULT_MAX_MESSAGE_BYTES = 1_000_012
# Room for the record's key and the message and message-set (or record batch) headers.
_ENVELOPE_OVERHEAD = 1024
# The smallest max_message_bytes that leaves room for a cut envelope's fields.
_MIN_MESSAGE_BYTES = 8192
# A cut envelope keeps at most this much of ``detail`` (a validator's sentence).
_MAX_DETAIL_CHARS = 2048
# Bytes that one latin-1 character of ``raw`` takes in ``json.dumps`` (ASCII output).
_JSON_COST = np.array([len(json.dumps(chr(b))) - 2 for b in range(256)], dtype=np.int64)


class DeadLetterError(RuntimeError):
    """Bad records could not be made durable: neither delivered nor kept in a file.

    The sink keeps them in memory and tries again at every ``flush``, which
    raises this until they are durable.
    """


def _lines(records: Sequence[BadRecord]) -> bytes:
    """The JSON lines of ``records`` (ASCII: ``json.dumps`` escapes the rest)."""
    return "".join(json.dumps(r.to_json()) + "\n" for r in records).encode("ascii")


class JsonlDeadLetterSink:
    """Appends bad records to a JSON-lines file, one ``BadRecord.to_json()`` object per line.

    The file and its parent directories are created on the first write; each
    ``write`` appends its lines with one ``write`` call on a file opened for
    appending, so sinks in several threads or processes can share a file
    without interleaving lines. Lines are ASCII (``json.dumps`` escapes the
    rest), so the file is valid UTF-8 whatever the payloads held. A sink
    pickles (to ship to a Dask worker) while it has no open file; the copy
    opens its own.

    Durability: :meth:`flush` (and :meth:`close`) fsync, and a ``write`` fsyncs
    by itself once ``sync_every_bytes`` are waiting. Lines that could not be
    appended (a full or failing disk) or whose fsync failed are kept in memory
    and appended again at the next ``write`` or ``flush``; until that succeeds
    ``flush`` raises :class:`DeadLetterError` and :attr:`failed` counts them.
    ``write`` itself never raises for the disk: one bad record must not stop
    the stream, and the checkpoint's ``flush`` stops the offset from moving past it.

    >>> import tempfile, pathlib
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "bad.jsonl"
    >>> with JsonlDeadLetterSink(path) as sink:
    ...     sink.write([BadRecord("s", "p", 1, "oversize", None, "too big", b"x")])
    >>> path.read_text()[:40]
    '{"source": "s", "partition": "p", "posit'
    """

    def __init__(self, path: str | os.PathLike[str], *, sync_every_bytes: int = 64 << 20) -> None:
        self.path = Path(path)
        self.sync_every_bytes = sync_every_bytes
        self.written = 0  # records appended to the file (and not known to be lost)
        self._fd: int | None = None
        self._lock = threading.Lock()
        # (lines, records) appended since the last fsync: kept until it succeeds.
        self._unsynced: list[tuple[bytes, int]] = []
        self._unsynced_bytes = 0
        # (lines, records) not in the file (an append or an fsync failed), in order.
        self._failed: list[tuple[bytes, int]] = []
        self._error: OSError | None = None  # the latest disk error, while records fail
        self._torn = False  # the file ends inside a line: the next append starts a new one

    @property
    def failed(self) -> int:
        """Records not durable because the disk failed (kept in memory, written again)."""
        with self._lock:
            return sum(n for _, n in self._failed)

    def write(self, records: Sequence[BadRecord]) -> None:
        """Append ``records`` (nothing happens for none); a disk error keeps them for later."""
        if not records:
            return
        data = _lines(records)
        with self._lock:
            self._failed.append((data, len(records)))
            try:
                self._append_failed()
                if self._unsynced_bytes >= self.sync_every_bytes:
                    self._sync()
            except OSError as exc:
                self._note(exc)

    def flush(self) -> None:
        """Append what a disk error held back, fsync; raise DeadLetterError if not durable."""
        with self._lock:
            try:
                self._append_failed()
                self._sync()
            except OSError as exc:
                self._note(exc)
                n = sum(n for _, n in self._failed)
                msg = (
                    f"{n} bad record(s) could not be made durable in {self.path} ({exc}); "
                    "they are kept in memory and written again at the next flush"
                )
                raise DeadLetterError(msg) from exc
            if self._error is not None:
                log.warning("the dead-letter file %s takes records again", self.path)
                self._error = None

    def close(self) -> None:
        """Flush to disk and close; raise as :meth:`flush` does. The sink may be written again."""
        try:
            self.flush()
        finally:
            with self._lock:
                self._close_fd()

    def _note(self, exc: OSError) -> None:
        if self._error is None:  # once per streak of failures, not once per record
            log.error("bad records could not be written to %s (%s); kept, retried", self.path, exc)
        self._error = exc

    def _append_failed(self) -> None:
        """Append the held-back lines in order (the lock is held); raise OSError if one fails."""
        while self._failed:
            data, n = self._failed[0]
            self._append(data)
            self._failed.pop(0)
            self._unsynced.append((data, n))
            self._unsynced_bytes += len(data)
            self.written += n

    def _append(self, data: bytes) -> None:
        if self._fd is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
            self._fd = fd
            end = os.fstat(fd).st_size
            # A line that a killed writer left unfinished: start on a line of our own.
            self._torn = end > 0 and os.pread(fd, 1, end - 1) != b"\n"
        fd = self._fd
        if self._torn:
            data = b"\n" + data
        size = os.fstat(fd).st_size
        view = memoryview(data)
        try:
            while view:
                # A regular file takes the whole write; loop in case it does not.
                view = view[os.write(fd, view) :]
        except OSError:
            if len(view) < len(data):  # a partial line is in the file
                was_torn, self._torn = self._torn, True
                # Take it back (when no other writer appended meanwhile); it goes again later.
                if os.fstat(fd).st_size == size + len(data) - len(view):
                    os.ftruncate(fd, size)
                    self._torn = was_torn
            raise
        self._torn = False

    def _sync(self) -> None:
        """fsync (the lock is held); on failure the unsynced lines go back to be written again."""
        if self._fd is None:
            return
        try:
            os.fsync(self._fd)
        except OSError:
            # After a failed fsync the kernel may have dropped those pages: append again.
            self._failed[:0] = self._unsynced
            self.written -= sum(n for _, n in self._unsynced)
            self._unsynced, self._unsynced_bytes = [], 0
            self._close_fd()
            raise
        self._unsynced, self._unsynced_bytes = [], 0

    def _close_fd(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                os.close(fd)
            except OSError as exc:
                log.warning("closing %s: %s", self.path, exc)

    def __enter__(self) -> JsonlDeadLetterSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        if self._fd is not None:
            msg = f"close the dead-letter sink for {self.path} before pickling it"
            raise TypeError(msg)
        return {"path": self.path, "written": self.written, "sync": self.sync_every_bytes}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"], sync_every_bytes=state["sync"])  # type: ignore[misc]
        self.written = state["written"]

    def __repr__(self) -> str:
        return f"JsonlDeadLetterSink({str(self.path)!r})"


def read_dead_letters(path: str | os.PathLike[str]) -> list[BadRecord]:
    """The bad records of a dead-letter file, raw bytes restored exactly.

    >>> import tempfile, pathlib
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "none.jsonl"
    >>> read_dead_letters(path)
    []
    """
    path = Path(path)
    if not path.exists():
        return []
    out = []
    with path.open(encoding="ascii") as f:
        for number, line in enumerate(f, 1):
            try:
                out.append(BadRecord.from_json(json.loads(line)))
            except (ValueError, KeyError, TypeError) as e:
                msg = f"{path}:{number} is not a dead-letter line ({e}): {line[:80]!r}"
                raise ValueError(msg) from e
    return out


def fitting_prefix(raw: bytes, room: int) -> int:
    """How many leading bytes of ``raw`` fit in ``room`` bytes as JSON text (latin-1, ASCII out).

    >>> fitting_prefix(b"abc", 2), fitting_prefix(b"\\xff\\xffa", 12), fitting_prefix(b"x", -1)
    (2, 2, 0)
    """
    if room <= 0 or not raw:
        return 0
    spent = np.cumsum(_JSON_COST[np.frombuffer(raw, dtype=np.uint8)])
    return int(np.searchsorted(spent, room, side="right"))


@dataclass
class _InFlight:
    record: BadRecord
    cut: bool  # sent cut to fit; the whole record is already in the spill file


class KafkaDeadLetterSink:
    """Writes each :class:`~connectors.types.BadRecord` as JSON to a dead-letter topic.

    The value is ``json.dumps(record.to_json())`` (raw bytes as latin-1 text, so
    any payload round-trips); the key is ``"source/partition"`` of the bad
    record, so one partition's bad records stay in order.

    Nothing is lost:

    - an envelope larger than the topic takes (``max_message_bytes``, Kafka
      0.9's default ``message.max.bytes`` of 1,000,012 bytes, or the producer's
      ``max_request_size`` from ``client_options`` when smaller) is sent in a
      form that fits: ``raw`` cut to a prefix, with ``"truncated": true``, the
      payload's length ``raw_bytes``, its ``raw_sha256`` and ``whole_record_in``
      (the spill file), and the whole record goes to the JSON-lines file
      ``spill_path`` (:attr:`truncated` counts those the topic acknowledged);
    - a record the broker refuses (``MessageSizeTooLargeError`` included), does
      not acknowledge within ``flush_timeout_s`` at :meth:`flush`, or that
      cannot be sent because Kafka is unreachable, goes whole to the spill file
      (:attr:`spilled`; a late acknowledgement makes a duplicate, never a loss);
    - without a ``spill_path`` such records (an oversize one included: it is
      never cut without a whole copy) stay in memory, are sent again at every
      :meth:`flush`, and make it raise :class:`DeadLetterError` until the topic
      has them (:attr:`failed`). ``streamrec run`` always gives one:
      ``<run_dir>/deadletter-rank<R>.jsonl``.

    ``write`` never raises for a record and blocks at most ``max_block_ms`` of
    the producer per call when the broker is away. :meth:`flush` returns once
    every record written so far is acknowledged by the broker or fsynced in the
    spill file, and raises :class:`DeadLetterError` otherwise; :meth:`close`
    flushes, then closes the producer.

        sink = KafkaDeadLetterSink("127.0.0.1:9092", "events.deadletter", api_version="0.9",
                                   spill_path="runs/job/deadletter-rank0.jsonl")
        sink.write([bad_record])
        sink.flush()  # every record so far acknowledged, or whole in the spill file
    """

    def __init__(
        self,
        bootstrap_servers: str,
        topic: str,
        *,
        api_version: ApiVersionSpec = "auto",
        client_options: Mapping[str, Any] | None = None,
        flush_timeout_s: float = 60.0,
        retry_timeout_s: float = 300.0,
        spill_path: str | os.PathLike[str] | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        self.bootstrap_servers = bootstrap_servers
        self.topic = topic
        self.api_version = parse_api_version(api_version)
        self.client_options = dict(client_options or {})
        self.flush_timeout_s = flush_timeout_s
        self.retry_timeout_s = retry_timeout_s
        request_limit = self.client_options.get("max_request_size")
        limit = min(max_message_bytes, int(request_limit or max_message_bytes))
        if limit < _MIN_MESSAGE_BYTES:
            msg = (
                f"max_message_bytes (and client_options max_request_size) must be at least "
                f"{_MIN_MESSAGE_BYTES} to leave room for a cut envelope, got {limit}"
            )
            raise ValueError(msg)
        self.max_message_bytes = limit
        self.spill = JsonlDeadLetterSink(spill_path) if spill_path is not None else None
        self.written = 0  # acknowledged by the broker (cut ones included)
        self.truncated = 0  # acknowledged cut to fit; whole in the spill file
        self.spilled = 0  # refused, unacknowledged or unsendable: whole in the spill file only
        self._lock = threading.Lock()
        self._producer: Any = None
        self._in_flight: dict[int, _InFlight] = {}
        self._next_id = 0
        # Neither delivered nor spilled (no spill file): sent again at every flush.
        self._unsent: list[BadRecord] = []
        self._first_error: BaseException | None = None

    @property
    def failed(self) -> int:
        """Records not durable now: held in memory (no spill file, or its disk failed)."""
        with self._lock:
            unsent = len(self._unsent)
        return unsent + (self.spill.failed if self.spill is not None else 0)

    def write(self, records: Sequence[BadRecord]) -> None:
        """Queue ``records`` for the dead-letter topic (delivery is asynchronous)."""
        if not records:
            return
        try:
            producer = self._get_producer()
        except Exception as exc:  # Kafka unreachable: keep them whole
            self._keep(records, exc)
            return
        from kafka.errors import KafkaTimeoutError

        for i, record in enumerate(records):
            try:
                self._send(producer, record)
            except KafkaTimeoutError as exc:
                # No metadata (or no buffer) within max_block_ms: the rest would wait as long.
                self._keep(records[i + 1 :], exc)
                return

    def flush(self) -> None:
        """Until every record written is acknowledged or fsynced in the spill file.

        Records held back (no spill file) are sent again first. Records the broker
        has not acknowledged within ``flush_timeout_s`` are spilled whole (they may
        still reach the topic later: a duplicate, never a loss). Raises
        :class:`DeadLetterError` while any record is not durable.
        """
        with self._lock:
            retry, self._unsent = self._unsent, []
        if retry:
            self.write(retry)
        if self._producer is not None:
            try:
                self._producer.flush(timeout=self.flush_timeout_s)
            except Exception as exc:
                log.warning("flushing the dead-letter topic %s failed: %r", self.topic, exc)
        with self._lock:
            waiting = list(self._in_flight)
        late = KafkaUnavailable(
            f"not acknowledged by {self.topic} at {self.bootstrap_servers} "
            f"within {self.flush_timeout_s}s"
        )
        for ident in waiting:
            self._settled(ident, late)
        spill_error: DeadLetterError | None = None
        if self.spill is not None:
            try:
                self.spill.flush()
            except DeadLetterError as exc:
                spill_error = exc
        with self._lock:
            unsent, first = len(self._unsent), self._first_error
        if unsent:
            msg = (
                f"{unsent} bad record(s) could not be written to {self.topic} at "
                f"{self.bootstrap_servers} and have no spill file (first error: {first!r}); "
                "they are kept in memory and sent again at the next flush"
            )
            raise DeadLetterError(msg) from spill_error
        if spill_error is not None:
            raise spill_error

    def close(self) -> None:
        """Flush everything queued, close the producer and the spill file; raise as ``flush``."""
        try:
            self.flush()
        finally:
            producer, self._producer = self._producer, None
            try:
                if producer is not None:
                    producer.close(timeout=self.flush_timeout_s)
            finally:
                if self.spill is not None:
                    self.spill.close()

    def _get_producer(self) -> Any:
        if self._producer is None:
            version = resolve_api_version(
                self.bootstrap_servers,
                self.api_version,
                client_options=self.client_options,
                retry_timeout_s=self.retry_timeout_s,
            )
            self.api_version = version
            self._producer = make_producer(self.bootstrap_servers, version, self.client_options)
        return self._producer

    def _send(self, producer: Any, record: BadRecord) -> None:
        """Send one record; raises only KafkaTimeoutError (after keeping the record)."""
        from kafka.errors import KafkaTimeoutError

        key = f"{record.source}/{record.partition}".encode()
        try:
            value, cut = self._envelope(record, key)
        except DeadLetterError as exc:  # oversize and nowhere to keep it whole
            self._keep([record], exc)
            return
        if cut and self.spill is not None:
            self.spill.write([record])  # the whole record first; never raises
        with self._lock:
            ident = self._next_id
            self._next_id += 1
            self._in_flight[ident] = _InFlight(record, cut)
        try:
            future = producer.send(self.topic, value=value, key=key)
        except KafkaTimeoutError as exc:
            self._settled(ident, exc)  # kept whole; the caller keeps the rest of its records
            raise
        except Exception as exc:  # one record's trouble must not stop the stream
            self._settled(ident, exc)
            return
        future.add_callback(lambda _meta, i=ident: self._settled(i, None))
        future.add_errback(lambda exc, i=ident: self._settled(i, exc))

    def _envelope(self, record: BadRecord, key: bytes) -> tuple[bytes, bool]:
        """The value to send and whether it was cut to fit ``max_message_bytes``."""
        value = json.dumps(record.to_json()).encode()
        limit = self.max_message_bytes - len(key) - _ENVELOPE_OVERHEAD
        if len(value) <= limit:
            return value, False
        if self.spill is None:
            msg = (
                f"a bad record's envelope ({len(value)} bytes) is larger than {self.topic} takes "
                f"({self.max_message_bytes} bytes) and there is no spill_path to keep it whole"
            )
            raise DeadLetterError(msg)
        envelope = record.to_json()
        envelope.update(
            detail=record.detail[:_MAX_DETAIL_CHARS],
            raw="",
            truncated=True,
            raw_bytes=len(record.raw),
            raw_sha256=hashlib.sha256(record.raw).hexdigest(),
            whole_record_in=str(self.spill.path),
        )
        keep = fitting_prefix(record.raw, limit - len(json.dumps(envelope)))
        envelope["raw"] = record.raw[:keep].decode("latin-1")
        return json.dumps(envelope).encode(), True

    def _settled(self, ident: int, error: BaseException | None) -> None:
        """A send ended (acknowledged when ``error`` is None); runs on the producer's thread."""
        with self._lock:
            sent = self._in_flight.pop(ident, None)
            if sent is None:  # already settled (spilled at a flush timeout)
                return
            if error is None:
                self.written += 1
                self.truncated += sent.cut
                return
        if sent.cut:  # the whole record is already in the spill file
            with self._lock:
                self.spilled += 1
            log.warning(
                "a cut bad record (%s offset %d) was refused by %s (%r); it is whole in %s",
                sent.record.partition,
                sent.record.position,
                self.topic,
                error,
                self.spill.path if self.spill is not None else "-",
            )
            return
        self._keep([sent.record], error)

    def _keep(self, records: Sequence[BadRecord], why: BaseException) -> None:
        """Records the topic did not take: whole to the spill file, else held for the next flush."""
        if not records:
            return
        if self.spill is not None:
            self.spill.write(records)
            with self._lock:
                self.spilled += len(records)
            log.warning(
                "%d bad record(s) could not be written to %s (%r); kept whole in %s",
                len(records),
                self.topic,
                why,
                self.spill.path,
            )
            return
        with self._lock:
            self._unsent.extend(records)
            if self._first_error is None:
                self._first_error = why
        log.error(
            "%d bad record(s) could not be written to %s (%r) and there is no spill file; "
            "held in memory until a flush delivers them",
            len(records),
            self.topic,
            why,
        )

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        spill = JsonlDeadLetterSink(self.spill.path) if self.spill is not None else None
        state.update(
            _producer=None, _lock=None, _in_flight={}, _unsent=[], _first_error=None, spill=spill
        )
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"KafkaDeadLetterSink({self.bootstrap_servers!r}, {self.topic!r})"


class CountingDeadLetterSink:
    """Counts bad records per reason, then forwards them (to nowhere by default).

    >>> sink = CountingDeadLetterSink()
    >>> sink.write([BadRecord("s", "p", i, "oversize", None, "") for i in range(3)])
    >>> sink.counts, sink.total
    ({'oversize': 3}, 3)
    """

    def __init__(self, inner: DeadLetterSink | None = None) -> None:
        self.inner: DeadLetterSink = inner if inner is not None else NullDeadLetterSink()
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    @property
    def counts(self) -> dict[str, int]:
        """Records written per reason, sorted by reason (a copy)."""
        with self._lock:
            return dict(sorted(self._counts.items()))

    @property
    def total(self) -> int:
        """Records written, all reasons."""
        with self._lock:
            return sum(self._counts.values())

    def write(self, records: Sequence[BadRecord]) -> None:
        """Count ``records``, then hand them to the inner sink."""
        with self._lock:
            self._counts.update(r.reason for r in records)
        self.inner.write(records)

    def flush(self) -> None:
        """Flush the inner sink (raising as it does)."""
        self.inner.flush()

    def close(self) -> None:
        """Close the inner sink."""
        self.inner.close()

    def __getstate__(self) -> dict[str, Any]:
        return {"inner": self.inner, "counts": dict(self._counts)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["inner"])  # type: ignore[misc]
        self._counts.update(state["counts"])


class NullDeadLetterSink:
    """Drops bad records (a job that only counts them).

    >>> NullDeadLetterSink().write([BadRecord("s", "p", 0, "oversize", None, "")])
    """

    def write(self, records: Sequence[BadRecord]) -> None:
        """Do nothing."""

    def flush(self) -> None:
        """Do nothing: nothing is kept."""

    def close(self) -> None:
        """Do nothing."""


if TYPE_CHECKING:  # mypy proves that the sinks implement the shared protocol

    def _is_sink(
        a: JsonlDeadLetterSink,
        b: KafkaDeadLetterSink,
        c: CountingDeadLetterSink,
        d: NullDeadLetterSink,
    ) -> list[DeadLetterSink]:
        return [a, b, c, d]
