"""One embedding table of one shard: a hash index (``kernels.hash_index``) over row slots.

Rows live in slot arrays (weights, optimizer state, per-row step) that never move
when the index grows. Every method takes the table's lock, and every kernel runs
without the GIL, so a shard serves calls on different tables in parallel.

>>> import numpy as np
>>> from embedding_store.types import TableConfig
>>> t = EmbeddingTable("user", TableConfig(dim=4, optimizer={"kind": "sgd", "lr": 0.5}))
>>> ids = np.array([7, 42], dtype=np.uint64)
>>> before = t.lookup(ids)
>>> t.push(ids, np.ones((2, 4), dtype=np.float32)).applied
2
>>> bool(np.allclose(t.lookup(ids, train=False), before - 0.5))
True
>>> len(t)
2
"""

from __future__ import annotations

import threading
from dataclasses import fields

import numpy as np
import numpy.typing as npt

from embedding_store.changes import ChangeLog
from embedding_store.errors import CheckpointError, InvalidRequest
from embedding_store.hashing import init_params, table_seed
from embedding_store.kernels.admission import admit_count_min, admit_probability
from embedding_store.kernels.float16 import gather_f16
from embedding_store.kernels.group_read import (
    P_BUCKET_ROWS,
    P_BUCKETS,
    P_WEIGHT_ROWS,
    P_WEIGHTS,
)
from embedding_store.kernels.hash_index import (
    DIRTY,
    FREQ_ONE,
    KEY,
    MAX_LOAD,
    META,
    OVERFLOW,
    PERSISTED,
    ROW,
    SEEN,
    buckets_for,
    delete_keys,
    empty_buckets,
    insert,
    probe,
    rehash,
    resolve_push,
    upsert,
)
from embedding_store.kernels.rows import gather, gather_or_init, gather_state, update_rows
from embedding_store.optim import RowOptimizer, make_optimizer
from embedding_store.types import (
    CountMinAdmission,
    ProbabilityAdmission,
    PushResult,
    RowBatch,
    RowState,
    TableChanges,
    TableConfig,
    TableStats,
)

F32 = npt.NDArray[np.float32]
I64 = npt.NDArray[np.int64]
U64 = npt.NDArray[np.uint64]

# Step clocks a caller may set: 2**40 steps is 35 years at 1,000 steps a second.
MAX_STEP = 1 << 40

# A table's counters: the fields of ``TableStats`` that ``stats`` does not compute.
_COMPUTED = {
    "name", "dim", "rows", "capacity", "memory_bytes", "clock", "memory_rows", "disk_rows",
    "disk_bytes",
}  # fmt: skip
_COUNTERS = tuple(f.name for f in fields(TableStats) if f.name not in _COMPUTED)


def bytes_at_capacity(config: TableConfig) -> int:
    """Bytes of one table's arrays once it holds ``config.capacity`` rows (a tiered
    table's ``tier.memory_rows``): what a shard's memory limit must hold for it (its
    free list counted full, as after mass evictions).

    >>> from embedding_store.types import AdagradConfig
    >>> bytes_at_capacity(TableConfig(dim=16, capacity=1000, optimizer=AdagradConfig()))
    186688
    """
    width = make_optimizer(config.optimizer).state_width(config.dim)
    rows = config.capacity if config.tier is None else config.tier.memory_rows
    # weights and optimizer state (float32), the row's step and a free-list slot (int64)
    per_row = 4 * (config.dim + width) + 8 + 8
    sketch = 0
    if isinstance(config.admission, CountMinAdmission):
        sketch = 4 * config.admission.depth * config.admission.width
    return buckets_for(rows) * 4 * 8 + rows * per_row + sketch


def _as_ids(ids: npt.ArrayLike, field: str = "ids") -> U64:
    arr = np.asarray(ids)
    if arr.ndim != 1:
        msg = f"{field}: expected a 1-d array of uint64 ids, got shape {arr.shape}"
        raise InvalidRequest(msg)
    if arr.dtype != np.uint64:
        if arr.dtype.kind not in "iu":
            msg = f"{field}: expected integer ids, got dtype {arr.dtype}"
            raise InvalidRequest(msg)
        arr = arr.astype(np.uint64)
    return np.ascontiguousarray(arr)


