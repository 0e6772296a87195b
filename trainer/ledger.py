"""The learned-offsets ledger: which source positions a rank has learned, across restarts.

Each rank appends one line per learned chunk to ``<run_dir>/learned-rank<R>.log``::

    <step> <partition> <start> <end>

and, whenever it rolls back to a job checkpoint (a restart, or a recovery from a
lost store shard), one line ::

    rollback <step>

which voids every earlier chunk learned after ``step``: the store and the dense
network were put back to that checkpoint, so those chunks count as never
learned, and they are learned again after the line. :func:`learned_ranges`
applies the rollbacks, which is how tests and ``benchmarks/chaos.py`` count
offsets learned once, twice or never.

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

from pathlib import Path
from types import TracebackType
from typing import TextIO

ROLLBACK = "rollback"


class Ledger:
    """Appends learned chunks and rollbacks to one rank's ledger file (line-buffered)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: TextIO = open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115

    def learned(self, step: int, partition: str, start: int, end: int) -> None:
        """Record that step ``step`` learned ``[start, end)`` of ``partition``."""
        self._file.write(f"{step} {partition} {start} {end}\n")

    def rollback(self, step: int) -> None:
        """Void every chunk recorded so far with a step after ``step``."""
        self._file.write(f"{ROLLBACK} {step}\n")

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def ledger_entries(path: Path) -> list[tuple[int, str, int, int]]:
    """The chunks of one ledger that still count, rollbacks applied, in the order learned.

    A line a killed process left half-written (the last one) is ignored.
    """
    entries: list[tuple[int, str, int, int]] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == ROLLBACK and parts[1].isdigit():
            upto = int(parts[1])
            entries = [e for e in entries if e[0] <= upto]
        elif len(parts) == 4 and parts[0].isdigit() and parts[2].isdigit() and parts[3].isdigit():
            entries.append((int(parts[0]), parts[1], int(parts[2]), int(parts[3])))
    return entries


def learned_ranges(*paths: Path) -> dict[str, list[tuple[int, int]]]:
    """Per partition, the ``[start, end)`` ranges learned (rollbacks applied), sorted.

    Several paths: the ledgers of every rank of a job, merged.
    """
    out: dict[str, list[tuple[int, int]]] = {}
    for path in paths:
        for _, partition, start, end in ledger_entries(path):
            out.setdefault(partition, []).append((start, end))
    return {p: sorted(r) for p, r in sorted(out.items())}
