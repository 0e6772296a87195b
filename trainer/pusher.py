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
>>> pusher = Pusher(store, run_id="fresh", fresh_rows=4)
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
import numpy.typing as npt

from embedding_store.client import StoreClient
from embedding_store.types import RowState, TableConfig
from pipeline.types import TableBatch
from trainer.fresh_rows import (
    PushRule,
    RecentPushes,
    SortedRows,
    latest_state,
    overlay_rows,
    predict_rows,
)

# Enough for any staleness bound a job would use; older pushes count as seen.
_APPLIED_TIMES_KEPT = 256

Grads = Mapping[str, tuple[npt.NDArray[np.uint64], npt.NDArray[np.float32]]]


class PushFailed(RuntimeError):
    """A push to the store failed; ``__cause__`` is the store's error."""


@dataclass
class Freshened:
    """What :meth:`Pusher.freshen` did to one batch, per row of its tables."""

    wait_s: float = 0.0  # waiting for this rank's last pushes to land
    # Rows by how many of this rank's pushes to them their lookup missed ...
    missed_by_row: dict[int, int] = field(default_factory=dict)
    # ... and by how many they were still without when trained (pushes in flight).
    trained_missed_by_row: dict[int, int] = field(default_factory=dict)
    replaced: int = 0  # rows whose value came from a push's reply instead of the lookup
    predicted: int = 0  # rows a push in flight will change, computed ahead of its reply
    waited: int = 0  # pushes in flight waited for (a row's state before them was unknown)


def _count(histogram: dict[int, int], values: npt.NDArray[np.int32]) -> None:
    counts = np.bincount(values) if values.shape[0] else np.zeros(0, np.int64)
    for k in np.flatnonzero(counts):
        histogram[int(k)] = histogram.get(int(k), 0) + int(counts[k])


def in_flight_hits(
    ids: npt.NDArray[np.uint64], pushes: list[InFlight], table: str
) -> npt.NDArray[np.int32]:
    """Per id, how many of the ``pushes`` not yet applied name it.

    >>> p = InFlight(1, {"t": (np.array([5, 2], np.uint64), np.zeros((2, 1), np.float32))})
    >>> in_flight_hits(np.array([2, 3], np.uint64), [p, p], "t").tolist()
    [2, 0]
    """
    hits = np.zeros(ids.shape[0], dtype=np.int32)
    for push in pushes:
        pushed = push.sorted_ids(table)
        if pushed is None or pushed.shape[0] == 0 or ids.shape[0] == 0:
            continue
        at = np.minimum(np.searchsorted(pushed, ids), pushed.shape[0] - 1)
        hits += pushed[at] == ids
    return hits


class InFlight:
    """A push submitted and not yet acknowledged: its number and gradients."""

    def __init__(self, seq: int, grads: Grads) -> None:
        self.seq = seq
        self.grads = grads
        self._sorted: dict[str, tuple[npt.NDArray[np.uint64], npt.NDArray[np.intp]]] = {}

    def _sort(self, table: str) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.intp]]:
        if table not in self._sorted:
            ids = np.asarray(self.grads[table][0], dtype=np.uint64)
            order = np.argsort(ids, kind="stable")
            self._sorted[table] = (ids[order], order)
        return self._sorted[table]

    def sorted_ids(self, table: str) -> npt.NDArray[np.uint64] | None:
        """The push's ids of ``table`` sorted (made on first use), None if it has none."""
        return self._sort(table)[0] if table in self.grads else None

    def grads_of(self, table: str, ids: npt.NDArray[np.uint64]) -> npt.NDArray[np.floating]:
        """The push's gradients of ``ids``, which it must all name."""
        sorted_ids, order = self._sort(table)
        return np.asarray(self.grads[table][1])[order[np.searchsorted(sorted_ids, ids)]]


