"""Rows by (table, id) in open-addressing hash tables: what a rank's pushes left, and
the ids of a push in flight.

Tables that the store updates with the same arithmetic (the same width, optimizer,
clip and gradient dtype: a Criteo-like job's 26 tables are one such group) share one
cache of rows, each key a table's number in the group and an id. The trainer then
brings a whole batch up to date in a handful of numba and numpy calls per group
instead of per table, whose fixed cost added up to a large share of a step
(``benchmarks/e2e.py`` measures fresh rows against none).

:class:`RowIndex` finds keys; :class:`PushedRowCache` keeps with each key the newest
row an answered push left in the store (this rank's or, in a job of several ranks,
another's, told at the step's collective), its optimizer state, which pushes of
each rank that row includes, and the numbers of this rank's last pushes that
changed it. Answers can come out of order (another rank's is told a step later):
a row's older state never replaces a newer one. It holds two generations: rows
go into the current one, and when that is full the previous one is dropped whole
and reused (no rehash, no sort: a batch of 4,096 samples over 26 large
vocabularies pushes ~40k rows a step, and evicting the oldest rows one by one
cost more than the step). A read probes every key but copies out only the rows
the caller needs.

>>> import numpy as np
>>> from embedding_store.types import RowState
>>> cache = PushedRowCache(dim=2, width=1)
>>> tab, ids = np.array([0, 1], np.int32), np.array([5, 5], np.uint64)
>>> cache.put(tab, ids, RowState(np.ones((2, 2), np.float32), np.zeros((2, 1), np.float32),
...                              np.array([1, 1])), np.array([[3], [3]]), push=3)
>>> missed, seen = cache.read(np.array([1, 0], np.int32), np.array([5, 4], np.uint64),
...                           applied_before=2, wanted=np.array([True, True]))
>>> missed.tolist(), seen.at.tolist(), seen.known.tolist(), seen.seen.tolist()
([1, 0], [0, 1], [True, False], [[3], [0]])
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numba as nb
import numpy as np
import numpy.typing as npt

from embedding_store.hashing import mix64
from embedding_store.kernels.intrinsics import AHEAD, prefetch
from embedding_store.types import RowState

I32 = npt.NDArray[np.int32]
I64 = npt.NDArray[np.int64]
U64 = npt.NDArray[np.uint64]
F32 = npt.NDArray[np.float32]
# The pushes per row whose numbers are kept (a lookup that missed more counts as this many).
RECENT_PUSHES = 8
_MAX_LOAD = 0.5
# Rows a put keeps per hold of the cache's lock.
_PUT_PART = 8192
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


@nb.njit(nogil=True, cache=True, inline="always")
def _home(key: np.uint64, tab: np.int32, mask: int) -> np.int64:
    return np.int64(mix64(key + np.uint64(tab) * _GOLDEN) & np.uint64(mask))


@nb.njit(nogil=True, cache=True, inline="always")
def _slot_of(
    keys: U64, tabs: I32, used: npt.NDArray[np.bool_], key: np.uint64, t: np.int32, mask: int
) -> np.int64:
    """The slot of key ``(t, key)``, or the empty slot where it would go."""
    b = _home(key, t, mask)
    while used[b] and not (keys[b] == key and tabs[b] == t):
        b = (b + 1) & mask
    return b


@nb.njit(nogil=True, cache=True)
def _find(keys: U64, tabs: I32, used: npt.NDArray[np.bool_], tab: I32, ids: U64, out: I64) -> None:
    mask = keys.shape[0] - 1
    for i in range(ids.shape[0]):
        b = _slot_of(keys, tabs, used, ids[i], tab[i], mask)
        out[i] = b if used[b] else -1


@nb.njit(nogil=True, cache=True)
def _insert(keys: U64, tabs: I32, used: npt.NDArray[np.bool_], tab: I32, ids: U64, out: I64) -> int:
    """The slot of each key, made where missing; returns how many were made."""
    mask = keys.shape[0] - 1
    made = 0
    for i in range(ids.shape[0]):
        b = _slot_of(keys, tabs, used, ids[i], tab[i], mask)
        if not used[b]:
            used[b] = True
            keys[b] = ids[i]
            tabs[b] = tab[i]
            made += 1
        out[i] = b
    return made


# A generation's slots: [key (the id's bits), table number + 1 (0: empty), this rank's
# newest push to the row (0: none), when the row's answer came (unix µs), the row's
# update count, then per rank the newest push the row includes] in one row of int64,
# and the row's weights and optimizer state back to back in one row of float32: a
# probe reads one cache line, a copy two or three.
_KEY, _TAB, _LAST, _ACKED, _STEP, _SEEN = 0, 1, 2, 3, 4, 5


@nb.njit(nogil=True, cache=True, inline="always")
def _gslot(meta: I64, key: np.int64, t: np.int32, mask: int) -> np.int64:
    """The slot of key ``(t, key)`` in a generation, or the empty slot where it would go."""
    return _gslot_from(meta, key, t, mask, _home(np.uint64(key), t, mask))


@nb.njit(nogil=True, cache=True, inline="always")
def _gslot_from(meta: I64, key: np.int64, t: np.int32, mask: int, b: np.int64) -> np.int64:
    """:func:`_gslot` from the key's home slot ``b``."""
    while meta[b, _TAB] != 0 and not (meta[b, _KEY] == key and meta[b, _TAB] == t + 1):
        b = (b + 1) & mask
    return b


