"""The hash index of a table: an ``int64[buckets, 4]`` array probed linearly.

One bucket holds the id, its row slot, the step it was last seen at and its
frequency with three flag bits (dirty, persisted, being pushed): a training lookup
touches two cache lines per id (bucket and row), not four. Deletion shifts later
buckets back instead of leaving tombstones, so probe lengths stay short under
eviction churn (``benchmarks/store.py`` runs lookups under eviction).

>>> import numpy as np
>>> buckets = empty_buckets(buckets_for(4))
>>> rows = np.empty(2, np.int64)
>>> probe(buckets, np.array([7, 8], np.int64), 1, False, rows), rows.tolist()
(2, [-1, -1])
"""

from __future__ import annotations

import numba as nb
import numpy as np
import numpy.typing as npt

from embedding_store.hashing import init_row, mix64
from embedding_store.kernels.intrinsics import AHEAD, prefetch

F32 = npt.NDArray[np.float32]
I64 = npt.NDArray[np.int64]

KEY, ROW, SEEN, META = 0, 1, 2, 3
# META = freq * FREQ_ONE | PUSHING | PERSISTED | DIRTY
DIRTY, PERSISTED, PUSHING, FREQ_ONE = 1, 2, 4, 8
MAX_LOAD = 0.75
# A row that cannot be stored because one request brings more new ids than the
# table's capacity (it reads as zeros and its gradient is dropped).
OVERFLOW = -2
NOT_ADMITTED = -1

_S32 = np.uint64(32)


@nb.njit(nogil=True, cache=True, inline="always")
def home(key: np.int64, n: int) -> np.int64:
    # Lemire's multiply-shift maps the hash's top 32 bits onto [0, n) for any n, so
    # the index can be sized to the capacity (n = capacity / MAX_LOAD) instead of
    # the next power of two, which would take up to twice the memory.
    return np.int64(((mix64(np.uint64(key)) >> _S32) * np.uint64(n)) >> _S32)


@nb.njit(nogil=True, cache=True, inline="always")
def next_bucket(b: int | np.int64, n: int) -> np.int64:
    after = np.int64(b + 1)
    return np.int64(0) if after == n else after


@nb.njit(nogil=True, cache=True, inline="always")
def slot_for(buckets: I64, key: np.int64, b: np.int64, n: int) -> np.int64:
    """The bucket holding ``key``, or the empty bucket where it would go, from ``b`` on."""
    while buckets[b, ROW] >= 0 and buckets[b, KEY] != key:
        b = next_bucket(b, n)
    return b


@nb.njit(nogil=True, cache=True)
def probe(buckets: I64, ids: I64, clock: int, touch: bool, rows_out: I64) -> int:
    """The row of each id (``NOT_ADMITTED`` when absent); returns how many are absent.

    Two passes (hash, then probe with the bucket ``AHEAD`` ids on prefetched)
    rather than one loop: each has a small, predictable body, so the CPU keeps
    many cache misses in flight. With ``touch`` the bucket's seen-step and
    frequency are updated (checkpointed state too: the bucket is marked dirty).
    """
    n_buckets = buckets.shape[0]
    n = ids.shape[0]
    for i in range(n):
        rows_out[i] = home(ids[i], n_buckets)
    missing = 0
    for i in range(n):
        if i + AHEAD < n:
            prefetch(buckets, rows_out[i + AHEAD])
        key = ids[i]
        b = rows_out[i]
        while True:
            r = buckets[b, ROW]
            if r < 0:
                rows_out[i] = NOT_ADMITTED
                missing += 1
                break
            if buckets[b, KEY] == key:
                rows_out[i] = r
                if touch:
                    buckets[b, SEEN] = clock
                    buckets[b, META] = (buckets[b, META] + FREQ_ONE) | DIRTY
                break
            b = next_bucket(b, n_buckets)
    return missing


@nb.njit(nogil=True, cache=True)
def insert(
    buckets: I64,
    ids: I64,
    positions: I64,
    clock: int,
    alloc: I64,
    free_rows: I64,
    row_limit: int,
    weights: F32,
    seed: np.uint64,
    init_kind: int,
    init_a: float,
    init_b: float,
    rows_out: I64,
    new_rows: I64,
) -> int:
    """Insert ``ids[positions]``; ``alloc`` is ``[used, n_free, next_row]``, updated in place."""
    n_buckets = buckets.shape[0]
    n_new = 0
    for p in range(positions.shape[0]):
        i = positions[p]
        key = ids[i]
        b = slot_for(buckets, key, home(key, n_buckets), n_buckets)
        r = buckets[b, ROW]
        if r < 0:
            if alloc[0] >= row_limit:
                rows_out[i] = OVERFLOW
                continue
            if alloc[1] > 0:
                alloc[1] -= 1
                r = free_rows[alloc[1]]
            else:
                r = alloc[2]
                alloc[2] += 1
            alloc[0] += 1
            buckets[b, KEY] = key
            buckets[b, ROW] = r
            buckets[b, SEEN] = clock
            buckets[b, META] = FREQ_ONE | DIRTY
            init_row(weights[r], np.uint64(key), seed, init_kind, init_a, init_b)
            new_rows[n_new] = r
            n_new += 1
        else:
            # The same new id twice in one request: the second sees the first's row.
            buckets[b, META] = (buckets[b, META] + FREQ_ONE) | DIRTY
        rows_out[i] = r
    return n_new


