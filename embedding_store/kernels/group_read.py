"""The kernels of ``TableGroup``: reads of many tables in one call, each table's
arrays found through its placement (the addresses of its buckets and weights).
"""

from __future__ import annotations

from typing import Any

import numba as nb
import numpy as np
import numpy.typing as npt
from numba.np.numpy_support import carray

from embedding_store.hashing import init_row, shard_index
from embedding_store.kernels.float16 import half_rounded
from embedding_store.kernels.hash_index import ROW, home, slot_for
from embedding_store.kernels.intrinsics import address

F32 = npt.NDArray[np.float32]
I64 = npt.NDArray[np.int64]
U64 = npt.NDArray[np.uint64]


# A table's placement (``EmbeddingTable._placement``): where its arrays lie and their rows.
P_BUCKETS, P_BUCKET_ROWS, P_WEIGHTS, P_WEIGHT_ROWS = range(4)


@nb.njit(nogil=True, cache=True, inline="always")
def _placed_arrays(placements: I64, t: int | np.int64, dim: int) -> tuple[I64, F32]:
    """Table ``t``'s buckets and weights, from its placement (``placements[t]`` is the
    address of the table's placement array)."""
    p = carray(address(placements[t]), 4, np.int64)
    buckets = carray(address(p[P_BUCKETS]), (p[P_BUCKET_ROWS], 4), np.int64)
    weights = carray(address(p[P_WEIGHTS]), (p[P_WEIGHT_ROWS], dim), np.float32)
    return buckets, weights


@nb.njit(nogil=True, cache=True)
def read_tables(
    placements: I64, seeds: U64, kinds: I64, a: Any, b: Any, unknown: I64,
    which: I64, keys: I64, out: F32, half: bool,
) -> None:  # fmt: skip
    """``out[i]``: the row of ``keys[i]`` in table ``which[i]`` (``placements`` holds the
    address of every table's placement), or its initial row where it has none,
    counted in ``unknown``: ``EmbeddingTable.read`` of several tables in one call.
    With ``half`` every value is rounded to float16 (and widened back).
    """
    dim = out.shape[1]
    for i in range(keys.shape[0]):
        t = which[i]
        index, w = _placed_arrays(placements, t, dim)
        key = keys[i]
        n = index.shape[0]
        r = index[slot_for(index, key, home(key, n), n), ROW]
        if r < 0:
            init_row(out[i], np.uint64(key), seeds[t], kinds[t], a[t], b[t])
            unknown[t] += 1
        else:
            for j in range(dim):
                out[i, j] = w[r, j]
        if half:
            for j in range(dim):
                out[i, j] = half_rounded(out[i, j])


@nb.njit(nogil=True, cache=True)
def read_tables_bounds(
    placements: I64, seeds: U64, kinds: I64, a: Any, b: Any, unknown: I64,
    bounds: I64, num_shards: int, keys: I64, out: F32, half: bool,
) -> None:  # fmt: skip
    """``read_tables`` of the ids of table ``t`` at ``keys[bounds[t]:bounds[t + 1]]``,
    each read from the shard that owns it (the group holds every table of shard 0,
    then of shard 1, ...)."""
    n_tables = bounds.shape[0] - 1
    which = np.empty(keys.shape[0], dtype=np.int64)
    for t in range(n_tables):
        for i in range(bounds[t], bounds[t + 1]):
            shard = shard_index(np.uint64(keys[i]), num_shards) if num_shards > 1 else 0
            which[i] = t + n_tables * shard
    read_tables(placements, seeds, kinds, a, b, unknown, which, keys, out, half)