@nb.njit(nogil=True, cache=True)
def _homes(tab: I32, ids: I64, mask: int) -> I64:
    """Each key's home slot: hashed in a pass of its own, so that the probes that
    follow can ask for the slot ``AHEAD`` keys on (a probe loop's data-dependent
    branches otherwise keep one cache miss in flight at a time)."""
    out = np.empty(ids.shape[0], np.int64)
    for i in range(ids.shape[0]):
        out[i] = _home(np.uint64(ids[i]), tab[i], mask)
    return out


@nb.njit(nogil=True, cache=True, inline="always")
def _newer(step: np.int64, seen: I64, meta: I64, b: np.int64) -> bool:
    """Whether a state (its row's update count, what its reply had seen) is at least as
    new as the one in slot ``b``: one shard's answers are ordered by both."""
    if step != meta[b, _STEP]:
        return bool(step > meta[b, _STEP])
    held = 0
    for j in range(seen.shape[0]):
        held += meta[b, _SEEN + j]
    return bool(seen.sum() >= held)


@nb.njit(nogil=True, cache=True)
def _put(
    meta: I64,
    payload: F32,
    recent: I64,
    meta_o: I64,
    tab: I32,
    ids: I64,
    w: F32,
    st: F32,
    steps: I64,
    seen: I64,
    acked_us: int,
    push: int,
    check_old: bool,
) -> int:
    """Each row into its key's slot (made where missing) unless a newer state of it is
    held (in this generation, or with ``check_old`` in the previous one, ``meta_o``);
    ``push`` > 0: this rank's push number, kept as the slot's newest (the oldest number
    drops off). Returns how many slots were made.
    """
    mask = meta.shape[0] - 1
    mask_o = meta_o.shape[0] - 1
    dim = w.shape[1]
    k = recent.shape[1]
    made = 0
    n = ids.shape[0]
    homes = _homes(tab, ids, mask)
    for i in range(n):
        if i + AHEAD < n:
            ahead = homes[i + AHEAD]
            prefetch(meta, ahead)
            prefetch(payload, ahead)
            prefetch(recent, ahead)
        row_seen = seen[i if seen.shape[0] > 1 else 0]
        if check_old:
            o = _gslot(meta_o, ids[i], tab[i], mask_o)
            if meta_o[o, _TAB] != 0 and not _newer(steps[i], row_seen, meta_o, o):
                continue  # another rank's answer came after a newer one
        b = _gslot_from(meta, ids[i], tab[i], mask, homes[i])
        if meta[b, _TAB] == 0:
            meta[b, _KEY] = ids[i]
            meta[b, _TAB] = tab[i] + 1
            meta[b, _LAST] = 0
            made += 1
        elif not _newer(steps[i], row_seen, meta, b):
            continue
        for j in range(dim):
            payload[b, j] = w[i, j]
        for j in range(st.shape[1]):
            payload[b, dim + j] = st[i, j]
        meta[b, _ACKED] = acked_us
        meta[b, _STEP] = steps[i]
        for j in range(seen.shape[1]):
            meta[b, _SEEN + j] = row_seen[j]
        if push <= 0:
            continue  # another rank's push
        if meta[b, _LAST] == 0:
            recent[b] = 0  # a new or reused slot's numbers were another key's
        elif recent[b, 0] == push:
            continue  # the same push answered twice (a retry)
        for j in range(k - 1, 0, -1):
            recent[b, j] = recent[b, j - 1]
        recent[b, 0] = push
        meta[b, _LAST] = push
    return made


