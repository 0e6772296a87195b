"""One table's rows on local disk: RocksDB, id to the row with its optimizer state.

The disk tier keeps what a shard's memory cannot: each row is one value, keyed by
its id, holding the weights, the optimizer's per-row state and the step it was
last seen at, so a row read back from disk trains on exactly where it left off.

RocksDB is set up as FBGEMM's SSD-offloaded embeddings set it: no write-ahead log
(the shard's checkpoints are what survives a crash, never the live files), direct
reads (the page cache would otherwise be a hidden, unbounded tier), bloom filters,
no compression (rows of floats do not compress). Why RocksDB and not a file of
fixed-size buckets updated in place: see ``benchmarks/tiers.py``.

Batched calls only: a lookup's misses are read together, spread over reader
threads so that the disk's queue holds many reads at once.

>>> import tempfile
>>> rows = RowBatch(
...     ids=np.array([10, 20], np.uint64),
...     weights=np.array([[1, 2], [3, 4]], np.float32),
...     state=np.array([[0.5], [0.25]], np.float32),
...     row_step=np.array([1, 2]), last_seen=np.array([7, 9]), freq=np.array([3, 1]))
>>> with tempfile.TemporaryDirectory() as d, DiskRows(d, RowLayout(2, 1)) as disk:
...     disk.put(rows)
...     found, got = disk.get(np.array([20, 30, 10], np.uint64))
>>> found.tolist(), got.ids.tolist(), got.weights.tolist(), got.last_seen.tolist()
([True, False, True], [20, 10], [[3.0, 4.0], [1.0, 2.0]], [9, 7])
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, cast

import numpy as np
import numpy.typing as npt
import rocksdict

from embedding_store.errors import StoreError
from embedding_store.types import RowBatch

U64 = npt.NDArray[np.uint64]
Records = npt.NDArray[np.void]

# Ids go to disk big-endian, so that RocksDB's byte order is the ids' order and a
# scan resumes from the last id it returned.
_KEY = np.dtype(">u8")
# Misses of one call are split into parts of at least this many ids, one part per
# reader thread: fewer per part and the threads' overhead outweighs the overlap.
_MIN_PART = 16


# What RocksDB's errors say when the filesystem refuses to grow a file.
_FULL = ("No space left", "ENOSPC", "File too large", "Quota exceeded")


class DiskFull(StoreError):
    """The disk tier's filesystem has no room for more rows; nothing was written."""


@dataclass(frozen=True)
class RowLayout:
    """How one row is laid out on disk: what a :class:`RowBatch` holds of it.

    >>> RowLayout(dim=32, state_width=1).itemsize  # 128 + 4 + 3 * 8
    156
    """

    dim: int
    state_width: int

    @property
    def dtype(self) -> np.dtype[np.void]:
        fields: list[tuple[Any, ...]] = [("weights", "<f4", (self.dim,))]
        if self.state_width:
            fields.append(("state", "<f4", (self.state_width,)))
        fields += [("row_step", "<i8"), ("last_seen", "<i8"), ("freq", "<i8")]
        return np.dtype(fields)

    @property
    def itemsize(self) -> int:
        return int(self.dtype.itemsize)

    def encode(self, rows: RowBatch) -> Records:
        out = np.empty(len(rows), dtype=self.dtype)
        out["weights"] = rows.weights
        if self.state_width:
            out["state"] = rows.state
        out["row_step"] = rows.row_step
        out["last_seen"] = rows.last_seen
        out["freq"] = rows.freq
        return out

    def decode(self, ids: U64, records: Records) -> RowBatch:
        def column(name: str, dtype: type[np.generic]) -> Any:
            return np.ascontiguousarray(records[name], dtype=dtype)

        state = (
            column("state", np.float32).reshape(-1, self.state_width)
            if self.state_width
            else np.zeros((records.shape[0], 0), dtype=np.float32)
        )
        return RowBatch(
            ids=np.ascontiguousarray(ids, dtype=np.uint64),
            weights=column("weights", np.float32).reshape(-1, self.dim),
            state=state,
            row_step=column("row_step", np.int64),
            last_seen=column("last_seen", np.int64),
            freq=column("freq", np.int64),
        )


@dataclass(frozen=True)
class DiskSettings:
    """How a tier uses the machine: ``readers`` threads read one call's rows at once,
    and writes are buffered in memory up to ``write_buffer_bytes`` (two such buffers
    at most) before they go to a table file."""

    readers: int = 16
    write_buffer_bytes: int = 16 << 20


