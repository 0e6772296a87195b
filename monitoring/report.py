"""``streamrec report``: loss, AUC, throughput and staleness of runs, as one HTML page.

A run directory (``run_dir`` of a job run by ``streamrec run``, ``backfill``
or ``demo``) holds ``metrics-rank<R>.jsonl``: one JSON object per progress
report of trainer rank R, appended across restarts. This module reads them
into typed series (``load_run``), draws one PNG per figure with every run
overlaid on the same axes, one line per run (``plot_*``), and writes a page
that links the PNGs relatively, so the folder can be moved (``write_report``).

The choices, in one place:

- **x axis**: samples the job had learned (restored checkpoints included), so
  a slow and a fast run line up where they have seen the same data. The
  throughput figure alone runs on seconds since the run started.
- **several ranks**: loss, AUC and staleness are rank 0's (its progressive
  AUC is the figure the CLI and the benchmarks print); throughput is the sum
  of every rank's; the x value of a rank-0 report adds the other ranks'
  samples at that time (interpolated between their reports).
- **throughput** comes from differences of ``samples_total`` between two
  reports of one rank, never from ``samples_per_s``, which is the average
  since the (re)start and would hide every slowdown after the first minutes.
- **restarts** (``samples`` and ``elapsed_s`` start again, ``time`` jumps)
  split a rank's reports into incarnations; lines break there, and a
  restored run goes back to the checkpoint's sample count, so the redone
  stretch shows as two overlapping lines. No rate spans the downtime.
- **counters** (``missed_pushes``, ``events_total``, the fresh rows' per-row
  histograms and counts) are read as Prometheus
  reads counters: a count that went down started again from zero. That holds
  whether a restarted trainer restores them or not.
- **malformed lines** (not JSON, missing or mistyped fields, a torn last
  line) are skipped, counted and listed in the page with file and line
  number, and printed by the command; ``strict=True`` (``--strict``) fails on
  the first one instead. A report on a live run must not die on the line the
  trainer is writing, and one torn line from a killed trainer must not hide
  a week of figures, but nothing is dropped unsaid.
- **checkpoints**: the manifests still in ``<run>/checkpoints`` (the job keeps
  the last ``checkpoint.keep``) are marked on the x axis; one kept elsewhere
  (``checkpoint.dir``) is not looked for.

matplotlib is imported by the functions that draw (``streamrec --help`` must
stay fast), and only ``Figure`` with the Agg canvas is used: no pyplot, no
backend switch, no global state.

>>> import json, tempfile
>>> run_dir = Path(tempfile.mkdtemp())
>>> line = {"rank": 0, "step": 1, "samples": 500, "samples_total": 500,
...         "elapsed_s": 1.0, "time": 100.0, "loss": 0.6, "metrics": {"auc": 0.7}}
>>> _ = (run_dir / "metrics-rank0.jsonl").write_text(json.dumps(line) + "\\n")
>>> page = write_report([run_dir], run_dir / "report.html", title="one run")
>>> sorted(p.name for p in run_dir.glob("report*"))  # doctest: +NORMALIZE_WHITESPACE
['report-auc.png', 'report-loss.png', 'report-staleness.png', 'report-throughput.png',
 'report.html']
"""

from __future__ import annotations

import argparse
import bisect
import html
import json
import math
import re
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from trainer.run_files import read_lines

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

_METRICS_FILE = re.compile(r"^metrics-rank(\d+)\.jsonl$")
_MANIFEST_FILE = re.compile(r"^JOB-\d+\.json$")
# matplotlib's "tab10": a run keeps its colour in every figure and in the table.
COLORS = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
)
_SHOWN_WARNINGS = 20  # skipped lines listed one by one in the page; the rest counted
NAN = float("nan")


class ReportError(Exception):
    """A run directory that cannot be reported on: missing, empty, or (strict) malformed."""


# --- what a run directory holds ----------------------------------------------------------


