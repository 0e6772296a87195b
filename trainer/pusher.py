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
import numpy.typing as npt

from embedding_store.client import StoreClient
from embedding_store.types import RowState, TableConfig
from pipeline.types import TableBatch
from trainer.fresh_rows import PushRule, predict_rows
from trainer.row_cache import PushedRowCache

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


@dataclass(frozen=True)
class _TableView:
    """One table of a batch as this rank's pushes leave it."""

    missed: npt.NDArray[np.int32]  # per row: own pushes its lookup missed
    still: npt.NDArray[np.int32]  # per row: pushes in flight it is trained without
    replace: npt.NDArray[np.intp]  # rows whose value changes ...
    values: npt.NDArray[np.float32]  # ... to these (float32; rounded as a lookup rounds)
    predicted: int  # rows whose value is a prediction of a push in flight
    unknown_seq: int  # the newest push in flight naming a row not predicted (0: none)


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

    def names(self, table: str, ids: npt.NDArray[np.uint64]) -> npt.NDArray[np.bool_]:
        """Which of ``ids`` the push names in ``table``.

        >>> push = InFlight(1, {"t": (np.array([5, 2], np.uint64), np.zeros((2, 1), np.float32))})
        >>> ids = np.array([2, 3], np.uint64)
        >>> push.names("t", ids).tolist(), push.names("u", ids).tolist()
        ([True, False], [False, False])
        """
        pushed = self.sorted_ids(table)
        if pushed is None or pushed.shape[0] == 0:
            return np.zeros(ids.shape[0], np.bool_)
        at = np.minimum(np.searchsorted(pushed, ids), pushed.shape[0] - 1)
        hit: npt.NDArray[np.bool_] = pushed[at] == ids
        return hit

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
        fresh_rows: bool = False,
        cached_rows: int = 1 << 18,
        tables: Mapping[str, TableConfig] | None = None,
    ) -> None:
        """``fresh_rows``: ask each push for the rows it left and remember at most
        ``cached_rows`` of them per table, for :meth:`freshen`.
        ``tables``: the store's table configs, to predict what a push in flight does
        to the rows (see :meth:`freshen`); None: wait for it instead.
        """
        self.store = store
        self._rules = {
            name: PushRule.of(name, config, store.grad_dtype)
            for name, config in (tables or {}).items()
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
        self._fresh = fresh_rows
        self._max_cached = cached_rows
        self._caches: dict[str, PushedRowCache] = {}
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
            return self.submitted - self._applied_by(looked_up_at)

    def _applied_by(self, when: float) -> int:
        """How many pushes were applied at ``when`` (unix s); the caller holds the lock."""
        # The acknowledgement times increase: those after ``when`` were not yet.
        times = self._applied_at
        return self.applied - (len(times) - bisect.bisect_right(times, when))

    def submit(self, grads: Grads) -> None:
        """Queue one step's row gradients (returns at once)."""
        self._raise_if_failed()
        with self._cond:
            self.submitted += 1
            n = self.submitted
            if self._fresh:
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
        while True:
            with self._cond:
                in_flight = list(self._in_flight)
                applied_before = self._applied_by(looked_up_at)
            views = {
                name: self._view(name, table, in_flight, applied_before)
                for name, table in tables.items()
                if table.rows is not None
            }
            # Exact: a row the rank cannot predict waits for the last push naming it.
            unknown = [v.unknown_seq for v in views.values() if v.unknown_seq]
            if not (wait and unknown):
                break
            out.wait_s += self._wait_for(max(unknown))
            out.waited += 1
        for name, view in views.items():
            table = tables[name]
            rows = table.rows
            if rows is not None and view.replace.shape[0]:
                if not rows.flags.writeable:
                    rows = rows.copy()
                rows[view.replace] = view.values
                table.rows = rows
            _count(out.missed_by_row, view.missed)
            _count(out.trained_missed_by_row, view.still)
            out.replaced += int(view.replace.shape[0])
            out.predicted += view.predicted
        return out

    def _view(
        self, name: str, table: TableBatch, in_flight: list[InFlight], applied_before: int
    ) -> _TableView:
        """What this rank's pushes make of ``table``'s rows (see :meth:`freshen`)."""
        ids = table.unique_ids
        looked_up = np.asarray(table.rows)
        # Per push in flight, which of the batch's ids it names.
        named = [push.names(name, ids) for push in in_flight]
        pending = np.zeros(len(ids), np.int32)
        for mask in named:
            pending += mask
        ahead = np.flatnonzero(pending > 0)
        rule = self._rules.get(name)
        width = rule.optimizer.state_width(rule.dim) if rule is not None else 0
        mine = self._remembered(name, ids, ahead, applied_before, looked_up.shape[1], width)
        missed, known, rows, seq, landed, landed_values = mine
        predicted = 0
        if rule is None:
            known[:] = False
        else:
            if not known.all():
                # A row this rank has not pushed lately whose lookup read exactly what
                # the store starts it as is new: its state before the push is the
                # initial one (a row whose updates all rounded away would be predicted
                # one step wrong).
                unknown = np.flatnonzero(~known)
                start = rule.new_rows(ids[ahead[unknown]])
                seen = looked_up[ahead[unknown]]
                new = (start.weights.astype(seen.dtype) == seen).all(axis=1)
                at = unknown[new]
                rows.weights[at] = start.weights[new]
                rows.state[at] = start.state[new]
                rows.row_step[at] = 0
                seq[at] = 0
                known[at] = True
            for push, mask in zip(in_flight, named, strict=True):
                # Rows this push names whose remembered state predates it.
                at = np.flatnonzero(known & mask[ahead] & (seq < push.seq))
                if at.shape[0] == 0:
                    continue
                after = predict_rows(rows.take(at), push.grads_of(name, ids[ahead[at]]), rule)
                rows.weights[at] = after.weights
                rows.state[at] = after.state
                rows.row_step[at] = after.row_step
                seq[at] = push.seq
                predicted += at.shape[0]
        # A row in flight takes its prediction where known, else what landed (if any).
        replace_ahead = ahead[known]
        keep_landed = ~np.isin(landed, replace_ahead, assume_unique=True)
        replace = np.concatenate([landed[keep_landed], replace_ahead])
        values = np.concatenate([landed_values[keep_landed], rows.weights[known]])
        still = np.zeros(len(ids), np.int32)
        still[ahead[~known]] = pending[ahead[~known]]
        unknown_seq = max(
            (p.seq for p, m in zip(in_flight, named, strict=True) if (m & (still > 0)).any()),
            default=0,
        )
        return _TableView(missed + pending, still, replace, values, predicted, unknown_seq)

    def _remembered(
        self,
        name: str,
        ids: npt.NDArray[np.uint64],
        ahead: npt.NDArray[np.intp],
        applied_before: int,
        dim: int,
        width: int,
    ) -> tuple[
        npt.NDArray[np.int32],
        npt.NDArray[np.bool_],
        RowState,
        npt.NDArray[np.int64],
        npt.NDArray[np.intp],
        npt.NDArray[np.float32],
    ]:
        """What the cache of ``name`` knows of ``ids``: per id the pushes its lookup
        missed; for the ids ``ahead`` (named by a push in flight) whether a row is
        remembered, that row and the push that left it; the ids a landed push changed
        since the lookup, and their rows.
        """
        cache = self._caches.get(name)
        if cache is None:  # no push of this table has been answered yet
            k = len(ahead)
            nothing = RowState(
                np.zeros((k, dim), np.float32),
                np.zeros((k, width), np.float32),
                np.zeros(k, np.int64),
            )
            none = np.zeros(0, np.intp)
            return (
                np.zeros(len(ids), np.int32),
                np.zeros(k, np.bool_),
                nothing,
                np.zeros(k, np.int64),
                none,
                np.zeros((0, dim), np.float32),
            )
        with cache.lock:
            slots = cache.find(ids)
            missed = cache.missed(slots, applied_before)
            known = slots[ahead] >= 0
            safe = np.where(known, slots[ahead], 0)
            rows = cache.take(safe)
            seq = np.where(known, cache.seq[safe], 0)
            landed = np.flatnonzero(missed > 0)
            return missed, known, rows, seq, landed, cache.weights[slots[landed]]

    def _cache(self, table: str, rows: RowState) -> PushedRowCache:
        cache = self._caches.get(table)
        if cache is None:  # made on the pusher's thread only
            cache = PushedRowCache(
                rows.weights.shape[1], rows.state.shape[1], max_rows=self._max_cached
            )
            self._caches[table] = cache
        return cache

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
                        return_rows=self._fresh,
                    )
                except BaseException as exc:  # handed to the trainer thread
                    with self._cond:
                        self._error = exc
                        self._cond.notify_all()
                    continue
                self.push_s += time.perf_counter() - t0
            if self._fresh and result is not None and result.rows is not None:
                # Each table's cache has a lock of its own: freshen reads one table while
                # this thread fills the next, and a row that its push left is read as
                # landed (its seq), whether or not ``applied`` counts it yet.
                for name, (ids, _) in grads.items():
                    self._cache(name, result.rows[name]).put(
                        np.asarray(ids, np.uint64), result.rows[name], n
                    )
            with self._cond:
                now = time.time()
                self.applied += 1
                self._applied_at.append(now)
                if self._in_flight and self._in_flight[0].seq == n:
                    self._in_flight.popleft()
                self._cond.notify_all()
