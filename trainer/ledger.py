"""The learned-offsets ledger: which source positions a rank has learned, across restarts.

Each rank appends one line per learned chunk to ``<run_dir>/learned-rank<R>.log``::

    <step> <partition> <start> <end> <unix time>

and, whenever it starts from a job checkpoint (a start, a restart, or a
recovery from a lost store shard), one line ::

    rollback <step> <unix time>

which voids every chunk learned before it after ``step``: the store and the
dense network were put back to that checkpoint, so those chunks count as never
learned, and they are learned again after the line. A rollback is the whole
job's (every rank starts from the same checkpoint), so :func:`learned_ranges`
merges the ledgers it is given by time and lets a rollback in any of them void
the chunks of all: a rank restarted on another host, with a new run directory
and perhaps another rank number, still voids what its earlier life learned.
That is how tests and ``benchmarks/chaos.py`` count offsets learned once,
twice or never. A long job's ledger is rotated by size (``trainer.run_files``,
:mod:`trainer.run_files`); the readers here read every part kept.

>>> import tempfile, pathlib
>>> path = pathlib.Path(tempfile.mkdtemp()) / "learned-rank0.log"
>>> with Ledger(path) as ledger:
...     ledger.learned(1, "t/0", 0, 10)
...     ledger.learned(2, "t/0", 10, 20)
...     ledger.rollback(1)
...     ledger.learned(2, "t/0", 10, 20)
>>> learned_ranges(path)
{'t/0': [(0, 10), (10, 20)]}
"""

from __future__ import annotations

import time
from pathlib import Path

from trainer.run_files import RotatingLines, read_lines

ROLLBACK = "rollback"


class Ledger(RotatingLines):
    """Appends learned chunks and rollbacks to one rank's ledger file (line-buffered),
    rotated past ``max_bytes`` with ``keep`` older parts (:mod:`trainer.run_files`;
    the readers below read every part kept).
    """

    def __init__(self, path: Path, *, max_bytes: int | None = None, keep: int = 4) -> None:
        super().__init__(path, max_bytes=max_bytes, keep=keep)

    def learned(self, step: int, partition: str, start: int, end: int) -> None:
        """Record that step ``step`` learned ``[start, end)`` of ``partition``."""
        self.write(f"{step} {partition} {start} {end} {time.time():.6f}\n")

    def rollback(self, step: int) -> None:
        """Void every chunk recorded so far (by any rank) with a step after ``step``."""
        self.write(f"{ROLLBACK} {step} {time.time():.6f}\n")


_Entry = tuple[int, str, int, int]


def _lines(path: Path) -> list[tuple[float, int, str, int, int] | tuple[float, int]]:
    """The parsed lines of one ledger: (time, step, partition, start, end) or (time, step)
    for a rollback. A line a killed process left half-written (the last one) is skipped;
    lines without a time (older ledgers) take their position in the file as one.
    """
    out: list[tuple[float, int, str, int, int] | tuple[float, int]] = []
    for i, line in enumerate(read_lines(path)):
        parts = line.split()
        if parts and parts[0] == ROLLBACK and len(parts) in (2, 3) and parts[1].isdigit():
            out.append((_time(parts[2:], i), int(parts[1])))
        elif (
            len(parts) in (4, 5)
            and parts[0].isdigit()
            and parts[2].isdigit()
            and parts[3].isdigit()
        ):
            out.append((_time(parts[4:], i), int(parts[0]), parts[1], int(parts[2]), int(parts[3])))
    return out


def _time(rest: list[str], index: int) -> float:
    try:
        return float(rest[0]) if rest else float(index)
    except ValueError:
        return float(index)


def _apply(lines: list[tuple[float, int, str, int, int] | tuple[float, int]]) -> list[_Entry]:
    entries: list[_Entry] = []
    for line in lines:
        if len(line) == 2:
            upto = line[1]
            entries = [e for e in entries if e[0] <= upto]
        else:
            entries.append(line[1:])
    return entries


def ledger_entries(path: Path) -> list[_Entry]:
    """The chunks of one ledger that still count, rollbacks applied, in the order learned."""
    return _apply(_lines(path))


def learned_ranges(*paths: Path) -> dict[str, list[tuple[int, int]]]:
    """Per partition, the ``[start, end)`` ranges learned (rollbacks applied), sorted.

    Several paths: the ledgers of every rank of a job, from every host and every
    run directory it had, merged by time (see the module docstring).
    """
    merged = sorted((line for path in paths for line in _lines(path)), key=lambda line: line[0])
    out: dict[str, list[tuple[int, int]]] = {}
    for _, partition, start, end in _apply(merged):
        out.setdefault(partition, []).append((start, end))
    return {p: sorted(r) for p, r in sorted(out.items())}
