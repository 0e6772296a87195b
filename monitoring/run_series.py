"""Series of runs for the report (pure): a metric against the samples learned, the
job's throughput, the mean staleness, and the summary table's figures.

The choices (x axis, several ranks, throughput, restarts, counters) are listed in
:mod:`monitoring.report`.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from monitoring.runs import NAN, Incarnation, Point, RunData

# --- series (pure) -----------------------------------------------------------------------


@dataclass(frozen=True)
class Series:
    """A line to draw: ``nan`` in ``y`` is a gap, ``nan`` in both a break between pieces."""

    x: tuple[float, ...]
    y: tuple[float, ...]


@dataclass(frozen=True)
class Segment:
    """Throughput ``rate`` (samples/s) from ``start`` to ``end`` (seconds since the run started)."""

    start: float
    end: float
    rate: float


def _interp(t: float, xs: Sequence[float], ys: Sequence[float]) -> float:
    """Piecewise linear through (xs, ys), flat beyond the ends (as ``numpy.interp``)."""
    if t <= xs[0]:
        return ys[0]
    if t >= xs[-1]:
        return ys[-1]
    i = bisect.bisect_right(xs, t)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 if x1 == x0 else y0 + (y1 - y0) * (t - x0) / (x1 - x0)


def job_samples(run: RunData, incarnation: int, t: float) -> float:
    """Samples the job had learned at unix time ``t`` in its ``incarnation``-th (re)start.

    The restored checkpoint's count plus what each rank had learned since, each
    rank's count interpolated between its reports. Ranks are restarted together
    (one job), so a rank's n-th incarnation is the job's n-th.

    >>> from monitoring.runs import run_from_lines
    >>> line = '{{"time": {}, "samples": {}, "samples_total": {}, "elapsed_s": {}}}'
    >>> run = run_from_lines("two ranks", {0: [line.format(11, 10, 10, 1)],
    ...                                    1: [line.format(12, 30, 30, 2)]})
    >>> job_samples(run, 0, 11.0)  # rank 1: 0 at 10 s, 30 at 12 s
    25.0
    """
    return _job_samples_curve(run, incarnation)(t)


def _job_samples_curve(run: RunData, incarnation: int) -> Callable[[float], float]:
    """``job_samples(run, incarnation, t)`` as a function of ``t``, the curves built once."""
    main = run.ranks[run.main_rank]
    before = float(main[min(incarnation, len(main) - 1)].samples_before)
    curves = []  # (times, samples) of each rank's incarnation, from its start
    for incs in run.ranks.values():
        if incarnation < len(incs):
            inc = incs[incarnation]
            xs = [inc.start, *(p.time for p in inc.points)]
            ys = [0.0, *(float(p.samples) for p in inc.points)]
            curves.append((xs, ys))

    def at(t: float) -> float:
        total = before
        for xs, ys in curves:
            total += _interp(t, xs, ys)
        return total

    return at


def _main_points(run: RunData) -> list[tuple[int, Point, float]]:
    """(incarnation, point, job samples) for every report of the main rank."""
    out = []
    for k, inc in enumerate(run.ranks[run.main_rank]):
        samples_at = _job_samples_curve(run, k)
        out += [(k, p, samples_at(p.time)) for p in inc.points]
    return out


def metric_series(run: RunData, metric: Callable[[Point], float | None]) -> Series:
    """``metric`` of the main rank's reports against job samples, broken at restarts.

    >>> from monitoring.runs import run_from_lines
    >>> line = '{{"time": {}, "samples": {}, "samples_total": {}, "elapsed_s": {}, "loss": {}}}'
    >>> run = run_from_lines("r", {0: [line.format(2, 10, 10, 1, 0.7),
    ...                                line.format(3, 20, 20, 2, "null"),
    ...                                line.format(9, 5, 15, 1, 0.5)]})
    >>> metric_series(run, lambda p: p.loss)
    Series(x=(10.0, 20.0, nan, 15.0), y=(0.7, nan, nan, 0.5))
    """
    xs: list[float] = []
    ys: list[float] = []
    last = 0
    for k, point, x in _main_points(run):
        if k != last:
            xs.append(NAN)
            ys.append(NAN)
            last = k
        value = metric(point)
        xs.append(x)
        ys.append(NAN if value is None else value)
    return Series(tuple(xs), tuple(ys))


def rank_segments(inc: Incarnation, origin: float) -> list[Segment]:
    """The rate of one incarnation between consecutive reports (its start counts as 0 samples).

    >>> p = lambda t, n: Point(0, float(t), 0, n, n + 100, t - 10.0)
    >>> rank_segments(Incarnation(0, (p(12, 50), p(14, 250))), origin=10)
    [Segment(start=0.0, end=2.0, rate=25.0), Segment(start=2.0, end=4.0, rate=100.0)]
    """
    segments: list[Segment] = []
    t0, n0 = inc.start, 0
    for p in inc.points:
        dt = p.time - t0
        if dt > 0:
            # samples_total and samples move together within an incarnation.
            segments.append(Segment(t0 - origin, p.time - origin, (p.samples - n0) / dt))
            t0, n0 = p.time, p.samples
    return segments


def throughput(run: RunData) -> list[Segment]:
    """Samples/s of all ranks together, piecewise constant; gaps where no rank trained.

    Each rank's rate holds between two of its reports; where the reports of
    several ranks interleave, the rates add up over the pieces between any two
    reports (so the area under the line is every sample learned).

    >>> from monitoring.runs import run_from_lines
    >>> line = '{{"time": {}, "samples": {}, "samples_total": {}, "elapsed_s": {}}}'
    >>> run = run_from_lines("r", {
    ...     0: [line.format(2, 100, 100, 2), line.format(4, 300, 300, 4)],
    ...     1: [line.format(3, 300, 300, 3)]})
    >>> [(s.start, s.end, s.rate) for s in throughput(run)]
    [(0.0, 2.0, 150.0), (2.0, 3.0, 200.0), (3.0, 4.0, 100.0)]
    """
    origin = run.start
    events: list[tuple[float, int, float]] = []  # (time, +1 starts / -1 ends, rate)
    for incs in run.ranks.values():
        for inc in incs:
            for s in rank_segments(inc, origin):
                events += [(s.start, 1, s.rate), (s.end, -1, s.rate)]
    events.sort(key=lambda e: (e[0], e[1]))
    out: list[Segment] = []
    active, rate = 0, 0.0
    prev: float | None = None
    for t, kind, r in events:
        if prev is not None and t > prev and active > 0:
            out.append(Segment(prev, t, rate))
        active += kind
        rate = rate + r if kind > 0 else rate - r
        if active == 0:
            rate = 0.0  # no drift from adding and taking away the same floats
        prev = t
    return out


def _counter_deltas(values: Sequence[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """Increments of a cumulative histogram; a bucket that went down started again at 0."""
    out: list[tuple[int, ...]] = []
    prev: tuple[int, ...] = ()
    for cur in values:
        old = prev + (0,) * (len(cur) - len(prev))
        if any(c < o for c, o in zip(cur, old, strict=False)) or len(cur) < len(prev):
            out.append(cur)  # a reset: everything counted since is new
        else:
            out.append(tuple(c - o for c, o in zip(cur, old, strict=False)))
        prev = cur
    return out


def _mean_missed(hist: Sequence[int]) -> float:
    batches = sum(hist)
    return sum(k * n for k, n in enumerate(hist)) / batches if batches else NAN


def has_missed_pushes(run: RunData) -> bool:
    """Whether the main rank's reports carry the observed staleness histogram."""
    return all(p.missed_pushes is not None for inc in run.ranks[run.main_rank] for p in inc.points)


