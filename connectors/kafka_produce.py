"""Writing to Kafka: :func:`produce`, and the records of a file to produce
(:class:`FileRecords`), for ``streamrec produce`` and test data.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Literal

from connectors.kafka_client import ApiVersionSpec, make_producer, resolve_api_version


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
