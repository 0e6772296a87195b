"""``Pusher``: row gradients go to the store on a background thread, a bounded number ahead.

The trainer hands over each step's gradients and goes on with the next batch;
``wait(n)`` blocks until at most ``n`` pushes are still unapplied, which is how
the trainer keeps its staleness bound (a lookup issued after ``wait(q)``
misses at most ``q`` pushes plus the batches already prefetched). A failed
push is raised on the trainer's thread at its next call: a gradient is never
dropped silently.

>>> import time
>>> import numpy as np
>>> from embedding_store.client import StoreClient
>>> from embedding_store.types import StoreConfig
>>> store = StoreClient.connect("inproc://1", config=StoreConfig(tables={"t": {"dim": 2}}))
>>> ids = np.array([1, 2], dtype=np.uint64)
>>> _ = store.lookup({"t": ids})
>>> pusher = Pusher(store, run_id="doc")
>>> pusher.submit({"t": (ids, np.ones((2, 2), dtype=np.float32))})
>>> _ = pusher.drain()  # seconds waited
>>> pusher.applied, pusher.outstanding
(1, 0)
>>> pusher.missed_since(0.0), pusher.missed_since(time.time())  # before / after it landed
(1, 0)
>>> pusher.close()

With ``fresh_rows``, each push asks the store for the rows it changed, and
``freshen`` lays them over a batch that was looked up before they landed
(see :mod:`trainer.fresh_rows`):

>>> from pipeline.types import TableBatch
>>> pusher = Pusher(store, run_id="fresh", fresh_rows=True)
>>> looked_up = time.time()
>>> table = TableBatch(fields=("f",), unique_ids=ids, inverse=np.array([0, 1], np.int32),
...                    offsets=np.array([0, 1, 2], np.int32),
...                    rows=store.lookup({"t": ids})["t"])
>>> pusher.submit({"t": (ids, np.ones((2, 2), dtype=np.float32))})
>>> report = pusher.freshen({"t": table}, looked_up, wait=True)
>>> report.missed_by_row, bool((table.rows == store.lookup({"t": ids})["t"]).all())
({1: 2}, True)
>>> pusher.close()
"""

from __future__ import annotations

import bisect
import queue
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from embedding_store.client import StoreClient
from embedding_store.types import PushedRows, PushOrigin, ShardRows, TableConfig
from pipeline.types import TableBatch
from trainer.fresh_rows import (
    Answered,
    Freshened,
    Grads,
    GroupView,
    InFlight,
    PushRule,
    TableGroup,
    view_of,
)

# Enough for any staleness bound a job would use; older pushes count as seen.
_APPLIED_TIMES_KEPT = 256


class PushFailed(RuntimeError):
    """A push to the store failed; ``__cause__`` is the store's error."""


@dataclass
class SharedPushes:
    """What one rank tells the others at a step (:meth:`Pusher.share`): the gradients
    it is about to push at ``step`` (None: it has no batch), the rows its answered
    pushes left (by group), and which of its pushes were answered since it last told.
    """

    rank: int
    step: int
    grads: Grads | None
    answered: list[tuple[str, Answered]] = field(default_factory=list)
    answered_steps: list[int] = field(default_factory=list)