def staleness_series(run: RunData) -> Series:
    """Observed staleness: the mean pushes a lookup missed between two main-rank reports.

    Older metrics files lack the histogram; then this is ``pushes_queued`` at
    each report (the pushes the next lookup would miss), a proxy.

    >>> from monitoring.runs import run_from_lines
    >>> line = ('{{"time": {}, "samples": {}, "samples_total": {}, "elapsed_s": 1, '
    ...         '"missed_pushes": {}}}')
    >>> run = run_from_lines("r", {0: [line.format(2, 10, 10, '{"0": 2}'),
    ...                                line.format(3, 20, 20, '{"0": 3, "2": 1}')]})
    >>> staleness_series(run)
    Series(x=(10.0, 20.0), y=(0.0, 1.0))
    """
    points = _main_points(run)
    if not has_missed_pushes(run):
        return metric_series(run, lambda p: float(p.pushes_queued))
    deltas = _counter_deltas([p.missed_pushes or () for _, p, _ in points])
    xs: list[float] = []
    ys: list[float] = []
    last = 0
    for (k, _, x), delta in zip(points, deltas, strict=True):
        if k != last:
            xs.append(NAN)
            ys.append(NAN)
            last = k
        xs.append(x)
        ys.append(_mean_missed(delta))
    return Series(tuple(xs), tuple(ys))


def _total_counter(points: Sequence[Point], get: Callable[[Point], int | None]) -> int | None:
    values = [get(p) for p in points]
    if any(v is None for v in values):
        return None
    return sum(d[0] for d in _counter_deltas([(v or 0,) for v in values]))


def _missed_total(
    run: RunData, get: Callable[[Point], tuple[int, ...] | None] = lambda p: p.missed_pushes
) -> list[int] | None:
    """Every rank's batches (or rows) by pushes missed, over the whole run.

    ``get`` picks the histogram of a point; None where some report lacks it.
    """
    missed: list[int] = []
    for rank_incs in run.ranks.values():
        points = [p for inc in rank_incs for p in inc.points]
        hists = [get(p) for p in points]
        if any(h is None for h in hists):
            return None
        for delta in _counter_deltas([h or () for h in hists]):
            for k, n in enumerate(delta):
                if k == len(missed):
                    missed.append(0)
                missed[k] += n
    return missed


