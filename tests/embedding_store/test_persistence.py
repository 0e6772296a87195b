"""Checkpoints on disk: full and delta chains, corruption detection, no partial loads."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from embedding_store.errors import CheckpointError
from embedding_store.persistence import list_manifests
from embedding_store.shard import StoreShard
from embedding_store.types import StoreConfig

CONFIG = StoreConfig(
    tables={
        "user": {"dim": 4, "optimizer": {"kind": "adam", "lr": 0.05}, "capacity": 5000},
        "item": {"dim": 2, "optimizer": {"kind": "sgd", "lr": 0.1, "momentum": 0.9}},
    },
    full_checkpoint_every=2,
    keep_full_checkpoints=2,
)


def _step(shard: StoreShard, seed: int) -> None:
    rng = np.random.default_rng(seed)
    users = rng.integers(0, 3000, 400).astype(np.uint64)
    items = rng.integers(0, 50, 100).astype(np.uint64)
    shard.lookup({"user": users, "item": items})
    shard.push(
        {
            "user": (users, rng.normal(size=(400, 4)).astype(np.float32)),
            "item": (items, rng.normal(size=(100, 2)).astype(np.float32)),
        }
    )


def _state(shard: StoreShard) -> dict[str, dict[int, np.ndarray]]:
    out = {}
    for name, table in shard.tables.items():
        rows, _, _ = table.export(dirty_only=False, mark_clean=False)
        out[name] = {
            int(i): np.concatenate([w, s, [step, seen, freq]])
            for i, w, s, step, seen, freq in zip(
                rows.ids,
                rows.weights,
                rows.state,
                rows.row_step,
                rows.last_seen,
                rows.freq,
                strict=True,
            )
        }
    return out


def _assert_same(a: StoreShard, b: StoreShard) -> None:
    sa, sb = _state(a), _state(b)
    for name in sa:
        assert sa[name].keys() == sb[name].keys(), name
        for k in sa[name]:
            np.testing.assert_array_equal(sa[name][k], sb[name][k])
        assert a.table(name).clock == b.table(name).clock


def test_auto_checkpoints_form_a_chain_that_restores_exactly(tmp_path: Path) -> None:
    shard = StoreShard(CONFIG)
    kinds = []
    for i in range(5):
        _step(shard, i)
        shard.lookup({"user": np.arange(20, dtype=np.uint64)})  # seen, not pushed
        shard.table("user").evict(50)  # tombstones in the deltas
        kinds.append(shard.checkpoint(tmp_path, "auto").kind)
    assert kinds == ["full", "delta", "delta", "full", "delta"]
    copy = StoreShard(CONFIG)
    result = copy.restore(tmp_path)
    assert [Path(m).name for m in result.manifests] == [
        "MANIFEST-00000004.json",
        "MANIFEST-00000005.json",
    ]
    _assert_same(shard, copy)
    # Optimizer state came back too: one more identical step keeps them equal.
    _step(shard, 99)
    _step(copy, 99)
    _assert_same(shard, copy)


def test_deltas_hold_only_dirty_rows_and_tombstones(tmp_path: Path) -> None:
    shard = StoreShard(CONFIG)
    _step(shard, 0)
    full = shard.checkpoint(tmp_path, "full")
    shard.push({"item": (np.array([3], np.uint64), np.ones((1, 2), np.float32))})
    removed = shard.table("user").evict(10)
    delta = shard.checkpoint(tmp_path, "delta")
    assert delta.kind == "delta"
    assert delta.rows == 1
    assert delta.tombstones == removed
    assert full.rows == len(shard.table("user")) + removed + len(shard.table("item"))


def test_an_id_removed_and_created_again_survives_a_delta(tmp_path: Path) -> None:
    shard = StoreShard(CONFIG)
    ids = np.arange(10, dtype=np.uint64)
    shard.lookup({"user": ids})
    shard.checkpoint(tmp_path, "full")
    assert shard.table("user").remove(ids[:3]) == 3  # tombstones for 0, 1, 2
    shard.lookup({"user": ids[:1]})  # 0 comes back
    delta = shard.checkpoint(tmp_path, "delta")
    assert (delta.kind, delta.tombstones) == ("delta", 3)
    copy = StoreShard(CONFIG)
    copy.restore(tmp_path)
    assert sorted(copy.table("user").ids().tolist()) == [0, *range(3, 10)]
    _assert_same(shard, copy)


def test_garbage_collection_keeps_the_newest_full_chains(tmp_path: Path) -> None:
    shard = StoreShard(CONFIG)
    for i in range(9):
        _step(shard, i)
        shard.checkpoint(tmp_path, "auto")
    seqs = [s for s, _ in list_manifests(tmp_path)]
    # fulls at 1, 4, 7: the chain of 1 is gone, 4.. are kept
    assert seqs == [4, 5, 6, 7, 8, 9]
    leftovers = [
        p.name
        for p in tmp_path.iterdir()
        if p.name.startswith(("00000001", "00000002", "00000003"))
    ]
    assert leftovers == []


@pytest.mark.parametrize("damage", ["missing", "truncated", "corrupt", "manifest"])
def test_a_damaged_checkpoint_fails_by_name_and_loads_nothing(tmp_path: Path, damage: str) -> None:
    shard = StoreShard(CONFIG)
    _step(shard, 0)
    shard.checkpoint(tmp_path, "full")
    _step(shard, 1)
    shard.checkpoint(tmp_path, "delta")
    victim = tmp_path / "00000002-delta-user.rows.arrow"
    if damage == "missing":
        victim.unlink()
    elif damage == "truncated":
        data = victim.read_bytes()
        victim.write_bytes(data[: len(data) // 2])
    elif damage == "corrupt":
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
    else:
        victim = tmp_path / "MANIFEST-00000002.json"
        victim.write_text(victim.read_text()[:40])

    target = StoreShard(CONFIG)
    _step(target, 42)
    before = _state(target)
    with pytest.raises(CheckpointError, match=victim.name):
        target.restore(tmp_path)
    after = _state(target)
    for name in before:
        assert before[name].keys() == after[name].keys()


def test_restore_refuses_a_changed_table_shape(tmp_path: Path) -> None:
    shard = StoreShard(CONFIG)
    _step(shard, 0)
    shard.checkpoint(tmp_path, "full")
    changed = StoreConfig(
        tables={**CONFIG.tables, "user": CONFIG.tables["user"].model_copy(update={"dim": 8})}
    )
    with pytest.raises(CheckpointError, match="'user'"):
        StoreShard(changed).restore(tmp_path)
    only_item = StoreConfig(tables={"item": CONFIG.tables["item"]})
    with pytest.raises(CheckpointError, match="does not define"):
        StoreShard(only_item).restore(tmp_path)


def test_restore_over_capacity_names_the_table(tmp_path: Path) -> None:
    shard = StoreShard(CONFIG)
    _step(shard, 0)
    shard.checkpoint(tmp_path, "full")
    small = StoreConfig(
        tables={**CONFIG.tables, "user": CONFIG.tables["user"].model_copy(update={"capacity": 10})}
    )
    with pytest.raises(CheckpointError, match="capacity is 10"):
        StoreShard(small).restore(tmp_path)


def test_manifest_records_metadata_and_is_written_atomically(tmp_path: Path) -> None:
    shard = StoreShard(CONFIG)
    _step(shard, 0)
    result = shard.checkpoint(tmp_path, "full", metadata={"offsets": {"events/0": 1234}})
    doc = json.loads(Path(result.manifest).read_text())
    assert doc["metadata"] == {"offsets": {"events/0": 1234}}
    assert doc["tables"]["user"]["rows"] == len(shard.table("user"))
    assert not list(tmp_path.glob(".*.tmp"))


def test_a_failed_write_forces_the_next_checkpoint_to_be_full(tmp_path: Path) -> None:
    shard = StoreShard(CONFIG)
    _step(shard, 0)
    shard.checkpoint(tmp_path, "full")
    _step(shard, 1)
    blocker = tmp_path / "blocked"
    blocker.write_text("a file where a directory should be")
    with pytest.raises(OSError, match="blocked"):
        shard.checkpoint(blocker, "auto")
    assert shard.checkpoint(tmp_path, "auto").kind == "full"
    copy = StoreShard(CONFIG)
    copy.restore(tmp_path)
    _assert_same(shard, copy)
