"""The disk tier's engine (RocksDB on a real disk) against a dict of rows."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from embedding_store.errors import StoreError
from embedding_store.tier.disk_rows import DiskRows, RowLayout

LAYOUT = RowLayout(dim=4, state_width=1)


def records(ids: np.ndarray, salt: float) -> np.ndarray:
    weights = (ids[:, None] % 1000).astype(np.float32) + salt + np.arange(4, dtype=np.float32)
    state = (ids[:, None] % 7).astype(np.float32) * salt
    return LAYOUT.pack(weights, state, ids.astype(np.int64) % 1_000_003 + int(salt))


def as_dict(ids: np.ndarray, recs: np.ndarray) -> dict[int, bytes]:
    return {int(i): r.tobytes() for i, r in zip(ids, recs, strict=True)}


def test_rows_read_back_as_written_replaced_and_deleted(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    oracle: dict[int, bytes] = {}
    with DiskRows(tmp_path / "t", LAYOUT, readers=4) as disk:
        for salt in range(6):
            ids = np.unique(rng.integers(0, 1 << 63, 3000, dtype=np.uint64) % np.uint64(20_000))
            recs = records(ids, float(salt))
            disk.put(ids, recs)
            oracle.update(as_dict(ids, recs))
            gone = ids[::5]
            disk.delete(gone)
            for i in gone:
                oracle.pop(int(i))
        asked = np.concatenate(
            [rng.integers(0, 20_000, 5000).astype(np.uint64), np.array([1 << 63], np.uint64)]
        )
        found, got = disk.get(asked)
        for i, hit, rec in zip(asked, found, got, strict=True):
            assert hit == (int(i) in oracle)
            if hit:
                assert rec.tobytes() == oracle[int(i)]
        assert not found[-1]


def test_a_scan_returns_every_row_once_in_id_order(tmp_path: Path) -> None:
    ids = np.random.default_rng(2).permutation(np.arange(0, 50_000, 3, dtype=np.uint64))
    ids = np.concatenate([ids, np.array([(1 << 64) - 1, 1 << 63], np.uint64)])
    with DiskRows(tmp_path / "t", LAYOUT) as disk:
        disk.put(ids, records(ids, 1.0))
        parts = list(disk.scan_all(count=1000))
        scanned = np.concatenate([p[0] for p in parts])
        assert scanned.tolist() == sorted(ids.tolist())
        assert all(len(p[0]) <= 1000 for p in parts)
        recs = np.concatenate([p[1] for p in parts])
        assert as_dict(scanned, recs) == as_dict(ids, records(ids, 1.0))
        after, _ = disk.scan(after=int(sorted(ids.tolist())[10]), count=5)
        assert after.tolist() == sorted(ids.tolist())[11:16]


def test_a_checkpoint_is_the_tier_as_it_was_and_restores_apart(tmp_path: Path) -> None:
    ids = np.arange(10_000, dtype=np.uint64)
    with DiskRows(tmp_path / "live", LAYOUT) as disk:
        disk.put(ids, records(ids, 1.0))
        cp = disk.checkpoint(tmp_path / "cp")
        # After the checkpoint: changed, removed and new rows, none of which it holds.
        disk.put(ids[:100], records(ids[:100], 2.0))
        disk.delete(ids[100:200])
        disk.put(np.array([77_777], np.uint64), records(np.array([77_777], np.uint64), 3.0))
    inode = {f.name: f.stat().st_ino for f in cp.iterdir() if f.suffix == ".sst"}
    assert inode, "the checkpoint holds the engine's table files"
    with DiskRows.restore(cp, tmp_path / "restored", LAYOUT) as back:
        found, got = back.get(np.concatenate([ids, np.array([77_777], np.uint64)]))
        assert found[:-1].all()
        assert not found[-1]
        assert as_dict(ids, got[:-1]) == as_dict(ids, records(ids, 1.0))
        # The restored tier trains on without touching the checkpoint's files.
        back.put(ids[:10], records(ids[:10], 5.0))
        back.checkpoint(tmp_path / "cp2")
    for f in cp.iterdir():
        if f.name in inode:
            assert f.stat().st_ino == inode[f.name]
    with DiskRows.restore(cp, tmp_path / "again", LAYOUT) as again:
        _, got = again.get(ids[:10])
        assert as_dict(ids[:10], got) == as_dict(ids[:10], records(ids[:10], 1.0))


def test_records_of_another_layout_are_refused_by_name(tmp_path: Path) -> None:
    with DiskRows(tmp_path / "t", LAYOUT) as disk:
        other = RowLayout(dim=8, state_width=1).pack(
            np.zeros((2, 8), np.float32), np.zeros((2, 1), np.float32), np.zeros(2)
        )
        with pytest.raises(ValueError, match="records: expected 2 rows"):
            disk.put(np.array([1, 2], np.uint64), other)
    with DiskRows(tmp_path / "t", LAYOUT) as disk:
        disk.put(np.array([1], np.uint64), records(np.array([1], np.uint64), 1.0))
    # The same files read with a wider layout: a row of the wrong size is an error.
    with (
        DiskRows(tmp_path / "t", RowLayout(dim=8, state_width=1)) as disk,
        pytest.raises(StoreError, match="a row of 28 bytes, expected 44"),
    ):
        disk.get(np.array([1], np.uint64))


def test_a_closed_tier_says_so(tmp_path: Path) -> None:
    disk = DiskRows(tmp_path / "t", LAYOUT)
    disk.close()
    disk.close()
    with pytest.raises(StoreError, match="closed"):
        disk.get(np.array([1], np.uint64))
