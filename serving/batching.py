"""Dynamic batching: requests that arrive while the model is busy are scored together.

A request's cost is mostly fixed (decoding and validating its records, hashing,
building tensors, one forward pass), so the requests the server's loop read
while the model was busy are joined into its next call, up to
``max_records`` records: under concurrent load requests share that fixed cost,
while a lone request goes straight through. Records are scored as they would
be alone (one row per record; the dense version and the rows are those of the
shared call).

A bad record fails only its own request: a joined call that finds one scores
its requests again one by one, so each gets its own 400 with its own
indices.

A request that finds the model idle (no call for ``idle_s``, nothing waiting)
can be scored at once (:meth:`LoopBatcher.score`): paced requests then skip
the turns of the loop that joining costs, and take less of the server's CPU
(``benchmarks/serve.py`` paces them beside training), while the requests of a
busy server still wait for their turn's others.

What waits is bounded: a request that would take the records waiting past
``max_queued_records`` is shed at once (:class:`~serving.types.Overloaded`,
503 with ``Retry-After``); one whose deadline passes while it waits is
answered :class:`~serving.types.DeadlineExceeded` (504) without being scored;
and a joined call is given the latest of its requests' deadlines. Requests of
a lower nonzero ``priority`` (Triton's: 1 is the highest) are scored first;
0, the default, comes last.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from serving.types import BadRecords, Deadline, DeadlineExceeded, Overloaded, Prediction

log = logging.getLogger("streamrec.serve")


class Scorer(Protocol):
    def predict(self, records: Sequence[bytes]) -> Prediction: ...


# Told a request's prediction, or the error scoring it raised.
Done = Callable[[Prediction | None, Exception | None], None]


@dataclass
class _Waiting:
    records: Sequence[bytes]
    done: asyncio.Future[Prediction] | Done
    deadline: Deadline | None = None
    priority: int = 0


def _latest(group: Sequence[_Waiting]) -> Deadline | None:
    """The deadline a joined call keeps: its requests' latest (None if one has none)."""
    latest: Deadline | None = None
    for waiting in group:
        if waiting.deadline is None:
            return None
        if latest is None or waiting.deadline.at > latest.at:
            latest = waiting.deadline
    return latest


def _order(waiting: _Waiting) -> int:
    # Triton's priorities: 1 is the highest; 0 (no priority given) after every level.
    return waiting.priority if waiting.priority > 0 else 1 << 63


def takes_deadline(scorer: object) -> bool:
    """Whether ``scorer.predict`` takes a ``deadline`` keyword.

    >>> class Old:
    ...     def predict(self, records): ...
    >>> class New:
    ...     def predict(self, records, *, deadline=None): ...
    >>> takes_deadline(Old()), takes_deadline(New())
    (False, True)
    """
    try:
        parameters = inspect.signature(scorer.predict).parameters  # type: ignore[attr-defined]
    except (AttributeError, TypeError, ValueError):
        return False
    return "deadline" in parameters


def split_prediction(prediction: Prediction, sizes: Sequence[int]) -> list[Prediction]:
    """One joined call's prediction cut back into its requests' (``sizes`` records each).

    >>> import numpy as np
    >>> joined = Prediction({"y": np.arange(5, dtype=np.float32)}, {"dense_version": 3})
    >>> [p.probabilities["y"].tolist() for p in split_prediction(joined, [2, 0, 3])]
    [[0.0, 1.0], [], [2.0, 3.0, 4.0]]
    """
    out, start = [], 0
    for n in sizes:
        probabilities = {h: p[start : start + n] for h, p in prediction.probabilities.items()}
        out.append(Prediction(probabilities, dict(prediction.parameters)))
        start += n
    return out


