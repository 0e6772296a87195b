"""Dead-letter sinks: where bad records go, with everything needed to replay them.

- :class:`JsonlDeadLetterSink` appends one JSON line per record
  (:meth:`BadRecord.to_json <connectors.types.BadRecord.to_json>`: the raw bytes as
  latin-1 text, so any payload round-trips) and fsyncs on close;
- :class:`CountingDeadLetterSink` counts records per reason and forwards them;
- :class:`NullDeadLetterSink` drops them.

A Kafka dead-letter sink lives in :mod:`connectors.kafka`.

>>> import tempfile, pathlib
>>> from connectors.types import BadRecord
>>> bad = BadRecord("kafka", "events/0", 7, "not_json", None, "the payload is not JSON", b"\\xff{")
>>> path = pathlib.Path(tempfile.mkdtemp()) / "dead" / "letters.jsonl"
>>> sink = CountingDeadLetterSink(JsonlDeadLetterSink(path))
>>> sink.write([bad, bad])
>>> sink.close()
>>> sink.counts, read_dead_letters(path)[0].raw
({'not_json': 2}, b'\\xff{')
"""

from __future__ import annotations

import json
import os
import threading
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from connectors.types import BadRecord, DeadLetterSink


class JsonlDeadLetterSink:
    """Appends bad records to a JSON-lines file, one ``BadRecord.to_json()`` object per line.

    The file and its parent directories are created on the first write; each
    ``write`` appends its lines with one ``write`` call on a file opened for
    appending, so sinks in several threads or processes can share a file
    without interleaving lines. ``close`` flushes and fsyncs. Lines are ASCII
    (``json.dumps`` escapes the rest), so the file is valid UTF-8 whatever the
    payloads held. A sink pickles (to ship to a Dask worker) while it has no
    open file; the copy opens its own.

    Writing raises ``OSError`` when the disk does: losing dead letters silently
    would hide data loss, so the job fails instead.

    >>> import tempfile, pathlib
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "bad.jsonl"
    >>> with JsonlDeadLetterSink(path) as sink:
    ...     sink.write([BadRecord("s", "p", 1, "oversize", None, "too big", b"x")])
    >>> path.read_text()[:40]
    '{"source": "s", "partition": "p", "posit'
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._fd: int | None = None
        self._lock = threading.Lock()
        self.written = 0

    def write(self, records: Sequence[BadRecord]) -> None:
        """Append ``records`` (nothing happens for none)."""
        if not records:
            return
        data = "".join(json.dumps(r.to_json()) + "\n" for r in records).encode("ascii")
        with self._lock:
            if self._fd is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            view = memoryview(data)
            while view:
                # A regular file takes the whole write; loop in case it does not.
                view = view[os.write(self._fd, view) :]
            self.written += len(records)

    def flush(self) -> None:
        """Make every line written so far durable (fsync)."""
        with self._lock:
            if self._fd is not None:
                os.fsync(self._fd)

    def close(self) -> None:
        """Flush to disk and close; the sink may be written to again (it reopens)."""
        with self._lock:
            if self._fd is not None:
                try:
                    os.fsync(self._fd)
                finally:
                    os.close(self._fd)
                    self._fd = None

    def __enter__(self) -> JsonlDeadLetterSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        if self._fd is not None:
            msg = f"close the dead-letter sink for {self.path} before pickling it"
            raise TypeError(msg)
        return {"path": self.path, "written": self.written}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"])  # type: ignore[misc]
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
        """Flush the inner sink."""
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
        """Do nothing."""

    def close(self) -> None:
        """Do nothing."""