@dataclass(frozen=True)
class Point:
    """One progress report of one rank (one line of ``metrics-rank<R>.jsonl``)."""

    rank: int
    time: float  # unix s
    step: int
    samples: int  # learned by this incarnation
    samples_total: int  # learned by the job, restored checkpoints included
    elapsed_s: float  # since this incarnation's loop started
    loss: float | None = None  # mean of the recent batch losses
    auc: float | None = None  # progressive, over the metrics window
    logloss: float | None = None
    staleness: int = 0  # the configured bound
    pushes_queued: int = 0
    missed_pushes: tuple[int, ...] | None = None  # [k]: batches that missed k pushes
    events_total: int | None = None
    # Fresh rows, per embedding row: [k] rows whose lookup missed k of the rank's own
    # pushes, and rows still missing k when trained; rows trained with a pushed value,
    # of those predicted for the push in flight, pushes in flight waited for.
    missed_pushes_by_row: tuple[int, ...] | None = None
    trained_missed_pushes_by_row: tuple[int, ...] | None = None
    rows_freshened: int | None = None
    rows_predicted: int | None = None
    fresh_waits: int | None = None
    best_auc: float | None = None

    @property
    def start(self) -> float:
        """When this report's incarnation started (unix s)."""
        return self.time - self.elapsed_s


@dataclass(frozen=True)
class Incarnation:
    """The reports of one rank between two (re)starts."""

    rank: int
    points: tuple[Point, ...]

    @property
    def start(self) -> float:
        return self.points[0].start

    @property
    def end(self) -> float:
        return self.points[-1].time

    @property
    def samples_before(self) -> int:
        """What the restored checkpoint had learned (0 on a fresh start)."""
        first = self.points[0]
        return first.samples_total - first.samples


@dataclass(frozen=True)
class CheckpointMark:
    """A job checkpoint manifest found in ``<run>/checkpoints``."""

    step: int
    samples: int
    created: float  # unix s


@dataclass(frozen=True)
class RunData:
    """Everything read from one run directory."""

    name: str
    path: Path
    ranks: Mapping[int, tuple[Incarnation, ...]]
    checkpoints: tuple[CheckpointMark, ...] = ()
    warnings: tuple[str, ...] = ()  # "file:line: why", one per skipped line or manifest
    skipped_lines: int = 0

    @property
    def start(self) -> float:
        """When the first incarnation of any rank started (unix s)."""
        return min(inc.start for incs in self.ranks.values() for inc in incs)

    @property
    def main_rank(self) -> int:
        """The rank whose loss and AUC are shown: 0, or the lowest present."""
        return min(self.ranks)


# --- parsing (pure) ----------------------------------------------------------------------


def _optional_number(raw: Mapping[str, Any], key: str) -> float | None:
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        msg = f"{key!r} is {value!r}, not a number"
        raise ValueError(msg)
    return float(value)


def _number(raw: Mapping[str, Any], key: str) -> float:
    value = _optional_number(raw, key)
    if value is None:
        msg = f"missing {key!r}"
        raise ValueError(msg)
    return value


