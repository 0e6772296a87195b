"""Rows by (table, id) in one open-addressing hash table: what a rank's pushes left, and
the ids of a push in flight.

Tables that the store updates with the same arithmetic (the same width, optimizer,
clip and gradient dtype: a Criteo-like job's 26 tables are one such group) share one
table of rows, each key a table's number in the group and an id. The trainer then
brings a whole batch up to date in a handful of numba and numpy calls per group
instead of per table: on the hot-id stream's 26 tables, per-table calls cost about
half a millisecond each per step, a fifth of the step.

:class:`RowIndex` finds keys; :class:`PushedRowCache` keeps with each key the newest
row a push of this rank left in the store, its optimizer state and the numbers of
the last pushes that changed it.

>>> import numpy as np
>>> from embedding_store.types import RowState
>>> cache = PushedRowCache(dim=2, width=1)
>>> tab, ids = np.array([0, 1], np.int32), np.array([5, 5], np.uint64)
>>> cache.put(tab, ids, RowState(np.ones((2, 2), np.float32), np.zeros((2, 1), np.float32),
...                              np.array([1, 1])), seq=3)
>>> seen = cache.read(np.array([1, 0], np.int32), np.array([5, 4], np.uint64), applied_before=2)
>>> seen.known.tolist(), seen.seq.tolist(), seen.missed.tolist()
([True, False], [3, 0], [1, 0])
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


@nb.njit(nogil=True, cache=True)
def _find(keys: U64, tabs: I32, used: npt.NDArray[np.bool_], tab: I32, ids: U64, out: I64) -> None:
    mask = keys.shape[0] - 1
    for i in range(ids.shape[0]):
        key, t = ids[i], tab[i]
        b = _home(key, t, mask)
        out[i] = -1
        while used[b]:
            if keys[b] == key and tabs[b] == t:
                out[i] = b
                break
            b = (b + 1) & mask


@nb.njit(nogil=True, cache=True)
def _insert(keys: U64, tabs: I32, used: npt.NDArray[np.bool_], tab: I32, ids: U64, out: I64) -> int:
    """The slot of each key, made where missing; returns how many were made."""
    mask = keys.shape[0] - 1
    made = 0
    for i in range(ids.shape[0]):
        key, t = ids[i], tab[i]
        b = _home(key, t, mask)
        while used[b] and not (keys[b] == key and tabs[b] == t):
            b = (b + 1) & mask
        if not used[b]:
            used[b] = True
            keys[b] = key
            tabs[b] = t
            made += 1
        out[i] = b
    return made


@nb.njit(nogil=True, cache=True)
def _store(
    weights: F32,
    state: F32,
    row_step: I64,
    seq: I64,
    recent: I64,
    slots: I64,
    w: F32,
    st: F32,
    steps: I64,
    push: int,
) -> None:
    """Each row into its slot, with ``push`` as the slot's newest push (the oldest
    number drops off).
    """
    k = recent.shape[1]
    for i in range(slots.shape[0]):
        s = slots[i]
        weights[s] = w[i]
        state[s] = st[i]
        row_step[s] = steps[i]
        if recent[s, 0] == push:
            continue  # the same push answered twice (a retried request)
        for j in range(k - 1, 0, -1):
            recent[s, j] = recent[s, j - 1]
        recent[s, 0] = push
        seq[s] = push


@nb.njit(nogil=True, cache=True)
def _read(
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
    applied_before: int,
    known: npt.NDArray[np.bool_],
    missed: I32,
    out_w: F32,
    out_s: F32,
    out_step: I64,
    out_seq: I64,
) -> None:
    mask = keys.shape[0] - 1
    for i in range(ids.shape[0]):
        key, t = ids[i], tab[i]
        b = _home(key, t, mask)
        s = np.int64(-1)
        while used[b]:
            if keys[b] == key and tabs[b] == t:
                s = b
                break
            b = (b + 1) & mask
        if s < 0:
            known[i] = False
            missed[i] = 0
            continue
        known[i] = True
        n = 0
        for j in range(recent.shape[1]):
            if recent[s, j] > applied_before:
                n += 1
        missed[i] = n
        out_w[i] = weights[s]
        out_s[i] = state[s]
        out_step[i] = row_step[s]
        out_seq[i] = seq[s]


class RowIndex:
    """A set of (table number, id) keys, each found at a slot.

    >>> index = RowIndex(np.array([0, 0, 1], np.int32), np.array([7, 8, 7], np.uint64))
    >>> index.rows_of(np.array([1, 1, 0], np.int32), np.array([7, 8, 8], np.uint64)).tolist()
    [2, -1, 1]
    """

    def __init__(self, tab: I32, ids: U64, capacity: int = 0) -> None:
        """Index the keys ``(tab[i], ids[i])`` as rows ``i`` (the last of a repeated key wins)."""
        capacity = max(capacity, 16)
        while tab.shape[0] > _MAX_LOAD * capacity:
            capacity *= 2
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
    """What :meth:`PushedRowCache.read` knows of some keys, per key."""

    known: npt.NDArray[np.bool_]  # the cache has a row
    missed: I32  # of its recent pushes, how many came after the lookup
    rows: RowState  # the row as its newest push left it (zeros where not known)
    seq: I64  # that push's number (0 where not known)

    @classmethod
    def nothing(cls, n: int, dim: int, width: int) -> Remembered:
        """``n`` keys of which nothing is known."""
        return cls(
            np.zeros(n, np.bool_),
            np.zeros(n, np.int32),
            RowState(
                np.zeros((n, dim), np.float32),
                np.zeros((n, width), np.float32),
                np.zeros(n, np.int64),
            ),
            np.zeros(n, np.int64),
        )


class PushedRowCache:
    """Rows as this rank's pushes left them, by (table number, id) (see the module docstring).

    ``max_rows`` bounds it: when full, the rows whose newest push is the oldest
    go first (a row pushed that long ago is one every lookup has seen).
    """

    def __init__(self, dim: int, width: int, *, max_rows: int = 1 << 20) -> None:
        self.dim, self.width, self.max_rows = dim, width, max_rows
        # Held by ``put`` (which may reallocate) and by ``read``.
        self.lock = threading.Lock()
        self._allocate(1024)

    def _allocate(self, capacity: int) -> None:
        self.index = RowIndex(np.zeros(0, np.int32), np.zeros(0, np.uint64), capacity)
        self.weights = np.zeros((capacity, self.dim), np.float32)
        self.state = np.zeros((capacity, self.width), np.float32)
        self.row_step = np.zeros(capacity, np.int64)
        self.seq = np.zeros(capacity, np.int64)  # the newest push that changed the row
        self.recent = np.zeros((capacity, RECENT_PUSHES), np.int64)

    def __len__(self) -> int:
        return self.index.size

    def read(self, tab: I32, ids: U64, applied_before: int) -> Remembered:
        """What the cache holds of each key, and how many of its pushes came after push
        ``applied_before`` (those a lookup made when that push had landed missed).
        """
        n = ids.shape[0]
        out = Remembered.nothing(n, self.dim, self.width)
        with self.lock:
            index = self.index
            _read(
                index.keys, index.tabs, index.used, self.weights, self.state, self.row_step,
                self.seq, self.recent, tab, ids, applied_before, out.known, out.missed,
                out.rows.weights, out.rows.state, out.rows.row_step, out.seq,
            )  # fmt: skip
        return out

    def put(self, tab: I32, ids: U64, rows: RowState, seq: int) -> None:
        """Keep ``rows`` (what push ``seq`` left) as the newest of their keys."""
        with self.lock:
            if (self.index.size + ids.shape[0]) > _MAX_LOAD * self.index.keys.shape[0]:
                self._make_room(ids.shape[0])
            slots = self.index.insert(tab, ids)
            _store(
                self.weights, self.state, self.row_step, self.seq, self.recent, slots,
                np.ascontiguousarray(rows.weights, np.float32),
                np.ascontiguousarray(rows.state, np.float32),
                np.ascontiguousarray(rows.row_step, np.int64), seq,
            )  # fmt: skip

    def _make_room(self, incoming: int) -> None:
        """Grow, or past ``max_rows`` drop the rows pushed longest ago, then rehash."""
        keep = np.flatnonzero(self.index.used)
        need = keep.shape[0] + incoming
        if need > self.max_rows:
            # The newest rows that leave room for the incoming ones.
            room = max(self.max_rows - incoming, 0)
            order = np.argsort(self.seq[keep], kind="stable")
            keep = keep[order[keep.shape[0] - min(room, keep.shape[0]) :]]
            need = keep.shape[0] + incoming
        capacity = 1024
        while need > _MAX_LOAD * capacity:
            capacity *= 2
        old_index = self.index
        old = (self.weights, self.state, self.row_step, self.seq, self.recent)
        self._allocate(capacity)
        slots = self.index.insert(old_index.tabs[keep], old_index.keys[keep])
        self.weights[slots] = old[0][keep]
        self.state[slots] = old[1][keep]
        self.row_step[slots] = old[2][keep]
        self.seq[slots] = old[3][keep]
        self.recent[slots] = old[4][keep]