def _options(direct: bool, settings: DiskSettings) -> rocksdict.Options:
    opts = rocksdict.Options(raw_mode=True)
    opts.create_if_missing(True)
    opts.set_use_direct_reads(direct)
    opts.set_use_direct_io_for_flush_and_compaction(direct)
    opts.set_compression_type(rocksdict.DBCompressionType.none())
    table = rocksdict.BlockBasedOptions()
    table.set_bloom_filter(10, False)
    table.set_block_size(4096)
    # Index and filter blocks stay in the table readers (a few bytes per row), not in
    # the block cache, so a miss costs one read of a data block.
    table.set_cache_index_and_filter_blocks(False)
    table.set_block_cache(rocksdict.Cache(8 << 20))
    opts.set_block_based_table_factory(table)
    opts.set_max_background_jobs(2)
    opts.set_write_buffer_size(settings.write_buffer_bytes)
    opts.set_max_write_buffer_number(2)
    return opts


class DiskRows:
    """A table's rows on disk, by id. Thread-safe for concurrent calls.

    ``path`` is a directory this object owns: made if missing, opened if it holds
    a tier already (see :meth:`checkpoint` for how one is copied).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        layout: RowLayout,
        settings: DiskSettings = DiskSettings(),
    ) -> None:
        self.path = Path(path)
        self.layout = layout
        self.path.mkdir(parents=True, exist_ok=True)
        # Direct I/O where the filesystem has it (not tmpfs): else reads go through the
        # page cache, which ``direct_io`` False tells (a benchmark must say so).
        self.direct_io = True
        try:
            try:
                self._db = rocksdict.Rdict(str(self.path), _options(True, settings))
            except Exception:  # rocksdict raises plain Exceptions with RocksDB's message
                self.direct_io = False
                self._db = rocksdict.Rdict(str(self.path), _options(False, settings))
        except Exception as e:
            msg = f"disk tier at {self.path}: cannot open it: {e}"
            raise StoreError(msg) from e
        # rocksdict's stubs and its runtime disagree on these two (an attribute, a
        # method taking the flag): set as the runtime has them.
        write: Any = rocksdict.WriteOptions()
        write.disable_wal = True
        self._db.set_write_options(write)
        read: Any = rocksdict.ReadOptions()
        read.fill_cache(False)
        self._read: rocksdict.ReadOptions = read
        self.settings = settings
        self._readers = ThreadPoolExecutor(
            settings.readers, thread_name_prefix=f"disk-{self.path.name}"
        )
        self._n_readers = settings.readers
        self._lock = threading.Lock()  # closing against calls in flight
        self._closed = False

    # --- rows ------------------------------------------------------------------

    def get(self, ids: U64) -> tuple[npt.NDArray[np.bool_], RowBatch]:
        """Which ``ids`` are on disk, and the rows of those that are, in their order."""
        found, records = self._get(ids)
        return found, self.layout.decode(ids[found], records[found])

    def _get(self, ids: U64) -> tuple[npt.NDArray[np.bool_], Records]:
        n = ids.shape[0]
        out = np.zeros(n, dtype=self.layout.dtype)
        found = np.zeros(n, dtype=np.bool_)
        if n == 0:
            return found, out
        keys = ids.astype(_KEY).tobytes()
        parts = min(self._n_readers, max(1, n // _MIN_PART))
        bounds = np.linspace(0, n, parts + 1).astype(np.int64)
        size = self.layout.itemsize

        def read(lo: int, hi: int) -> None:
            asked: list[str | int | float | bytes | bool] = [
                keys[i * 8 : i * 8 + 8] for i in range(lo, hi)
            ]
            got = cast(list[bytes | None], self._db.get(asked, read_opt=self._read))
            hit = [i for i, v in enumerate(got) if v is not None]
            if not hit:
                return
            raw = b"".join(v for v in got if v is not None)
            if len(raw) != size * len(hit):
                msg = (
                    f"disk tier at {self.path}: a row of {len(raw) // len(hit)} bytes, "
                    f"expected {size}"
                )
                raise StoreError(msg)
            at = np.asarray(hit, dtype=np.int64) + lo
            out[at] = np.frombuffer(raw, dtype=self.layout.dtype)
            found[at] = True

        self._check_open()
        if parts == 1:
            read(0, n)
        else:
            for f in [
                self._readers.submit(read, int(bounds[i]), int(bounds[i + 1])) for i in range(parts)
            ]:
                f.result()
        return found, out

    def put(self, rows: RowBatch) -> None:
        """Write ``rows`` (an id already there is replaced)."""
        if rows.weights.shape[1:] != (self.layout.dim,) or rows.state.shape[1:] != (
            self.layout.state_width,
        ):
            msg = (
                f"rows: expected weights of ({self.layout.dim},) and state of "
                f"({self.layout.state_width},) per row, got {rows.weights.shape[1:]} and "
                f"{rows.state.shape[1:]} (disk tier at {self.path})"
            )
            raise ValueError(msg)
        ids = rows.ids
        keys = ids.astype(_KEY).tobytes()
        raw = self.layout.encode(rows).tobytes()
        size = self.layout.itemsize
        batch = rocksdict.WriteBatch(raw_mode=True)
        for i in range(ids.shape[0]):
            batch.put(keys[i * 8 : i * 8 + 8], raw[i * size : (i + 1) * size])
        self._write(batch)

    def delete(self, ids: U64) -> None:
        keys = ids.astype(_KEY).tobytes()
        batch = rocksdict.WriteBatch(raw_mode=True)
        for i in range(ids.shape[0]):
            batch.delete(keys[i * 8 : i * 8 + 8])
        self._write(batch)

    def _write(self, batch: rocksdict.WriteBatch) -> None:
        self._check_open()
        try:
            self._db.write(batch)
        except Exception as e:
            raise self._write_error(e) from e

    def _write_error(self, e: Exception) -> StoreError:
        if any(s in str(e) for s in _FULL):
            msg = f"disk tier at {self.path}: the disk is full ({e}); the rows stay in memory"
            return DiskFull(msg)
        return StoreError(f"disk tier at {self.path}: a write failed: {e}")

    def scan(self, after: int | None = None, count: int = 65536) -> RowBatch:
        """Up to ``count`` rows in id order, from the first id above ``after``."""
        self._check_open()
        it = self._db.iter(self._read)
        if after is None:
            it.seek_to_first()
        else:
            it.seek(np.array([after], dtype=_KEY).tobytes())
            if it.valid() and it.key() == np.array([after], dtype=_KEY).tobytes():
                it.next()
        keys: list[bytes] = []
        values: list[bytes] = []
        while it.valid() and len(keys) < count:
            keys.append(it.key())
            values.append(it.value())
            it.next()
        del it
        ids = np.frombuffer(b"".join(keys), dtype=_KEY).astype(np.uint64)
        return self.layout.decode(ids, np.frombuffer(b"".join(values), dtype=self.layout.dtype))

    def scan_all(self, count: int = 65536) -> Iterator[RowBatch]:
        """Every row, ``count`` at a time, in id order."""
        after: int | None = None
        while True:
            rows = self.scan(after, count)
            if len(rows):
                yield rows
            if len(rows) < count:
                return
            after = int(rows.ids[-1])

    # --- the tier as a whole -------------------------------------------------------

    def checkpoint(self, dest: str | os.PathLike[str]) -> Path:
        """A consistent copy of the tier at ``dest`` (must not exist): the engine's
        own checkpoint, its table files hard links, so it costs no row copies."""
        self._check_open()
        dest = Path(dest)
        rocksdict.Checkpoint(self._db).create_checkpoint(str(dest))
        return dest

    @classmethod
    def restore(
        cls,
        checkpoint: str | os.PathLike[str],
        path: str | os.PathLike[str],
        layout: RowLayout,
        settings: DiskSettings = DiskSettings(),
    ) -> DiskRows:
        """A live tier at ``path`` made from a :meth:`checkpoint`, which stays as it
        was: its table files are hard-linked (RocksDB never changes a table file once
        written), the rest (the engine's manifest and options) copied."""
        path = Path(path)
        if path.exists():
            shutil.rmtree(path)
        path.mkdir(parents=True)
        for f in Path(checkpoint).iterdir():
            if f.suffix == ".sst":
                os.link(f, path / f.name)
            else:
                shutil.copy2(f, path / f.name)
        return cls(path, layout, settings)

    def flush(self) -> None:
        """Write the rows held in the engine's memory buffer to its table files."""
        self._check_open()
        try:
            self._db.flush()
        except Exception as e:
            raise self._write_error(e) from e

    def disk_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.path.iterdir() if f.is_file())

    def _check_open(self) -> None:
        if self._closed:
            msg = f"disk tier at {self.path}: closed"
            raise StoreError(msg)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._readers.shutdown(wait=True)
        self._db.close()

    def __enter__(self) -> DiskRows:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
