"""A tiered table (memory over RocksDB on disk) against the same table all in memory.

The same random calls go to both: training lookups of skewed ids, pushes with
repeated ids, reads, removals, evictions and checkpoints. After every call the
two hold the same rows, each with the same weights, optimizer state, step, last
seen step and frequency, while the tiered one keeps at most its memory budget in
memory and moves the rest to disk and back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from embedding_store.errors import InvalidRequest
from embedding_store.table import EmbeddingTable
from embedding_store.tier.tiered_table import TieredTable
from embedding_store.types import RowBatch, TableConfig

MEMORY_ROWS = 256
UNIVERSE = 3000

CASES: dict[str, dict[str, Any]] = {
    "adagrad": {"optimizer": {"kind": "adagrad", "lr": 0.1}},
    "adam, count-min admission": {
        "optimizer": {"kind": "adam", "lr": 0.01},
        "admission": {"kind": "count_min", "threshold": 2},
    },
    "sgd momentum, lru, ttl": {
        "optimizer": {"kind": "sgd", "lr": 0.1, "momentum": 0.9},
        "ttl_steps": 40,
        "tier_policy": "lru",
    },
}


def configs(case: dict[str, Any]) -> tuple[TableConfig, TableConfig]:
    base = {k: v for k, v in case.items() if k != "tier_policy"}
    plain = TableConfig(dim=4, capacity=100_000, **base)
    tier = {"memory_rows": MEMORY_ROWS, "policy": case.get("tier_policy", "lfu"), "readers": 4}
    return plain, TableConfig(dim=4, capacity=100_000, tier=tier, **base)


def rows_dict(rows: RowBatch) -> dict[int, tuple[Any, ...]]:
    return {
        int(rows.ids[i]): (
            rows.weights[i].tobytes(),
            rows.state[i].tobytes(),
            int(rows.row_step[i]),
            int(rows.last_seen[i]),
            int(rows.freq[i]),
        )
        for i in range(len(rows))
    }


def everything(table: EmbeddingTable) -> dict[int, tuple[Any, ...]]:
    rows, _, _ = table.export(False, mark_clean=False)
    return rows_dict(rows)


def skewed_ids(rng: np.random.Generator, n: int) -> np.ndarray:
    # Zipf-like ranks scattered over the universe: a hot set and a long tail.
    ranks = np.minimum(rng.zipf(1.3, n) - 1, UNIVERSE - 1)
    return ((ranks * 7919) % UNIVERSE).astype(np.uint64)


class Restored:
    """A table rebuilt from the chain of a table's exports, as a restore rebuilds it."""

    def __init__(self, config: TableConfig) -> None:
        self.config = config
        self.table = EmbeddingTable("copy", config)

    def apply(self, rows: RowBatch, tombs: np.ndarray, full: bool) -> None:
        if full:
            self.table = EmbeddingTable("copy", self.config)
        if tombs.shape[0]:
            self.table.remove(tombs)
        if len(rows):
            self.table.load(rows)