@nb.njit(nogil=True, cache=True, inline="always")
def _after(recent: I64, b: np.int64, applied_before: int) -> int:
    """How many of slot ``b``'s pushes came after push ``applied_before``."""
    after = 0
    for j in range(recent.shape[1]):
        if recent[b, j] > applied_before:
            after += 1
    return after


@nb.njit(nogil=True, cache=True)
def _read(
    meta_n: I64,
    payload_n: F32,
    recent_n: I64,
    meta_o: I64,
    payload_o: F32,
    recent_o: I64,
    tab: I32,
    ids: I64,
    applied_before: int,
    answered_after_us: int,
    wanted: npt.NDArray[np.bool_],
    missed: I32,
    at: I64,
    known: npt.NDArray[np.bool_],
    out_w: F32,
    out_s: F32,
    out_step: I64,
    out_seen: I64,
) -> int:
    """:meth:`PushedRowCache.read` in three passes over the keys: hash, probe (the
    previous generation, ``_o``, is probed only for keys the current one, ``_n``,
    lacks or that a push after the lookup changed), then copy the rows wanted, each
    pass asking for the lines ``AHEAD`` keys on; returns how many keys' rows were
    written to the outputs."""
    mask_n = meta_n.shape[0] - 1
    mask_o = meta_o.shape[0] - 1
    keys = ids.shape[0]
    homes = _homes(tab, ids, mask_n)
    homes_o = _homes(tab, ids, mask_o)
    # Per row to copy, its slot: in the current generation (>= 0), the previous one
    # (-2 - slot) or none (-1).
    slot = homes  # each home is read before its place is written
    n = 0
    for i in range(keys):
        if i + AHEAD < keys:
            prefetch(meta_n, homes[i + AHEAD])
            prefetch(meta_o, homes_o[i + AHEAD])
        b = _gslot_from(meta_n, ids[i], tab[i], mask_n, homes[i])
        in_new = meta_n[b, _TAB] != 0
        m = 0
        late = False
        if in_new:
            if meta_n[b, _LAST] > applied_before:
                m = _after(recent_n, b, applied_before)
                o = _gslot_from(meta_o, ids[i], tab[i], mask_o, homes_o[i])
                if meta_o[o, _TAB] != 0 and meta_o[o, _LAST] > applied_before:
                    m += _after(recent_o, o, applied_before)
            late = meta_n[b, _ACKED] > answered_after_us
        else:
            b = _gslot_from(meta_o, ids[i], tab[i], mask_o, homes_o[i])
            if meta_o[b, _TAB] == 0:
                b = np.int64(-1)
            else:
                if meta_o[b, _LAST] > applied_before:
                    m = _after(recent_o, b, applied_before)
                late = meta_o[b, _ACKED] > answered_after_us
                b = -2 - b
        missed[i] = m
        if m == 0 and not late and not wanted[i]:
            continue
        at[n] = i
        slot[n] = b
        n += 1
    for r in range(n):
        if r + AHEAD < n:
            ahead = slot[r + AHEAD]
            if ahead >= 0:
                prefetch(payload_n, ahead)
            elif ahead < -1:
                prefetch(payload_o, -2 - ahead)
        b = slot[r]
        known[r] = b != -1
        if b == -1:
            out_w[r] = 0.0
            out_s[r] = 0.0
            out_step[r] = 0
            out_seen[r] = 0
        elif b >= 0:
            _copy_row(meta_n, payload_n, b, out_w, out_s, out_step, out_seen, r)
        else:
            _copy_row(meta_o, payload_o, -2 - b, out_w, out_s, out_step, out_seen, r)
    return n


