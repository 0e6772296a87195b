"""Rows by (table, id) in open-addressing hash tables: what a rank's pushes left, and
the ids of a push in flight.

Tables that the store updates with the same arithmetic (the same width, optimizer,
clip and gradient dtype: a Criteo-like job's 26 tables are one such group) share one
cache of rows, each key a table's number in the group and an id. The trainer then
brings a whole batch up to date in a handful of numba and numpy calls per group
instead of per table: on the hot-id stream's 26 tables, per-table calls cost about
half a millisecond each per step, a fifth of the step.

:class:`RowIndex` finds keys; :class:`PushedRowCache` keeps with each key the newest
row a push of this rank left in the store, its optimizer state and the numbers of
the last pushes that changed it. It holds two generations: rows go into the
current one, and when that is full the previous one is dropped whole and reused
(no rehash, no sort: a batch of 4,096 samples over 26 large vocabularies pushes
~40k rows a step, and evicting the oldest rows one by one cost more than the
step). A read probes every key but copies out only the rows the caller needs.

>>> import numpy as np
>>> from embedding_store.types import RowState
>>> cache = PushedRowCache(dim=2, width=1)
>>> tab, ids = np.array([0, 1], np.int32), np.array([5, 5], np.uint64)
>>> cache.put(tab, ids, RowState(np.ones((2, 2), np.float32), np.zeros((2, 1), np.float32),
...                              np.array([1, 1])), seq=3)
>>> missed, seen = cache.read(np.array([1, 0], np.int32), np.array([5, 4], np.uint64),
...                           applied_before=2, wanted=np.array([True, True]))
>>> missed.tolist(), seen.at.tolist(), seen.known.tolist(), seen.seq.tolist()
([1, 0], [0, 1], [True, False], [3, 0])
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


@nb.njit(nogil=True, cache=True)
def _put(
    keys: U64,
    tabs: I32,
    used: npt.NDArray[np.bool_],
    weights: F32,
    state: F32,
    row_step: I64,
    seq: I64,
    recent: I64,
    tab: I32,
    ids: U64,
    w: F32,
    st: F32,
    steps: I64,
    push: int,
) -> int:
    """Each row into its key's slot (made where missing), with ``push`` as the slot's
    newest push (the oldest number drops off); returns how many slots were made.
    """
    mask = keys.shape[0] - 1
    k = recent.shape[1]
    made = 0
    for i in range(ids.shape[0]):
        b = _slot_of(keys, tabs, used, ids[i], tab[i], mask)
        if not used[b]:
            used[b] = True
            keys[b] = ids[i]
            tabs[b] = tab[i]
            recent[b] = 0  # a reused slot's numbers were another key's
            made += 1
        weights[b] = w[i]
        state[b] = st[i]
        row_step[b] = steps[i]
        if recent[b, 0] == push:
            continue  # the same push answered twice (a retried request)
        for j in range(k - 1, 0, -1):
            recent[b, j] = recent[b, j - 1]
        recent[b, 0] = push
        seq[b] = push
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
    new: tuple[U64, I32, npt.NDArray[np.bool_], I64, F32, F32, I64, I64],
    old: tuple[U64, I32, npt.NDArray[np.bool_], I64, F32, F32, I64, I64],
    tab: I32,
    ids: U64,
    applied_before: int,
    wanted: npt.NDArray[np.bool_],
    missed: I32,
    at: I64,
    known: npt.NDArray[np.bool_],
    out_w: F32,
    out_s: F32,
    out_step: I64,
    out_seq: I64,
) -> int:
    """:meth:`PushedRowCache.read` in one pass over the keys and both generations
    (``new`` read first); returns how many keys' rows were written to the outputs."""
    n = 0
    for i in range(ids.shape[0]):
        b_new, m_new = _probe_one(new[0], new[1], new[2], new[3], tab[i], ids[i], applied_before)
        b_old, m_old = _probe_one(old[0], old[1], old[2], old[3], tab[i], ids[i], applied_before)
        missed[i] = m_new + m_old
        if missed[i] == 0 and not wanted[i]:
            continue
        at[n] = i
        known[n] = b_new >= 0 or b_old >= 0
        if b_new >= 0:
            _copy_row(new[4], new[5], new[6], new[7], b_new, out_w, out_s, out_step, out_seq, n)
        elif b_old >= 0:
            _copy_row(old[4], old[5], old[6], old[7], b_old, out_w, out_s, out_step, out_seq, n)
        else:
            out_w[n] = 0.0
            out_s[n] = 0.0
            out_step[n] = 0
            out_seq[n] = 0
        n += 1
    return n


