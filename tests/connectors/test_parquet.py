"""ParquetSource: the source contract, paths, projection, resuming, the synthetic round trip."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from connectors.parquet import InvalidPosition, ParquetSource, UnknownPartition
from connectors.synthetic import SyntheticConfig, SyntheticSource, write_parquet
from connectors.types import Chunk, Source
from tests.connectors.contract import CONTRACT_CHECKS, check_empty, plan_all, table_of


def _write(path: Path, rows: int, row_group_size: int, offset: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table(
        {
            "x": pa.array(np.arange(offset, offset + rows, dtype=np.int64)),
            "y": pa.array([f"v{i}" for i in range(rows)], type=pa.string()),
            "z": pa.array(np.arange(rows, dtype=np.float64) / 2),
        }
    )
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


@pytest.fixture
def data(tmp_path: Path) -> Path:
    """A folder of files with various row groups, one nested and one empty."""
    root = tmp_path / "data"
    _write(root / "a.parquet", 1000, 128)
    _write(root / "b.parquet", 37, 10, offset=5000)
    _write(root / "sub" / "c.parquet", 300, 300, offset=9000)
    _write(root / "empty.parquet", 0, 10)
    (root / "_SUCCESS").write_text("")  # not Parquet: folders only take *.parquet
    return root


@pytest.mark.parametrize("check", CONTRACT_CHECKS, ids=lambda c: c.__name__)
def test_contract(check: Callable[[Source], None], data: Path) -> None:
    check(ParquetSource(data))


def test_contract_empty(tmp_path: Path) -> None:
    check_empty(ParquetSource(_write(tmp_path / "e.parquet", 0, 10)))
    # A synthetic file of zero events too.
    check_empty(ParquetSource(write_parquet(tmp_path / "s.parquet", SyntheticConfig(), events=0)))


def test_folder_partitions_and_reads(data: Path) -> None:
    src = ParquetSource(data)
    assert src.partitions() == ["a.parquet", "b.parquet", "empty.parquet", "sub/c.parquet"]
    assert [src.end_position(p) for p in src.partitions()] == [1000, 37, 0, 300]
    assert src.path("sub/c.parquet") == str((data / "sub" / "c.parquet").resolve())
    chunk = src.plan("b.parquet", 0, 10**9)
    assert chunk is not None
    assert table_of(src.read(chunk))["x"].to_pylist() == list(range(5000, 5037))


def test_globs_lists_and_duplicates(data: Path) -> None:
    assert ParquetSource(str(data / "*.parquet")).partitions() == [
        "a.parquet",
        "b.parquet",
        "empty.parquet",
    ]
    assert ParquetSource(str(data / "**" / "c.parquet")).partitions() == ["c.parquet"]
    # Names are relative to the deepest common folder, whatever form the paths take.
    both = ParquetSource([data / "a.parquet", str(data / "sub" / "*.parquet")])
    assert both.partitions() == ["a.parquet", "sub/c.parquet"]
    # The same file named twice is one partition.
    assert (
        ParquetSource([data, data / "a.parquet"]).partitions() == ParquetSource(data).partitions()
    )
    assert ParquetSource(data / "a.parquet").partitions() == ["a.parquet"]


def test_missing_paths_are_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"nope\.parquet"):
        ParquetSource(tmp_path / "nope.parquet")
    with pytest.raises(FileNotFoundError, match=r"glob .*\*\.parquet"):
        ParquetSource(str(tmp_path / "*.parquet"))
    (tmp_path / "hollow").mkdir()
    with pytest.raises(FileNotFoundError, match="hollow"):
        ParquetSource(tmp_path / "hollow")
    with pytest.raises(FileNotFoundError, match="at least one path"):
        ParquetSource([])


def test_projection(data: Path) -> None:
    src = ParquetSource(data, columns=["z", "x"])
    chunk = src.plan("a.parquet", 128, 128)
    assert chunk is not None
    table = table_of(src.read(chunk))
    assert table.column_names == ["z", "x"]
    assert table["x"].to_pylist() == list(range(128, 256))
    with pytest.raises(KeyError, match=r"a\.parquet.*\['w'\]"):
        ParquetSource(data, columns=["x", "w"])


def test_chunks_are_max_records_long_whatever_the_row_groups(data: Path) -> None:
    src = ParquetSource(data)
    assert src.boundaries("b.parquet") == [0, 10, 20, 30, 37]
    # Small row groups are merged, and cut where max_records ends.
    spans = [(c.start, c.end) for c in plan_all(src, "b.parquet", 0, 25)]
    assert spans == [(0, 25), (25, 37)]
    # A row group larger than max_records is cut into several chunks (it used to be
    # one chunk, so a backfill of 65,536-row groups took steps of 65,536 samples).
    spans = [(c.start, c.end) for c in plan_all(src, "a.parquet", 0, 50)]
    assert spans == [(s, min(s + 50, 1000)) for s in range(0, 1000, 50)]
    rows = [x for c in plan_all(src, "a.parquet", 0, 50) for x in table_of(src.read(c))["x"]]
    assert [x.as_py() for x in rows] == list(range(1000))
    first_groups = [dict(c.extra)["row_groups"] for c in plan_all(src, "a.parquet", 100, 50)[:2]]
    assert first_groups == [(0, 1), (1,)]  # only the row groups a chunk overlaps


def test_resume_anywhere_inside_a_row_group(data: Path) -> None:
    src = ParquetSource(data)
    # A checkpoint that stopped at row 389, inside the fourth row group, resumes there.
    rest = [table_of(src.read(c)) for c in plan_all(src, "a.parquet", 389, 200)]
    assert pa.concat_tables(rest)["x"].to_pylist() == list(range(389, 1000))
    assert src.is_finished("a.parquet", 1000)
    assert not src.is_finished("a.parquet", 999)


@pytest.mark.parametrize("position", [1001, -1])
def test_bad_position_names_file_and_rows(data: Path, position: int) -> None:
    src = ParquetSource(data)
    with pytest.raises(InvalidPosition) as err:
        src.plan("a.parquet", position, 100)
    text = str(err.value)
    assert str(data.resolve() / "a.parquet") in text
    assert f"position {position} is outside the file's 1000 rows" in text


def test_unknown_partition_and_foreign_chunk(data: Path) -> None:
    src = ParquetSource(data)
    with pytest.raises(UnknownPartition, match=r"zz\.parquet"):
        src.end_position("zz.parquet")
    with pytest.raises(ValueError, match="kafka"):
        src.read(Chunk("kafka", "a.parquet", 0, 128))
    with pytest.raises(ValueError, match="names no row groups"):
        src.read(Chunk("parquet", "a.parquet", 0, 128))


def test_file_changed_under_the_source(data: Path) -> None:
    src = ParquetSource(data)
    chunk = src.plan("b.parquet", 0, 10)
    assert chunk is not None
    _write(data / "b.parquet", 37, 5)
    with pytest.raises(InvalidPosition, match="the file changed"):
        src.read(chunk)


def test_empty_row_groups_are_skipped(tmp_path: Path) -> None:
    path = tmp_path / "gaps.parquet"
    schema = pa.schema([pa.field("x", pa.int64())])
    with pq.ParquetWriter(path, schema) as w:
        w.write_table(pa.table({"x": [0, 1, 2]}, schema=schema))
        w.write_table(schema.empty_table())
        w.write_table(pa.table({"x": [3, 4]}, schema=schema))
    src = ParquetSource(path)
    if pq.ParquetFile(path).metadata.num_row_groups == 3:  # pyarrow wrote the empty group
        assert src.boundaries("gaps.parquet") == [0, 3, 5]
    chunks = plan_all(src, "gaps.parquet", 0, 2)
    assert [table_of(src.read(c))["x"].to_pylist() for c in chunks] == [[0, 1], [2, 3], [4]]


def test_source_pickles_with_chunks(data: Path) -> None:
    src = ParquetSource(data, columns=["x"])
    chunk = src.plan("sub/c.parquet", 0, 10)
    assert chunk is not None
    remote = pickle.loads(pickle.dumps(src))
    assert table_of(remote.read(pickle.loads(pickle.dumps(chunk)))).equals(
        table_of(src.read(chunk))
    )


def test_synthetic_round_trip(tmp_path: Path) -> None:
    cfg = SyntheticConfig(seed=11, partitions=2)
    path = write_parquet(tmp_path / "synth.parquet", cfg, events=1000, row_group_size=128)
    path1 = write_parquet(tmp_path / "p1.parquet", cfg, events=300, partition=1)
    synth = SyntheticSource(cfg)
    src = ParquetSource([path, path1])
    assert src.boundaries("synth.parquet") == [*range(0, 1000, 128), 1000]
    for chunk in plan_all(src, "synth.parquet", 0, 300):
        raw = src.read(chunk)
        expected = table_of(synth.read(Chunk("synthetic", "synthetic/0", chunk.start, chunk.end)))
        assert table_of(raw).equals(expected)
        assert (raw.positions == np.arange(chunk.start, chunk.end)).all()
    whole = pq.read_table(path1)
    assert whole.equals(synth.records(1, 0, 300))
    # Nullable dense columns keep their nulls through Parquet.
    assert whole["I12"].null_count > 0
