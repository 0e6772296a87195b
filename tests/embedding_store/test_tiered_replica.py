"""Serving replicas of tiered tables: the copy and the changes reach both tiers.

A replica of a tiered table is tiered too (its own disk tier, in its data dir):
it copies the training shard's rows from memory and from disk, follows the
changes, and reads every id as the training shard does while rows move between
the tiers on both sides.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from deploy.local.shards import ShardProcess
from embedding_store.client import StoreClient
from embedding_store.errors import InvalidRequest, StoreUnavailable
from embedding_store.replica import ShardFollower
from embedding_store.shard import StoreShard
from embedding_store.transport.base import RetryPolicy
from embedding_store.types import StoreConfig, TableConfig
from tests.support.waits import wait_until

U64 = np.uint64
TABLE = TableConfig(
    dim=3,
    optimizer={"kind": "adagrad", "lr": 0.3},
    capacity=5000,
    tier={"memory_rows": 64, "readers": 2},
)


def _ids(rng: np.random.Generator, n: int) -> np.ndarray:
    # Ids spread over the whole 64-bit range, as hashed ids are, from a universe of 3000.
    return (rng.integers(0, 3000, n).astype(U64) * U64(0x9E3779B97F4A7C15)).astype(U64)


def _every(shard: StoreShard) -> np.ndarray:
    return np.sort(shard.table("t").ids())


@pytest.mark.parametrize("page_rows", [7, 1000])
def test_a_replica_of_a_tiered_table_reads_as_its_training_shard(
    page_rows: int, tmp_path: Path
) -> None:
    config = StoreConfig(tables={"t": TABLE})
    training = StoreShard(config, data_dir=tmp_path / "training")
    replica = StoreShard(config, data_dir=tmp_path / "replica", read_only=True)
    follower = ShardFollower(replica, training, page_rows=page_rows)
    rng = np.random.default_rng(3)
    try:
        for round_ in range(12):
            for _ in range(30):
                ids = _ids(rng, 50)
                training.lookup({"t": ids})
                grads = rng.standard_normal((ids.shape[0], 3)).astype(np.float32)
                training.push({"t": (ids, grads)})
            if round_ % 4 == 3:
                training.table("t").remove(_ids(rng, 20))
            # Reads on the replica move its rows between its own tiers meanwhile.
            replica.lookup({"t": _ids(rng, 50)}, train=False) if round_ else None
            assert follower.sync_once()
            every = _every(training)
            assert every.shape[0] > 10 * 64  # most of them on disk, on both sides
            # A read of more rows than memory holds reads them where they are.
            served = replica.lookup({"t": every}, train=False)["t"]
            parts = np.array_split(every, every.shape[0] // 50 + 1)  # a peek: <= 64 rows
            learned = np.concatenate([training.peek({"t": p})["t"].weights for p in parts])
            np.testing.assert_array_equal(served, learned)
            np.testing.assert_array_equal(replica.table("t").read(every)[0], learned)
        assert follower.copies == 1
        table = replica.table("t")
        assert table.tiered
        assert table.stats().disk_rows > 0
        assert table.memory_rows <= 64
    finally:
        training.close()
        replica.close()


def test_a_replica_of_a_tiered_table_needs_a_data_dir() -> None:
    config = StoreConfig(tables={"t": TABLE})
    with pytest.raises(InvalidRequest, match="'t' is tiered: its disk tier needs a serving"):
        StoreShard(config, read_only=True)


@pytest.mark.processes
def test_a_replica_process_follows_a_tiered_training_shard(
    write_job: Callable[..., Path], token_file: Path, start_shards: Any, tmp_path: Path
) -> None:
    job = write_job(
        tables={
            "user": {
                "dim": 8,
                "capacity": 20_000,
                "optimizer": {"kind": "sgd", "lr": 0.5},
                "tier": {"memory_rows": 300},
            }
        }
    )
    [training] = start_shards(1, job, token_file)
    token = token_file.read_text().strip()
    replica = ShardProcess.start(
        job, tmp_path / "replica", token_file=token_file, follow=training.address
    )
    start_shards.track(replica)
    fast = RetryPolicy(attempts=2, initial_backoff_s=0.05, timeout_s=10)
    ids = np.arange(1, 3001, dtype=U64) * U64(0x9E3779B97F4A7C15)
    with (
        StoreClient.connect(f"grpc://{training.address}", token=token, retry=fast) as train,
        StoreClient.connect(f"grpc://{replica.address}", token=token, retry=fast) as serve,
    ):
        for part in np.array_split(ids, 20):  # 3,000 rows, 300 in memory: most on disk
            train.lookup({"user": part})
            train.push({"user": (part, np.full((part.shape[0], 8), 0.5, np.float32))})

        def learned() -> np.ndarray:
            return np.asarray(train.lookup({"user": ids}, train=False)["user"], np.float32)

        def served() -> np.ndarray:
            try:
                return np.asarray(serve.lookup({"user": ids}, train=False)["user"], np.float32)
            except StoreUnavailable:  # still copying its training shard: no rows yet
                return np.zeros((0, 8), np.float32)

        wait_until(lambda: np.array_equal(served(), learned()), "the replica holds every row")
        # More pushes to rows on disk on the training side: the replica follows them.
        for cold in np.split(ids[:500], 2):  # a training call's rows fit in memory
            train.lookup({"user": cold})
            train.push({"user": (cold, np.ones((250, 8), np.float32))})
        wait_until(lambda: np.array_equal(served(), learned()), "the pushes to cold rows")
        [stats] = train.stats()
        assert {t.name: t.disk_rows for t in stats.tables}["user"] > 2000