@nb.njit(nogil=True, cache=True, inline="always")
def _copy_row(
    meta: I64, payload: F32, b: np.int64,
    out_w: F32, out_s: F32, out_step: I64, out_seen: I64, n: int,
) -> None:  # fmt: skip
    dim = out_w.shape[1]
    for j in range(dim):
        out_w[n, j] = payload[b, j]
    for j in range(out_s.shape[1]):
        out_s[n, j] = payload[b, dim + j]
    out_step[n] = meta[b, _STEP]
    for j in range(out_seen.shape[1]):
        out_seen[n, j] = meta[b, _SEEN + j]


class RowIndex:
    """A set of (table number, id) keys, each found at a slot.

    >>> index = RowIndex(np.array([0, 0, 1], np.int32), np.array([7, 8, 7], np.uint64))
    >>> index.rows_of(np.array([1, 1, 0], np.int32), np.array([7, 8, 8], np.uint64)).tolist()
    [2, -1, 1]
    """

    def __init__(self, tab: I32, ids: U64, capacity: int = 0) -> None:
        """Index the keys ``(tab[i], ids[i])`` as rows ``i`` (the last of a repeated key wins)."""
        capacity = max(capacity, _capacity_for(tab.shape[0], smallest=16))
        self.keys = np.zeros(capacity, np.uint64)
        self.tabs = np.zeros(capacity, np.int32)
        self.used = np.zeros(capacity, np.bool_)
        self.row_at = np.full(capacity, -1, np.int64)
        self.size = 0  # keys held
        slots = self.insert(tab, ids)
        self.row_at[slots] = np.arange(tab.shape[0], dtype=np.int64)

    def insert(self, tab: I32, ids: U64) -> I64:
        """The slot of each key, made where missing (the caller keeps the load under half)."""
        out = np.empty(ids.shape[0], np.int64)
        self.size += _insert(self.keys, self.tabs, self.used, tab, ids, out)
        return out

    def find(self, tab: I32, ids: U64) -> I64:
        """The slot of each key, -1 where it has none."""
        out = np.empty(ids.shape[0], np.int64)
        _find(self.keys, self.tabs, self.used, tab, ids, out)
        return out

    def rows_of(self, tab: I32, ids: U64) -> I64:
        """The row each key was indexed as, -1 where it was not."""
        slots = self.find(tab, ids)
        rows: I64 = np.where(slots >= 0, self.row_at[slots], -1)
        return rows


