"""A table larger than memory: the hot rows in an :class:`EmbeddingTable`, the rest on disk.

The memory tier is the table as it always is, bounded by ``tier.memory_rows``
instead of the capacity. Any call that needs a row memory does not hold (a
lookup, a push, a read) first reads it from the disk tier (:mod:`.disk_rows`) with
its optimizer state, last step and frequency, making room by moving the rows the
policy picks to disk. A row thus trains exactly as it would in memory: the two
tiers together hold what an all-in-memory table holds, row for row.

The disk tier keeps a copy of every row that ever left memory; a row read back is
clean until it changes. The index's ``PERSISTED`` bit says a row has a copy on
disk, ``DIRTY`` that memory's is newer, so a clean row leaves memory without a
write. A checkpoint (:meth:`export`) writes memory's changed rows to disk first,
and its delta holds every row changed since the last, in memory or moved to disk
since.

>>> import tempfile
>>> from embedding_store.types import TableConfig
>>> config = TableConfig(dim=2, capacity=1000, tier={"memory_rows": 4},
...                      optimizer={"kind": "sgd", "lr": 1.0})
>>> first, second = np.arange(4, dtype=np.uint64), np.arange(4, 8, dtype=np.uint64)
>>> with tempfile.TemporaryDirectory() as d:
...     t = TieredTable("t", config, d)
...     before = t.lookup(first).copy()
...     _ = t.push(first, np.ones((4, 2), np.float32))
...     _ = t.lookup(second)  # memory holds 4 rows: the first four go to disk
...     moved = t.tier_counters()["demotions"]
...     back = t.lookup(first, train=False)  # and come back, as they were left
...     t.close()
>>> moved, len(t), t.memory_rows, bool(np.allclose(back, before - 1.0))
(4, 8, 4, True)
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from embedding_store.errors import CheckpointError, InvalidRequest
from embedding_store.hashing import init_rows
from embedding_store.kernels.hash_index import (
    DIRTY,
    FREQ_ONE,
    KEY,
    META,
    PERSISTED,
    ROW,
    SEEN,
    probe,
    upsert,
)
from embedding_store.kernels.rows import gather_or_init
from embedding_store.persistence import file_entry
from embedding_store.table import EmbeddingTable
from embedding_store.tier.disk_rows import DiskRows, DiskSettings, RowLayout
from embedding_store.tier.flags import meta_of, set_flags
from embedding_store.tier.snapshots import export_tier, restore_tier
from embedding_store.types import RowBatch, TableConfig, TierConfig

I64 = npt.NDArray[np.int64]
U64 = npt.NDArray[np.uint64]

# A frequency above this ranks as this: the score packs it over the 40 bits of a step.
_FREQ_CAP = (1 << 22) - 1
_STEP_BITS = 40
# Rows of the disk tier one expiry pass looks at: expiring rows on disk is a scan,
# spread over the passes instead of read in one.
_EXPIRY_SCAN = 65536
_TIER_COUNTERS = ("tier_asked", "tier_missed", "promotions", "demotions")
# rows_page's cursors from here on page the disk tier: DISK_PAGES + an id's top 56 bits.
DISK_PAGES = 1 << 62


def empty_rows(dim: int, state_width: int) -> RowBatch:
    return RowBatch(
        ids=np.zeros(0, np.uint64),
        weights=np.zeros((0, dim), np.float32),
        state=np.zeros((0, state_width), np.float32),
        row_step=np.zeros(0, np.int64),
        last_seen=np.zeros(0, np.int64),
        freq=np.zeros(0, np.int64),
    )


def _concat(parts: list[RowBatch]) -> RowBatch:
    return RowBatch(
        ids=np.concatenate([p.ids for p in parts]),
        weights=np.concatenate([p.weights for p in parts]),
        state=np.concatenate([p.state for p in parts]),
        row_step=np.concatenate([p.row_step for p in parts]),
        last_seen=np.concatenate([p.last_seen for p in parts]),
        freq=np.concatenate([p.freq for p in parts]),
    )


def _settings(tier: TierConfig) -> DiskSettings:
    return DiskSettings(readers=tier.readers, write_buffer_bytes=tier.write_buffer_mb << 20)


class TieredTable(EmbeddingTable):
    """An :class:`EmbeddingTable` whose rows beyond ``tier.memory_rows`` live on disk
    at ``path`` (a folder it owns). ``close`` it to release the disk tier."""

    tiered = True

    def __init__(self, name: str, config: TableConfig, path: str | os.PathLike[str]) -> None:
        if config.tier is None:
            msg = f"table {name!r}: a tiered table needs tier settings (tier.memory_rows)"
            raise ValueError(msg)
        super().__init__(name, config)
        self.tier: TierConfig = config.tier
        layout = RowLayout(config.dim, self.state_width)
        # A table starts empty, as an untiered one does: rows come back by a restore
        # from a checkpoint, never from the files of a tier that was live (they are
        # written without a log, so a crash leaves them behind memory's rows).
        shutil.rmtree(path, ignore_errors=True)
        self.disk = DiskRows(Path(path), layout, _settings(config.tier))
        # Rows on disk, counted exactly: rows leave memory with a copy there, or were
        # put there by a restore; only deletions take them off.
        self._disk_rows = 0
        # After a failed checkpoint: every row counts as changed until the next.
        self._all_changed = False
        # Ids changed since the last checkpoint whose newest copy went to disk, and ids
        # deleted since: the next delta's rows read back from disk, and its tombstones.
        self._changed_on_disk: list[I64] = []
        self._deleted: list[I64] = []
        self._expiry_cursor: int | None = None
        self._checksums: dict[tuple[int, int, int], str] = {}

    # --- sizes -------------------------------------------------------------------

    def __len__(self) -> int:
        """Rows of the table in both tiers."""
        return self._disk_rows + self._memory_only()

    def _memory_only(self) -> int:
        occupied = self._buckets[:, ROW] >= 0
        return int(np.count_nonzero(occupied & ((self._buckets[:, META] & PERSISTED) == 0)))

    @property
    def memory_rows(self) -> int:
        return int(self._alloc[0])

    def tier_counters(self) -> dict[str, int]:
        """Ids asked for (``tier_asked``, repeats counted) and of those not in memory
        (``tier_missed``), rows read back from disk (``promotions``) and moved out of
        memory (``demotions``): :meth:`stats` has them too."""
        with self._lock:
            return {k: self._counters[k] for k in _TIER_COUNTERS}

    def _disk_stats(self) -> dict[str, int]:
        return {"disk_rows": self._disk_rows, "disk_bytes": self.disk.disk_bytes()}

    # --- bulk loads ----------------------------------------------------------------

    def create(self, ids: npt.ArrayLike, *, step: int | None = None) -> None:
        """As :meth:`EmbeddingTable.create`, with no row moved between the tiers: rows on
        disk are marked seen there, and new rows go to memory if it has room for them
        all, else straight to disk in one batch. A bulk load larger than memory thus
        costs one disk write a row, and leaves the hot rows in memory."""
        keys = np.ascontiguousarray(np.asarray(ids, dtype=np.uint64)).view(np.int64)
        with self._lock:
            done = self._create_in_place(keys, step)
        if not done:
            super().create(keys.view(np.uint64), step=step)

    def _create_in_place(self, keys: I64, step: int | None) -> bool:
        """:meth:`create` under the lock; False where a lookup does the work instead:
        repeated ids, or new rows that would take the table over its capacity (the
        lookup drops rows as an untiered table does)."""
        if keys.shape[0] == 0 or np.unique(keys).shape[0] != keys.shape[0]:
            return False
        meta = np.empty(keys.shape[0], dtype=np.int64)
        meta_of(self._buckets, keys, meta)
        elsewhere = keys[meta < 0]
        found, old = self.disk.get(elsewhere.view(np.uint64))
        new = elsewhere[~found]
        if len(self) + new.shape[0] > self.config.capacity:
            return False
        clock = self._next_clock(step)
        # Admission counts what it sees (a count-min sketch): put back if the write fails.
        sketch = self._sketch.copy()
        counters = self._counters
        rejected = counters["rejected_admissions"]
        admitted = self._admit(new, np.arange(new.shape[0]), clock)
        to_disk = admitted.shape[0] > self._room - int(self._alloc[0])
        old.last_seen[:] = clock
        np.add(old.freq, 1, out=old.freq)
        written = old
        if to_disk:
            written = _concat([self._initial_rows(new[admitted].view(np.uint64), clock), old])
        try:
            if len(written):
                self.disk.put(written)  # raises DiskFull before anything changes
        except BaseException:
            self._sketch[...] = sketch
            counters["rejected_admissions"] = rejected
            raise
        if len(written):
            self._changed_on_disk.append(written.ids.view(np.int64).copy())
        self.clock = clock
        here = keys[meta >= 0]
        probe(self._buckets, here, clock, True, np.empty(here.shape[0], np.int64))
        if to_disk:
            self._disk_rows += admitted.shape[0]
            counters["admissions"] += admitted.shape[0]
        else:
            self._insert_new(new, admitted, clock, np.full(new.shape[0], -1))
        counters["lookups"] += 1
        counters["lookup_ids"] += keys.shape[0]
        counters["tier_asked"] += keys.shape[0]
        counters["tier_missed"] += elsewhere.shape[0]
        self._maybe_expire()
        return True

    def _initial_rows(self, ids: U64, clock: int) -> RowBatch:
        """New rows of ``ids`` as the table makes them, seen once at ``clock``."""
        n = ids.shape[0]
        weights = np.empty((n, self.dim), dtype=np.float32)
        init_rows(weights, ids, self._seed, *self._init)
        state = np.zeros((n, self.state_width), dtype=np.float32)
        self.optimizer.initialize(weights, state, np.arange(n, dtype=np.int64))
        return RowBatch(
            ids=ids,
            weights=weights,
            state=state,
            row_step=np.zeros(n, np.int64),
            last_seen=np.full(n, clock, np.int64),
            freq=np.ones(n, np.int64),
        )

    # --- moving rows between the tiers --------------------------------------------

    def _ensure_resident(self, keys: I64) -> None:
        if keys.shape[0] == 0:
            return
        if self._over_memory(keys):
            msg = (
                f"table {self.name!r}: one call needs {np.unique(keys).shape[0]} rows in "
                f"memory at once, more than tier.memory_rows ({self._room}); raise it"
            )
            raise InvalidRequest(msg)
        rows = np.empty(keys.shape[0], dtype=np.int64)
        missing = probe(self._buckets, keys, self.clock, False, rows)
        self._counters["tier_asked"] += keys.shape[0]
        self._counters["tier_missed"] += missing
        if not missing:
            return
        wanted = np.unique(keys[rows < 0])
        _, batch = self.disk.get(wanted.view(np.uint64))
        # Room for every row the call may add, read back or new, made now: rows go to
        # disk here or not at all, before the call changes anything (a full disk fails
        # it whole).
        free = self._room - int(self._alloc[0])
        if wanted.shape[0] > free:
            adding = wanted.shape[0] - len(batch)
            self._evict_lru(wanted.shape[0] - free, protect=keys, adding=adding)
            if len(batch) > self._room - int(self._alloc[0]):
                msg = (
                    f"table {self.name!r}: one call needs {np.unique(keys).shape[0]} rows in "
                    f"memory at once, more than tier.memory_rows ({self._room}); raise it"
                )
                raise InvalidRequest(msg)
        if not len(batch):
            return
        self._reserve(len(batch))
        keys_in = batch.ids.view(np.int64)
        slots = np.empty(len(batch), dtype=np.int64)
        upsert(self._buckets, keys_in, self._alloc, self._free, batch.last_seen, batch.freq, slots)
        self._weights[slots] = batch.weights
        self._state[slots] = batch.state
        self._row_step[slots] = batch.row_step
        set_flags(self._buckets, keys_in, PERSISTED)
        self._counters["promotions"] += len(batch)

    def _evict_lru(
        self,
        n: int,
        protect_clock: int | None = None,
        protect: I64 | None = None,
        adding: int | None = None,
    ) -> int:
        """Move ``n`` rows (or a little more) to disk, the policy's least wanted first;
        never rows seen at ``protect_clock`` or of ``protect``. When the ``adding`` new
        rows (default ``n``) would take the table over its capacity, the rows are
        dropped instead, as an untiered table drops them."""
        occupied = np.flatnonzero(self._buckets[:, ROW] >= 0)
        seen = self._buckets[occupied, SEEN]
        if protect_clock is not None:
            keep = seen < protect_clock
            occupied, seen = occupied[keep], seen[keep]
        if self.tier.policy == "lfu":
            freq = np.minimum(self._buckets[occupied, META] // FREQ_ONE, _FREQ_CAP)
            score = (freq << _STEP_BITS) | seen
        else:
            score = seen
        n_asked = n
        n = max(n, self._room // 64)
        # The n least wanted apart from ``protect``: among the n + len(protect) least
        # wanted of all (a set over the whole memory tier costs more than the pick).
        k = min(occupied.shape[0], n + (protect.shape[0] if protect is not None else 0))
        if k < occupied.shape[0]:
            part = np.argpartition(score, k - 1)[:k]
            occupied, score = occupied[part], score[part]
        if protect is not None:
            free = ~np.isin(self._buckets[occupied, KEY], protect)
            occupied, score = occupied[free], score[free]
        n = min(n, occupied.shape[0])
        if n <= 0:
            return 0
        victims = occupied[np.argpartition(score, n - 1)[:n]] if n < occupied.shape[0] else occupied
        if len(self) + (n_asked if adding is None else adding) > self.config.capacity:
            dropped = self._delete(self._buckets[victims, KEY].copy())
            self._counters["evictions"] += dropped
            return dropped
        return self._demote(victims)

    def _demote(self, victims: I64) -> int:
        meta = self._buckets[victims, META]
        persisted = (meta & PERSISTED) != 0
        write = ((meta & DIRTY) != 0) | ~persisted
        if write.any():
            rows = self._rows_at(victims[write])
            self.disk.put(rows)  # raises DiskFull before anything leaves memory
            self._disk_rows += int(np.count_nonzero(~persisted))
            self._changed_on_disk.append(rows.ids.view(np.int64).copy())
        moved, _ = self._delete_slots(self._buckets[victims, KEY].copy())
        self._counters["demotions"] += moved
        return moved

    # --- deletion and expiry -------------------------------------------------------

    def _delete(self, keys: I64) -> int:
        meta = np.empty(keys.shape[0], dtype=np.int64)
        meta_of(self._buckets, keys, meta)
        elsewhere = np.unique(keys[meta < 0])
        found, _ = self.disk.get(elsewhere.view(np.uint64))
        on_disk_only = elsewhere[found]
        deleted, persisted = self._delete_slots(keys)
        gone = np.concatenate([persisted, on_disk_only])
        if gone.shape[0]:
            self.disk.delete(gone.view(np.uint64))
            self._disk_rows -= gone.shape[0]
        removed = deleted + on_disk_only.shape[0]
        if removed:
            self._deleted.append(keys.copy())
            if self._log is not None:
                self._log.record(keys)
        return int(removed)

    def _expire_now(self, ttl: int) -> int:
        return super()._expire_now(ttl) + self._expire_on_disk(ttl)

    def _expire_on_disk(self, ttl: int) -> int:
        """Delete the stale rows of the next part of the disk tier (rows in memory are
        the memory tier's to expire: their copy on disk may be older)."""
        part = self.disk.scan(self._expiry_cursor, _EXPIRY_SCAN)
        self._expiry_cursor = int(part.ids[-1]) if len(part) == _EXPIRY_SCAN else None
        stale = part.ids[part.last_seen < self.clock - ttl].view(np.int64)
        if stale.shape[0] == 0:
            return 0
        meta = np.empty(stale.shape[0], dtype=np.int64)
        meta_of(self._buckets, stale, meta)
        stale = stale[meta < 0]
        expired = self._delete(stale) if stale.shape[0] else 0
        self._counters["expirations"] += expired
        return expired

    # --- checkpoints ---------------------------------------------------------------

    def export(self, dirty_only: bool, *, mark_clean: bool = True) -> tuple[RowBatch, U64, int]:
        """As :meth:`EmbeddingTable.export`, over both tiers. With ``mark_clean``, the
        changed rows in memory are written to disk first (they stay in memory)."""
        with self._lock:
            dirty_only = dirty_only and not self._all_changed
            occupied = self._buckets[:, ROW] >= 0
            if dirty_only:
                occupied &= (self._buckets[:, META] & DIRTY) != 0
            in_memory = self._rows_at(np.flatnonzero(occupied))
            parts = [in_memory]
            disk_ids = (
                np.unique(np.concatenate(self._changed_on_disk))
                if dirty_only and self._changed_on_disk
                else np.zeros(0, np.int64)
            )
            if not dirty_only:
                parts += [self._disk_only(rows) for rows in self.disk.scan_all()]
            elif disk_ids.shape[0]:
                # Changed since the last checkpoint and moved to disk: its newest copy is
                # in memory if it came back (then it is there as a clean row), else on disk.
                here = np.empty(disk_ids.shape[0], dtype=np.int64)
                meta_of(self._buckets, disk_ids, here)
                back = disk_ids[(here >= 0) & ((here & DIRTY) == 0)]
                parts.append(self._rows_at(self._buckets_of(back)))
                _, rows = self.disk.get(disk_ids[here < 0].view(np.uint64))
                parts.append(rows)
            batch = _concat(parts)
            tombs = (
                np.setdiff1d(np.concatenate(self._deleted), batch.ids.view(np.int64))
                if self._deleted
                else np.zeros(0, np.int64)
            )
            if mark_clean:
                self._flush(np.flatnonzero(self._buckets[:, ROW] >= 0))
                self._changed_on_disk = []
                self._deleted = []
                self._all_changed = False
            return batch, tombs.view(np.uint64), self.clock

    def checkpoint_tier(
        self, directory: Path, prefix: str
    ) -> tuple[list[dict[str, Any]], int, int]:
        """A full snapshot as the disk tier's own checkpoint in ``directory`` (files named
        ``{prefix}...``, table files hard links): memory's changed rows are written to
        disk first, so the tier holds every row. Returns the files' manifest entries,
        the rows and the clock; the table counts as checkpointed (the next delta
        starts here)."""
        with self._lock:
            self._flush(np.flatnonzero(self._buckets[:, ROW] >= 0))
            files = export_tier(self.disk, directory, prefix)
            self._changed_on_disk = []
            self._deleted = []
            self._all_changed = False
            return [self._entry(f) for f in files], self._disk_rows, self.clock

    def _entry(self, path: Path) -> dict[str, Any]:
        # The engine never changes a table file once written and the checkpoint links
        # it: a file's checksum is computed once, not at every full snapshot.
        st = path.stat()
        key = (st.st_ino, st.st_size, st.st_mtime_ns)
        if key not in self._checksums:
            self._checksums[key] = file_entry(path)["sha256"]
        return file_entry(path, self._checksums[key])

    def load_tier(self, files: list[Path], prefix: str, rows: int) -> None:
        """Take a checkpoint's tier ``files`` (of ``rows`` rows) as this table's disk tier
        (restore path, onto a table that holds nothing yet)."""
        with self._lock:
            if int(self._alloc[0]) or self._disk_rows:
                msg = f"table {self.name!r}: a disk tier is restored onto an empty table only"
                raise CheckpointError(msg)
            path, layout = self.disk.path, self.disk.layout
            self.disk.close()
            self.disk = restore_tier(files, prefix, path, layout, self.disk.settings)
            self._disk_rows = rows
            self._all_changed = True  # nothing of it is in this shard's own chain yet

    def _disk_only(self, rows: RowBatch) -> RowBatch:
        meta = np.empty(len(rows), dtype=np.int64)
        meta_of(self._buckets, rows.ids.view(np.int64), meta)
        return rows.select(meta < 0)

    def _buckets_of(self, keys: I64) -> I64:
        """The buckets of ``keys``, all of which have a row in memory."""
        occupied = np.flatnonzero(self._buckets[:, ROW] >= 0)
        at = np.isin(self._buckets[occupied, KEY], keys)
        return occupied[at]

    def _flush(self, sel: I64) -> None:
        """Write the rows of buckets ``sel`` that disk lacks or holds older to disk."""
        meta = self._buckets[sel, META]
        write = sel[((meta & DIRTY) != 0) | ((meta & PERSISTED) == 0)]
        if write.shape[0] == 0:
            return
        new = int(np.count_nonzero((self._buckets[write, META] & PERSISTED) == 0))
        self.disk.put(self._rows_at(write))
        self._disk_rows += new
        self._buckets[write, META] = (self._buckets[write, META] & ~np.int64(DIRTY)) | PERSISTED

    def mark_all_dirty(self) -> None:
        """Every row counts as changed: the next delta holds them all (a failed checkpoint
        leaves what was persisted unknown)."""
        with self._lock:
            occupied = self._buckets[:, ROW] >= 0
            self._buckets[occupied, META] |= DIRTY
            self._all_changed = True

    def load(self, batch: RowBatch) -> None:
        """Insert or overwrite rows (restore path): rows memory holds are overwritten
        there, the others go to disk; all count as changed since the last checkpoint."""
        keys = np.ascontiguousarray(batch.ids).view(np.int64)
        with self._lock:
            meta = np.empty(keys.shape[0], dtype=np.int64)
            meta_of(self._buckets, keys, meta)
        here = meta >= 0
        if here.any():
            super().load(batch.select(here))
        rest = batch.select(~here)
        if not len(rest):
            return
        with self._lock:
            found, _ = self.disk.get(rest.ids)
            self.disk.put(rest)
            self._disk_rows += int(np.count_nonzero(~found))
            self._changed_on_disk.append(rest.ids.view(np.int64).copy())

    def load_weights(self, ids: npt.NDArray[np.uint64], weights: npt.NDArray[np.float32]) -> None:
        """As :meth:`EmbeddingTable.load_weights` (a serving replica's rows), over both
        tiers: rows memory holds are overwritten there, the others written to disk."""
        keys = np.ascontiguousarray(ids).view(np.int64)
        with self._lock:
            meta = np.empty(keys.shape[0], dtype=np.int64)
            meta_of(self._buckets, keys, meta)
            here = meta >= 0
            rest = keys[~here]
            found, _ = self.disk.get(rest.view(np.uint64))
            new = int(np.count_nonzero(~found))
            if len(self) + new > self.config.capacity:
                msg = (
                    f"table {self.name!r}: {len(self) + new} rows on a replica whose "
                    f"capacity is {self.config.capacity}"
                )
                raise CheckpointError(msg)
            if rest.shape[0]:
                n = rest.shape[0]
                zeros = np.zeros(n, np.int64)
                self.disk.put(
                    RowBatch(
                        ids=rest.view(np.uint64),
                        weights=np.ascontiguousarray(weights[~here], np.float32),
                        state=np.zeros((n, self.state_width), np.float32),
                        row_step=zeros,
                        last_seen=zeros,
                        freq=zeros,
                    )
                )
                self._disk_rows += new
            if here.any():
                mine = keys[here]
                rows = np.empty(mine.shape[0], dtype=np.int64)
                probe(self._buckets, mine, self.clock, False, rows)
                self._weights[rows] = weights[here]
                # Memory's copy is now the newer: it goes to disk when it leaves.
                set_flags(self._buckets, mine, DIRTY)

    def lookup(
        self,
        ids: npt.ArrayLike,
        *,
        train: bool = True,
        step: int | None = None,
        out: npt.NDArray[np.floating] | None = None,
    ) -> npt.NDArray[np.floating]:
        """As :meth:`EmbeddingTable.lookup`; a read (``train=False``) of more rows than
        memory holds reads them where they are, bringing none into memory."""
        keys = np.ascontiguousarray(np.asarray(ids, dtype=np.uint64)).view(np.int64)
        if train or not self._over_memory(keys):
            return super().lookup(ids, train=train, step=step, out=out)
        rows = np.zeros((keys.shape[0], self.dim), np.float32)
        with self._lock:
            present, weights = self._weights_now(keys)
        rows[present] = weights
        if out is None:
            return rows
        out[...] = rows
        return out

    def read(
        self, ids: npt.ArrayLike, out: npt.NDArray[np.float32] | None = None
    ) -> tuple[npt.NDArray[np.float32], int]:
        """As :meth:`EmbeddingTable.read`; a read of more rows than memory holds reads
        them where they are, bringing none into memory."""
        keys = np.ascontiguousarray(np.asarray(ids, dtype=np.uint64)).view(np.int64)
        if not self._over_memory(keys):
            return super().read(ids, out)
        rows = np.empty((keys.shape[0], self.dim), np.float32) if out is None else out
        with self._lock:
            present, weights = self._weights_now(keys)
            unknown = int(np.count_nonzero(~present))
            self._counters["unknown_reads"] += unknown
        # Each id's row among ``weights``, or -1: read as the row a lookup would create.
        at = np.full(keys.shape[0], -1, dtype=np.int64)
        at[present] = np.arange(weights.shape[0])
        gather_or_init(weights, at, keys, self._seed, *self._init, rows)
        return rows, unknown

    def _over_memory(self, keys: I64) -> bool:
        """Whether ``keys`` are more distinct rows than memory holds."""
        return bool(keys.shape[0] > self._room and np.unique(keys).shape[0] > self._room)

    def _weights_now(self, keys: I64) -> tuple[npt.NDArray[np.bool_], npt.NDArray[np.float32]]:
        rows = np.empty(keys.shape[0], dtype=np.int64)
        probe(self._buckets, keys, self.clock, False, rows)
        present = rows >= 0
        absent = np.flatnonzero(~present)
        found, on_disk = self.disk.get(keys[absent].view(np.uint64))
        weights = np.empty((keys.shape[0], self.dim), dtype=np.float32)
        weights[present] = self._weights[rows[present]]
        weights[absent[found]] = on_disk.weights
        present[absent[found]] = True
        return present, weights[present]

    def rows_page(self, cursor: int, count: int) -> tuple[U64, npt.NDArray[np.float32], int]:
        """As :meth:`EmbeddingTable.rows_page`, over both tiers: memory's slots first,
        then the disk tier in id order (cursors from :data:`DISK_PAGES` on), each row
        as its newest copy (memory's where it is there too). A row that moves between
        the tiers while the pages are read is in one page or the other, or in both."""
        if cursor < DISK_PAGES:
            ids, weights, nxt = super().rows_page(cursor, count)
            return ids, weights, DISK_PAGES if nxt < 0 else nxt
        if count < 1:
            msg = f"rows_page: count must be >= 1, got {count}"
            raise InvalidRequest(msg)
        after = cursor - DISK_PAGES
        with self._lock:
            # The cursor holds an id's top 56 bits: the page goes on past ``count`` rows to
            # the end of its last id's prefix, so that the next starts at a new one.
            part = self.disk.scan((after << 8) - 1 if after else None, count)
            ids = part.ids
            if len(part) == count:
                last = int(ids[-1]) >> 8
                tail = self.disk.scan(int(ids[-1]), 256)
                tail = tail.select((tail.ids >> np.uint64(8)) == last)
                ids = np.concatenate([ids, tail.ids])
                weights = np.concatenate([part.weights, tail.weights])
                nxt = DISK_PAGES + last + 1 if last + 1 < 1 << 56 else -1
            else:
                weights, nxt = part.weights.copy(), -1
            rows = np.empty(ids.shape[0], dtype=np.int64)
            probe(self._buckets, ids.view(np.int64), self.clock, False, rows)
            here = np.flatnonzero(rows >= 0)
            weights[here] = self._weights[rows[here]]
        return ids, weights, nxt

    def ids(self) -> U64:
        """The ids that have a row now, in either tier."""
        with self._lock:
            memory = self._buckets[self._buckets[:, ROW] >= 0, KEY]
            disk = [rows.ids.view(np.int64) for rows in self.disk.scan_all()]
        return np.unique(np.concatenate([memory, *disk])).view(np.uint64)

    def close(self) -> None:
        """Release the disk tier (its files stay)."""
        self.disk.close()
