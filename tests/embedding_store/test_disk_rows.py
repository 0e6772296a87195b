"""The disk tier's engine (RocksDB on a real disk) against a dict of rows."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from embedding_store.errors import StoreError
from embedding_store.tier.disk_rows import DiskRows, DiskSettings, RowLayout
from embedding_store.types import RowBatch

LAYOUT = RowLayout(dim=4, state_width=1)


def rows_of(ids: np.ndarray, salt: float, dim: int = 4) -> RowBatch:
    ids = np.asarray(ids, dtype=np.uint64)
    base = (ids % np.uint64(1000)).astype(np.float32)[:, None]
    return RowBatch(
        ids=ids,
        weights=base + salt + np.arange(dim, dtype=np.float32),
        state=(ids % np.uint64(7)).astype(np.float32)[:, None] * salt,
        row_step=(ids % np.uint64(13)).astype(np.int64) + int(salt),
        last_seen=(ids % np.uint64(1_000_003)).astype(np.int64) + int(salt),
        freq=(ids % np.uint64(5)).astype(np.int64) * 8 + int(salt),
    )


def as_dict(rows: RowBatch) -> dict[int, tuple[object, ...]]:
    return {
        int(rows.ids[i]): (
            rows.weights[i].tolist(),
            rows.state[i].tolist(),
            int(rows.row_step[i]),
            int(rows.last_seen[i]),
            int(rows.freq[i]),
        )
        for i in range(len(rows))
    }


def test_rows_read_back_as_written_replaced_and_deleted(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    oracle: dict[int, tuple[object, ...]] = {}
    with DiskRows(tmp_path / "t", LAYOUT, DiskSettings(readers=4)) as disk:
        for salt in range(6):
            ids = np.unique(rng.integers(0, 20_000, 3000)).astype(np.uint64)
            disk.put(rows_of(ids, float(salt)))
            oracle.update(as_dict(rows_of(ids, float(salt))))
            gone = ids[::5]
            disk.delete(gone)
            for i in gone:
                oracle.pop(int(i))
        asked = np.concatenate(
            [rng.integers(0, 20_000, 5000).astype(np.uint64), np.array([1 << 63], np.uint64)]
        )
        found, got = disk.get(asked)
        assert found.tolist() == [int(i) in oracle for i in asked]
        assert got.ids.tolist() == asked[found].tolist()
        assert as_dict(got) == {i: oracle[i] for i in got.ids.tolist()}


def test_a_scan_returns_every_row_once_in_id_order(tmp_path: Path) -> None:
    ids = np.random.default_rng(2).permutation(np.arange(0, 50_000, 3, dtype=np.uint64))
    ids = np.concatenate([ids, np.array([(1 << 64) - 1, 1 << 63], np.uint64)])
    with DiskRows(tmp_path / "t", LAYOUT) as disk:
        disk.put(rows_of(ids, 1.0))
        parts = list(disk.scan_all(count=1000))
        scanned = [i for p in parts for i in p.ids.tolist()]
        assert scanned == sorted(ids.tolist())
        assert all(len(p) <= 1000 for p in parts)
        everything: dict[int, tuple[object, ...]] = {}
        for p in parts:
            everything.update(as_dict(p))
        assert everything == as_dict(rows_of(ids, 1.0))
        after = disk.scan(after=sorted(ids.tolist())[10], count=5)
        assert after.ids.tolist() == sorted(ids.tolist())[11:16]


def test_a_checkpoint_is_the_tier_as_it_was_and_restores_apart(tmp_path: Path) -> None:
    ids = np.arange(10_000, dtype=np.uint64)
    with DiskRows(tmp_path / "live", LAYOUT) as disk:
        disk.put(rows_of(ids, 1.0))
        cp = disk.checkpoint(tmp_path / "cp")
        # After the checkpoint: changed, removed and new rows, none of which it holds.
        disk.put(rows_of(ids[:100], 2.0))
        disk.delete(ids[100:200])
        disk.put(rows_of(np.array([77_777]), 3.0))
    inode = {f.name: f.stat().st_ino for f in cp.iterdir() if f.suffix == ".sst"}
    assert inode, "the checkpoint holds the engine's table files"
    with DiskRows.restore(cp, tmp_path / "restored", LAYOUT) as back:
        found, got = back.get(np.concatenate([ids, np.array([77_777], np.uint64)]))
        assert found[:-1].all()
        assert not found[-1]
        assert as_dict(got) == as_dict(rows_of(ids, 1.0))
        # The restored tier trains on without touching the checkpoint's files.
        back.put(rows_of(ids[:10], 5.0))
        back.checkpoint(tmp_path / "cp2")
    for f in cp.iterdir():
        if f.name in inode:
            assert f.stat().st_ino == inode[f.name]
    with DiskRows.restore(cp, tmp_path / "again", LAYOUT) as again:
        _, got = again.get(ids[:10])
        assert as_dict(got) == as_dict(rows_of(ids[:10], 1.0))


def test_rows_of_another_shape_are_refused_by_name(tmp_path: Path) -> None:
    with DiskRows(tmp_path / "t", LAYOUT) as disk:
        with pytest.raises(ValueError, match=r"rows: expected weights of \(4,\)"):
            disk.put(rows_of(np.array([1, 2]), 1.0, dim=8))
        disk.put(rows_of(np.array([1]), 1.0))
    # The same files read with a wider layout: a row of the wrong size is an error.
    with (
        DiskRows(tmp_path / "t", RowLayout(dim=8, state_width=1)) as disk,
        pytest.raises(StoreError, match="a row of 44 bytes, expected 60"),
    ):
        disk.get(np.array([1], np.uint64))


def test_a_closed_tier_says_so(tmp_path: Path) -> None:
    disk = DiskRows(tmp_path / "t", LAYOUT)
    disk.close()
    disk.close()
    with pytest.raises(StoreError, match="closed"):
        disk.get(np.array([1], np.uint64))


FULL_DISK = """
import resource, signal, sys
import numpy as np
# Files may not grow past 1 MiB: the engine's first table file over it fails to write,
# as on a full disk (the signal the kernel sends for it is ignored, as a shard would).
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
from embedding_store.tier.disk_rows import DiskFull, DiskRows, RowLayout
from embedding_store.types import RowBatch
disk = DiskRows(sys.argv[1], RowLayout(4, 1))
written = 0
ones = np.ones(20000, np.int64)
try:
    for k in range(100):
        ids = np.arange(k * 20000, (k + 1) * 20000, dtype=np.uint64)
        weights = np.ones((20000, 4), np.float32)
        disk.put(RowBatch(ids, weights, weights[:, :1], ones, ones, ones))
        disk.flush()
        written = (k + 1) * 20000
except DiskFull as e:
    print("FULL", e)
found, _ = disk.get(np.arange(0, written, 7, dtype=np.uint64))
print("READABLE", bool(found.all()), written)
"""


@pytest.mark.processes
def test_a_full_disk_is_an_error_naming_the_tier_and_its_rows_stay_readable(
    tmp_path: Path,
) -> None:
    import subprocess
    import sys

    from tests.support.processes import REPO_ROOT

    run = subprocess.run(
        [sys.executable, "-c", FULL_DISK, str(tmp_path / "tier")],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"FULL disk tier at {tmp_path / 'tier'}: the disk is full" in run.stdout
    assert "File too large" in run.stdout
    assert "READABLE True" in run.stdout
