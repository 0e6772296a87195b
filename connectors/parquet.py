"""``ParquetSource``: Parquet files as a finite source, in chunks of at most ``max_records`` rows.

Each file is a partition; its positions are row indices within the file. A
chunk is ``[position, min(position + max_records, rows))``: a row group larger
than ``max_records`` is cut into several chunks, and smaller ones are merged,
so a backfill trains at ``trainer.batch_size`` whatever row-group size the
files were written with. Any row is a valid position, so a checkpoint taken in
the middle of a row group resumes there. A read decodes only the row groups
the chunk overlaps.

Partition names are the files' paths relative to the deepest folder that holds
all of them (POSIX separators), so they stay the same when the same data is
named again from another working directory or moved as a whole.

>>> import tempfile, pyarrow as pa, pyarrow.parquet as pq
>>> d = tempfile.mkdtemp()
>>> pq.write_table(pa.table({"x": list(range(10))}), f"{d}/a.parquet", row_group_size=4)
>>> src = ParquetSource(d)
>>> src.partitions(), src.end_position("a.parquet")
(['a.parquet'], 10)
>>> chunk = src.plan("a.parquet", 0, 100)
>>> chunk.start, chunk.end
(0, 10)
>>> [(c.start, c.end) for c in (src.plan("a.parquet", p, 3) for p in (0, 3, 6, 9))]
[(0, 3), (3, 6), (6, 9), (9, 10)]
>>> src.read(src.plan("a.parquet", 3, 3)).table["x"].to_pylist()  # across row groups 0 and 1
[3, 4, 5]
>>> src.plan("a.parquet", 11, 100)  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
connectors.parquet.InvalidPosition: ...position 11 is outside the file's 10 rows ...
"""

from __future__ import annotations

import bisect
import glob
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from connectors.types import Chunk, RawChunk


class InvalidPosition(ValueError):
    """A position a source cannot resume from (not a chunk boundary, or past the end)."""


class UnknownPartition(ValueError):
    """A partition name the source does not have."""


@dataclass(frozen=True)
class _File:
    path: str  # absolute
    starts: tuple[int, ...]  # first row of each non-empty row group
    groups: tuple[int, ...]  # the row-group index of each entry of ``starts``
    rows: int


