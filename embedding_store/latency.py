"""A small thread-safe latency histogram with fixed Prometheus-style buckets.

Each gRPC servicer (and in-process transport) owns its own histograms; nothing
here is global. ``snapshot()`` gives a frozen ``LatencySnapshot`` (defined in
``types``, with every other result type) whose counts are cumulative, as
Prometheus' ``le`` buckets are.

>>> hist = LatencyHistogram()
>>> for seconds in (0.0002, 0.0003, 0.004, 0.004):
...     hist.observe(seconds)
>>> snap = hist.snapshot()
>>> snap.count, round(snap.sum_s, 6)
(4, 0.0085)
>>> dict(zip(snap.buckets, snap.counts))[0.005]  # observations of at most 5 ms
4
>>> snap.quantile(0.5)  # the 2nd of 4 lies in (0.25 ms, 0.5 ms]
0.0005
>>> with hist.time():  # times the block, even when it raises
...     pass
>>> hist.snapshot().count
5
"""

from __future__ import annotations

import bisect
import itertools
import math
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from embedding_store.types import LatencySnapshot

__all__ = ["DEFAULT_BUCKETS_S", "LatencyHistogram", "LatencySnapshot"]

# From 100 µs (an in-memory lookup of a few ids) to 2.5 s (a stalled shard);
# every histogram of the store uses these, so shards' histograms can be summed.
DEFAULT_BUCKETS_S: tuple[float, ...] = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    math.inf,
)


class LatencyHistogram:
    """Counts of observed durations (seconds) per bucket; safe to share between threads.

    ``buckets_s``: the upper bounds, positive and strictly increasing; ``+inf``
    is appended when missing.

    >>> LatencyHistogram((0.1, 0.01))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: buckets_s must be positive, finite and strictly increasing ... got (0.1, 0.01)
    """

    def __init__(self, buckets_s: Sequence[float] = DEFAULT_BUCKETS_S) -> None:
        bounds = tuple(float(b) for b in buckets_s)
        if bounds and bounds[-1] == math.inf:
            bounds = bounds[:-1]
        if (
            not bounds
            or not all(math.isfinite(b) and b > 0.0 for b in bounds)
            or any(not lo < hi for lo, hi in itertools.pairwise(bounds))
        ):
            msg = (
                "buckets_s must be positive, finite and strictly increasing (then +inf), "
                f"got {tuple(buckets_s)}"
            )
            raise ValueError(msg)
        self.buckets_s: tuple[float, ...] = (*bounds, math.inf)
        self._lock = threading.Lock()
        # Per bucket, not cumulative: observe() touches one counter.
        self._counts = [0] * len(self.buckets_s)
        self._sum_s = 0.0

    def observe(self, seconds: float) -> None:
        """Count one duration; it falls in the first bucket whose bound is >= it."""
        if not (seconds >= 0.0 and math.isfinite(seconds)):
            msg = f"observe: a duration must be finite and non-negative, got {seconds}"
            raise ValueError(msg)
        i = bisect.bisect_left(self.buckets_s, seconds)
        with self._lock:
            self._counts[i] += 1
            self._sum_s += seconds

    @contextmanager
    def time(self) -> Iterator[None]:
        """Observe how long the ``with`` block takes (also when it raises)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.observe(max(0.0, time.perf_counter() - start))

    def snapshot(self) -> LatencySnapshot:
        """The counts so far, cumulative, taken consistently under the lock."""
        with self._lock:
            counts = list(self._counts)
            sum_s = self._sum_s
        running, cumulative = 0, []
        for c in counts:
            running += c
            cumulative.append(running)
        return LatencySnapshot(
            buckets=self.buckets_s, counts=tuple(cumulative), sum_s=sum_s, count=running
        )