@nb.njit(nogil=True, cache=True)
def _delete_at(buckets: I64, b: int | np.int64) -> None:
    """Remove bucket ``b`` by shifting back the entries that probed past it."""
    n_buckets = buckets.shape[0]
    hole = b
    j = b
    while True:
        j = next_bucket(j, n_buckets)
        if buckets[j, ROW] < 0:
            break
        at = home(buckets[j, KEY], n_buckets)
        # The entry at j may move into the hole unless its home lies in (hole, j].
        stays = hole < at <= j if hole <= j else at > hole or at <= j
        if not stays:
            for c in range(4):
                buckets[hole, c] = buckets[j, c]
            hole = j
    buckets[hole, KEY] = 0
    buckets[hole, ROW] = -1
    buckets[hole, SEEN] = 0
    buckets[hole, META] = 0


@nb.njit(nogil=True, cache=True)
def delete_keys(
    buckets: I64,
    keys: I64,
    alloc: I64,
    free_rows: I64,
    tombstones: I64,
) -> tuple[int, int]:
    """Delete ``keys``; returns (deleted, tombstones written)."""
    n_buckets = buckets.shape[0]
    deleted = 0
    n_tomb = 0
    for i in range(keys.shape[0]):
        key = keys[i]
        b = slot_for(buckets, key, home(key, n_buckets), n_buckets)
        r = buckets[b, ROW]
        if r < 0:
            continue
        if buckets[b, META] & PERSISTED:
            tombstones[n_tomb] = key
            n_tomb += 1
        free_rows[alloc[1]] = r
        alloc[1] += 1
        alloc[0] -= 1
        deleted += 1
        _delete_at(buckets, b)
    return deleted, n_tomb


@nb.njit(nogil=True, cache=True)
def resolve_push(
    buckets: I64,
    ids: I64,
    grads: F32,
    rows_out: I64,
    scratch: I64,
) -> tuple[int, int, bool]:
    """Map pushed ids to rows (-1: absent or non-finite); returns (absent, nonfinite, dup).

    A duplicate id is detected by a PUSHING bit set in its bucket for the
    duration of the call, so no extra per-row array is touched.
    """
    n_buckets = buckets.shape[0]
    dim = grads.shape[1]
    n = ids.shape[0]
    for i in range(n):
        scratch[i] = home(ids[i], n_buckets)
    absent = 0
    nonfinite = 0
    dup = False
    for i in range(n):
        if i + AHEAD < n:
            prefetch(buckets, scratch[i + AHEAD])
        finite = True
        for j in range(dim):
            if not np.isfinite(grads[i, j]):
                finite = False
                break
        if not finite:
            rows_out[i] = -1
            scratch[i] = -1
            nonfinite += 1
            continue
        key = ids[i]
        b = slot_for(buckets, key, scratch[i], n_buckets)
        r = buckets[b, ROW]
        if r < 0:
            rows_out[i] = -1
            scratch[i] = -1
            absent += 1
            continue
        meta = buckets[b, META]
        if meta & PUSHING:
            dup = True
        buckets[b, META] = meta | DIRTY | PUSHING
        rows_out[i] = r
        scratch[i] = b
    for i in range(n):
        if scratch[i] >= 0:
            buckets[scratch[i], META] &= ~PUSHING
    return absent, nonfinite, dup


@nb.njit(nogil=True, cache=True)
def upsert(
    buckets: I64,
    ids: I64,
    alloc: I64,
    free_rows: I64,
    last_seen: I64,
    freq: I64,
    rows_out: I64,
) -> int:
    """Find or create a slot for each id (restore path); returns how many were created."""
    n_buckets = buckets.shape[0]
    created = 0
    for i in range(ids.shape[0]):
        key = ids[i]
        b = slot_for(buckets, key, home(key, n_buckets), n_buckets)
        r = buckets[b, ROW]
        if r < 0:
            if alloc[1] > 0:
                alloc[1] -= 1
                r = free_rows[alloc[1]]
            else:
                r = alloc[2]
                alloc[2] += 1
            alloc[0] += 1
            created += 1
            buckets[b, KEY] = key
            buckets[b, ROW] = r
        buckets[b, SEEN] = last_seen[i]
        buckets[b, META] = freq[i] * FREQ_ONE
        rows_out[i] = r
    return created


@nb.njit(nogil=True, cache=True)
def rehash(old: I64, new: I64) -> None:
    n_buckets = new.shape[0]
    for b in range(old.shape[0]):
        if old[b, ROW] < 0:
            continue
        nb_ = home(old[b, KEY], n_buckets)
        while new[nb_, ROW] >= 0:
            nb_ = next_bucket(nb_, n_buckets)
        for c in range(4):
            new[nb_, c] = old[b, c]


def empty_buckets(n: int) -> I64:
    buckets = np.zeros((n, 4), dtype=np.int64)
    buckets[:, ROW] = -1
    return buckets


def buckets_for(rows: int) -> int:
    """Buckets that hold ``rows`` at most ``MAX_LOAD`` full (at least 16)."""
    return max(16, int(np.ceil(rows / MAX_LOAD)))
