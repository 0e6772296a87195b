"""Flag bits of a table's hash index read and set by id (``kernels.hash_index``).

>>> import numpy as np
>>> from embedding_store.kernels.hash_index import PERSISTED, buckets_for, empty_buckets, upsert
>>> buckets = empty_buckets(buckets_for(4))
>>> keys = np.array([7], np.int64)
>>> _ = upsert(buckets, keys, np.zeros(3, np.int64), np.zeros(0, np.int64),
...            np.zeros(1, np.int64), np.ones(1, np.int64), np.empty(1, np.int64))
>>> set_flags(buckets, keys, PERSISTED)
>>> out = np.empty(2, np.int64)
>>> meta_of(buckets, np.array([7, 8], np.int64), out); out.tolist()
[10, -1]
"""

from __future__ import annotations

import numba as nb
import numpy as np
import numpy.typing as npt

from embedding_store.kernels.hash_index import KEY, META, ROW, home, slot_for

I64 = npt.NDArray[np.int64]


@nb.njit(nogil=True, cache=True)
def meta_of(buckets: I64, keys: I64, out: I64) -> None:
    """``out[i]``: the META word of ``keys[i]`` (frequency and flags), -1 without a row."""
    n_buckets = buckets.shape[0]
    for i in range(keys.shape[0]):
        b = slot_for(buckets, keys[i], home(keys[i], n_buckets), n_buckets)
        out[i] = buckets[b, META] if buckets[b, ROW] >= 0 and buckets[b, KEY] == keys[i] else -1


@nb.njit(nogil=True, cache=True)
def set_flags(buckets: I64, keys: I64, flags: int) -> None:
    """OR ``flags`` into the META word of each of ``keys`` that has a row."""
    n_buckets = buckets.shape[0]
    for i in range(keys.shape[0]):
        b = slot_for(buckets, keys[i], home(keys[i], n_buckets), n_buckets)
        if buckets[b, ROW] >= 0:
            buckets[b, META] |= flags
