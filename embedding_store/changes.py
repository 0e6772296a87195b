"""Which ids a table changed, by version: what a serving replica asks to follow a shard.

A training shard's table keeps a :class:`ChangeLog` once a follower has asked
for one (a shard nobody follows pays nothing). Every push and every deletion
(eviction, expiry, removal) records the ids it touched under a new version; a
follower that holds the table as of version ``v`` asks for the ids changed
since ``v`` and reads their rows as they are now (an id without a row now was
deleted). The log keeps the newest ``capacity`` ids: a follower that fell
further behind, or that followed an earlier life of the table (another
``epoch``: a shard restarted or restored), is told to copy the table whole
and follow from the version the copy started at.

Pure: no locks and no I/O; the table calls it under its own lock.

>>> import numpy as np
>>> log = ChangeLog(capacity=4)
>>> log.record(np.array([5, 6], np.int64)); log.record(np.array([6, 7], np.int64))
>>> log.version, log.since(0).tolist(), log.since(1).tolist(), log.since(2).tolist()
(2, [5, 6, 7], [6, 7], [])
>>> log.record(np.array([8, 9, 10], np.int64))  # 7 ids kept at most 4: version 1 and 2 go
>>> log.since(1) is None, log.since(2).tolist()
(True, [8, 9, 10])
"""

from __future__ import annotations

import bisect
import time
import uuid
from collections import deque

import numpy as np
import numpy.typing as npt

I64 = npt.NDArray[np.int64]

DEFAULT_CAPACITY = 1 << 20
"""Ids kept per table (8 MiB): many follower rounds of a busy job's pushes, so that only
a follower stalled for long copies the table again (``benchmarks/serve.py`` follows one)."""


class ChangeLog:
    """The ids changed per version, newest ``capacity`` ids kept (at least one version)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            msg = f"capacity: must be at least 1, got {capacity}"
            raise ValueError(msg)
        self.capacity = capacity
        # Tells this log from one of another life of the table, whose versions differ.
        self.epoch = uuid.uuid4().hex
        self.version = 0
        self.changed_at = time.time()  # wall time of the newest version (freshness)
        self._versions: deque[int] = deque()
        self._keys: deque[I64] = deque()
        self._ids = 0
        self._forgotten = 0  # the newest version whose ids were dropped

    def record(self, keys: I64) -> None:
        """Record ``keys`` (copied) as changed, under a new version."""
        if keys.shape[0] == 0:
            return
        self.version += 1
        self.changed_at = time.time()
        self._versions.append(self.version)
        self._keys.append(np.array(keys, dtype=np.int64, copy=True))
        self._ids += keys.shape[0]
        while self._ids > self.capacity and len(self._keys) > 1:
            self._ids -= self._keys.popleft().shape[0]
            self._forgotten = self._versions.popleft()

    def reaches(self, version: int) -> bool:
        """Whether the ids changed since ``version`` are all still here."""
        return self._forgotten <= version <= self.version

    def since(self, version: int) -> I64 | None:
        """The distinct ids changed after ``version``, sorted; None when no longer known."""
        if not self.reaches(version):
            return None
        first = bisect.bisect_right(self._versions, version)
        parts = [self._keys[i] for i in range(first, len(self._keys))]
        if not parts:
            return np.zeros(0, dtype=np.int64)
        return np.unique(np.concatenate(parts))