def _integer(raw: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = raw.get(key, default)
    if value is None:
        msg = f"missing {key!r}"
        raise ValueError(msg)
    if isinstance(value, bool) or not isinstance(value, int):
        msg = f"{key!r} is {value!r}, not an integer"
        raise ValueError(msg)
    return value


def _optional_integer(raw: Mapping[str, Any], key: str) -> int | None:
    return None if raw.get(key) is None else _integer(raw, key)


def _histogram(raw: Mapping[str, Any], name: str) -> tuple[int, ...] | None:
    value = raw.get(name)
    if value is None:
        return None
    if not isinstance(value, dict):
        msg = f"{name!r} is {value!r}, not an object"
        raise ValueError(msg)
    counts: dict[int, int] = {}
    for key, n in value.items():
        if not (isinstance(key, str) and key.isdigit()):
            msg = f"{name!r} key {key!r} is not a count of pushes"
            raise ValueError(msg)
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            msg = f"{name!r}[{key!r}] is {n!r}, not a count"
            raise ValueError(msg)
        counts[int(key)] = n
    top = max(counts, default=-1)
    return tuple(counts.get(k, 0) for k in range(top + 1))


def parse_point(text: str, *, rank: int) -> Point:
    """One metrics line of rank ``rank``; ``ValueError`` says what is wrong with it.

    Fields newer trainers add (``missed_pushes``, ``events_total``,
    ``best_auc``, the fresh rows' ``missed_pushes_by_row``,
    ``trained_missed_pushes_by_row``, ``rows_freshened``, ``rows_predicted``,
    ``fresh_waits``) may be missing; ``time``, ``samples``, ``samples_total``
    and ``elapsed_s`` may not.

    >>> p = parse_point('{"rank": 0, "time": 5.0, "step": 2, "samples": 8, '
    ...     '"samples_total": 18, "elapsed_s": 2.0, "missed_pushes": {"0": 1, "2": 1}}', rank=0)
    >>> p.start, p.samples_total, p.missed_pushes, p.auc
    (3.0, 18, (1, 0, 1), None)
    >>> p.missed_pushes_by_row, p.rows_freshened  # a trainer from before fresh rows
    (None, None)
    >>> parse_point('{"time": 5.0}', rank=0)
    Traceback (most recent call last):
    ...
    ValueError: missing 'samples'
    """
    try:
        raw = json.loads(text)
    except ValueError as exc:
        msg = f"not JSON ({exc})"
        raise ValueError(msg) from None
    if not isinstance(raw, dict):
        msg = f"a JSON {type(raw).__name__}, not an object"
        raise ValueError(msg)
    if raw.get("rank", rank) != rank:
        msg = f"'rank' is {raw['rank']!r} in the file of rank {rank}"
        raise ValueError(msg)
    metrics = raw.get("metrics") or {}
    if not isinstance(metrics, dict):
        msg = f"'metrics' is {metrics!r}, not an object"
        raise ValueError(msg)
    return Point(
        rank=rank,
        time=_number(raw, "time"),
        step=_integer(raw, "step", 0),
        samples=_integer(raw, "samples"),
        samples_total=_integer(raw, "samples_total"),
        elapsed_s=_number(raw, "elapsed_s"),
        loss=_optional_number(raw, "loss"),
        auc=_optional_number(metrics, "auc"),
        logloss=_optional_number(metrics, "logloss"),
        staleness=_integer(raw, "staleness", 0),
        pushes_queued=_integer(raw, "pushes_queued", 0),
        missed_pushes=_histogram(raw, "missed_pushes"),
        events_total=_optional_integer(raw, "events_total"),
        best_auc=_optional_number(raw, "best_auc"),
        missed_pushes_by_row=_histogram(raw, "missed_pushes_by_row"),
        trained_missed_pushes_by_row=_histogram(raw, "trained_missed_pushes_by_row"),
        rows_freshened=_optional_integer(raw, "rows_freshened"),
        rows_predicted=_optional_integer(raw, "rows_predicted"),
        fresh_waits=_optional_integer(raw, "fresh_waits"),
    )


def parse_lines(
    lines: Iterable[str], *, rank: int, source: str = "<lines>", strict: bool = False
) -> tuple[list[Point], list[str]]:
    """The points of one rank's lines, and a ``"source:N: why"`` per skipped line.

    Blank lines are no reports and are passed over; with ``strict`` a
    malformed line raises ``ReportError`` instead of being skipped.

    >>> good = '{"time": 1.0, "samples": 1, "samples_total": 1, "elapsed_s": 1.0}'
    >>> points, skipped = parse_lines([good, "", '{"time": 2'], rank=0, source="m.jsonl")
    >>> len(points), skipped
    (1, ["m.jsonl:3: not JSON (Expecting ',' delimiter: line 1 column 11 (char 10))"])
    """
    points: list[Point] = []
    skipped: list[str] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            points.append(parse_point(line, rank=rank))
        except ValueError as exc:
            where = f"{source}:{number}: {exc}"
            if strict:
                raise ReportError(where) from None
            skipped.append(where)
    return points, skipped


def split_incarnations(points: Sequence[Point]) -> tuple[Incarnation, ...]:
    """One rank's points, split where the trainer was restarted.

    A restart shows as ``samples`` or ``elapsed_s`` going down, or as a start
    (``time - elapsed_s``) after the previous report: a trainer killed early
    may have reported less than its successor's first report.

    >>> p = lambda t, n, total, e: Point(0, t, 0, n, total, e)
    >>> incs = split_incarnations([p(10, 5, 5, 1), p(11, 9, 9, 2), p(30, 4, 9, 1)])
    >>> [(i.start, i.samples_before, len(i.points)) for i in incs]
    [(9, 0, 2), (29, 5, 1)]
    """
    runs: list[list[Point]] = []
    for point in points:
        prev = runs[-1][-1] if runs else None
        if (
            prev is None
            or point.samples < prev.samples
            or point.elapsed_s < prev.elapsed_s
            or point.start > prev.time
        ):
            runs.append([point])
        else:
            runs[-1].append(point)
    return tuple(Incarnation(rank=r[0].rank, points=tuple(r)) for r in runs)


def _unique_names(paths: Sequence[Path]) -> list[str]:
    """Directory names; where two are the same, as many parent folders as tell them apart."""
    parts = [p.resolve().parts for p in paths]
    names = [""] * len(paths)
    for depth in range(1, max((len(p) for p in parts), default=1) + 1):
        names = ["/".join(p[-depth:]) for p in parts]
        if len(set(names)) == len(names):
            return names
    return [f"{p.resolve().name} #{i + 1}" for i, p in enumerate(paths)]  # a folder twice


def run_from_lines(
    name: str,
    lines_by_rank: Mapping[int, Iterable[str]],
    *,
    path: Path | None = None,
    checkpoints: Sequence[CheckpointMark] = (),
    strict: bool = False,
) -> RunData:
    """A run from each rank's metrics lines (the pure part of ``load_run``).

    >>> run = run_from_lines("r", {0: ['{"time": 2, "samples": 4, "samples_total": 4, '
    ...                                '"elapsed_s": 1}']})
    >>> run.name, run.start, run.skipped_lines
    ('r', 1.0, 0)
    """
    ranks: dict[int, tuple[Incarnation, ...]] = {}
    warnings: list[str] = []
    for rank, lines in sorted(lines_by_rank.items()):
        source = str((path or Path(name)) / f"metrics-rank{rank}.jsonl")
        points, skipped = parse_lines(lines, rank=rank, source=source, strict=strict)
        warnings += skipped
        if points:
            ranks[rank] = split_incarnations(points)
    where = path if path is not None else name
    if not ranks:
        why = f" ({len(warnings)} malformed lines)" if warnings else ""
        msg = f"{where}: no progress reports in its metrics files{why}"
        raise ReportError(msg)
    return RunData(
        name=name,
        path=path if path is not None else Path(name),
        ranks=ranks,
        checkpoints=tuple(sorted(checkpoints, key=lambda c: c.created)),
        warnings=tuple(warnings),
        skipped_lines=len(warnings),
    )


# --- reading run directories (the I/O shell) ---------------------------------------------


def _read_checkpoints(run_dir: Path) -> tuple[list[CheckpointMark], list[str]]:
    folder = run_dir / "checkpoints"
    marks: list[CheckpointMark] = []
    warnings: list[str] = []
    if not folder.is_dir():
        return marks, warnings
    for path in sorted(folder.iterdir()):
        if not _MANIFEST_FILE.match(path.name):
            continue
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
            marks.append(
                CheckpointMark(
                    step=_integer(raw, "step"),
                    samples=_integer(raw, "samples"),
                    created=_number(raw, "created"),
                )
            )
        except (OSError, ValueError, AttributeError) as exc:
            # Checkpoint marks only decorate the figures: say so, draw the rest.
            warnings.append(f"{path}: not marked, unreadable manifest ({exc})")
    return marks, warnings


def load_run(path: Path, *, name: str | None = None, strict: bool = False) -> RunData:
    """Read one run directory (see the module doc for what is skipped and why).

    >>> import tempfile
    >>> load_run(Path(tempfile.mkdtemp()) / "nothing")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    monitoring.report.ReportError: .../nothing: not a directory
    """
    if not path.is_dir():
        msg = f"{path}: not a directory"
        raise ReportError(msg)
    files = {
        int(m.group(1)): p
        for p in path.iterdir()
        if (m := _METRICS_FILE.match(p.name)) is not None and p.is_file()
    }
    if not files:
        msg = (
            f"{path}: no metrics-rank<R>.jsonl files; is it the run_dir of a "
            "`streamrec run`, `backfill` or `demo` job?"
        )
        raise ReportError(msg)
    lines: dict[int, list[str]] = {}
    for rank, file in files.items():
        try:
            # Every part a long job's rotation kept (trainer.run_files), oldest first.
            lines[rank] = read_lines(file)
        except OSError as exc:
            msg = f"{file}: cannot read ({exc})"
            raise ReportError(msg) from exc
    marks, manifest_warnings = _read_checkpoints(path)
    run = run_from_lines(
        name or path.resolve().name, lines, path=path, checkpoints=marks, strict=strict
    )
    return replace(run, warnings=run.warnings + tuple(manifest_warnings))


def load_runs(paths: Sequence[Path], *, strict: bool = False) -> list[RunData]:
    """Read several run directories, named so that no two share a legend entry."""
    return [
        load_run(p, name=n, strict=strict) for p, n in zip(paths, _unique_names(paths), strict=True)
    ]


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


# --- figures -----------------------------------------------------------------------------


def color(index: int) -> str:
    """The colour of the ``index``-th run, the same in every figure and the table."""
    return COLORS[index % len(COLORS)]


def _figure(title: str, xlabel: str, ylabel: str) -> tuple[Figure, Axes]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 4.5), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(visible=True, alpha=0.3)
    return fig, ax