class Pusher:
    """Applies pushes in submission order on one background thread."""

    def __init__(
        self,
        store: StoreClient,
        *,
        run_id: str,
        fresh_rows: bool = False,
        cached_rows: int = 1 << 19,
        tables: Mapping[str, TableConfig] | None = None,
        rank: int = 0,
        ranks: int = 1,
    ) -> None:
        """``fresh_rows``: ask each push for the rows it left and remember at most
        about ``cached_rows`` of them per group of tables (those with the same
        arithmetic), for :meth:`freshen`.
        ``tables``: the store's table configs, to predict what a push in flight does
        to the rows (see :meth:`freshen`); None: wait for it instead.
        ``rank`` of ``ranks``: with several, the ranks tell each other their pushes
        (:meth:`share`, after :meth:`join`) and fresh rows include every rank's.
        """
        self.rank, self.ranks = rank, ranks
        self.store = store
        self._max_cached = cached_rows
        # Tables with the same arithmetic share a group (one cache, one pass per step);
        # a table whose config is not known is a group of its own, made when first met.
        self._groups: dict[str, tuple[TableGroup, int]] = {}
        self._groups_lock = threading.Lock()
        by_arithmetic: dict[str, list[tuple[str, PushRule | None]]] = {}
        for name, config in sorted((tables or {}).items()):
            rule = PushRule.of(name, config, store.grad_dtype)
            by_arithmetic.setdefault(rule.arithmetic, []).append((name, rule))
        for members in by_arithmetic.values():
            group = TableGroup(members, cached_rows=cached_rows, ranks=ranks)
            self._groups.update({name: (group, group.members[name]) for name, _ in members})
        # Request ids are unique per run incarnation: after a restore the same
        # batch is pushed again, and the store must not take it for a retry.
        self.run_id = run_id
        self.submitted = 0
        self.applied = 0
        self.push_s = 0.0  # time spent in the store's Push (background)
        # Unix times the most recent pushes were acknowledged, in order.
        self._applied_at: deque[float] = deque(maxlen=_APPLIED_TIMES_KEPT)
        self._queue: queue.Queue[tuple[InFlight, Grads] | None] = queue.Queue()
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._fresh = fresh_rows
        self._in_flight: deque[InFlight] = deque()  # kept only with fresh_rows
        # With several ranks: the others' pushes whose answers were not told yet (the
        # trainer's thread only), and what to tell them of this rank's.
        self._group_name: str | None = None
        self._others: list[InFlight] = []
        self._outbox: list[tuple[str, Answered]] = []
        self._answered_steps: list[int] = []
        self._thread = threading.Thread(target=self._run, name="streamrec-pusher", daemon=True)
        self._thread.start()

    @property
    def outstanding(self) -> int:
        with self._cond:
            return self.submitted - self.applied

    def missed_since(self, looked_up_at: float) -> int:
        """How many pushes submitted so far were not applied at ``looked_up_at`` (unix s).

        For a batch about to be trained, that is how many earlier pushes its
        lookup missed: its observed staleness. A push counts as applied when
        the store acknowledged it, which can only overcount by the reply's flight.
        """
        with self._cond:
            return self.submitted - self._applied_by(looked_up_at)

    def _applied_by(self, when: float) -> int:
        """How many pushes were applied at ``when`` (unix s); the caller holds the lock."""
        # The acknowledgement times increase: those after ``when`` were not yet.
        times = self._applied_at
        return self.applied - (len(times) - bisect.bisect_right(times, when))

    def join(self, group: str) -> None:
        """Name every push after its origin in ``group`` (one name for all the job's
        ranks): the store then says which of each rank's pushes its answers include.
        """
        self._group_name = group

    def submit(self, grads: Grads, *, step: int | None = None) -> None:
        """Queue the row gradients of ``step`` (default: the push's number; steps
        increase) and return at once."""
        self._raise_if_failed()
        with self._cond:
            self.submitted += 1
            push = InFlight(self.submitted, grads, rank=self.rank, step=step)
            if self._fresh:
                self._in_flight.append(push)
        self._queue.put((push, grads))

    def share(self, step: int, grads: Grads | None) -> SharedPushes:
        """What to tell the other ranks at ``step``, before pushing ``grads`` (see
        :class:`SharedPushes`); every rank then hands all ranks' to :meth:`take_shared`.
        """
        with self._cond:
            answered, self._outbox = self._outbox, []
            steps, self._answered_steps = self._answered_steps, []
        return SharedPushes(self.rank, step, grads, answered, steps)

    def unshare(self, shared: SharedPushes) -> None:
        """Put back what :meth:`share` took when it could not be told (no step)."""
        with self._cond:
            self._outbox[:0] = shared.answered
            self._answered_steps[:0] = shared.answered_steps

    def take_shared(self, told: list[SharedPushes]) -> None:
        """Keep what the other ranks answered pushes left, and know their next pushes."""
        for shared in told:
            if shared.rank == self.rank:
                continue
            for key, answered in shared.answered:
                # A group's key is its first table's name: the group of that table.
                self._group_of(key)[0].take(answered)
            if shared.answered_steps:
                done = set(shared.answered_steps)
                self._others = [
                    p for p in self._others if not (p.rank == shared.rank and p.step in done)
                ]
            if shared.grads:
                self._others.append(InFlight(0, shared.grads, rank=shared.rank, step=shared.step))

    def wait(self, at_most: int) -> float:
        """Block until at most ``at_most`` pushes are unapplied; returns the seconds waited."""
        t0 = time.perf_counter()
        with self._cond:
            while self.submitted - self.applied > at_most and self._error is None:
                self._cond.wait()
        self._raise_if_failed()
        return time.perf_counter() - t0

    def freshen(
        self, tables: Mapping[str, TableBatch], looked_up_at: float, *, wait: bool = False
    ) -> Freshened:
        """Bring ``tables``' looked-up rows up to date with this rank's own pushes.

        The rows that pushes landed after ``looked_up_at`` (unix s) changed are
        replaced by what those pushes left; the rows that the pushes still in
        flight (at most the push queue's bound) will change are predicted with the
        store's arithmetic from their last answered state (needs ``tables``).
        A row whose state is not remembered (this rank had not pushed it lately)
        is trained without the push in flight, and counted; with ``wait`` that
        push is waited for instead, so a row pushed at step t is what step t + 1
        trains, at any staleness. Needs ``fresh_rows``.

        A lookup time later than the true one only costs rows overlaid with the
        value they already had (this rank's pushes are its own); the lookup and the
        acknowledgement times come from the hosts' clocks, which are assumed in
        step to well under a step's time.
        """
        if not self._fresh:
            msg = "freshen: this Pusher was made without fresh_rows"
            raise RuntimeError(msg)
        out = Freshened()
        groups: dict[int, tuple[TableGroup, list[tuple[int, TableBatch]]]] = {}
        for name, table in tables.items():
            if table.rows is not None:
                group, number = self._group_of(name)
                groups.setdefault(id(group), (group, []))[1].append((number, table))
        views: list[GroupView] = []
        read = False
        while True:
            with self._cond:
                in_flight = sorted([*self._in_flight, *self._others], key=lambda p: p.order)
                applied_before = self._applied_by(looked_up_at)
            views = [
                view_of(group, batch, in_flight, applied_before, looked_up_at, self.rank)
                for group, batch in groups.values()
            ]
            if not wait:
                break
            # Exact: a row the rank cannot predict waits for the last push naming it ...
            unknown = [v.unknown_seq for v in views if v.unknown_seq]
            if unknown:
                out.wait_s += self._wait_for(max(unknown))
                out.waited += 1
                continue
            # ... and a row only other ranks' pushes in flight name is read again, with
            # what it includes: its lookup may or may not hold those pushes.
            if read or self._group_name is None:
                break
            read = True
            for (group, _), view in zip(groups.values(), views, strict=True):
                out.read += self._read_again(group, view)
        for view in views:
            view.apply(out)
        return out

    def _read_again(self, group: TableGroup, view: GroupView) -> int:
        """Read the rows ``view`` trains without a push in flight from the store, as of
        now, into ``group``'s cache; returns how many were read."""
        if view.unknown_ids.shape[0] == 0 or self._group_name is None:
            return 0
        names = {number: name for name, number in group.members.items()}
        ids = {
            names[int(number)]: view.unknown_ids[view.unknown_tab == number]
            for number in np.unique(view.unknown_tab)
        }
        origin = PushOrigin(self._group_name, self.rank, self.ranks, 0, read=True)
        rows = self.store.read_pushed(ids, origin=origin)
        if rows is not None:
            group.remember(rows.parts, rank=self.rank, step=0, push=0, acked=time.time())
        return int(view.unknown_ids.shape[0])

    def _group_of(self, name: str) -> tuple[TableGroup, int]:
        """The group of table ``name`` and its number there."""
        found = self._groups.get(name)
        if found is None:
            with self._groups_lock:
                found = self._groups.get(name)
                if found is None:
                    found = (
                        TableGroup([(name, None)], cached_rows=self._max_cached, ranks=self.ranks),
                        0,
                    )
                    self._groups[name] = found
        return found

    def _wait_for(self, seq: int) -> float:
        """Block until push ``seq`` is applied; returns the seconds waited."""
        t0 = time.perf_counter()
        with self._cond:
            while self.applied < seq and self._error is None:
                self._cond.wait()
        self._raise_if_failed()
        return time.perf_counter() - t0

    def drain(self) -> float:
        """Block until every submitted push is applied."""
        return self.wait(0)

    def close(self) -> None:
        """Stop the thread after the queued pushes (call ``drain`` first to see errors)."""
        self._queue.put(None)
        self._thread.join(timeout=60)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            msg = f"a push to the embedding store failed: {self._error}"
            raise PushFailed(msg) from self._error

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            push, grads = item
            n = push.seq
            result = None
            if self._error is None:
                t0 = time.perf_counter()
                request_id = (
                    PushOrigin(self._group_name, self.rank, self.ranks, push.step).request_id
                    if self._group_name is not None
                    else f"{self.run_id}-{n}"
                )
                try:
                    result = self.store.push(grads, request_id=request_id, return_rows=self._fresh)
                except BaseException as exc:  # handed to the trainer thread
                    with self._cond:
                        self._error = exc
                        self._cond.notify_all()
                    continue
                self.push_s += time.perf_counter() - t0
            answered_at = time.time()
            kept: list[tuple[str, Answered]] = []
            if self._fresh and result is not None and result.rows is not None:
                # Each group's cache has a lock of its own: freshen reads one group while
                # this thread fills the next, and a row that its push left is read as
                # landed (its seq), whether or not ``applied`` counts it yet.
                rows = result.rows
                parts = (
                    rows.parts
                    if isinstance(rows, PushedRows)
                    else [ShardRows({k: ids for k, (ids, _) in grads.items()}, None, rows)]
                )
                touched = {id(g): g for g, _ in map(self._group_of, grads)}
                for group in touched.values():
                    answered = group.remember(
                        parts, rank=self.rank, step=push.step, push=n, acked=answered_at
                    )
                    if self._group_name is not None:
                        kept.extend((group.key, a) for a in answered)
            with self._cond:
                self.applied += 1
                self._applied_at.append(answered_at)
                if self._in_flight and self._in_flight[0].seq == n:
                    self._in_flight.popleft()
                if self._group_name is not None:
                    self._outbox.extend(kept)
                    self._answered_steps.append(push.step)
                self._cond.notify_all()