@dataclass(frozen=True)
class Remembered:
    """What :meth:`PushedRowCache.read` knows of the keys at positions ``at``."""

    at: I64  # the keys' positions among those read
    known: npt.NDArray[np.bool_]  # the cache has a row
    rows: RowState  # the row as the newest answered push left it (zeros where not known)
    seen: I64  # [n, ranks]: per rank, the newest of its pushes that row includes (0: none)

    def first(self, n: int) -> Remembered:
        """The first ``n`` keys' part."""
        rows = self.rows
        return Remembered(
            self.at[:n],
            self.known[:n],
            RowState(rows.weights[:n], rows.state[:n], rows.row_step[:n]),
            self.seen[:n],
        )

    @classmethod
    def nothing(cls, at: I64, dim: int, width: int, ranks: int = 1) -> Remembered:
        """The keys at ``at``, of which nothing is known."""
        n = at.shape[0]
        return cls(
            at,
            np.zeros(n, np.bool_),
            RowState(
                np.zeros((n, dim), np.float32),
                np.zeros((n, width), np.float32),
                np.zeros(n, np.int64),
            ),
            np.zeros((n, ranks), np.int64),
        )


class _Generation:
    """One hash table of rows, their payload by slot."""

    def __init__(self, dim: int, width: int, capacity: int, ranks: int) -> None:
        self.meta = np.zeros((capacity, _SEEN + ranks), np.int64)  # see _KEY ... _SEEN
        self.payload = np.zeros((capacity, dim + width), np.float32)  # weights, then state
        # This rank's last pushes that changed the row (their numbers).
        self.recent = np.zeros((capacity, RECENT_PUSHES), np.int64)
        self.size = 0

    @property
    def capacity(self) -> int:
        return int(self.meta.shape[0])

    def clear(self) -> None:
        self.meta[:, _TAB] = 0
        self.size = 0

    def grown(self, capacity: int) -> _Generation:
        """A copy with ``capacity`` slots."""
        ranks = self.meta.shape[1] - _SEEN
        bigger = _Generation(0, self.payload.shape[1], capacity, ranks)
        keep = np.flatnonzero(self.meta[:, _TAB])
        slots = _slots_made(bigger.meta, self.meta[keep])
        bigger.size = keep.shape[0]
        bigger.meta[slots] = self.meta[keep]
        bigger.payload[slots] = self.payload[keep]
        bigger.recent[slots] = self.recent[keep]
        return bigger


@nb.njit(nogil=True, cache=True)
def _slots_made(meta: I64, rows: I64) -> I64:
    """Where each of ``rows`` (distinct keys' meta) goes in the empty table ``meta``."""
    mask = meta.shape[0] - 1
    out = np.empty(rows.shape[0], np.int64)
    for i in range(rows.shape[0]):
        b = _gslot(meta, rows[i, _KEY], np.int32(rows[i, _TAB] - 1), mask)
        meta[b, _KEY] = rows[i, _KEY]
        meta[b, _TAB] = rows[i, _TAB]
        out[i] = b
    return out


def _keys(ids: U64) -> I64:
    """Ids as the generations hold them (their bits as int64)."""
    return np.ascontiguousarray(ids, np.uint64).view(np.int64)


def _micros(t: float) -> int:
    """Unix seconds as whole microseconds (a far future for inf)."""
    return int(t * 1e6) if np.isfinite(t) else np.iinfo(np.int64).max


def _capacity_for(rows: int, smallest: int = 1024) -> int:
    """The power of two of slots that holds ``rows`` keys under the load bound."""
    capacity = smallest
    while rows > _MAX_LOAD * capacity:
        capacity *= 2
    return capacity


