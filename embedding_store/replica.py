"""A serving replica: a read-only copy of a training shard that follows its changes.

Prediction servers read rows from replicas, never from the shards that train:
serving load cannot slow training down, and a training shard's death does not
stop serving (the replica keeps answering with what it holds, and catches up
when the shard is back). A :class:`ShardFollower` keeps a read-only
:class:`~embedding_store.shard.StoreShard` a copy of one training shard:

1. At start the replica may hold the training shard's newest checkpoint (its
   snapshot mirror or data dir, restored like any shard's). The checkpoint
   names the shard's change logs at its cut, so the replica asks only for the
   rows changed since.
2. Otherwise (no checkpoint, the shard restarted since, or it fell further
   behind than the shard's log remembers: ``change_log_ids``), the follower
   copies the table page by page into a new table off to the side, applies
   the changes made meanwhile, and swaps it in: lookups never see a half copy.
3. Then, every ``poll_s``, it asks each table for the rows changed since the
   version it holds, evictions included, and applies them.

The replica is *caught up* once every table has been brought to a version the
training shard answered after the follower started; until then its Health
answers SYNCING (a readiness probe fails), and a replica that restored no
checkpoint refuses reads (UNAVAILABLE: clients retry) rather than answer
every id with an initial row. An id the replica has no row for
is read as the table's initial row, as a training lookup would create it,
and counted (``unknown_reads``).

>>> import numpy as np
>>> from embedding_store.shard import StoreShard
>>> from embedding_store.types import StoreConfig
>>> config = StoreConfig(tables={"item": {"dim": 2, "optimizer": {"kind": "sgd", "lr": 1.0}}})
>>> training, replica = StoreShard(config), StoreShard(config, read_only=True)
>>> follower = ShardFollower(replica, training)
>>> follower.sync_once()  # the first round copies the table
True
>>> ids = np.array([5, 6], np.uint64)
>>> _ = training.lookup({"item": ids})
>>> _ = training.push({"item": (ids, np.ones((2, 2), np.float32))})
>>> follower.sync_once(), follower.copies
(True, 1)
>>> served = replica.lookup({"item": ids})["item"]
>>> bool((served == training.peek({"item": ids})["item"].weights).all())
True
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from embedding_store.errors import StoreError
from embedding_store.follow import FOLLOW_POLL_S
from embedding_store.shard import StoreShard, release_tables
from embedding_store.table import EmbeddingTable, apply_changes
from embedding_store.types import TableChanges

log = logging.getLogger(__name__)

U64 = npt.NDArray[np.uint64]
F32 = npt.NDArray[np.float32]

PAGE_ROWS = 65_536
_COPY_ATTEMPTS = 5


class ChangeSource(Protocol):
    """A training shard as a follower reads it: a ``StoreShard`` here, a
    ``GrpcTransport`` over the network."""

    def changes(self, table: str, epoch: str, since: int) -> TableChanges: ...

    def changes_many(self, asks: Sequence[tuple[str, str, int]]) -> list[TableChanges]: ...

    def rows_page(self, table: str, cursor: int, count: int) -> tuple[U64, F32, int]: ...


@dataclass
class FollowStats:
    """What a follower did, and how fresh its replica is (for metrics and logs)."""

    rounds: int = 0
    copies: int = 0  # tables copied whole
    rows_applied: int = 0
    removed: int = 0
    errors: int = 0
    last_error: str = ""
    caught_up_at: float | None = None  # wall time a round last brought every table current
    source_changed_at: float | None = None  # the training shard's newest change applied


class ShardFollower:
    """Keeps the read-only ``replica`` a copy of the training shard ``source``."""

    def __init__(
        self,
        replica: StoreShard,
        source: ChangeSource,
        *,
        poll_s: float = FOLLOW_POLL_S,
        page_rows: int = PAGE_ROWS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not replica.read_only:
            msg = "ShardFollower: the replica must be a read-only StoreShard (read_only=True)"
            raise ValueError(msg)
        self.replica = replica
        self.source = source
        self.poll_s = poll_s
        self.page_rows = page_rows
        self._clock = clock
        # table -> (epoch, version) the replica holds; from the checkpoint it restored.
        self._positions: dict[str, tuple[str, int]] = dict(replica.restored_logs)
        self._current: set[str] = set()  # tables brought current since this follower started
        self.caught_up = threading.Event()
        if not self._positions:
            # Nothing restored: until the first copy, a read would get initial rows for
            # every id (a model's worth of wrong answers), so reads are refused instead.
            replica.unavailable = "this serving replica is copying its training shard; ask again"
        self.stats = FollowStats()

    @property
    def copies(self) -> int:
        return self.stats.copies

    def position(self, table: str) -> tuple[str, int] | None:
        """(epoch, version) of the training shard's log that the replica holds ``table`` at."""
        return self._positions.get(table)

    def sync_table(self, name: str, changes: TableChanges | None = None) -> None:
        """Bring one table to the training shard's current version (``changes``: what
        the shard answered for it already)."""
        if changes is None:
            epoch, since = self._positions.get(name, ("", 0))
            changes = self.source.changes(name, epoch, since)
        if changes.complete:
            self._apply(self.replica.table(name), changes)
        else:
            self._copy(name, changes.epoch, changes.version)
        self._current.add(name)

    def _apply(self, table: EmbeddingTable, changes: TableChanges) -> None:
        apply_changes(table, changes.ids, changes.weights, changes.removed)
        self._positions[table.name] = (changes.epoch, changes.version)
        self.stats.rows_applied += int(changes.ids.shape[0])
        self.stats.removed += int(changes.removed.shape[0])
        previous = self.stats.source_changed_at or 0.0
        self.stats.source_changed_at = max(previous, changes.changed_at)

    def _copy(self, name: str, epoch: str, version: int) -> None:
        """Copy ``name`` whole from the version ``(epoch, version)`` on, and swap it in."""
        for _ in range(_COPY_ATTEMPTS):
            table = self.replica.new_table(name)
            try:
                cursor = 0
                while cursor >= 0:
                    ids, weights, cursor = self.source.rows_page(name, cursor, self.page_rows)
                    table.load_weights(ids, weights)
                # Rows changed while the pages were read, as they are now.
                changes = self.source.changes(name, epoch, version)
                if changes.complete:
                    self._apply(table, changes)
                    self.replica.replace_table(table)
                    self.stats.copies += 1
                    log.info("replica: copied table %r (%d rows)", name, len(table))
                    return
            except BaseException:
                release_tables([table])
                raise
            release_tables([table])
            # The shard restarted, or changed faster than its log remembers: again.
            epoch, version = changes.epoch, changes.version
        msg = (
            f"table {name!r}: the training shard changed faster than its change log "
            f"remembers in {_COPY_ATTEMPTS} copies; raise the table's change_log_ids"
        )
        raise StoreError(msg)

    def sync_once(self) -> bool:
        """One round over every table; True when all are current (the replica is ready).

        A table that fails is logged and tried again next round; the others go on.
        """
        ok = True
        names = list(self.replica.tables)
        answers: dict[str, TableChanges] = {}
        try:
            # One call for every table: a call per table costs the training shard a
            # call's overhead per table every round (``benchmarks/serve.py``).
            asks = [(n, *self._positions.get(n, ("", 0))) for n in names]
            answers = dict(zip(names, self.source.changes_many(asks), strict=True))
        except StoreError as exc:
            self._failed(exc)
            self.stats.rounds += 1
            return False
        for name in names:
            try:
                self.sync_table(name, answers[name])
            except StoreError as exc:
                ok = False
                self._failed(exc, name)
        self.stats.rounds += 1
        if ok and self._current >= set(self.replica.tables):
            self.stats.caught_up_at = self._clock()
            self.replica.unavailable = None
            self.caught_up.set()
            return True
        return False

    def _failed(self, exc: StoreError, table: str | None = None) -> None:
        self.stats.errors += 1
        if str(exc) != self.stats.last_error:
            what = f"table {table!r}" if table is not None else "the training shard"
            log.warning("replica: following %s: %s", what, exc)
        self.stats.last_error = str(exc)

    def run(self, stop: threading.Event) -> None:
        """Follow until ``stop`` is set, a round every ``poll_s``."""
        while not stop.is_set():
            started = time.monotonic()
            self.sync_once()
            stop.wait(max(0.0, self.poll_s - (time.monotonic() - started)))

    def current_at(self) -> float:
        """Wall time of the newest round that brought every table current (0: none yet)."""
        return self.stats.caught_up_at or 0.0

    def health(self) -> str:
        """What the replica's Health answers: SERVING once caught up, else SYNCING."""
        return "SERVING" if self.caught_up.is_set() else "SYNCING"