def _png(fig: Figure, ax: Axes) -> bytes:
    import io

    from matplotlib.backends.backend_agg import FigureCanvasAgg

    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="best", fontsize="small")
    FigureCanvasAgg(fig)  # attaches itself to the figure: PNG through Agg, no pyplot
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _mark_checkpoints(ax: Axes, xs: Sequence[float], index: int) -> None:
    """Small triangles on the x axis where run ``index`` took a checkpoint.

    Each run's row sits a little higher: runs checkpointing at the same sample
    counts would hide each other's marks otherwise.
    """
    if xs:
        ax.plot(
            list(xs),
            [0.025 * index] * len(xs),
            linestyle="none",
            marker="^",
            markersize=7,
            color=color(index),
            transform=ax.get_xaxis_transform(),  # y in axes units: on the axis line
            clip_on=False,
        )


def _samples_axis(ax: Axes) -> None:
    from matplotlib.ticker import EngFormatter

    ax.xaxis.set_major_formatter(EngFormatter())


def _plot_metric(
    runs: Sequence[RunData],
    metric: Callable[[Point], float | None],
    title: str,
    ylabel: str,
    *,
    best: bool = False,
) -> bytes:
    fig, ax = _figure(title, "samples learned", ylabel)
    _samples_axis(ax)
    for i, run in enumerate(runs):
        s = metric_series(run, metric)
        ax.plot(s.x, s.y, color=color(i), label=run.name, marker="." if len(s.x) < 60 else None)
        _mark_checkpoints(ax, [c.samples for c in run.checkpoints], i)
    if best:
        bests = [summarize(run).best_auc for run in runs]
        shared = len({b for b in bests if b is not None}) == 1
        for i, (run, b) in enumerate(zip(runs, bests, strict=True)):
            if b is None:
                continue
            ax.axhline(
                b,
                linestyle="--",
                linewidth=1,
                color="0.4" if shared else color(i),
                label=f"best achievable {b:.4f}" if shared else f"{run.name}: best {b:.4f}",
            )
            if shared:
                break
    return _png(fig, ax)