@nb.njit(nogil=True, cache=True, inline="always")
def _copy_row(
    w: F32, s: F32, step: I64, seq: I64, b: np.int64,
    out_w: F32, out_s: F32, out_step: I64, out_seq: I64, n: int,
) -> None:  # fmt: skip
    for j in range(w.shape[1]):
        out_w[n, j] = w[b, j]
    for j in range(s.shape[1]):
        out_s[n, j] = s[b, j]
    out_step[n] = step[b]
    out_seq[n] = seq[b]


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
    rows: RowState  # the row as its newest push left it (zeros where not known)
    seq: I64  # that push's number (0 where not known)

    def first(self, n: int) -> Remembered:
        """The first ``n`` keys' part."""
        rows = self.rows
        return Remembered(
            self.at[:n],
            self.known[:n],
            RowState(rows.weights[:n], rows.state[:n], rows.row_step[:n]),
            self.seq[:n],
        )

    @classmethod
    def nothing(cls, at: I64, dim: int, width: int) -> Remembered:
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
            np.zeros(n, np.int64),
        )


class _Generation:
    """One hash table of rows, their payload by slot."""

    def __init__(self, dim: int, width: int, capacity: int) -> None:
        self.keys = np.zeros(capacity, np.uint64)
        self.tabs = np.zeros(capacity, np.int32)
        self.used = np.zeros(capacity, np.bool_)
        self.weights = np.zeros((capacity, dim), np.float32)
        self.state = np.zeros((capacity, width), np.float32)
        self.row_step = np.zeros(capacity, np.int64)
        self.seq = np.zeros(capacity, np.int64)  # the newest push that changed the row
        self.recent = np.zeros((capacity, RECENT_PUSHES), np.int64)
        self.size = 0

    @property
    def capacity(self) -> int:
        return int(self.keys.shape[0])

    def clear(self) -> None:
        self.used[:] = False
        self.size = 0

    def put(self, tab: I32, ids: U64, rows: RowState, seq: int) -> None:
        self.size += _put(
            self.keys, self.tabs, self.used, self.weights, self.state, self.row_step,
            self.seq, self.recent, tab, ids,
            np.ascontiguousarray(rows.weights, np.float32),
            np.ascontiguousarray(rows.state, np.float32),
            np.ascontiguousarray(rows.row_step, np.int64), seq,
        )  # fmt: skip

    def arrays(self) -> tuple[U64, I32, npt.NDArray[np.bool_], I64, F32, F32, I64, I64]:
        """What :func:`_read` reads of the generation."""
        return (
            self.keys, self.tabs, self.used, self.recent,
            self.weights, self.state, self.row_step, self.seq,
        )  # fmt: skip

    def grown(self, capacity: int) -> _Generation:
        """A copy with ``capacity`` slots."""
        bigger = _Generation(self.weights.shape[1], self.state.shape[1], capacity)
        keep = np.flatnonzero(self.used)
        slots = np.empty(keep.shape[0], np.int64)
        bigger.size = _insert(
            bigger.keys, bigger.tabs, bigger.used, self.tabs[keep], self.keys[keep], slots
        )
        bigger.weights[slots] = self.weights[keep]
        bigger.state[slots] = self.state[keep]
        bigger.row_step[slots] = self.row_step[keep]
        bigger.seq[slots] = self.seq[keep]
        bigger.recent[slots] = self.recent[keep]
        return bigger


def _capacity_for(rows: int, smallest: int = 1024) -> int:
    """The power of two of slots that holds ``rows`` keys under the load bound."""
    capacity = smallest
    while rows > _MAX_LOAD * capacity:
        capacity *= 2
    return capacity


class PushedRowCache:
    """Rows as this rank's pushes left them, by (table number, id) (see the module docstring).

    ``max_rows`` bounds it: each generation holds about half; when the current one
    is full, the previous one (rows pushed longest ago, which the lookups since
    have seen) is dropped.
    """

    def __init__(self, dim: int, width: int, *, max_rows: int = 1 << 19) -> None:
        self.dim, self.width = dim, width
        self.generation_rows = max(max_rows // 2, 1)
        # Held by ``put`` and ``read``.
        self.lock = threading.Lock()
        self.current = _Generation(dim, width, 1024)
        self.previous: _Generation | None = None
        self._empty = _Generation(dim, width, 1)  # read where there is no previous one

    def __len__(self) -> int:
        """Rows held (a row in both generations counts twice)."""
        return self.current.size + (self.previous.size if self.previous is not None else 0)

    def read(
        self, tab: I32, ids: U64, applied_before: int, wanted: npt.NDArray[np.bool_]
    ) -> tuple[I32, Remembered]:
        """Per key, how many of its pushes came after push ``applied_before`` (those a
        lookup made when that push had landed missed); and what the cache holds of the
        keys that missed one or are ``wanted``.
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
            np.empty(n, np.int64),
        )
        with self.lock:
            old = self.previous if self.previous is not None else self._empty
            found = _read(
                self.current.arrays(), old.arrays(), tab, ids, applied_before, wanted,
                missed, at, out.known, out.rows.weights, out.rows.state, out.rows.row_step,
                out.seq,
            )  # fmt: skip
        return missed, out.first(found)

    def put(self, tab: I32, ids: U64, rows: RowState, seq: int) -> None:
        """Keep ``rows`` (what push ``seq`` left) as the newest of their keys."""
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
                    self.current = _Generation(self.dim, self.width, need)
            elif current.size + n > _MAX_LOAD * current.capacity:
                self.current = current.grown(_capacity_for(current.size + n))
            self.current.put(tab, ids, rows, seq)