class LoopBatcher:
    """Joins the requests submitted in one turn of an asyncio loop, and scores them there.

    ``submit`` queues a request and, for the first of a turn, schedules one
    call for the next turn: every request whose handler ran in between (all
    that the loop read while the previous call ran) is joined into it, up to
    ``max_records`` records. The loop's thread scores: handing requests to a
    model thread and back costs two thread wake-ups each, which shows in both
    the latency of a lone request and the rate of many clients (see
    ``benchmarks/serve.py``).

    >>> import asyncio, numpy as np
    >>> from serving.types import Prediction
    >>> class Half:
    ...     def predict(self, records):
    ...         return Prediction({"click": np.full(len(records), 0.5, np.float32)}, {})
    >>> batcher = LoopBatcher(Half())
    >>> async def two():
    ...     return await asyncio.gather(batcher.submit([b"{}"]), batcher.submit([b"{}", b"{}"]))
    >>> [p.probabilities["click"].tolist() for p in asyncio.run(two())], batcher.calls
    ([[0.5], [0.5, 0.5]], 1)
    """

    def __init__(
        self,
        scorer: Scorer,
        *,
        max_records: int = 4096,
        idle_s: float = 0.001,
        max_queued_records: int | None = None,
    ) -> None:
        """``max_records``: no joined call holds more (a larger request runs alone);
        ``idle_s``: :meth:`score` scores at once after this long without a call;
        ``max_queued_records``: a request that would take the records waiting past
        this is shed (an empty queue takes any request); None: 16 calls' worth."""
        if max_records < 1:
            msg = f"max_records: expected at least 1, got {max_records}"
            raise ValueError(msg)
        queued = 16 * max_records if max_queued_records is None else max_queued_records
        if queued < 1:
            msg = f"max_queued_records: expected at least 1, got {max_queued_records}"
            raise ValueError(msg)
        self.scorer = scorer
        self.max_records = max_records
        self.max_queued_records = queued
        self.idle_s = idle_s
        self.calls = 0  # calls of the scorer, for the metrics and tests
        self.joined = 0  # requests that shared a call with others
        self.shed = 0  # requests refused because the queue was full
        self.expired = 0  # requests whose deadline passed while they waited
        self._pending: list[_Waiting] = []
        self._pending_records = 0
        self._scheduled = False
        self._last_end = -float("inf")  # when the scorer last returned (perf_counter)
        self._deadlines = takes_deadline(scorer)

    def score(
        self,
        records: Sequence[bytes],
        done: Done,
        *,
        deadline: Deadline | None = None,
        priority: int = 0,
    ) -> None:
        """Score ``records`` and tell ``done``: at once when the model has been idle
        for ``idle_s`` and nothing waits (a lone request), else as :meth:`submit`
        does, with the others of this turn. Requests that follow a call closely
        (those read while it ran) are the ones that share a call.

        >>> import numpy as np
        >>> class Half:
        ...     def predict(self, records):
        ...         return Prediction({"click": np.full(len(records), 0.5, np.float32)}, {})
        >>> batcher, got = LoopBatcher(Half()), []
        >>> batcher.score([b"{}"], lambda p, e: got.append(p.probabilities["click"].tolist()))
        >>> got, batcher.calls  # idle: scored at once, without a loop
        ([[0.5]], 1)
        """
        waiting = _Waiting(records, done, deadline, priority)
        if not self._pending and time.perf_counter() - self._last_end >= self.idle_s:
            self._alone(waiting)
            return
        self._queue(waiting)

    def submit(
        self, records: Sequence[bytes], *, deadline: Deadline | None = None, priority: int = 0
    ) -> asyncio.Future[Prediction]:
        """Score ``records`` on the running loop, joined with the others of this turn."""
        done: asyncio.Future[Prediction] = asyncio.get_running_loop().create_future()
        self._queue(_Waiting(records, done, deadline, priority))
        return done

    def _queue(self, waiting: _Waiting) -> None:
        n = len(waiting.records)
        if self._pending and self._pending_records + n > self.max_queued_records:
            self.shed += 1
            message = (
                f"server busy: {self._pending_records} records wait to be scored and this "
                f"request's {n} would pass serving.max_queued_records "
                f"({self.max_queued_records}); retry after the Retry-After seconds"
            )
            _settle(waiting, None, Overloaded(message))
            return
        self._pending.append(waiting)
        self._pending_records += n
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._drain)

    def _drain(self) -> None:
        self._scheduled = False
        pending, self._pending = self._pending, []
        self._pending_records = 0
        if any(w.priority for w in pending):
            pending.sort(key=_order)  # stable: arrival order within a level
        group: list[_Waiting] = []
        n = 0
        for waiting in pending:
            if waiting.deadline is not None and waiting.deadline.passed():
                # Scored requests before it took its time: answered without scoring.
                self.expired += 1
                _settle(waiting, None, _late(waiting.deadline, "waiting in the queue"))
                continue
            if group and n + len(waiting.records) > self.max_records:
                self._score(group)
                group, n = [], 0
            group.append(waiting)
            n += len(waiting.records)
        if group:
            self._score(group)

    def _score(self, group: list[_Waiting]) -> None:
        if len(group) == 1:
            self._alone(group[0])
            return
        records = [r for w in group for r in w.records]
        self.calls += 1
        self.joined += len(group)
        try:
            prediction = self._predict(records, _latest(group))
        except BadRecords:
            for waiting in group:  # each request gets its own bad records, or its answer
                self._alone(waiting)
            return
        except Exception as exc:
            for waiting in group:
                _settle(waiting, None, exc)
            return
        parts = split_prediction(prediction, [len(w.records) for w in group])
        for waiting, part in zip(group, parts, strict=True):
            _settle(waiting, part, None)

    def _alone(self, waiting: _Waiting) -> None:
        deadline = waiting.deadline
        if deadline is not None and deadline.passed():
            self.expired += 1
            _settle(waiting, None, _late(deadline, "waiting in the queue"))
            return
        self.calls += 1
        try:
            prediction = self._predict(waiting.records, deadline)
        except Exception as exc:
            _settle(waiting, None, exc)
        else:
            _settle(waiting, prediction, None)

    def _predict(self, records: Sequence[bytes], deadline: Deadline | None) -> Prediction:
        try:
            if self._deadlines and deadline is not None:
                return self.scorer.predict(records, deadline=deadline)  # type: ignore[call-arg]
            return self.scorer.predict(records)
        finally:
            self._last_end = time.perf_counter()


def _late(deadline: Deadline, stage: str) -> DeadlineExceeded:
    return DeadlineExceeded(deadline.timeout_s, stage)


def _settle(waiting: _Waiting, result: Prediction | None, exc: Exception | None) -> None:
    done = waiting.done
    if not isinstance(done, asyncio.Future):
        try:
            done(result, exc)
        except Exception:  # one request's answer must not fail the others of its call
            log.exception("answering a scored request")
        return
    if done.done():  # cancelled with its request
        return
    if exc is not None:
        done.set_exception(exc)
    else:
        done.set_result(result)  # type: ignore[arg-type]