def _expand(paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> list[Path]:
    """Files named by ``paths``: files as given, folders searched recursively, globs expanded."""
    items = [paths] if isinstance(paths, str | os.PathLike) else list(paths)
    if not items:
        msg = "ParquetSource needs at least one path (file, folder or glob)"
        raise FileNotFoundError(msg)
    found: list[Path] = []
    for item in items:
        text = os.fspath(item)
        if glob.has_magic(text):
            matches = sorted(glob.glob(text, recursive=True))
            if not matches:
                msg = f"no file matches the glob {text!r}"
                raise FileNotFoundError(msg)
            candidates = [Path(m) for m in matches]
        else:
            candidates = [Path(text)]
        for c in candidates:
            if c.is_dir():
                inside = sorted(p for p in c.rglob("*.parquet") if p.is_file())
                if not inside:
                    msg = f"folder {str(c)!r} holds no *.parquet file"
                    raise FileNotFoundError(msg)
                found.extend(inside)
            elif c.is_file():
                found.append(c)
            else:
                msg = f"no such Parquet file or folder: {str(c)!r}"
                raise FileNotFoundError(msg)
    # The same file named twice (a folder and a glob inside it) is one partition.
    unique = {p.resolve(): None for p in found}
    return sorted(unique)


def _describe(boundaries: Sequence[int]) -> str:
    if len(boundaries) <= 8:
        return ", ".join(map(str, boundaries))
    head = ", ".join(map(str, boundaries[:4]))
    tail = ", ".join(map(str, boundaries[-3:]))
    return f"{head}, ..., {tail} ({len(boundaries)} in all)"


class ParquetSource:
    """A ``Source`` over Parquet ``paths`` (files, folders or globs), optionally projected.

    Every file's metadata is read once here, so a missing column or an
    unreadable file fails at construction, not in a worker.

    >>> ParquetSource("/nonexistent/*.parquet")
    Traceback (most recent call last):
    ...
    FileNotFoundError: no file matches the glob '/nonexistent/*.parquet'
    """

    def __init__(
        self,
        paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        columns: list[str] | None = None,
        name: str = "parquet",
    ) -> None:
        self.name = name
        self.columns = list(columns) if columns is not None else None
        files = _expand(paths)
        root = Path(os.path.commonpath([str(f.parent) for f in files]))
        self._files: dict[str, _File] = {}
        for path in files:
            meta = pq.ParquetFile(path)
            if self.columns is not None:
                have = set(meta.schema_arrow.names)
                missing = [c for c in self.columns if c not in have]
                if missing:
                    msg = (
                        f"{str(path)!r} has no column(s) {missing} "
                        f"(columns: {meta.schema_arrow.names})"
                    )
                    raise KeyError(msg)
            starts: list[int] = []
            groups: list[int] = []
            row = 0
            for g in range(meta.metadata.num_row_groups):
                n = meta.metadata.row_group(g).num_rows
                if n > 0:
                    starts.append(row)
                    groups.append(g)
                row += n
            self._files[path.relative_to(root).as_posix()] = _File(
                str(path), tuple(starts), tuple(groups), row
            )

    def _file(self, partition: str) -> _File:
        try:
            return self._files[partition]
        except KeyError:
            names = list(self._files)
            shown = names if len(names) <= 10 else [*names[:10], "..."]
            msg = f"source {self.name!r} has no partition {partition!r} (partitions: {shown})"
            raise UnknownPartition(msg) from None

    def path(self, partition: str) -> str:
        """The absolute path of a partition's file."""
        return self._file(partition).path

    def partitions(self) -> list[str]:
        """The files, sorted, named relative to the deepest folder holding them all."""
        return sorted(self._files)

    def start_position(self, partition: str) -> int:
        """Row 0."""
        self._file(partition)
        return 0

    def end_position(self, partition: str) -> int | None:
        """The file's row count."""
        return self._file(partition).rows

    def boundaries(self, partition: str) -> list[int]:
        """The file's row-group starts and its end (chunks may start anywhere between)."""
        f = self._file(partition)
        return [*f.starts, f.rows]

    def plan(self, partition: str, position: int, max_records: int) -> Chunk | None:
        """Rows ``[position, min(position + max_records, rows))``; None at the end.

        The chunk names the row groups it overlaps and where it starts in the first.
        """
        f = self._file(partition)
        if position == f.rows:
            return None
        if not 0 <= position < f.rows:
            msg = (
                f"{f.path}: position {position} is outside the file's {f.rows} rows "
                f"(partition {partition!r}); resume at a row in [0, {f.rows}]"
            )
            raise InvalidPosition(msg)
        if max_records < 1:
            msg = f"max_records must be >= 1, got {max_records}"
            raise ValueError(msg)
        end = min(position + max_records, f.rows)
        # Row groups overlapping [position, end): the last starting at or before
        # ``position``, up to the last starting before ``end``.
        first = bisect.bisect_right(f.starts, position) - 1
        last = bisect.bisect_left(f.starts, end)
        return Chunk(
            source=self.name,
            partition=partition,
            start=position,
            end=end,
            extra=(
                ("path", f.path),
                ("row_groups", f.groups[first:last]),
                ("skip", position - f.starts[first]),
            ),
        )

    def is_finished(self, partition: str, position: int) -> bool:
        """True at or after the file's last row."""
        return position >= self._file(partition).rows

    def read(self, chunk: Chunk) -> RawChunk:
        """The chunk's rows (projected to ``columns``), with their row indices.

        Decodes the row groups the chunk overlaps, then slices (zero-copy).
        """
        if chunk.source != self.name:
            msg = f"source {self.name!r} cannot read a chunk of source {chunk.source!r}"
            raise ValueError(msg)
        f = self._file(chunk.partition)
        extra = dict(chunk.extra)
        groups = extra.get("row_groups")
        if not isinstance(groups, tuple):
            msg = f"{chunk!r} names no row groups: plan it with ParquetSource.plan"
            raise ValueError(msg)
        skip = extra.get("skip", 0)
        if not isinstance(skip, int):
            msg = f"{chunk!r}: 'skip' must be a row count"
            raise ValueError(msg)
        table = pq.ParquetFile(f.path).read_row_groups(list(groups), columns=self.columns)
        if table.num_rows < skip + len(chunk):
            msg = (
                f"{f.path}: row groups {list(groups)} hold {table.num_rows} rows, the chunk "
                f"[{chunk.start}, {chunk.end}) needs {skip + len(chunk)}: the file changed"
            )
            raise InvalidPosition(msg)
        table = table.slice(skip, len(chunk))
        positions = np.arange(chunk.start, chunk.end, dtype=np.int64)
        return RawChunk(chunk=chunk, positions=positions, table=table)

    def close(self) -> None:
        """Nothing to release (files are opened per read)."""
