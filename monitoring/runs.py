"""What a run directory holds, read into typed values: every trainer rank's progress
reports (``metrics-rank<R>.jsonl``), split into incarnations at restarts, and the
checkpoints kept (:func:`load_run`).

Parsing is pure (:func:`parse_point`, :func:`run_from_lines`); :func:`load_run` is
the I/O shell. The choices (malformed lines, restarts, checkpoints) are listed in
:mod:`monitoring.report`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from trainer.run_files import read_lines

_METRICS_FILE = re.compile(r"^metrics-rank(\d+)\.jsonl$")
_MANIFEST_FILE = re.compile(r"^JOB-\d+\.json$")
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
    monitoring.runs.ReportError: .../nothing: not a directory
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