class EmbeddingTable:
    """A bounded, persistent-ready embedding table (one shard's part of it)."""

    # Whether some rows may live off memory (a read must bring them in first).
    tiered = False

    def __init__(self, name: str, config: TableConfig) -> None:
        self.name = name
        self.config = config
        self.dim = config.dim
        self.optimizer: RowOptimizer = make_optimizer(config.optimizer)
        self._state_width = self.optimizer.state_width(config.dim)
        self._seed = table_seed(name, config.seed)
        self._init = init_params(config.initializer)
        self._lock = threading.Lock()
        # Where ``_buckets`` and ``_weights`` lie (see ``kernels.group_read``): made once,
        # kept up to date in place under the lock, so that a ``TableGroup`` hands its
        # kernel one address per table instead of two arrays, each of which the call
        # would type-check and unbox (``benchmarks/serve.py``).
        self._placement = np.zeros(4, dtype=np.int64)
        # Rows memory holds at most: all of them, or a tiered table's memory tier.
        self._room = config.capacity if config.tier is None else config.tier.memory_rows
        self._max_buckets = buckets_for(self._room)
        adm = config.admission
        self._sketch = (
            np.zeros((adm.depth, adm.width), dtype=np.uint32)
            if isinstance(adm, CountMinAdmission)
            else np.zeros((0, 1), dtype=np.uint32)
        )
        self.clock = 0
        # Made when a serving replica first asks what changed (see ``changes``).
        self._log: ChangeLog | None = None
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._reset_storage(min(config.initial_rows, self._room))
        self._next_expiry = 0

    def _reset_storage(self, rows: int) -> None:
        # The arrays are C-contiguous, here and when they grow: ``TableGroup`` hands
        # them to its kernel as they are.
        self._alloc_rows = max(1, rows)
        self._buckets = empty_buckets(min(self._max_buckets, buckets_for(self._alloc_rows)))
        self._weights = np.zeros((self._alloc_rows, self.dim), dtype=np.float32)
        self._place()
        self._state = np.zeros((self._alloc_rows, self._state_width), dtype=np.float32)
        self._row_step = np.zeros(self._alloc_rows, dtype=np.int64)
        # Rows freed by eviction, expiry or removal; grown on demand, so a table
        # that never deletes pays nothing for it.
        self._free = np.zeros(0, dtype=np.int64)
        self._alloc = np.zeros(3, dtype=np.int64)  # used, n_free, next_row
        self._tombstones: list[I64] = []

    # --- sizing ---------------------------------------------------------------

    def __len__(self) -> int:
        return int(self._alloc[0])

    @property
    def memory_bytes(self) -> int:
        """Bytes held by this table's arrays (bounded by the configured capacity)."""
        arrays = (
            self._buckets,
            self._weights,
            self._state,
            self._row_step,
            self._free,
            self._sketch,
        )
        return sum(a.nbytes for a in arrays) + sum(t.nbytes for t in self._tombstones)

    def _reserve(self, extra: int) -> None:
        """Make room for ``extra`` more rows (never beyond the capacity)."""
        used, n_free, next_row = (int(x) for x in self._alloc)
        want = min(self._room, used + extra)
        free_slots = n_free + self._alloc_rows - next_row
        if used + free_slots < want:
            new_alloc = self._alloc_rows
            while new_alloc - next_row + n_free + used < want:
                new_alloc *= 2
            self._grow_rows(min(self._room, new_alloc))
        if want > MAX_LOAD * self._buckets.shape[0] and self._buckets.shape[0] < self._max_buckets:
            n = self._buckets.shape[0]
            while want > MAX_LOAD * n and n < self._max_buckets:
                n *= 2
            new = empty_buckets(min(n, self._max_buckets))
            rehash(self._buckets, new)
            self._buckets = new
            self._place()

    def _grow_rows(self, new_alloc: int) -> None:
        old = self._alloc_rows

        def grow(a: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
            b = np.zeros(shape, dtype=a.dtype)
            b[:old] = a[:old]
            return b

        self._weights = grow(self._weights, (new_alloc, self.dim))
        self._place()
        self._state = grow(self._state, (new_alloc, self._state_width))
        self._row_step = grow(self._row_step, (new_alloc,))
        self._alloc_rows = new_alloc

    def _place(self) -> None:
        """``_placement`` for the arrays ``_buckets`` and ``_weights`` are now (called
        where they are replaced: under the lock, or before the table is shared)."""
        p = self._placement
        p[P_BUCKETS] = self._buckets.ctypes.data
        p[P_BUCKET_ROWS] = self._buckets.shape[0]
        p[P_WEIGHTS] = self._weights.ctypes.data
        p[P_WEIGHT_ROWS] = self._weights.shape[0]

    # --- the training path ------------------------------------------------------

    def _advance_clock(self, step: int | None) -> int:
        self.clock = self._next_clock(step)
        return self.clock

    def _next_clock(self, step: int | None) -> int:
        """The clock a training call at ``step`` moves to (InvalidRequest for a bad step)."""
        if step is not None and not 0 <= int(step) < MAX_STEP:
            # A clock of 2**62 (or -5) would be persisted and break TTL and recency.
            msg = f"step: must be in [0, 2**40), got {int(step)} (table {self.name!r})"
            raise InvalidRequest(msg)
        return self.clock + 1 if step is None else max(self.clock, int(step))

    def lookup(
        self,
        ids: npt.ArrayLike,
        *,
        train: bool = True,
        step: int | None = None,
        out: npt.NDArray[np.floating] | None = None,
    ) -> npt.NDArray[np.floating]:
        """Rows for ``ids`` (float32[n, dim], or ``out``), in request order.

        ``train=True`` advances the table's clock (to ``step`` when given, else by
        one), marks the rows seen and creates rows for new admitted ids.
        ``train=False`` changes nothing; ids without a row read as zeros. Ids not
        (yet) admitted read as zeros in both modes.

        ``out``: a C-contiguous float32 or float16 ``[n, dim]`` array to write the
        rows into, and return (float16 is converted as the rows are copied, as
        ``astype`` rounds): a server writes the rows straight into its reply.
        """
        keys = _as_ids(ids).view(np.int64)
        n = keys.shape[0]
        if out is None:
            out = np.empty((n, self.dim), dtype=np.float32)
        elif (
            out.shape != (n, self.dim)
            or out.dtype not in (np.float32, np.float16)
            or not out.flags.c_contiguous
            or not out.flags.writeable
        ):
            msg = (
                f"out: expected a writable C-contiguous float32 or float16 array of shape "
                f"({n}, {self.dim}), got {out.dtype} {out.shape} (table {self.name!r})"
            )
            raise ValueError(msg)
        rows = np.empty(n, dtype=np.int64)
        with self._lock:
            # First: moving rows between tiers may fail (a full disk), and then the
            # call must have changed nothing, the clock included.
            self._ensure_resident(keys)
            clock = self._advance_clock(step) if train else self.clock
            missing = probe(self._buckets, keys, clock, train, rows)
            if train:
                self._counters["lookups"] += 1
                self._counters["lookup_ids"] += n
                if missing:
                    self._create(keys, np.flatnonzero(rows < 0), clock, rows)
            # Before expiry, and under the lock: the rows are read as this call left them.
            if out.dtype == np.float16:
                gather_f16(self._weights.view(np.uint32), rows, out.view(np.uint16))
            else:
                gather(self._weights, rows, out)
            if train:
                self._maybe_expire()
        return out

    def create(self, ids: npt.ArrayLike, *, step: int | None = None) -> None:
        """A bulk load: what a training :meth:`lookup` of ``ids`` does (rows made for new
        admitted ids, every row marked seen), with no rows read out."""
        self.lookup(ids, train=True, step=step)

    def _ensure_resident(self, keys: I64) -> None:
        """Bring the rows of ``keys`` that are elsewhere into memory (under the lock):
        nothing here, where every row is in memory; a tiered table reads them from disk."""

    def _create(self, keys: I64, positions: I64, clock: int, rows: I64) -> None:
        self._insert_new(keys, self._admit(keys, positions, clock), clock, rows)

    def _admit(self, keys: I64, positions: I64, clock: int) -> I64:
        """The ``positions`` of new ``keys`` the admission policy gives a row (it counts
        the sightings, and the rejections)."""
        adm = self.config.admission
        if isinstance(adm, CountMinAdmission):
            admitted = np.empty(positions.shape[0], dtype=np.bool_)
            admit_count_min(self._sketch, keys, positions, adm.threshold, admitted)
        elif isinstance(adm, ProbabilityAdmission):
            admitted = np.empty(positions.shape[0], dtype=np.bool_)
            admit_probability(keys, positions, self._seed, clock, adm.probability, admitted)
        else:
            admitted = np.ones(positions.shape[0], dtype=np.bool_)
        rejected = int(positions.shape[0] - np.count_nonzero(admitted))
        self._counters["rejected_admissions"] += rejected
        return positions[admitted] if rejected else positions

    def _insert_new(self, keys: I64, positions: I64, clock: int, rows: I64) -> None:
        """Rows for the admitted new ``keys[positions]``, their slots into ``rows``."""
        if positions.shape[0] == 0:
            return
        need = positions.shape[0]
        overflow_room = self._room - int(self._alloc[0])
        if need > overflow_room:
            self._evict_lru(need - overflow_room, protect_clock=clock)
        self._reserve(need)
        new_rows = np.empty(need, dtype=np.int64)
        kind, a, b = self._init
        n_new = insert(
            self._buckets,
            keys,
            positions,
            clock,
            self._alloc,
            self._free,
            self._room,
            self._weights,
            self._seed,
            kind,
            a,
            b,
            rows,
            new_rows,
        )
        if n_new:
            fresh = new_rows[:n_new]
            self._row_step[fresh] = 0
            self.optimizer.initialize(self._weights, self._state, fresh)
        self._counters["admissions"] += n_new
        # Rows that found no room read as zeros (the gather's rows < 0).
        self._counters["overflow"] += int(np.count_nonzero(rows[positions] == OVERFLOW))

    def push(
        self, ids: npt.ArrayLike, grads: npt.ArrayLike, *, into: RowState | None = None
    ) -> PushResult:
        """Apply gradients to the rows of ``ids`` with the table's optimizer.

        Gradients of an id named twice are summed. Gradients with a NaN or Inf,
        and updates that would leave a NaN or Inf in a row (an overflow), are
        rejected and counted (``rejected_nonfinite``): the row keeps its values.
        Ids without a row (not admitted, or evicted since their lookup) are
        dropped and counted. ``into``: filled with the rows of ``ids`` as the push
        left them, as :meth:`peek` reads them (a push reply's rows).

        >>> t = EmbeddingTable("t", TableConfig(dim=1, optimizer={"kind": "sgd", "lr": 1.0}))
        >>> _ = t.lookup([7])
        >>> after = RowState(np.empty((2, 1), np.float32), np.empty((2, 0), np.float32),
        ...                  np.empty(2, np.int64))
        >>> _ = t.push([7, 8], np.ones((2, 1), np.float32), into=after)
        >>> after.weights[0] == t.lookup([7])[0], after.row_step.tolist()
        (array([ True]), [1, -1])
        """
        keys = _as_ids(ids).view(np.int64)
        g = np.asarray(grads)
        if g.ndim != 2 or g.shape[0] != keys.shape[0] or g.shape[1] != self.dim:
            msg = (
                f"grads: expected shape ({keys.shape[0]}, {self.dim}) for table {self.name!r}, "
                f"got {g.shape}"
            )
            raise InvalidRequest(msg)
        g = np.ascontiguousarray(g, dtype=np.float32)
        rows = np.empty(keys.shape[0], dtype=np.int64)
        with self._lock:
            self._ensure_resident(keys)
            scratch = np.empty(keys.shape[0], dtype=np.int64)
            absent, nonfinite, dup = resolve_push(self._buckets, keys, g, rows, scratch)
            if dup:
                valid = rows >= 0
                uniq, inverse = np.unique(rows[valid], return_inverse=True)
                summed = np.zeros((uniq.shape[0], self.dim), dtype=np.float32)
                np.add.at(summed, inverse, g[valid])
                rows, g = uniq.astype(np.int64), summed
                # Finite gradients of one id can overflow when summed (2e38 twice).
                overflow = ~np.isfinite(g).all(axis=1)
                if overflow.any():
                    nonfinite += int(np.bincount(inverse, minlength=len(uniq))[overflow].sum())
                    rows[overflow] = -1
            skipped = absent + nonfinite
            nonfinite += self._apply_finite(rows, g)
            if into is not None:
                if dup or skipped:
                    # Rows of ids repeated or left out are found again (rare).
                    self._peek_locked(keys, into)
                else:
                    gather_state(
                        self._weights, self._state, self._row_step, rows,
                        into.weights, into.state, into.row_step,
                    )  # fmt: skip
            applied = keys.shape[0] - absent - nonfinite
            if self._log is not None:
                self._log.record(keys)
            self._counters["pushes"] += 1
            self._counters["push_ids"] += keys.shape[0]
            self._counters["dropped_not_admitted"] += absent
            self._counters["rejected_nonfinite"] += nonfinite
        return PushResult(
            applied=applied, dropped_not_admitted=absent, rejected_nonfinite=nonfinite
        )

    def _apply_finite(self, rows: I64, g: F32) -> int:
        return update_rows(
            self.optimizer,
            self.config.weight_clip,
            self._weights,
            self._state,
            self._row_step,
            rows,
            g,
        )

    @property
    def state_width(self) -> int:
        """Float32 columns of optimizer state per row."""
        return self._state_width

    def peek(self, ids: npt.ArrayLike) -> RowState:
        """The rows of ``ids`` with their optimizer state, changing nothing (not even
        recency); an id without a row has ``row_step`` -1 and zeros.

        >>> t = EmbeddingTable("t", TableConfig(dim=2, optimizer={"kind": "sgd", "lr": 1.0}))
        >>> _ = t.lookup([7])
        >>> _ = t.push([7], np.ones((1, 2), np.float32))
        >>> t.peek([7, 8]).row_step.tolist()
        [1, -1]
        """
        keys = _as_ids(ids).view(np.int64)
        n = keys.shape[0]
        out = RowState(
            np.empty((n, self.dim), np.float32),
            np.empty((n, self._state_width), np.float32),
            np.empty(n, np.int64),
        )
        with self._lock:
            self._peek_locked(keys, out)
        return out

    def peek_into(self, ids: npt.ArrayLike, into: RowState) -> None:
        """:meth:`peek` into the arrays of ``into`` (one row per id)."""
        keys = _as_ids(ids).view(np.int64)
        with self._lock:
            self._peek_locked(keys, into)

    def _peek_locked(self, keys: I64, into: RowState) -> None:
        self._ensure_resident(keys)
        rows = np.empty(keys.shape[0], dtype=np.int64)
        probe(self._buckets, keys, self.clock, False, rows)
        gather_state(
            self._weights, self._state, self._row_step, rows, into.weights, into.state,
            into.row_step,
        )  # fmt: skip

    # --- serving ------------------------------------------------------------------

    def read(self, ids: npt.ArrayLike, out: F32 | None = None) -> tuple[F32, int]:
        """Rows for ``ids`` as a server reads them: changing nothing, and an id
        without a row read as the row a training lookup would create for it.

        Returns the rows and how many ids had no row (counted as ``unknown_reads``).

        >>> t = EmbeddingTable("t", TableConfig(dim=2, optimizer={"kind": "sgd", "lr": 1.0}))
        >>> rows, unknown = t.read([7])
        >>> unknown, bool((rows == t.lookup([7])).all()), len(t)
        (1, True, 1)
        """
        keys = _as_ids(ids).view(np.int64)
        n = keys.shape[0]
        if out is None:
            out = np.empty((n, self.dim), dtype=np.float32)
        if n == 0:
            # A request's few ids leave most tables of most shards with none: no lock,
            # no kernel.
            return out, 0
        rows = np.empty(n, dtype=np.int64)
        kind, a, b = self._init
        with self._lock:
            self._ensure_resident(keys)
            unknown = probe(self._buckets, keys, self.clock, False, rows)
            gather_or_init(self._weights, rows, keys, self._seed, kind, a, b, out)
            self._counters["unknown_reads"] += unknown
        return out, int(unknown)

    def changes(self, epoch: str, since: int) -> TableChanges:
        """The rows changed after version ``since`` of the log ``epoch``, as they are now.

        A follower that holds the table as of ``(epoch, since)`` applies the rows
        and removes the ``removed`` ids to hold it as of the returned version.
        When the log does not reach back there (another epoch, too far behind,
        or no log yet: one is started now), ``complete`` is False: copy the
        table with :meth:`rows_page` and follow from the returned version.

        >>> t = EmbeddingTable("t", TableConfig(dim=1, optimizer={"kind": "sgd", "lr": 1.0}))
        >>> first = t.changes("", 0)
        >>> first.complete, first.version
        (False, 0)
        >>> _ = t.lookup([3, 4]); _ = t.push([3], np.ones((1, 1), np.float32)); _ = t.remove([4])
        >>> c = t.changes(first.epoch, 0)
        >>> c.complete, c.version, c.ids.tolist(), c.removed.tolist()
        (True, 2, [3], [4])
        """
        with self._lock:
            if self._log is None:
                self._log = ChangeLog(self.config.change_log_ids)
            log = self._log
            keys = log.since(since) if epoch == log.epoch else None
            if keys is None:
                empty = np.zeros(0, dtype=np.uint64)
                return TableChanges(
                    epoch=log.epoch, version=log.version, complete=False, ids=empty,
                    weights=np.zeros((0, self.dim), np.float32), removed=empty,
                    changed_at=log.changed_at,
                )  # fmt: skip
            present, weights = self._weights_now(keys)
            return TableChanges(
                epoch=log.epoch, version=log.version, complete=True,
                ids=keys[present].view(np.uint64), weights=weights,
                removed=keys[~present].view(np.uint64), changed_at=log.changed_at,
            )  # fmt: skip

    def _weights_now(self, keys: I64) -> tuple[npt.NDArray[np.bool_], F32]:
        """Which ``keys`` have a row, and those rows' weights in order (under the lock,
        moving no row between tiers)."""
        rows = np.empty(keys.shape[0], dtype=np.int64)
        probe(self._buckets, keys, self.clock, False, rows)
        present = rows >= 0
        kept = rows[present]
        weights = np.empty((kept.shape[0], self.dim), dtype=np.float32)
        gather(self._weights, kept, weights)
        return present, weights

    def log_position(self) -> tuple[str, int] | None:
        """(epoch, version) of the change log now; None while no replica follows."""
        with self._lock:
            return None if self._log is None else (self._log.epoch, self._log.version)

    def rows_page(self, cursor: int, count: int) -> tuple[U64, F32, int]:
        """The ids and weights of the rows stored in slots ``[cursor, cursor + count)``,
        and the next cursor (``-1`` after the last slot).

        Slots never move (a growing index does not renumber them), so paging
        through them while pushes go on misses no row that existed throughout;
        a follower copies a table page by page this way and then applies the
        changes since the version it asked for first.

        >>> t = EmbeddingTable("t", TableConfig(dim=1))
        >>> _ = t.lookup([10, 11, 12])
        >>> ids, _, nxt = t.rows_page(0, 2); ids.tolist(), nxt
        ([10, 11], 2)
        >>> ids, _, nxt = t.rows_page(2, 2); ids.tolist(), nxt
        ([12], -1)
        """
        if cursor < 0 or count < 1:
            msg = f"rows_page: cursor must be >= 0 and count >= 1, got {cursor}, {count}"
            raise InvalidRequest(msg)
        with self._lock:
            end = cursor + count
            slot = self._buckets[:, ROW]
            sel = np.flatnonzero((slot >= cursor) & (slot < end))
            sel = sel[np.argsort(slot[sel], kind="stable")]
            ids = self._buckets[sel, KEY].view(np.uint64)
            weights = self._weights[self._buckets[sel, ROW]]
            nxt = end if end < int(self._alloc[2]) else -1
            return ids, weights, nxt

    # --- eviction and expiry ----------------------------------------------------

    def _delete(self, keys: I64) -> int:
        deleted, persisted = self._delete_slots(keys)
        if persisted.shape[0]:
            self._tombstones.append(persisted)
        if deleted and self._log is not None:
            self._log.record(keys)
        return deleted

    def _delete_slots(self, keys: I64) -> tuple[int, I64]:
        """Free the rows of ``keys``; returns how many, and the keys of those persisted."""
        need = int(self._alloc[1]) + keys.shape[0]
        if need > self._free.shape[0]:
            free = np.zeros(min(self._alloc_rows, max(need, 2 * self._free.shape[0])), np.int64)
            free[: self._alloc[1]] = self._free[: self._alloc[1]]
            self._free = free
        tomb = np.empty(keys.shape[0], dtype=np.int64)
        deleted, n_tomb = delete_keys(self._buckets, keys, self._alloc, self._free, tomb)
        return int(deleted), tomb[:n_tomb].copy()

    def _evict_lru(self, n: int, protect_clock: int | None = None) -> int:
        occupied = np.flatnonzero(self._buckets[:, ROW] >= 0)
        seen = self._buckets[occupied, SEEN]
        if protect_clock is not None:
            keep = seen < protect_clock
            occupied, seen = occupied[keep], seen[keep]
        # Evict a little more than asked so a full table does not rescan every call.
        n = min(occupied.shape[0], max(n, self._room // 64))
        if n <= 0:
            return 0
        victims = occupied[np.argpartition(seen, n - 1)[:n]] if n < occupied.shape[0] else occupied
        deleted = self._delete(self._buckets[victims, KEY].copy())
        self._counters["evictions"] += deleted
        return deleted

    def evict(self, n: int) -> int:
        """Evict the ``n`` least recently seen rows now (at least; see eviction slack)."""
        with self._lock:
            return self._evict_lru(n)

    def _maybe_expire(self) -> None:
        ttl = self.config.ttl_steps
        if ttl is None or self.clock < self._next_expiry:
            return
        # Scanning is O(buckets): do it every ttl/4 steps, so a row lives at most 1.25 ttl.
        self._next_expiry = self.clock + max(1, ttl // 4)
        self._expire_now(ttl)

    def _expire_now(self, ttl: int) -> int:
        occupied = np.flatnonzero(self._buckets[:, ROW] >= 0)
        stale = occupied[self._buckets[occupied, SEEN] < self.clock - ttl]
        if stale.shape[0] == 0:
            return 0
        deleted = self._delete(self._buckets[stale, KEY].copy())
        self._counters["expirations"] += deleted
        return deleted

    def expire(self) -> int:
        """Remove rows unseen for more than ``ttl_steps`` steps now; returns how many."""
        if self.config.ttl_steps is None:
            return 0
        with self._lock:
            return self._expire_now(self.config.ttl_steps)

    # --- persistence support ----------------------------------------------------

    def export(self, dirty_only: bool, *, mark_clean: bool = True) -> tuple[RowBatch, U64, int]:
        """Take rows (all, or dirty since the last export) and the ids removed since.

        Returns the rows, the tombstones and the clock, as one consistent cut of
        the table. With ``mark_clean`` (a checkpoint) the rows become clean and
        persisted and the tombstones are taken; without it nothing changes.
        """
        with self._lock:
            occupied = self._buckets[:, ROW] >= 0
            if dirty_only:
                occupied &= (self._buckets[:, META] & DIRTY) != 0
            sel = np.flatnonzero(occupied)
            meta = self._buckets[sel, META]
            batch = self._rows_at(sel)
            tombs = (
                np.concatenate(self._tombstones).view(np.uint64)
                if self._tombstones
                else np.zeros(0, dtype=np.uint64)
            )
            if mark_clean:
                self._buckets[sel, META] = (meta & ~np.int64(DIRTY)) | PERSISTED
                self._tombstones = []
            return batch, tombs, self.clock

    def _rows_at(self, sel: I64) -> RowBatch:
        """The rows of the buckets ``sel`` (under the lock)."""
        rows = self._buckets[sel, ROW]
        return RowBatch(
            ids=self._buckets[sel, KEY].view(np.uint64),
            weights=self._weights[rows],
            state=self._state[rows],
            row_step=self._row_step[rows],
            last_seen=self._buckets[sel, SEEN].copy(),
            freq=self._buckets[sel, META] // FREQ_ONE,
        )

    def mark_all_dirty(self) -> None:
        """Forget what was persisted (after a failed checkpoint, the next must be full)."""
        with self._lock:
            occupied = self._buckets[:, ROW] >= 0
            self._buckets[occupied, META] = (self._buckets[occupied, META] | DIRTY) & ~np.int64(
                PERSISTED
            )
            self._tombstones = []

    def load(self, batch: RowBatch) -> None:
        """Insert or overwrite rows (restore path); the rows count as not yet persisted."""
        if batch.weights.shape[1:] != (self.dim,) or batch.state.shape[1:] != (self._state_width,):
            msg = (
                f"table {self.name!r}: checkpoint rows have shape {batch.weights.shape[1:]} and "
                f"state {batch.state.shape[1:]}, the table expects ({self.dim},) and "
                f"({self._state_width},): was the table's dim or optimizer changed?"
            )
            raise CheckpointError(msg)
        keys = np.ascontiguousarray(batch.ids).view(np.int64)
        with self._lock:
            if len(self) + keys.shape[0] > self.config.capacity:
                # Only new ids need room; count them before failing.
                present = np.empty(keys.shape[0], dtype=np.int64)
                missing = probe(self._buckets, keys, 0, False, present)
                if len(self) + missing > self.config.capacity:
                    msg = (
                        f"table {self.name!r}: restoring {len(self) + missing} rows onto a shard "
                        f"whose capacity is {self.config.capacity}; raise the table's capacity "
                        "or restore onto more shards"
                    )
                    raise CheckpointError(msg)
            self._reserve(keys.shape[0])
            rows = np.empty(keys.shape[0], dtype=np.int64)
            upsert(
                self._buckets,
                keys,
                self._alloc,
                self._free,
                np.ascontiguousarray(batch.last_seen, dtype=np.int64),
                np.ascontiguousarray(batch.freq, dtype=np.int64),
                rows,
            )
            self._weights[rows] = batch.weights
            self._state[rows] = batch.state
            self._row_step[rows] = batch.row_step
            self._buckets[:, META] |= np.where(self._buckets[:, ROW] >= 0, DIRTY, 0)

    def load_weights(self, ids: npt.NDArray[np.uint64], weights: F32) -> None:
        """Insert or overwrite the weights of ``ids`` (a serving replica's rows: their
        optimizer state is not kept)."""
        keys = np.ascontiguousarray(ids).view(np.int64)
        n = keys.shape[0]
        with self._lock:
            present = np.empty(n, dtype=np.int64)
            missing = probe(self._buckets, keys, 0, False, present)
            if len(self) + missing > self.config.capacity:
                msg = (
                    f"table {self.name!r}: {len(self) + missing} rows on a replica whose "
                    f"capacity is {self.config.capacity}"
                )
                raise CheckpointError(msg)
            self._reserve(missing)
            rows = np.empty(n, dtype=np.int64)
            zeros = np.zeros(n, dtype=np.int64)
            upsert(self._buckets, keys, self._alloc, self._free, zeros, zeros, rows)
            self._weights[rows] = weights

    def remove(self, ids: npt.ArrayLike) -> int:
        """Delete the rows of ``ids`` (restore applies tombstones with this)."""
        keys = _as_ids(ids).view(np.int64)
        with self._lock:
            return self._delete(keys)

    def ids(self) -> U64:
        """The ids that have a row now (in bucket order)."""
        with self._lock:
            occupied = self._buckets[:, ROW] >= 0
            ids: U64 = self._buckets[occupied, KEY].view(np.uint64)
            return ids

    def set_clock(self, clock: int) -> None:
        """Move the clock forward to ``clock`` (restore path)."""
        with self._lock:
            self.clock = max(self.clock, int(clock))

    def stats(self) -> TableStats:
        """A consistent snapshot of this table's counters."""
        with self._lock:
            return TableStats(
                name=self.name,
                dim=self.dim,
                rows=len(self),
                capacity=self.config.capacity,
                memory_bytes=self.memory_bytes,
                clock=self.clock,
                memory_rows=int(self._alloc[0]),
                **self._disk_stats(),
                **self._counters,
            )

    def _disk_stats(self) -> dict[str, int]:
        """``disk_rows`` and ``disk_bytes`` of :class:`TableStats` (a tiered table's)."""
        return {"disk_rows": 0, "disk_bytes": 0}


def apply_changes(
    table: EmbeddingTable,
    ids: npt.NDArray[np.uint64],
    weights: F32,
    removed: npt.NDArray[np.uint64],
) -> None:
    """Apply a follower's received changes to a replica's ``table``: removals, then rows.

    >>> src = EmbeddingTable("t", TableConfig(dim=1, optimizer={"kind": "sgd", "lr": 1.0}))
    >>> copy = EmbeddingTable("t", src.config)
    >>> _ = src.changes("", 0); epoch = src.changes("", 0).epoch
    >>> _ = src.lookup([1, 2]); _ = src.push([1, 2], np.ones((2, 1), np.float32))
    >>> c = src.changes(epoch, 0)
    >>> apply_changes(copy, c.ids, c.weights, c.removed)
    >>> bool((copy.read([1, 2])[0] == src.read([1, 2])[0]).all())
    True
    """
    if removed.shape[0]:
        table.remove(removed)
    if ids.shape[0]:
        table.load_weights(ids, weights)