@pytest.mark.parametrize("case", list(CASES))
def test_a_tiered_table_holds_row_for_row_what_memory_alone_holds(
    case: str, tmp_path: Path
) -> None:
    plain_cfg, tiered_cfg = configs(CASES[case])
    plain = EmbeddingTable("t", plain_cfg)
    tiered = TieredTable("t", tiered_cfg, tmp_path / "tier")
    restored = Restored(plain_cfg)
    rng = np.random.default_rng(7)
    try:
        for step in range(300):
            op = rng.choice(
                ["lookup", "lookup", "push", "push", "read", "remove", "evict", "create"]
            )
            if step % 37 == 36:
                full = step % 111 == 110
                rows, tombs, clock = tiered.export(not full)
                want_clock = plain.export(not full, mark_clean=False)[2]
                restored.apply(rows, tombs, full)
                assert clock == want_clock
                assert everything(restored.table) == everything(plain), f"restore at {step}"
            elif op == "lookup":
                ids = skewed_ids(rng, int(rng.integers(1, 120)))
                np.testing.assert_array_equal(tiered.lookup(ids), plain.lookup(ids))
            elif op == "push":
                ids = skewed_ids(rng, int(rng.integers(1, 120)))
                grads = rng.standard_normal((ids.shape[0], 4)).astype(np.float32)
                a, b = tiered.push(ids, grads), plain.push(ids, grads)
                assert a == b
            elif op == "read":
                ids = rng.integers(0, UNIVERSE, 50).astype(np.uint64)
                np.testing.assert_array_equal(
                    tiered.lookup(ids, train=False), plain.lookup(ids, train=False)
                )
                np.testing.assert_array_equal(tiered.read(ids)[0], plain.read(ids)[0])
                a, b = tiered.peek(ids), plain.peek(ids)
                np.testing.assert_array_equal(a.state, b.state)
                np.testing.assert_array_equal(a.row_step, b.row_step)
            elif op == "create":
                # A bulk load: new ids, ids in memory and on disk (some straight to disk).
                ids = np.unique(rng.integers(0, UNIVERSE, int(rng.integers(1, 600))))
                tiered.create(ids.astype(np.uint64))
                plain.create(ids.astype(np.uint64))
            elif op == "remove":
                ids = rng.integers(0, UNIVERSE, 5).astype(np.uint64)
                assert tiered.remove(ids) == plain.remove(ids)
            else:
                tiered.evict(int(rng.integers(1, 50)))
            assert tiered.memory_rows <= MEMORY_ROWS
            assert len(tiered) == len(plain)
            assert everything(tiered) == everything(plain), f"after {op} at step {step}"
        counters = tiered.tier_counters()
        assert counters["demotions"] > 300, counters
        assert counters["promotions"] > 300, counters
        assert sorted(tiered.ids().tolist()) == sorted(plain.ids().tolist())
    finally:
        tiered.close()


def test_a_training_call_that_needs_more_rows_than_memory_holds_is_refused_by_name(
    tmp_path: Path,
) -> None:
    _, config = configs(CASES["adagrad"])
    table = TieredTable("t", config, tmp_path / "tier")
    try:
        ids = np.arange(2 * MEMORY_ROWS, dtype=np.uint64)
        for part in np.split(ids, 4):
            table.lookup(part)
        with pytest.raises(InvalidRequest, match=r"table 't': one call needs 512 rows"):
            table.lookup(ids)
        with pytest.raises(InvalidRequest, match=r"table 't': one call needs 512 rows"):
            table.peek(ids)
        assert len(table) == 2 * MEMORY_ROWS  # nothing was lost
        # A read is no training call: it reads the rows where they are.
        parts = [table.lookup(part, train=False) for part in np.split(ids, 4)]
        np.testing.assert_array_equal(table.lookup(ids, train=False), np.concatenate(parts))
        np.testing.assert_array_equal(table.read(ids)[0], np.concatenate(parts))
    finally:
        table.close()


def test_a_tiered_table_starts_empty_over_the_files_of_a_live_one(tmp_path: Path) -> None:
    _, config = configs(CASES["adagrad"])
    first = TieredTable("t", config, tmp_path / "tier")
    for part in np.split(np.arange(4 * MEMORY_ROWS, dtype=np.uint64), 8):
        first.lookup(part)
    assert first.disk.disk_bytes() > 0 or first.tier_counters()["demotions"] > 0
    first.close()
    again = TieredTable("t", config, tmp_path / "tier")
    try:
        assert len(again) == 0
        assert again.ids().shape[0] == 0
    finally:
        again.close()


def test_a_shard_keeps_its_tiers_in_its_data_dir_and_says_what_a_tier_needs(
    tmp_path: Path,
) -> None:
    from embedding_store.shard import StoreShard
    from embedding_store.types import StoreConfig

    _, config = configs(CASES["adagrad"])
    store = StoreConfig(tables={"t": config})
    with pytest.raises(InvalidRequest, match=r"table 't' is tiered: its disk tier needs"):
        StoreShard(store)
    with pytest.raises(InvalidRequest, match=r"table 't' is tiered: .* a serving replica's"):
        StoreShard(store, read_only=True)
    shard = StoreShard(store, data_dir=tmp_path / "shard")
    try:
        assert isinstance(shard.table("t"), TieredTable)
        for part in np.split(np.arange(4 * MEMORY_ROWS, dtype=np.uint64), 8):
            shard.lookup({"t": part})
        assert len(shard.table("t")) == 4 * MEMORY_ROWS
        shard.checkpoint()
        shard.restore()  # a new table, in a folder of its own; the old one's is gone
        assert len(shard.table("t")) == 4 * MEMORY_ROWS
        assert [p.name for p in (tmp_path / "shard" / "tier").iterdir()] == ["t.2"]
    finally:
        shard.close()