def plot_loss(runs: Sequence[RunData]) -> bytes:
    """PNG: rank 0's loss (mean of its recent batches) against samples learned."""
    return _plot_metric(runs, lambda p: p.loss, "Training loss (rank 0)", "loss")


def plot_auc(runs: Sequence[RunData]) -> bytes:
    """PNG: rank 0's progressive AUC against samples learned, and the best achievable."""
    return _plot_metric(
        runs, lambda p: p.auc, "Progressive AUC (rank 0)", "AUC over the window", best=True
    )


def plot_throughput(runs: Sequence[RunData]) -> bytes:
    """PNG: samples/s of all ranks together between reports, against seconds since start.

    >>> import json
    >>> line = lambda t, n: json.dumps({"time": t, "samples": n, "samples_total": n,
    ...                                 "elapsed_s": t - 1})
    >>> png = plot_throughput([run_from_lines("r", {0: [line(2, 5), line(3, 20)]})])
    >>> png[:8] == b"\\x89PNG\\r\\n\\x1a\\n"
    True
    """
    fig, ax = _figure("Throughput (all ranks)", "seconds since the run started", "samples/s")
    for i, run in enumerate(runs):
        xs: list[float] = []
        ys: list[float] = []
        for s in throughput(run):
            if xs and xs[-1] != s.start:
                xs.append(NAN)
                ys.append(NAN)
            xs += [s.start, s.end]
            ys += [s.rate, s.rate]
        ax.plot(xs, ys, color=color(i), label=run.name)
        _mark_checkpoints(ax, [c.created - run.start for c in run.checkpoints], i)
    ax.set_ylim(bottom=0)
    return _png(fig, ax)


