"""Rows by (table, id) in open-addressing hash tables: what a rank's pushes left, and
the ids of a push in flight.

Tables that the store updates with the same arithmetic (the same width, optimizer,
clip and gradient dtype: a Criteo-like job's 26 tables are one such group) share one
cache of rows, each key a table's number in the group and an id. The trainer then
brings a whole batch up to date in a handful of numba and numpy calls per group
instead of per table: on the hot-id stream's 26 tables, per-table calls cost about
half a millisecond each per step, a fifth of the step.

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
from embedding_store.types import RowState

I32 = npt.NDArray[np.int32]
I64 = npt.NDArray[np.int64]
U64 = npt.NDArray[np.uint64]
F32 = npt.NDArray[np.float32]
F64 = npt.NDArray[np.float64]
# The pushes per row whose numbers are kept (a lookup that missed more counts as this many).
RECENT_PUSHES = 8
_MAX_LOAD = 0.5
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


@nb.njit(nogil=True, cache=True, inline="always")
def _newer(step_a: np.int64, seen_a: I64, step_b: np.int64, seen_b: I64) -> bool:
    """Whether state a (its row's update count, what its reply had seen) is at least as
    new as state b of the same row: one shard's answers are ordered by both."""
    if step_a != step_b:
        return bool(step_a > step_b)
    return bool(seen_a.sum() >= seen_b.sum())


@nb.njit(nogil=True, cache=True)
def _put(
    gen: tuple[U64, I32, npt.NDArray[np.bool_], I64, F32, F32, I64, I64, F64],
    old: tuple[U64, I32, npt.NDArray[np.bool_], I64, F32, F32, I64, I64, F64],
    tab: I32,
    ids: U64,
    w: F32,
    st: F32,
    steps: I64,
    seen: I64,
    acked: float,
    push: int,
) -> int:
    """Each row into its key's slot of ``gen`` (made where missing) unless a newer state
    of it is held (in ``gen`` or ``old``); ``push`` > 0: this rank's push number, kept as
    the slot's newest (the oldest number drops off). Returns how many slots were made.
    """
    keys, tabs, used, recent, weights, state, row_step, seen_at, acked_at = gen
    mask = keys.shape[0] - 1
    k = recent.shape[1]
    made = 0
    for i in range(ids.shape[0]):
        o = _slot_of(old[0], old[1], old[2], ids[i], tab[i], old[0].shape[0] - 1)
        if old[2][o] and not _newer(steps[i], seen[i], old[6][o], old[7][o]):
            continue  # another rank's answer came after a newer one
        b = _slot_of(keys, tabs, used, ids[i], tab[i], mask)
        if not used[b]:
            used[b] = True
            keys[b] = ids[i]
            tabs[b] = tab[i]
            recent[b] = 0  # a reused slot's numbers were another key's
            made += 1
        elif not _newer(steps[i], seen[i], row_step[b], seen_at[b]):
            continue
        weights[b] = w[i]
        state[b] = st[i]
        row_step[b] = steps[i]
        seen_at[b] = seen[i]
        acked_at[b] = acked
        if push <= 0 or recent[b, 0] == push:
            continue  # another rank's, or the same push answered twice (a retry)
        for j in range(k - 1, 0, -1):
            recent[b, j] = recent[b, j - 1]
        recent[b, 0] = push
    return made


@nb.njit(nogil=True, cache=True, inline="always")
def _probe_one(
    keys: U64, tabs: I32, used: npt.NDArray[np.bool_], recent: I64, t: np.int32,
    key: np.uint64, applied_before: int,
) -> tuple[np.int64, int]:  # fmt: skip
    """The slot of key ``(t, key)`` (-1: none) and how many of its pushes came after
    ``applied_before``."""
    b = _slot_of(keys, tabs, used, key, t, keys.shape[0] - 1)
    if not used[b]:
        return np.int64(-1), 0
    after = 0
    for j in range(recent.shape[1]):
        if recent[b, j] > applied_before:
            after += 1
    return b, after


@nb.njit(nogil=True, cache=True)
def _read(
    new: tuple[U64, I32, npt.NDArray[np.bool_], I64, F32, F32, I64, I64, F64],
    old: tuple[U64, I32, npt.NDArray[np.bool_], I64, F32, F32, I64, I64, F64],
    tab: I32,
    ids: U64,
    applied_before: int,
    answered_after: float,
    wanted: npt.NDArray[np.bool_],
    missed: I32,
    at: I64,
    known: npt.NDArray[np.bool_],
    out_w: F32,
    out_s: F32,
    out_step: I64,
    out_seen: I64,
) -> int:
    """:meth:`PushedRowCache.read` in one pass over the keys and both generations
    (``new`` read first); returns how many keys' rows were written to the outputs."""
    n = 0
    for i in range(ids.shape[0]):
        b_new, m_new = _probe_one(new[0], new[1], new[2], new[3], tab[i], ids[i], applied_before)
        b_old, m_old = _probe_one(old[0], old[1], old[2], old[3], tab[i], ids[i], applied_before)
        missed[i] = m_new + m_old
        src = new if b_new >= 0 else old
        b = b_new if b_new >= 0 else b_old
        late = b >= 0 and src[8][b] > answered_after
        if missed[i] == 0 and not late and not wanted[i]:
            continue
        at[n] = i
        known[n] = b >= 0
        if b >= 0:
            for j in range(out_w.shape[1]):
                out_w[n, j] = src[4][b, j]
            for j in range(out_s.shape[1]):
                out_s[n, j] = src[5][b, j]
            out_step[n] = src[6][b]
            out_seen[n] = src[7][b]
        else:
            out_w[n] = 0.0
            out_s[n] = 0.0
            out_step[n] = 0
            out_seen[n] = 0
        n += 1
    return n


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
        self.keys = np.zeros(capacity, np.uint64)
        self.tabs = np.zeros(capacity, np.int32)
        self.used = np.zeros(capacity, np.bool_)
        self.weights = np.zeros((capacity, dim), np.float32)
        self.state = np.zeros((capacity, width), np.float32)
        self.row_step = np.zeros(capacity, np.int64)
        # Per rank, the newest of its pushes the row includes; when its push was answered.
        self.seen = np.zeros((capacity, ranks), np.int64)
        self.acked = np.zeros(capacity, np.float64)
        # This rank's last pushes that changed the row (their numbers).
        self.recent = np.zeros((capacity, RECENT_PUSHES), np.int64)
        self.size = 0

    @property
    def capacity(self) -> int:
        return int(self.keys.shape[0])

    def clear(self) -> None:
        self.used[:] = False
        self.size = 0

    def arrays(self) -> tuple[U64, I32, npt.NDArray[np.bool_], I64, F32, F32, I64, I64, F64]:
        """What the kernels read of the generation."""
        return (
            self.keys, self.tabs, self.used, self.recent,
            self.weights, self.state, self.row_step, self.seen, self.acked,
        )  # fmt: skip

    def grown(self, capacity: int) -> _Generation:
        """A copy with ``capacity`` slots."""
        bigger = _Generation(
            self.weights.shape[1], self.state.shape[1], capacity, self.seen.shape[1]
        )
        keep = np.flatnonzero(self.used)
        slots = np.empty(keep.shape[0], np.int64)
        bigger.size = _insert(
            bigger.keys, bigger.tabs, bigger.used, self.tabs[keep], self.keys[keep], slots
        )
        bigger.weights[slots] = self.weights[keep]
        bigger.state[slots] = self.state[keep]
        bigger.row_step[slots] = self.row_step[keep]
        bigger.seen[slots] = self.seen[keep]
        bigger.acked[slots] = self.acked[keep]
        bigger.recent[slots] = self.recent[keep]
        return bigger


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
            found = _read(
                self.current.arrays(), old.arrays(), tab, ids, applied_before,
                float(answered_after), wanted, missed, at, out.known, out.rows.weights,
                out.rows.state, out.rows.row_step, out.seen,
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
        rank's pushes; answered at unix time ``acked``) as their keys' newest, where no
        newer state of a key is held. ``push``: this rank's number of that push (0:
        another rank's).
        """
        n = ids.shape[0]
        with self.lock:
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
            old = self.previous if self.previous is not None else self._empty
            self.current.size += _put(
                self.current.arrays(), old.arrays(), tab, ids,
                np.ascontiguousarray(rows.weights, np.float32),
                np.ascontiguousarray(rows.state, np.float32),
                np.ascontiguousarray(rows.row_step, np.int64),
                np.ascontiguousarray(seen, np.int64), acked, push,
            )  # fmt: skip