class Pusher:
    """Applies pushes in submission order on one background thread."""

    def __init__(
        self,
        store: StoreClient,
        *,
        run_id: str,
        fresh_rows: int = 0,
        tables: Mapping[str, TableConfig] | None = None,
    ) -> None:
        """``fresh_rows``: remember the rows of this many recent pushes (0: ask for none).
        ``tables``: the store's table configs, to predict what a push in flight does
        to the rows (see :meth:`freshen`); None: wait for it instead.
        """
        self.store = store
        self._rules = {
            name: PushRule.of(config, store.grad_dtype) for name, config in (tables or {}).items()
        }
        # Request ids are unique per run incarnation: after a restore the same
        # batch is pushed again, and the store must not take it for a retry.
        self.run_id = run_id
        self.submitted = 0
        self.applied = 0
        self.push_s = 0.0  # time spent in the store's Push (background)
        # Unix times the most recent pushes were acknowledged, in order.
        self._applied_at: deque[float] = deque(maxlen=_APPLIED_TIMES_KEPT)
        self._queue: queue.Queue[tuple[int, Grads] | None] = queue.Queue()
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._recent = RecentPushes(fresh_rows) if fresh_rows > 0 else None
        self._in_flight: deque[InFlight] = deque()  # kept only with fresh_rows
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
            times = list(self._applied_at)
            unapplied = self.submitted - self.applied
        # The acknowledgement times increase: those after the lookup were missed.
        return unapplied + len(times) - bisect.bisect_right(times, looked_up_at)

    def submit(self, grads: Grads) -> None:
        """Queue one step's row gradients (returns at once)."""
        self._raise_if_failed()
        with self._cond:
            self.submitted += 1
            n = self.submitted
            if self._recent is not None:
                self._in_flight.append(InFlight(n, grads))
        self._queue.put((n, grads))

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
        store's arithmetic from their last answered state (needs ``tables``), or,
        where that state is not remembered, that push is waited for. So a row
        pushed at step t is what step t + 1 trains, at any staleness. Without
        ``tables`` the pushes in flight are waited for when ``wait``, else their
        rows are trained without them and counted. Needs ``fresh_rows``.

        A lookup time later than the true one only costs rows overlaid with the
        value they already had (this rank's pushes are its own); the lookup and the
        acknowledgement times come from the hosts' clocks, which are assumed in
        step to well under a step's time.
        """
        if self._recent is None:
            msg = "freshen: this Pusher was made without fresh_rows"
            raise RuntimeError(msg)
        out = Freshened()
        # The pushes in flight, oldest first: each predicted, or waited for.
        predicted: dict[str, list[SortedRows]] = {}  # newest first
        with self._cond:
            in_flight = list(self._in_flight)
        i = 0
        while i < len(in_flight):
            push = in_flight[i]
            plan = self._plan(push, tables, predicted) if self._rules else None
            if plan is not None:
                for name, (ids, before, grads) in plan.items():
                    after = predict_rows(before, grads, self._rules[name])
                    predicted.setdefault(name, []).insert(0, (ids, after))
                    out.predicted += ids.shape[0]
                i += 1
                continue
            if not (wait or self._rules):
                break  # trained without the pushes in flight
            out.wait_s += self._wait_for(push.seq)
            out.waited += 1
            # It and every push before it landed: their answers replace the predictions.
            predicted.clear()
            with self._cond:
                in_flight = list(self._in_flight)
            i = 0
        unpredicted = in_flight[i:]
        with self._cond:
            landed = self._recent.missed(self._recent.applied_by(looked_up_at))
        for name, table in tables.items():
            if table.rows is None:
                continue
            table.rows, missed = overlay_rows(table.unique_ids, table.rows, landed, name)
            table.rows, ahead = overlay_rows(
                table.unique_ids, table.rows, list(reversed(predicted.get(name, []))), name
            )
            still = in_flight_hits(table.unique_ids, unpredicted, name)
            _count(out.missed_by_row, missed + ahead + still)
            _count(out.trained_missed_by_row, still)
            out.replaced += int(np.count_nonzero(missed + ahead))
        return out

    def _plan(
        self,
        push: InFlight,
        tables: Mapping[str, TableBatch],
        predicted: Mapping[str, list[SortedRows]],
    ) -> dict[str, tuple[npt.NDArray[np.uint64], RowState, npt.NDArray[np.floating]]] | None:
        """Per table, the batch's ids ``push`` names, their state before it and its
        gradients of them; None when some state is not known (or a table has no rule).
        """
        plan = {}
        for name, table in tables.items():
            pushed = push.sorted_ids(name)
            if pushed is None:
                continue
            ids = np.intersect1d(table.unique_ids, pushed, assume_unique=True)
            if ids.shape[0] == 0:
                continue
            if name not in self._rules:
                return None
            with self._cond:
                remembered = self._recent.newest_first(name, push.seq) if self._recent else []
            before, found = latest_state(ids, [*predicted.get(name, []), *remembered])
            if not found.all():
                return None
            plan[name] = (ids, before, push.grads_of(name, ids))
        return plan

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
            n, grads = item
            result = None
            if self._error is None:
                t0 = time.perf_counter()
                try:
                    result = self.store.push(
                        grads,
                        request_id=f"{self.run_id}-{n}",
                        return_rows=self._recent is not None,
                    )
                except BaseException as exc:  # handed to the trainer thread
                    with self._cond:
                        self._error = exc
                        self._cond.notify_all()
                    continue
                self.push_s += time.perf_counter() - t0
            with self._cond:
                now = time.time()
                if self._recent is not None and result is not None and result.rows is not None:
                    rows = result.rows
                    self._recent.add(n, now, {k: (ids, rows[k]) for k, (ids, _) in grads.items()})
                self.applied += 1
                self._applied_at.append(now)
                if self._in_flight and self._in_flight[0].seq == n:
                    self._in_flight.popleft()
                self._cond.notify_all()