def plot_staleness(runs: Sequence[RunData]) -> bytes:
    """PNG: pushes a lookup missed (rank 0, mean between reports), and each run's bound."""
    fig, ax = _figure("Staleness (rank 0)", "samples learned", "pushes missed by a lookup (mean)")
    _samples_axis(ax)
    top = 1.0
    for i, run in enumerate(runs):
        s = staleness_series(run)
        observed = has_missed_pushes(run)
        label = run.name if observed else f"{run.name} (pushes queued at a report)"
        ax.plot(s.x, s.y, color=color(i), label=label, linestyle="-" if observed else ":")
        bound = summarize(run).staleness_bound
        ax.axhline(
            bound,
            color=color(i),
            linestyle="--",
            linewidth=1,
            alpha=0.7,
            label=f"{run.name}: bound {bound}",
        )
        _mark_checkpoints(ax, [c.samples for c in run.checkpoints], i)
        top = max(top, bound + 0.5, *(y for y in s.y if not math.isnan(y)))
    ax.set_ylim(-0.05 * top, top * 1.1)
    return _png(fig, ax)


# (file suffix, caption, function): the figures of a report, in page order.
PLOTS: tuple[tuple[str, str, Callable[[Sequence[RunData]], bytes]], ...] = (
    (
        "loss",
        "Training loss of rank 0: the mean of its last 50 batch losses at each report.",
        plot_loss,
    ),
    (
        "auc",
        "Progressive AUC of rank 0 (every batch scored before it is learned), over the "
        "metrics window; dashed: the synthetic stream's best achievable AUC, when known.",
        plot_auc,
    ),
    (
        "throughput",
        "Samples learned per second by all ranks together, between consecutive progress "
        "reports (not the trainer's since-start average); gaps: restarts.",
        plot_throughput,
    ),
    (
        "staleness",
        "Pushes a batch's embedding lookup missed, mean over the batches between two "
        "reports of rank 0; dashed: the configured bound; dotted: older runs without the "
        "histogram, pushes still queued at each report.",
        plot_staleness,
    ),
)


# --- the page ----------------------------------------------------------------------------


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _freshened(s: Summary) -> str:
    if s.rows_freshened is None:
        return "-"
    return f"{s.rows_freshened:,} / {_fmt(s.rows_predicted, ',d')} / {_fmt(s.fresh_waits, ',d')}"


def _share(share: tuple[float, ...] | None) -> str:
    if share is None:
        return "-"
    return " / ".join(f"{s:.1%}" for s in share)


