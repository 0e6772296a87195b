"""Dynamic batching: requests that arrive while the model is busy are scored together.

A request's cost is mostly fixed (decoding and validating its records column
by column, hashing, building tensors, one forward pass), so the model runs on
a thread of its own, and every request that came in while it was busy is
joined into its next call, up to ``max_records`` records: under concurrent
load requests share that fixed cost, while a lone request goes straight
through. The server's event loop meanwhile goes on reading and answering
requests. Records are scored as they would be alone (one row per record;
the dense version and the rows are those of the shared call).

A bad record fails only its own request: a joined call that finds one scores
its requests again one by one, so each gets its own 400 with its own
indices.

>>> import numpy as np
>>> from serving.types import Prediction
>>> class Half:
...     name, heads = "m", ("click",)
...     def predict(self, records):
...         return Prediction({"click": np.full(len(records), 0.5, np.float32)}, {"v": 1})
>>> batcher = RequestBatcher(Half())
>>> batcher.submit([b"{}", b"{}"]).result().probabilities["click"].tolist()
[0.5, 0.5]
>>> batcher.close()
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

from serving.types import BadRecords, Prediction

log = logging.getLogger(__name__)


class Scorer(Protocol):
    def predict(self, records: Sequence[bytes]) -> Prediction: ...


@dataclass
class _Waiting:
    records: Sequence[bytes]
    done: Future[Prediction] = field(default_factory=Future)


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


class RequestBatcher:
    """Runs a scorer on one thread, joining the requests that wait into one call."""

    def __init__(self, scorer: Scorer, *, max_records: int = 4096) -> None:
        """``max_records``: no joined call holds more (a larger request runs alone)."""
        if max_records < 1:
            msg = f"max_records: expected at least 1, got {max_records}"
            raise ValueError(msg)
        self.scorer = scorer
        self.max_records = max_records
        self.calls = 0  # calls of the scorer, for the metrics and tests
        self.joined = 0  # requests that shared a call with others
        self._queue: queue.SimpleQueue[_Waiting | None] = queue.SimpleQueue()
        self._held: _Waiting | None = None  # taken from the queue, too large to join
        self._thread = threading.Thread(target=self._run, name="serve-model", daemon=True)
        self._thread.start()

    def submit(self, records: Sequence[bytes]) -> Future[Prediction]:
        """Score ``records``; the future holds their prediction or the scorer's error."""
        waiting = _Waiting(records)
        self._queue.put(waiting)
        return waiting.done

    def close(self) -> None:
        """Stop after the requests already submitted."""
        self._queue.put(None)
        self._thread.join(timeout=60)

    def _next_group(self) -> list[_Waiting] | None:
        first = self._held if self._held is not None else self._queue.get()
        self._held = None
        if first is None:
            return None
        group, n = [first], len(first.records)
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return group
            if item is None:
                self._queue.put(None)  # stop once this group is answered
                return group
            if n + len(item.records) > self.max_records:
                self._held = item
                return group
            group.append(item)
            n += len(item.records)

    def _run(self) -> None:
        while True:
            group = self._next_group()
            if group is None:
                return
            self._score(group)

    def _score(self, group: list[_Waiting]) -> None:
        if len(group) == 1:
            self._alone(group[0])
            return
        records = [r for w in group for r in w.records]
        self.calls += 1
        self.joined += len(group)
        try:
            prediction = self.scorer.predict(records)
        except BadRecords:
            for waiting in group:  # each request gets its own bad records, or its answer
                self._alone(waiting)
            return
        except BaseException as exc:
            for waiting in group:
                waiting.done.set_exception(exc)
            return
        parts = split_prediction(prediction, [len(w.records) for w in group])
        for waiting, part in zip(group, parts, strict=True):
            waiting.done.set_result(part)

    def _alone(self, waiting: _Waiting) -> None:
        self.calls += 1
        try:
            waiting.done.set_result(self.scorer.predict(waiting.records))
        except BaseException as exc:
            waiting.done.set_exception(exc)