def _stale_share(hist: Sequence[int] | None) -> float | None:
    """The share of rows that missed one or more pushes; None without any row counted."""
    rows = sum(hist) if hist else 0
    return (rows - hist[0]) / rows if hist and rows else None


# --- the summary table (pure) ------------------------------------------------------------


@dataclass(frozen=True)
class Summary:
    """One row of the page's table."""

    name: str
    path: str
    ranks: int
    restarts: int
    samples: int  # learned by the job at the end (the last checkpoint's count plus since)
    samples_trained: int  # learned by every incarnation, redone stretches counted again
    duration_s: float  # from the first start to the last report, downtime included
    training_s: float  # time some rank was training
    mean_samples_per_s: float  # samples_trained / training_s
    final_auc: float | None
    final_loss: float | None
    best_auc: float | None
    staleness_bound: int
    missed_share: tuple[float, float, float] | None  # lookups missing 0, 1, 2+ pushes
    missed_mean: float | None  # pushes a lookup missed, on average
    events: int | None  # records read, dead-lettered included (newer files)
    # Fresh rows (newer files, fresh rows on): the share of embedding rows that missed
    # one or more of their rank's own pushes at lookup, and as trained; rows trained
    # with a pushed value, of those predicted, pushes in flight waited for.
    rows_stale_share: tuple[float, float] | None
    rows_freshened: int | None
    rows_predicted: int | None
    fresh_waits: int | None
    checkpoints: int
    skipped_lines: int
    warnings: tuple[str, ...] = field(default=(), repr=False)


def _last(values: Iterable[float | None]) -> float | None:
    found = None
    for v in values:
        if v is not None and not math.isnan(v):
            found = v
    return found


def summarize(run: RunData) -> Summary:
    """The figures of the page's table for ``run``.

    >>> from monitoring.runs import run_from_lines
    >>> line = '{{"time": {}, "samples": {}, "samples_total": {}, "elapsed_s": {}, "loss": 0.5}}'
    >>> run = run_from_lines("r", {0: [line.format(2, 10, 10, 1), line.format(3, 30, 30, 2),
    ...                                line.format(9, 20, 40, 1)]})
    >>> s = summarize(run)
    >>> s.samples, s.samples_trained, s.restarts, s.duration_s, s.training_s
    (40, 50, 1, 8.0, 3.0)
    """
    main = run.ranks[run.main_rank]
    main_points = [p for inc in main for p in inc.points]
    incs = [inc for incs in run.ranks.values() for inc in incs]
    # The time some rank trained: the union of the incarnations' spans.
    spans = sorted((inc.start, inc.end) for inc in incs)
    training_s, reach = 0.0, -math.inf
    for a, b in spans:
        if b > reach:
            training_s += b - max(a, reach)
            reach = b
    trained = sum(inc.points[-1].samples for inc in incs)
    missed = _missed_total(run)
    total = sum(missed) if missed is not None else 0
    share = None
    if missed and total:
        share = (missed[0] / total, sum(missed[1:2]) / total, sum(missed[2:]) / total)

    def counter_total(get: Callable[[Point], int | None]) -> int | None:
        total: int | None = 0
        for rank_incs in run.ranks.values():
            n = _total_counter([p for inc in rank_incs for p in inc.points], get)
            total = None if n is None or total is None else total + n
        return total

    at_lookup = _stale_share(_missed_total(run, lambda p: p.missed_pushes_by_row))
    as_trained = _stale_share(_missed_total(run, lambda p: p.trained_missed_pushes_by_row))
    # No row counted (fresh rows off, sync, older files) is no figure, not 0% stale.
    rows_stale = None
    if at_lookup is not None and as_trained is not None:
        rows_stale = (at_lookup, as_trained)
    fresh = rows_stale is not None
    return Summary(
        name=run.name,
        path=str(run.path),
        ranks=len(run.ranks),
        restarts=len(main) - 1,
        samples=round(job_samples(run, len(main) - 1, math.inf)),
        samples_trained=trained,
        duration_s=max(inc.end for inc in incs) - run.start,
        training_s=training_s,
        mean_samples_per_s=trained / training_s if training_s > 0 else 0.0,
        final_auc=_last(p.auc for p in main_points),
        final_loss=_last(p.loss for p in main_points),
        best_auc=_last(p.best_auc for p in main_points),
        staleness_bound=main_points[-1].staleness,
        missed_share=share,
        missed_mean=_mean_missed(missed) if missed and total else None,
        events=counter_total(lambda p: p.events_total),
        rows_stale_share=rows_stale,
        rows_freshened=counter_total(lambda p: p.rows_freshened) if fresh else None,
        rows_predicted=counter_total(lambda p: p.rows_predicted) if fresh else None,
        fresh_waits=counter_total(lambda p: p.fresh_waits) if fresh else None,
        checkpoints=len(run.checkpoints),
        skipped_lines=run.skipped_lines,
        warnings=run.warnings,
    )