def render_html(
    title: str,
    summaries: Sequence[Summary],
    images: Sequence[tuple[str, str]],
    *,
    generated: str,
) -> str:
    """The page: the table of ``summaries``, then each (PNG file name, caption) in ``images``.

    >>> page = render_html("t <1>", [], [("a b.png", "A")], generated="now")
    >>> "<title>t &lt;1&gt;</title>" in page, 'src="a%20b.png"' in page
    (True, True)
    """
    e = html.escape
    rows = []
    for i, s in enumerate(summaries):
        rows.append(
            "<tr>"
            f'<td class="run"><span class="swatch" style="background:{color(i)}"></span>'
            f'{e(s.name)}<div class="path">{e(s.path)}</div></td>'
            f'<td class="ranks">{s.ranks}</td>'
            f'<td class="restarts">{s.restarts}</td>'
            f'<td class="samples">{s.samples:,}</td>'
            f'<td class="duration">{s.duration_s:,.1f}</td>'
            f'<td class="throughput">{s.mean_samples_per_s:,.0f}</td>'
            f'<td class="auc">{_fmt(s.final_auc, ".4f")}</td>'
            f'<td class="best_auc">{_fmt(s.best_auc, ".4f")}</td>'
            f'<td class="loss">{_fmt(s.final_loss, ".4f")}</td>'
            f'<td class="bound">{s.staleness_bound}</td>'
            f'<td class="missed_mean">{_fmt(s.missed_mean, ".2f")}</td>'
            f'<td class="missed">{_share(s.missed_share)}</td>'
            f'<td class="rows_stale">{_share(s.rows_stale_share)}</td>'
            f'<td class="rows_freshened">{_freshened(s)}</td>'
            f'<td class="events">{_fmt(s.events, ",d")}</td>'
            f'<td class="checkpoints">{s.checkpoints}</td>'
            f'<td class="skipped">{s.skipped_lines}</td>'
            "</tr>"
        )
    warnings = []
    for s in summaries:
        if not s.warnings:
            continue
        shown = "".join(f"<li>{e(w)}</li>" for w in s.warnings[:_SHOWN_WARNINGS])
        more = len(s.warnings) - _SHOWN_WARNINGS
        tail = f"<li>… and {more} more</li>" if more > 0 else ""
        manifests = len(s.warnings) - s.skipped_lines
        also = f", {manifests} checkpoint manifests unreadable" if manifests else ""
        warnings.append(
            f"<p><b>{e(s.name)}</b>: {s.skipped_lines} malformed metrics lines skipped{also}"
            f"</p><ul>{shown}{tail}</ul>"
        )
    warning_html = (
        f'<section class="warnings"><h2>Skipped input</h2>{"".join(warnings)}</section>'
        if warnings
        else ""
    )
    figures = "".join(
        f'<figure><img src="{e(quote(name))}" alt="{e(caption)}">'
        f"<figcaption>{e(caption)}</figcaption></figure>"
        for name, caption in images
    )
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{e(title)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; color: #222; }}
table {{ border-collapse: collapse; font-size: 0.9em; }}
th, td {{ border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: right; }}
th {{ background: #f3f3f3; }}
td.run {{ text-align: left; }}
.path {{ color: #777; font-size: 0.8em; }}
.swatch {{ display: inline-block; width: 0.8em; height: 0.8em; margin-right: 0.4em; }}
figure {{ margin: 2em 0; }}
figcaption {{ color: #555; max-width: 900px; }}
img {{ max-width: 100%; }}
.warnings {{ background: #fff4e5; padding: 0.5em 1em; }}
</style>
</head>
<body>
<h1>{e(title)}</h1>
<p>Generated {e(generated)}. Loss, AUC and staleness are rank 0's; throughput is every
rank's summed. Samples on the x axes are those the job had learned, restored checkpoints
included; ▲ on an x axis: a checkpoint still in the run directory.</p>
<table>
<tr><th>run</th><th>ranks</th><th>restarts</th><th>samples</th><th>duration s</th>
<th>mean samples/s</th><th>final AUC</th><th>best AUC</th><th>final loss</th>
<th>staleness bound</th><th>pushes a lookup missed (mean)</th>
<th>lookups missing 0 / 1 / 2+ pushes</th>
<th>rows missing own pushes: at lookup / as trained</th>
<th>rows freshened / predicted / waits</th><th>events read</th>
<th>checkpoints</th><th>skipped lines</th></tr>
{"".join(rows)}
</table>
<p class="note">samples: learned by the job at its last report; mean samples/s: every
sample learned (redone ones after a restart again) over the time some rank trained.
rows missing own pushes (fresh rows only, every rank): the share of embedding rows whose
lookup missed one or more of their rank's own pushes, and that still missed one when
trained; rows freshened: trained with a pushed value instead of the looked-up one, of
those predicted for the push in flight; waits: pushes in flight waited for.</p>
{warning_html}
{figures}
</body>
</html>
"""


def write_report(
    run_dirs: Sequence[Path | RunData],
    out: Path | None = None,
    *,
    title: str | None = None,
    strict: bool = False,
) -> Path:
    """Write ``out`` (default ``<first run>/report.html``) and its PNGs next to it.

    ``run_dirs`` are run directories, or runs already loaded (a caller that
    deletes its run directories loads them first). The PNGs are named after
    ``out`` (``report-loss.png``, ...) and linked relatively. Returns ``out``.
    """
    paths = [r for r in run_dirs if isinstance(r, Path)]
    loaded = iter(load_runs(paths, strict=strict))
    runs = [next(loaded) if isinstance(r, Path) else r for r in run_dirs]
    if not runs:
        msg = "no run directories to report on"
        raise ReportError(msg)
    if out is None:
        out = runs[0].path / "report.html"
    out.parent.mkdir(parents=True, exist_ok=True)
    images = []
    for suffix, caption, plot in PLOTS:
        name = f"{out.stem}-{suffix}.png"
        (out.parent / name).write_bytes(plot(runs))
        images.append((name, caption))
    page = render_html(
        title or "streamrec: " + ", ".join(r.name for r in runs),
        [summarize(r) for r in runs],
        images,
        generated=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    )
    out.write_text(page, encoding="utf-8")
    return out


# --- the command -------------------------------------------------------------------------


def cmd_report(args: argparse.Namespace) -> int:
    """``streamrec report``: 0 when written, 2 for a run it cannot read, 1 when it cannot write."""
    out: Path | None = args.out
    try:
        runs = load_runs(args.run_dirs, strict=args.strict)
        for run in runs:
            for w in run.warnings[:_SHOWN_WARNINGS]:
                print(f"streamrec report: skipped {w}", file=sys.stderr)
            if len(run.warnings) > _SHOWN_WARNINGS:
                more = len(run.warnings) - _SHOWN_WARNINGS
                print(f"streamrec report: ... and {more} more in {run.path}", file=sys.stderr)
        page = write_report(list(runs), out, title=args.title)
    except ReportError as exc:
        print(f"streamrec report: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"streamrec report: cannot write the report: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {page} and {len(PLOTS)} PNGs next to it")
    return 0


def add_report_command(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``report`` to the ``streamrec`` parser (``add_subparsers()``'s result).

    >>> parser = argparse.ArgumentParser(prog="streamrec")
    >>> add_report_command(parser.add_subparsers(dest="command"))
    >>> args = parser.parse_args(["report", "runs/a", "runs/b", "--out", "cmp.html"])
    >>> args.func is cmd_report, args.run_dirs, args.out
    (True, [PosixPath('runs/a'), PosixPath('runs/b')], PosixPath('cmp.html'))
    """
    report = subparsers.add_parser(
        "report",
        help="an HTML page of loss, AUC, throughput and staleness plots of one or more runs",
        description=(
            "Read the metrics-rank<R>.jsonl files of each run directory and write an HTML "
            "page with PNG plots (loss, progressive AUC, throughput, staleness) and a summary "
            "table. Several runs are drawn on the same axes, one line each, e.g. a sync, a "
            "hybrid and an async run. The PNGs are written next to the page and linked "
            "relatively: move the folder, not the page alone. Malformed metrics lines are "
            "skipped and listed (in the page and here) unless --strict."
        ),
    )
    report.add_argument(
        "run_dirs",
        nargs="+",
        type=Path,
        metavar="RUN_DIR",
        help="a job's run_dir (where `streamrec run`, `backfill` or `demo` wrote its metrics)",
    )
    report.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="PATH",
        help="the HTML file to write (default: report.html in the first RUN_DIR); its PNGs "
        "go next to it, named after it (cmp.html: cmp-loss.png, cmp-auc.png, ...)",
    )
    report.add_argument("--title", default=None, help="the page's title (default: the runs' names)")
    report.add_argument(
        "--strict",
        action="store_true",
        help="fail on a malformed metrics line instead of skipping it",
    )
    report.set_defaults(func=cmd_report)