def test_rows_that_cannot_go_to_disk_stay_in_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from embedding_store.tier.disk_rows import DiskFull

    plain_cfg, tiered_cfg = configs(CASES["adagrad"])
    plain = EmbeddingTable("t", plain_cfg)
    tiered = TieredTable("t", tiered_cfg, tmp_path / "tier")
    try:
        first = np.arange(MEMORY_ROWS, dtype=np.uint64)
        for table in (plain, tiered):
            table.lookup(first)
            table.push(first, np.ones((MEMORY_ROWS, 4), np.float32))

        def full(rows: RowBatch) -> None:
            raise DiskFull(f"disk tier at {tmp_path}: the disk is full (test)")

        monkeypatch.setattr(tiered.disk, "put", full)
        more = np.arange(MEMORY_ROWS, MEMORY_ROWS + 50, dtype=np.uint64)
        with pytest.raises(DiskFull, match="the disk is full"):
            tiered.lookup(more)
        assert everything(tiered) == everything(plain)  # nothing lost, nothing half-moved
        with pytest.raises(DiskFull, match="the disk is full"):
            tiered.create(np.arange(1000, 1500, dtype=np.uint64))  # a bulk load onto disk
        assert everything(tiered) == everything(plain)
        assert tiered.clock == plain.clock
        monkeypatch.undo()
        np.testing.assert_array_equal(tiered.lookup(more), plain.lookup(more))
        assert everything(tiered) == everything(plain)
    finally:
        tiered.close()


def test_a_tiered_table_keeps_to_its_capacity_dropping_the_least_wanted(tmp_path: Path) -> None:
    config = TableConfig(dim=4, capacity=600, tier={"memory_rows": MEMORY_ROWS})
    table = TieredTable("t", config, tmp_path / "tier")
    rng = np.random.default_rng(5)
    try:
        for _ in range(60):
            table.lookup(skewed_ids(rng, 100))
            # The capacity holds within the eviction's slack (a 64th of memory).
            assert len(table) <= 600 + MEMORY_ROWS // 64 + 100
        assert len(table) > MEMORY_ROWS
        stats = table.stats()
        assert stats.evictions > 0
        assert stats.memory_rows <= MEMORY_ROWS
        assert stats.disk_rows + stats.memory_rows >= stats.rows
    finally:
        table.close()


def test_a_bulk_load_larger_than_memory_goes_straight_to_disk(tmp_path: Path) -> None:
    plain_cfg, tiered_cfg = configs(CASES["adagrad"])
    plain = EmbeddingTable("t", plain_cfg)
    tiered = TieredTable("t", tiered_cfg, tmp_path / "tier")
    try:
        hot = np.arange(100, dtype=np.uint64)
        for table in (plain, tiered):
            table.lookup(hot)
            table.push(hot, np.ones((100, 4), np.float32))
        ids = np.random.default_rng(3).permutation(20_000).astype(np.uint64)
        for part in np.array_split(ids, 4):
            tiered.create(part, step=5)
            plain.create(part, step=5)
        counters = tiered.tier_counters()
        # Nothing moved through memory: the hot rows stayed, the new ones went to disk.
        assert counters["demotions"] == 0, counters
        assert counters["promotions"] == 0, counters
        assert tiered.memory_rows == 100
        assert tiered.stats().disk_rows == 20_000 - 100
        assert len(tiered) == len(plain) == 20_000
        assert everything(tiered) == everything(plain)
        np.testing.assert_array_equal(tiered.lookup(ids[:200]), plain.lookup(ids[:200]))
    finally:
        tiered.close()
