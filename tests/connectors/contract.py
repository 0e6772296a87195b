"""The source contract suite (river's ``check_*`` style), shared by the source tests.

Each ``check_*`` function takes a :class:`~connectors.types.Source` and asserts one
part of the contract every source keeps; ``CONTRACT_CHECKS`` lists those that
hold for any source with records, ``check_empty`` is for a source without any.
``test_synthetic.py`` and ``test_parquet.py`` run them against their sources.
Columnar sources only: the checks read ``RawChunk.table``. ``plan_all`` (any
source) is a helper of the source tests.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pytest

from connectors.types import Chunk, RawChunk, Source


def table_of(raw: RawChunk) -> pa.Table:
    """The table of a columnar raw chunk (every source here is columnar)."""
    assert raw.table is not None
    return raw.table


def plan_all(source: Source, partition: str, start: int, max_records: int) -> list[Chunk]:
    """Chunks from ``start`` until the plan has nothing more (``_plan_checked`` also checks)."""
    chunks = []
    position = start
    while (chunk := source.plan(partition, position, max_records)) is not None:
        chunks.append(chunk)
        position = chunk.end
    return chunks


def _plan_checked(source: Source, partition: str, max_records: int) -> list[Chunk]:
    chunks = []
    pos = source.start_position(partition)
    while not source.is_finished(partition, pos):
        chunk = source.plan(partition, pos, max_records)
        assert chunk is not None, f"{partition}: not finished at {pos} but nothing planned"
        assert chunk.start == pos
        assert chunk.end > chunk.start
        chunks.append(chunk)
        pos = chunk.end
    assert source.plan(partition, pos, max_records) is None
    assert pos == source.end_position(partition)
    return chunks


def check_covers_every_position(source: Source) -> None:
    """Planning from start to finish reads every position once, in order."""
    for max_records in (1, 7, 1000, 10**9):
        for partition in source.partitions():
            seen: list[int] = []
            for chunk in _plan_checked(source, partition, max_records):
                assert chunk.source == source.name
                assert chunk.partition == partition
                raw = source.read(chunk)
                assert raw.chunk == chunk
                assert (raw.table is None) != (raw.payloads is None)
                assert raw.table is not None
                assert raw.table.num_rows == len(raw)
                assert raw.positions.dtype == np.int64
                assert ((raw.positions >= chunk.start) & (raw.positions < chunk.end)).all()
                seen.extend(raw.positions.tolist())
            end = source.end_position(partition)
            assert end is not None
            assert seen == list(range(source.start_position(partition), end))


def check_chunks_pickle(source: Source) -> None:
    """A chunk, and the source itself, survive pickling (they travel to Dask workers)."""
    for partition in source.partitions():
        chunk = source.plan(partition, source.start_position(partition), 50)
        if chunk is None:
            continue
        again = pickle.loads(pickle.dumps(chunk))
        assert again == chunk
        remote = pickle.loads(pickle.dumps(source))
        assert table_of(remote.read(again)).equals(table_of(source.read(chunk)))


def check_read_is_deterministic(source: Source) -> None:
    """Reading a chunk twice gives equal records and positions."""
    for partition in source.partitions():
        chunk = source.plan(partition, source.start_position(partition), 100)
        if chunk is None:
            continue
        a, b = source.read(chunk), source.read(chunk)
        assert a.table is not None
        assert a.table.equals(b.table)
        assert (a.positions == b.positions).all()


def check_unknown_partition(source: Source) -> None:
    """A partition the source does not have is an error that names it."""
    with pytest.raises((KeyError, ValueError), match="no-such-partition"):
        source.plan("no-such-partition", 0, 10)


CONTRACT_CHECKS: list[Callable[[Source], None]] = [
    check_covers_every_position,
    check_chunks_pickle,
    check_read_is_deterministic,
    check_unknown_partition,
]


def check_empty(source: Source) -> None:
    """A source without records plans nothing and is finished at once."""
    for partition in source.partitions():
        start = source.start_position(partition)
        assert source.end_position(partition) == start
        assert source.is_finished(partition, start)
        assert source.plan(partition, start, 100) is None
