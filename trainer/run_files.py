"""Line files a rank appends to for as long as its job runs, bounded by rotation.

A rank writes a progress line to ``metrics-rank<R>.jsonl`` every few seconds and
a ledger line to ``learned-rank<R>.log`` every step: on a busy job tens of MB
a day each, for weeks. :class:`RotatingLines` rotates such a file by size,
as logrotate would: when a line would take ``<path>`` past ``max_bytes`` it
becomes ``<path>.1`` (an older ``.1`` becomes ``.2``, and so on), the oldest
beyond ``keep`` is deleted, and writing goes on in a new ``<path>``. A file is
only ever cut between lines. Readers take every part, oldest first
(:func:`parts_of`, :func:`read_lines`), so a report or an audit of the run sees
all that is kept.

>>> import tempfile
>>> path = Path(tempfile.mkdtemp()) / "m.jsonl"
>>> with RotatingLines(path, max_bytes=8, keep=2) as out:
...     for i in range(5):
...         out.write(f"line{i}\\n")
>>> [p.name for p in parts_of(path)]
['m.jsonl.2', 'm.jsonl.1', 'm.jsonl']
>>> read_lines(path)
['line2', 'line3', 'line4']
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from types import TracebackType
from typing import Self, TextIO


class RotatingLines:
    """Appends whole lines to ``path``, rotating it past ``max_bytes`` (None: never) and
    keeping ``keep`` rotated parts. Line-buffered: each line reaches the file when it
    is written (a killed process loses at most the line it was writing).
    """

    def __init__(self, path: Path, *, max_bytes: int | None, keep: int) -> None:
        if max_bytes is not None and max_bytes < 1:
            msg = f"max_bytes: expected at least 1 or None, got {max_bytes}"
            raise ValueError(msg)
        if keep < 0:
            msg = f"keep: expected 0 or more, got {keep}"
            raise ValueError(msg)
        self.path = path
        self.max_bytes = max_bytes
        self.keep = keep
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: TextIO = self._open()
        self._size = path.stat().st_size  # a restarted rank appends to its last file

    def _open(self) -> TextIO:
        return open(self.path, "a", encoding="utf-8", buffering=1)

    def write(self, lines: str) -> None:
        """Append ``lines`` (one or more whole lines, each ending in a newline)."""
        n = len(lines.encode("utf-8"))
        if self.max_bytes is not None and self._size and self._size + n > self.max_bytes:
            self._rotate()
        self._file.write(lines)
        self._size += n

    def _rotate(self) -> None:
        self._file.close()
        # The oldest kept part makes room, then each moves one up, from the oldest: no
        # part is overwritten before it has moved.
        oldest = _part(self.path, self.keep) if self.keep else self.path
        with contextlib.suppress(FileNotFoundError):
            oldest.unlink()
        for k in range(self.keep - 1, 0, -1):
            with contextlib.suppress(FileNotFoundError):
                _part(self.path, k).replace(_part(self.path, k + 1))
        if self.keep:
            self.path.replace(_part(self.path, 1))
        self._file = self._open()
        self._size = 0

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _part(path: Path, k: int) -> Path:
    return path.with_name(f"{path.name}.{k}")


def parts_of(path: Path) -> list[Path]:
    """The parts of the rotated file ``path`` that exist, oldest first (``path`` last)."""
    rotated: list[tuple[int, Path]] = []
    prefix = path.name + "."
    if path.parent.is_dir():
        for p in path.parent.iterdir():
            suffix = p.name.removeprefix(prefix)
            if p.name.startswith(prefix) and suffix.isdigit() and p.is_file():
                rotated.append((int(suffix), p))
    parts = [p for _, p in sorted(rotated, reverse=True)]
    return [*parts, path] if path.is_file() else parts


def read_lines(path: Path) -> list[str]:
    """Every line of the rotated file ``path``, oldest first (undecodable bytes replaced)."""
    lines: list[str] = []
    for part in parts_of(path):
        with contextlib.suppress(FileNotFoundError):  # rotated away while reading
            lines += part.read_text(encoding="utf-8", errors="replace").splitlines()
    return lines
