"""``PushedRowCache``: the rows a rank's own pushes left in the store, by id, for one table.

Each push's reply brings back the pushed rows with their optimizer state; the
cache keeps the newest of each row and the numbers of the last pushes that
changed it, in an open-addressing hash table (numba kernels, one call per
batch and table: a Criteo-like batch of 26 tables costs well under a
millisecond, where per-push sorted arrays searched with numpy cost ~50 ms).

>>> import numpy as np
>>> from embedding_store.types import RowState
>>> cache = PushedRowCache(dim=2, width=1)
>>> ids = np.array([5, 9], np.uint64)
>>> cache.put(ids, RowState(np.ones((2, 2), np.float32), np.zeros((2, 1), np.float32),
...                         np.array([1, 1])), seq=3)
>>> slots = cache.find(np.array([9, 4], np.uint64))
>>> (slots >= 0).tolist(), int(cache.seq[slots[0]]), cache.missed(slots, applied_before=2).tolist()
([True, False], 3, [1, 0])
"""

from __future__ import annotations

import threading

import numba as nb
import numpy as np
import numpy.typing as npt

from embedding_store.hashing import mix64
from embedding_store.types import RowState

I64 = npt.NDArray[np.int64]
U64 = npt.NDArray[np.uint64]
# The pushes per row whose numbers are kept (a lookup that missed more counts as this many).
RECENT_PUSHES = 8
_MAX_LOAD = 0.5


@nb.njit(nogil=True, cache=True)
def _find(keys: U64, used: npt.NDArray[np.bool_], ids: U64, out: I64) -> None:
    mask = keys.shape[0] - 1
    for i in range(ids.shape[0]):
        key = ids[i]
        b = np.int64(mix64(key) & np.uint64(mask))
        out[i] = -1
        while used[b]:
            if keys[b] == key:
                out[i] = b
                break
            b = (b + 1) & mask


@nb.njit(nogil=True, cache=True)
def _insert(keys: U64, used: npt.NDArray[np.bool_], ids: U64, out: I64) -> int:
    """The slot of each id, made where missing; returns how many were made."""
    mask = keys.shape[0] - 1
    made = 0
    for i in range(ids.shape[0]):
        key = ids[i]
        b = np.int64(mix64(key) & np.uint64(mask))
        while used[b] and keys[b] != key:
            b = (b + 1) & mask
        if not used[b]:
            used[b] = True
            keys[b] = key
            made += 1
        out[i] = b
    return made


@nb.njit(nogil=True, cache=True)
def _record(recent: I64, seq: I64, slots: I64, push: int) -> None:
    """Remember ``push`` as the newest push of each slot (the oldest number drops off)."""
    k = recent.shape[1]
    for i in range(slots.shape[0]):
        s = slots[i]
        if recent[s, 0] == push:
            continue  # the same push answered twice (a retried request)
        for j in range(k - 1, 0, -1):
            recent[s, j] = recent[s, j - 1]
        recent[s, 0] = push
        seq[s] = push


@nb.njit(nogil=True, cache=True)
def _missed(recent: I64, slots: I64, applied_before: int, out: npt.NDArray[np.int32]) -> None:
    for i in range(slots.shape[0]):
        s = slots[i]
        n = 0
        if s >= 0:
            for j in range(recent.shape[1]):
                if recent[s, j] > applied_before:
                    n += 1
        out[i] = n


class PushedRowCache:
    """One table's rows as this rank's pushes left them (see the module docstring).

    ``max_rows`` bounds it: when full, the rows whose newest push is the oldest
    go first (a row pushed that long ago is one every lookup has seen).
    """

    def __init__(self, dim: int, width: int, *, max_rows: int = 1 << 20) -> None:
        self.dim, self.width, self.max_rows = dim, width, max_rows
        # Held by ``put`` (which may reallocate); readers hold it across their reads.
        self.lock = threading.Lock()
        self._allocate(1024)

    def _allocate(self, capacity: int) -> None:
        self.keys = np.zeros(capacity, np.uint64)
        self.used = np.zeros(capacity, np.bool_)
        self.weights = np.zeros((capacity, self.dim), np.float32)
        self.state = np.zeros((capacity, self.width), np.float32)
        self.row_step = np.zeros(capacity, np.int64)
        self.seq = np.zeros(capacity, np.int64)  # the newest push that changed the row
        self.recent = np.zeros((capacity, RECENT_PUSHES), np.int64)
        self.rows = 0

    def __len__(self) -> int:
        return self.rows

    def find(self, ids: U64) -> I64:
        """The slot of each id, -1 where the cache has none."""
        out = np.empty(ids.shape[0], np.int64)
        _find(self.keys, self.used, np.ascontiguousarray(ids, np.uint64), out)
        return out

    def take(self, slots: I64) -> RowState:
        """The rows in ``slots`` (all found)."""
        return RowState(self.weights[slots], self.state[slots], self.row_step[slots])

    def missed(self, slots: I64, applied_before: int) -> npt.NDArray[np.int32]:
        """Per slot (-1: none), how many of its recent pushes came after push ``applied_before``."""
        out = np.empty(slots.shape[0], np.int32)
        _missed(self.recent, slots, applied_before, out)
        return out

    def put(self, ids: U64, rows: RowState, seq: int) -> None:
        """Keep ``rows`` (what push ``seq`` left) as the newest of their ids."""
        ids = np.ascontiguousarray(ids, np.uint64)
        with self.lock:
            if (self.rows + ids.shape[0]) > _MAX_LOAD * self.keys.shape[0]:
                self._make_room(ids.shape[0])
            slots = np.empty(ids.shape[0], np.int64)
            self.rows += _insert(self.keys, self.used, ids, slots)
            self.weights[slots] = rows.weights
            self.state[slots] = rows.state
            self.row_step[slots] = rows.row_step
            _record(self.recent, self.seq, slots, seq)

    def _make_room(self, incoming: int) -> None:
        """Grow, or past ``max_rows`` drop the rows pushed longest ago, then rehash."""
        keep = np.flatnonzero(self.used)
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
        old = (self.keys, self.weights, self.state, self.row_step, self.seq, self.recent)
        self._allocate(capacity)
        slots = np.empty(keep.shape[0], np.int64)
        self.rows = _insert(self.keys, self.used, old[0][keep], slots)
        self.weights[slots] = old[1][keep]
        self.state[slots] = old[2][keep]
        self.row_step[slots] = old[3][keep]
        self.seq[slots] = old[4][keep]
        self.recent[slots] = old[5][keep]
