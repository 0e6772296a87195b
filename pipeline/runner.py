"""``StreamRunner``: turns a source into prepared batches on a Dask cluster.

It plans chunks per partition, submits one ``prepare`` task per chunk
(round-robin over partitions), keeps at most ``staleness`` prepared batches in
flight, and yields them in the order they were submitted: so in source order
within each partition, and a batch is never overtaken by one looked up after
it. While the consumer holds a batch, at most ``staleness`` more are in
flight: a batch is trained at most ``staleness`` batches after its lookup,
which is the staleness bound (yielding whichever batch finished first would
let a slow one be overtaken, and miss more pushes than that).
``positions`` is, per partition, the end of the last batch yielded: every
record before it has been handed to the consumer exactly once.

``staleness=0`` is the synchronous mode: the next chunk is submitted (and its
rows looked up) only when the consumer asks for the next batch, i.e. after it
has pushed the gradients of the previous one.

With ``idle_ticks=True`` the iterator yields ``None`` whenever the source has
nothing new (a quiet Kafka partition) instead of waiting: a trainer rank in a
group must keep taking part in the per-step collective while its partitions
are quiet, or the other ranks would wait for it.

Each task prefers the next of the cluster's workers in turn (any other may
take it), so every worker reads, decodes and looks up. A task that fails, or
whose worker dies, is retried (its chunk is re-read from the source), so a
lost worker costs a retry, never a record.

``max_events`` bounds the records this run reads: chunks are planned so that
the records yielded never exceed it (a chunk is cut short at the budget), and
the iterator ends once it is spent. With ``budget_open`` (one rank of several
sharing a job's budget) a spent budget does not end the iterator: it ticks
``None`` while the ranks may still move budget to it (:meth:`allow`), and
:meth:`has_more` says whether the source holds records past what was read.
Every wait (for a task, for a quiet source) also ends when ``stop_when()``
says so.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from distributed import Client, Future, wait

from connectors.codecs import Codec
from connectors.spec import FeatureSpec
from connectors.types import BadRecord, Chunk, DeadLetterSink, Source
from pipeline.prepare import PrepareContext, StoreAddress, StoreClientPlugin, prepare_in_context
from pipeline.types import PreparedBatch

Prepared = tuple[PreparedBatch, list[BadRecord]]


@dataclass
class RunnerStats:
    """What the runner has done so far."""

    batches: int = 0
    records: int = 0
    bad_records: int = 0
    bad_by_reason: dict[str, int] = field(default_factory=dict)
    wait_s: float = 0.0  # time the consumer waited for a batch


class StreamRunner:
    """Prepared batches from ``source``, computed on the Dask cluster behind ``client``."""

    def __init__(
        self,
        client: Client,
        source: Source,
        spec: FeatureSpec,
        store: StoreAddress | None,
        *,
        staleness: int = 4,
        codec: Codec | None = None,
        max_records: int = 10_000,
        positions: Mapping[str, int] | None = None,
        deadletter: DeadLetterSink | None = None,
        poll_interval_s: float = 0.2,
        retries: int = 3,
        stop_when: Callable[[], bool] | None = None,
        idle_ticks: bool = False,
        max_events: int | None = None,
        budget_open: bool = False,
    ) -> None:
        if staleness < 0:
            msg = f"staleness must be >= 0, got {staleness}"
            raise ValueError(msg)
        if max_records < 1:
            msg = f"max_records must be >= 1, got {max_records}"
            raise ValueError(msg)
        if max_events is not None and max_events < 0:
            msg = f"max_events must be >= 0, got {max_events}"
            raise ValueError(msg)
        self.client = client
        self.source = source
        self.spec = spec
        self.store = store
        self.staleness = staleness
        self.codec = codec
        self.max_records = max_records
        self.deadletter = deadletter
        self.poll_interval_s = poll_interval_s
        self.retries = retries
        # Checked while the source has nothing new: a continuous stream that has
        # gone quiet still ends on Ctrl-C or --max-time.
        self.stop_when = stop_when
        self.idle_ticks = idle_ticks
        self.max_events = max_events
        self.budget_open = budget_open
        self.stats = RunnerStats()
        self._given = dict(positions or {})
        # Per partition: where this run started, where the next chunk starts, and
        # the end of the last batch yielded.
        self._first: dict[str, int] = {}
        self._planned: dict[str, int] = {}
        self._done: dict[str, int] = {}
        # The batches not yet yielded, every partition's, in submission order (the
        # order they are yielded in), with the positions each chunk spans and the
        # fetch of the task's result.
        self._submitted: deque[tuple[Future[Prepared], int, cf.Future[Prepared]]] = deque()
        # Fetches each task's result as soon as it is computed, while the consumer
        # trains: a Dask result stays on its worker until asked for, and asking only
        # when the batch is due would put its transfer on every step's critical path.
        self._fetcher: cf.ThreadPoolExecutor | None = None
        self._order: list[str] = []
        self._next_partition = 0
        self._closed = False
        self._token = uuid.uuid4().hex[:8]
        # The workers tasks are spread over, round-robin (refreshed with the partitions).
        self._workers: list[str] = []
        self._next_worker = int(self._token, 16)  # ranks sharing a cluster start apart
        if store is not None:
            client.register_plugin(StoreClientPlugin(store), name=StoreClientPlugin.name)
        self._context = f"streamrec-prepare-{self._token}"
        client.register_plugin(PrepareContext(self._context, source, spec, codec))

    # --- positions ----------------------------------------------------------------

    @property
    def positions(self) -> dict[str, int]:
        """Per partition, every position below this has been yielded (exactly once)."""
        return dict(self._done)

    def _refresh_partitions(self) -> None:
        for p in self.source.partitions():
            if p not in self._planned:
                start = self._given.get(p)
                if start is None:
                    start = self.source.start_position(p)
                self._first[p] = start
                self._planned[p] = start
                self._done[p] = start
                self._order.append(p)

    def _refresh_workers(self) -> None:
        with contextlib.suppress(Exception):  # a lost scheduler fails the tasks, not this
            self._workers = sorted(self.client.scheduler_info().get("workers", {}))

    def _inflight_count(self) -> int:
        return len(self._submitted)

    def _budget(self) -> int | None:
        """Records that may still be planned under ``max_events`` (None: no bound).

        A chunk in flight counts for its whole span: it holds at most that many records.
        """
        if self.max_events is None:
            return None
        read = self.stats.records + self.stats.bad_records
        return self.max_events - read - sum(span for _, span, _ in self._submitted)

    # --- submission -----------------------------------------------------------------

    def _submit(self, chunk: Chunk) -> Future[Prepared]:
        # Unique per runner and range: a key reused after a cancel (a resumed runner
        # planning a different range from the same start) would return the old task.
        key = f"prepare-{chunk.name}-{chunk.start}-{chunk.end}-{self._token}"
        # Each task prefers the next worker in turn (any other may take it, a lost one's
        # too). Left to choose, the scheduler gives nearly every task to one idle
        # worker, so a job's pipeline would run on one worker whatever
        # cluster.workers says.
        placement: dict[str, object] = {}
        if self._workers:
            worker = self._workers[self._next_worker % len(self._workers)]
            self._next_worker += 1
            placement = {"workers": [worker], "allow_other_workers": True}
        return self.client.submit(
            prepare_in_context,
            chunk,
            self._context,
            lookup=self.store is not None,
            key=key,
            retries=self.retries,
            pure=False,
            **placement,
        )

    def _top_up(self, limit: int) -> None:
        """Submit chunks round-robin over partitions until ``limit`` are in flight."""
        stalled = 0
        while self._inflight_count() < limit and self._order and stalled < len(self._order):
            budget = self._budget()
            if budget is not None and budget <= 0:
                return
            p = self._order[self._next_partition % len(self._order)]
            self._next_partition += 1
            size = self.max_records if budget is None else min(self.max_records, budget)
            chunk = self.source.plan(p, self._planned[p], size)
            if chunk is None:
                stalled += 1
                continue
            stalled = 0
            self._planned[p] = chunk.end
            future = self._submit(chunk)
            if self._fetcher is None:
                self._fetcher = cf.ThreadPoolExecutor(1, thread_name_prefix="streamrec-fetch")
            fetch = self._fetcher.submit(future.result)
            self._submitted.append((future, chunk.end - chunk.start, fetch))

    def _finished(self) -> bool:
        if self._inflight_count():
            return False
        budget = self._budget()
        if budget is not None and budget <= 0 and not self.budget_open:
            return True
        return all(self.source.is_finished(p, self._planned[p]) for p in self._order)

    # --- a budget shared with other ranks ------------------------------------------

    def has_more(self) -> bool:
        """Whether the source holds a record past what was planned (one ask of the
        source per partition: for Kafka, its log end)."""
        return any(self.source.plan(p, self._planned[p], 1) is not None for p in self._order)

    def allow(self, more: int) -> None:
        """From now on read at most ``more`` records beyond those yielded: what is in
        flight is dropped (its records are read again if the budget comes back)."""
        if more < 0:
            msg = f"more: expected a record count >= 0, got {more}"
            raise ValueError(msg)
        if self._submitted:
            self.client.cancel([f for f, _, _ in self._submitted])
            self._submitted.clear()
            self._planned = dict(self._done)
        self.max_events = self.stats.records + self.stats.bad_records + more

    def _stopping(self) -> bool:
        return self.stop_when is not None and self.stop_when()

    # --- iteration ------------------------------------------------------------------

    def __iter__(self) -> Iterator[PreparedBatch | None]:
        self._refresh_partitions()
        self._refresh_workers()
        # While the consumer trains on a batch, ``staleness`` more are in flight, so
        # a lookup misses the pushes of at most ``staleness`` earlier batches.
        limit = self.staleness + 1
        last_refresh = time.monotonic()
        quiet_until = 0.0
        while not self._closed:
            if time.monotonic() - last_refresh > 5.0:
                self._refresh_partitions()
                self._refresh_workers()
                last_refresh = time.monotonic()
            asked = bool(self._inflight_count()) or time.monotonic() >= quiet_until
            if asked:
                self._top_up(limit)
            if not self._submitted:
                if self._finished() or self._stopping():
                    return
                if asked:
                    # Asking the source again at once would only cost broker round trips.
                    quiet_until = time.monotonic() + self.poll_interval_s
                if self.idle_ticks:
                    yield None
                    continue
                time.sleep(self.poll_interval_s)
                self._refresh_partitions()
                continue
            t0 = time.perf_counter()
            future, _, fetch = self._submitted[0]
            # In slices: a task stuck on a source that went away must not hold a stop up.
            while not future.done():
                if self._stopping():
                    return
                with contextlib.suppress(TimeoutError):
                    wait([future], timeout=self.poll_interval_s)
            self.stats.wait_s += time.perf_counter() - t0
            batch, bad = fetch.result()
            self._submitted.popleft()
            future.release()
            self._record(batch, bad)
            yield batch
            # Only now, when the consumer asks for more, may staleness-0 submit the next.

    def _record(self, batch: PreparedBatch, bad: list[BadRecord]) -> None:
        self._done[batch.partition] = batch.end
        self.stats.batches += 1
        self.stats.records += len(batch)
        self.stats.bad_records += len(bad)
        for reason, n in batch.bad_by_reason.items():  # counted by prepare
            self.stats.bad_by_reason[reason] = self.stats.bad_by_reason.get(reason, 0) + n
        if bad and self.deadletter is not None:
            self.deadletter.write(bad)

    def progress(self) -> tuple[int, int | None]:
        """(records yielded, records to yield in this run or None) over all partitions."""
        done = sum(self._done[p] - self._first[p] for p in self._order)
        ends = [self.source.end_position(p) for p in self._order]
        if any(e is None for e in ends):
            return done, None
        total = sum((e or 0) - self._first[p] for p, e in zip(self._order, ends, strict=True))
        return done, total

    def close(self) -> None:
        """Cancel what is in flight; the positions stay those of the batches yielded."""
        was_open = not self._closed
        self._closed = True
        if self._submitted:
            self.client.cancel([f for f, _, _ in self._submitted])
        self._submitted.clear()
        if self._fetcher is not None:
            # Its fetches end with the cancelled tasks; nothing waits for them.
            self._fetcher.shutdown(wait=False, cancel_futures=True)
        # Workers drop their copy of the context (and its connections). Only while the
        # client is connected: a call to a scheduler that went away would wait for it,
        # and a restarted one has no copy anyway.
        if was_open and self.client.status == "running":
            with contextlib.suppress(Exception):
                self.client.unregister_worker_plugin(self._context)
