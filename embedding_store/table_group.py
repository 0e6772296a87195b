"""Tables read together in one kernel call (``kernels.group_read``): a prediction
request reads a few ids from each of dozens of tables.
"""

from __future__ import annotations

import operator
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from embedding_store.kernels.group_read import read_tables, read_tables_bounds
from embedding_store.table import EmbeddingTable, _as_ids

F32 = npt.NDArray[np.float32]
I64 = npt.NDArray[np.int64]
U64 = npt.NDArray[np.uint64]

_ACQUIRE = operator.methodcaller("acquire")
_RELEASE = operator.methodcaller("release")


class TableGroup:
    """Tables read together: :meth:`EmbeddingTable.read` of all of them in one kernel
    call: a prediction request reads a few ids from each of dozens of tables (of
    every shard), and one call for all of them spares a call's overhead per table
    (``benchmarks/serve.py``).

    >>> from embedding_store.types import TableConfig
    >>> config = TableConfig(dim=2, optimizer={"kind": "sgd", "lr": 1.0})
    >>> t, u = EmbeddingTable("t", config), EmbeddingTable("u", config)
    >>> _ = t.lookup([5])  # 5 has a row in t; 6 and 7 have none
    >>> out = np.empty((3, 2), np.float32)
    >>> TableGroup([t, u]).read(np.array([0, 1, 0]), np.array([5, 6, 7], np.uint64), out)
    True
    >>> want = [x.read([k])[0][0] for x, k in [(t, 5), (u, 6), (t, 7)]]
    >>> bool((out == np.stack(want)).all())
    True
    """

    def __init__(self, tables: Sequence[EmbeddingTable]) -> None:
        self.tables = tuple(tables)
        dims = {t.dim for t in self.tables}
        # None: not one dim, or a tiered table (its rows on disk are read in first):
        # the callers then read table by table.
        one_dim = len(dims) == 1 and not any(t.tiered for t in self.tables)
        self.dim = dims.pop() if one_dim else None
        self._seeds = np.array([t._seed for t in self.tables], dtype=np.uint64)
        self._kinds = np.array([t._init[0] for t in self.tables], dtype=np.int64)
        self._a = np.array([t._init[1] for t in self.tables], dtype=np.float64)
        self._b = np.array([t._init[2] for t in self.tables], dtype=np.float64)
        # Each table's placement array is made once and updated in place: its address
        # holds for the table's life, and the group holds the tables.
        self._placements = np.array([t._placement.ctypes.data for t in self.tables], dtype=np.int64)
        # Taken in one global order, so that two groups never wait on each other.
        self._locks = [lock for _, lock in sorted({id(t._lock): t._lock for t in tables}.items())]

    def holds(self, tables: Sequence[EmbeddingTable]) -> bool:
        """Whether this group is of ``tables`` (the very objects, in order)."""
        return len(tables) == len(self.tables) and all(map(operator.is_, tables, self.tables))

    def read_each(self, ids: Sequence[npt.ArrayLike]) -> list[F32] | None:
        """``tables[t].read(ids[t])[0]`` for every table, in one kernel call; None,
        with nothing read, where :meth:`read` would decline.

        >>> from embedding_store.types import TableConfig
        >>> config = TableConfig(dim=2, optimizer={"kind": "sgd", "lr": 1.0})
        >>> t, u = EmbeddingTable("t", config), EmbeddingTable("u", config)
        >>> a, b = TableGroup([t, u]).read_each([[5, 6], [7]])
        >>> bool((a == t.read([5, 6])[0]).all() and (b == u.read([7])[0]).all())
        True
        """
        keys = [_as_ids(k) for k in ids]  # refused as EmbeddingTable.read refuses them
        if self.dim is None or len(keys) != len(self.tables):
            return None
        bounds = np.cumsum([0, *(k.shape[0] for k in keys)], dtype=np.int64)
        out = np.empty((int(bounds[-1]), self.dim), np.float32)
        flat = np.concatenate(keys) if keys else np.zeros(0, np.uint64)
        if not self.read_bounds(bounds, flat, out):
            return None
        return [out[bounds[t] : bounds[t + 1]] for t in range(len(keys))]

    def read(self, which: I64, ids: npt.ArrayLike, out: F32, *, half: bool = False) -> bool:
        """``out[i]``: the row of ``ids[i]`` in ``tables[which[i]]``, read under every
        table's lock; with ``half``, rounded to float16 as rows sent in float16 are
        (``rows.astype(np.float16).astype(np.float32)``). False, with nothing read,
        when the tables' dims differ from ``out``'s (read them one by one)."""
        keys = _as_ids(ids).view(np.int64)
        if not self.tables or self.dim != out.shape[1]:
            return False
        self._locked(read_tables, np.asarray(which, dtype=np.int64), keys, out, half)
        return True

    def read_bounds(
        self, bounds: I64, ids: U64, out: F32, *, num_shards: int = 1, half: bool = False
    ) -> bool:
        """:meth:`read` of the ids of table ``t`` at ``ids[bounds[t]:bounds[t + 1]]``,
        each from the shard that owns it, where the group holds every table of shard
        0, then every table of shard 1, ... (``num_shards`` of them): a prediction's
        ids as it has them, with no per-id table index made first.

        >>> from embedding_store.types import TableConfig
        >>> config = TableConfig(dim=2, optimizer={"kind": "sgd", "lr": 1.0})
        >>> t, u = EmbeddingTable("t", config), EmbeddingTable("u", config)
        >>> _ = t.lookup([5])
        >>> out = np.empty((3, 2), np.float32)
        >>> TableGroup([t, u]).read_bounds(np.array([0, 1, 3]), np.array([5, 6, 7], np.uint64), out)
        True
        >>> bool((out == np.stack([t.read([5])[0][0], *u.read([6, 7])[0]])).all())
        True
        """
        keys = _as_ids(ids).view(np.int64)
        if not self.tables or self.dim != out.shape[1]:
            return False
        if (bounds.shape[0] - 1) * num_shards != len(self.tables):
            msg = (
                f"bounds: {bounds.shape[0] - 1} tables of {num_shards} shard(s), but the group "
                f"holds {len(self.tables)} tables"
            )
            raise ValueError(msg)
        bounds = np.asarray(bounds, dtype=np.int64)
        self._locked(read_tables_bounds, bounds, num_shards, keys, out, half)
        return True

    def _locked(self, kernel: Any, *args: object) -> None:
        """``kernel(placements, seeds, kinds, a, b, unknown, *args)`` over every table's
        arrays, read under the tables' locks; the ids it found without a row
        (``unknown[t]``) counted."""
        unknown = np.zeros(len(self.tables), dtype=np.int64)
        # Loops in C (map, consumed by a zero-length deque): a request reads dozens of
        # tables, and a Python loop over their locks would outweigh the kernel.
        deque(map(_ACQUIRE, self._locks), 0)
        try:
            # The arrays are read under the locks: a table that grows replaces them (with
            # C-contiguous ones, as the kernel takes them) and its placement with them.
            kernel(self._placements, self._seeds, self._kinds, self._a, self._b, unknown, *args)
            for t in np.flatnonzero(unknown).tolist():
                self.tables[t]._counters["unknown_reads"] += int(unknown[t])
        finally:
            deque(map(_RELEASE, self._locks), 0)