class PushedRowCache:
    """Rows as the newest answered pushes left them, by (table number, id) (see the
    module docstring).

    ``ranks``: the job's trainer ranks, whose pushes' answers all come here.
    ``max_rows`` bounds it: each generation holds about half; when the current one
    is full, the previous one (rows pushed longest ago, which the lookups since
    have seen) is dropped.
    """

    def __init__(self, dim: int, width: int, *, max_rows: int = 1 << 19, ranks: int = 1) -> None:
        self.dim, self.width, self.ranks = dim, width, ranks
        self.generation_rows = max(max_rows // 2, 1)
        # Held by ``put`` and ``read``.
        self.lock = threading.Lock()
        self.current = _Generation(dim, width, 1024, ranks)
        self.previous: _Generation | None = None
        self._empty = _Generation(dim, width, 1, ranks)  # read where there is no previous one

    def __len__(self) -> int:
        """Rows held (a row in both generations counts twice)."""
        return self.current.size + (self.previous.size if self.previous is not None else 0)

    def read(
        self,
        tab: I32,
        ids: U64,
        applied_before: int,
        wanted: npt.NDArray[np.bool_],
        answered_after: float = np.inf,
    ) -> tuple[I32, Remembered]:
        """Per key, how many of this rank's pushes to it came after its push number
        ``applied_before`` (those a lookup made when that push had landed missed); and
        what the cache holds of the keys that missed one, are ``wanted`` or hold a row
        answered after ``answered_after`` (unix s: another rank's push).
        """
        n = ids.shape[0]
        missed = np.empty(n, np.int32)
        at = np.empty(n, np.int64)
        out = Remembered(
            at,
            np.empty(n, np.bool_),
            RowState(
                np.empty((n, self.dim), np.float32),
                np.empty((n, self.width), np.float32),
                np.empty(n, np.int64),
            ),
            np.empty((n, self.ranks), np.int64),
        )
        with self.lock:
            old = self.previous if self.previous is not None else self._empty
            new = self.current
            found = _read(
                new.meta, new.payload, new.recent, old.meta, old.payload, old.recent, tab,
                _keys(ids), applied_before, _micros(answered_after), wanted, missed, at,
                out.known, out.rows.weights, out.rows.state, out.rows.row_step, out.seen,
            )  # fmt: skip
        return missed, out.first(found)

    def put(
        self,
        tab: I32,
        ids: U64,
        rows: RowState,
        seen: I64,
        *,
        acked: float = 0.0,
        push: int = 0,
    ) -> None:
        """Keep ``rows`` (what a push left, each having ``seen`` [n, ranks] of every
        rank's pushes, or [1, ranks] for all of them; answered at unix time ``acked``)
        as their keys' newest, where no newer state of a key is held. ``push``: this
        rank's number of that push (0: another rank's).
        """
        n = ids.shape[0]
        keys = _keys(ids)
        weights = np.ascontiguousarray(rows.weights, np.float32)
        state = np.ascontiguousarray(rows.state, np.float32)
        steps = np.ascontiguousarray(rows.row_step, np.int64)
        seen = np.ascontiguousarray(seen, np.int64)
        acked_us = _micros(acked)
        # In parts, letting the lock go between them: a read of the trainer's waits
        # for one part, not a whole push. Each row is kept whole with what it includes,
        # so a read between two parts sees each row before or after, both consistent.
        for a in range(0, n, _PUT_PART):
            b = min(a + _PUT_PART, n)
            with self.lock:
                self._make_room(b - a)
                old = self.previous if self.previous is not None else self._empty
                self.current.size += _put(
                    self.current.meta, self.current.payload, self.current.recent, old.meta,
                    tab[a:b], keys[a:b], weights[a:b], state[a:b], steps[a:b],
                    seen[a:b] if seen.shape[0] > 1 else seen, acked_us, push,
                    # One rank's answers come in order: only another rank's can be older.
                    self.ranks > 1 and self.previous is not None,
                )  # fmt: skip

    def _make_room(self, n: int) -> None:
        """Make the current generation able to take ``n`` more rows: grow it, or start
        a new one and drop the previous (the caller holds the lock)."""
        current = self.current
        if current.size and current.size + n > self.generation_rows:
            recycled, self.previous = self.previous, current
            need = _capacity_for(max(n, min(current.size, self.generation_rows)))
            if recycled is not None and recycled.capacity >= need:
                recycled.clear()
                self.current = recycled
            else:
                self.current = _Generation(self.dim, self.width, need, self.ranks)
        elif current.size + n > _MAX_LOAD * current.capacity:
            self.current = current.grown(_capacity_for(current.size + n))
