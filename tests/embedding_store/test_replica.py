"""Serving replicas: read-only copies of training shards that follow their changes.

The model test drives a training table and a follower in one process with
random operations, the training table as the oracle. The others run real
``streamrec store serve`` and ``streamrec store replica`` processes.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deploy.local.shards import ShardProcess
from embedding_store.client import StoreClient
from embedding_store.errors import InvalidRequest, StoreUnavailable
from embedding_store.replica import ShardFollower
from embedding_store.shard import StoreShard
from embedding_store.table import EmbeddingTable
from embedding_store.transport.base import RetryPolicy
from embedding_store.types import StoreConfig, TableConfig
from tests.support.jobs import DEFAULT_TABLES
from tests.support.processes import streamrec
from tests.support.waits import wait_until

U64 = np.uint64
FAST = RetryPolicy(attempts=2, initial_backoff_s=0.05, timeout_s=10)


def _served(shard: StoreShard, table: str, ids: np.ndarray) -> np.ndarray:
    rows, _ = shard.table(table).read(ids)
    return rows


_OPS = st.lists(
    st.tuples(
        st.sampled_from(["lookup", "push", "evict", "remove", "sync", "restore", "checkpoint"]),
        st.lists(st.integers(1, 40), min_size=1, max_size=12),
    ),
    max_size=30,
)


@settings(max_examples=60, deadline=None)
@given(ops=_OPS, log_ids=st.sampled_from([4, 16, 1 << 20]))
def test_a_follower_holds_what_the_training_shard_holds(
    ops: list[tuple[str, list[int]]], log_ids: int, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """After any sequence of pushes, evictions, removals, restores and syncs, one more
    sync leaves the replica reading every id as the training shard does."""
    table = TableConfig(
        dim=3, optimizer={"kind": "adagrad", "lr": 0.3}, capacity=24, change_log_ids=log_ids
    )
    config = StoreConfig(tables={"t": table})
    directory = tmp_path_factory.mktemp("ckpt")
    training = StoreShard(config, data_dir=directory)
    replica = StoreShard(config, read_only=True)
    follower = ShardFollower(replica, training, page_rows=5)
    checkpointed = False
    for op, raw in ops:
        ids = np.array(raw, dtype=U64)
        if op == "lookup":
            training.lookup({"t": ids})
        elif op == "push":
            grads = np.full((ids.shape[0], 3), 0.25, np.float32) * ids[:, None].astype(np.float32)
            training.push({"t": (ids, grads)})
        elif op == "evict":
            training.table("t").evict(len(raw))
        elif op == "remove":
            training.table("t").remove(ids)
        elif op == "sync":
            assert follower.sync_once()
        elif op == "checkpoint":
            training.checkpoint()
            checkpointed = True
        elif op == "restore" and checkpointed:
            training.restore()
    assert follower.sync_once()
    every = np.arange(0, 42, dtype=U64)
    np.testing.assert_array_equal(_served(replica, "t", every), _served(training, "t", every))


def test_a_replica_refuses_pushes_and_checkpoints() -> None:
    config = StoreConfig(tables={"t": {"dim": 2}})
    replica = StoreShard(config, read_only=True)
    ids = np.array([1], U64)
    with pytest.raises(InvalidRequest, match="read-only serving replica"):
        replica.push({"t": (ids, np.ones((1, 2), np.float32))})
    with pytest.raises(InvalidRequest, match="read-only serving replica"):
        replica.checkpoint("/nonexistent")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_replica_reads_many_tables_at_once_as_each_alone(dtype: str) -> None:
    """A lookup of several tables of one dim is one kernel call (``TableGroup``): the
    rows of each table's own read, learned and unknown ids alike, into reply buffers
    too; bad ids are refused as a lone table's read refuses them."""
    sgd = {"kind": "sgd", "lr": 0.5}
    config = StoreConfig(
        tables={
            "a": {"dim": 3, "optimizer": sgd},
            "b": {"dim": 3, "optimizer": sgd, "initializer": {"kind": "normal", "std": 0.3}},
            "c": {"dim": 3, "optimizer": sgd},
        }
    )
    training = StoreShard(config)
    rng = np.random.default_rng(2)
    learned = {name: rng.integers(0, 1 << 50, 40, dtype=np.uint64) for name in config.tables}
    training.lookup(learned)
    training.push({n: (ids, rng.normal(size=(40, 3))) for n, ids in learned.items()})
    replica = StoreShard(config, read_only=True)
    assert ShardFollower(replica, training).sync_once()
    request = {
        name: np.concatenate([ids[:: i + 2], rng.integers(0, 1 << 50, 5, dtype=np.uint64)])
        for i, (name, ids) in enumerate(learned.items())
    }
    request["c"] = np.array([], np.uint64)  # a table with no ids in the request
    before = {n: replica.table(n).stats().unknown_reads for n in config.tables}
    got = replica.lookup(request, train=False, dtype=dtype)  # type: ignore[arg-type]
    buffers = {"b": np.empty((len(request["b"]), 3), dtype)}
    into = replica.lookup(request, train=False, out=buffers)
    for name, ids in request.items():
        want = _served(replica, name, ids).astype(dtype)
        assert got[name].dtype == np.dtype(dtype)
        np.testing.assert_array_equal(got[name], want)
        np.testing.assert_array_equal(into[name].astype(dtype), want)
        unknown = replica.table(name).stats().unknown_reads - before[name]
        assert unknown == 3 * (5 if name != "c" else 0)  # two lookups and the check's read
    assert into["b"] is buffers["b"]
    with pytest.raises(InvalidRequest, match="integer ids"):
        replica.lookup({"a": np.array([1], U64), "b": np.array([0.5])}, train=False)


def _read(client: StoreClient, table: str, ids: np.ndarray) -> np.ndarray:
    return np.asarray(client.lookup({table: ids}, train=False)[table], dtype=np.float32)


def _initial(table: str, ids: np.ndarray) -> np.ndarray:
    fresh = EmbeddingTable(table, TableConfig.model_validate(DEFAULT_TABLES[table]))
    return fresh.read(ids)[0]


def _health(address: str, token_file: Path) -> str:
    out = streamrec("store", "health", "--address", address, "--token-file", str(token_file))
    return (out.stdout + out.stderr).strip()


@pytest.mark.processes
def test_a_replica_serves_pushes_and_evictions_and_outlives_its_training_shard(
    write_job: Callable[..., Path], token_file: Path, start_shards: Any, tmp_path: Path
) -> None:
    job = write_job(
        tables={
            **DEFAULT_TABLES,
            "user": {**DEFAULT_TABLES["user"], "capacity": 1000},
        }
    )
    [training] = start_shards(1, job, token_file)
    token = token_file.read_text().strip()
    replica = ShardProcess.start(
        job, tmp_path / "replica", token_file=token_file, follow=training.address
    )
    start_shards.track(replica)
    ids = np.arange(1, 801, dtype=U64)
    with (
        StoreClient.connect(f"grpc://{training.address}", token=token, retry=FAST) as train,
        StoreClient.connect(f"grpc://{replica.address}", token=token, retry=FAST) as serve,
    ):
        wait_until(lambda: "SERVING" in _health(replica.address, token_file), "caught up")
        train.lookup({"user": ids})
        train.push({"user": (ids, np.full((800, 8), 0.5, np.float32))})
        learned = _read(train, "user", ids)
        assert not np.allclose(learned, _initial("user", ids))
        wait_until(lambda: np.array_equal(_read(serve, "user", ids), learned), "pushed rows")

        # 400 more ids on a table of 1,000 rows: the least recently seen are evicted,
        # and the replica forgets them too (it reads them as initial rows again).
        more = np.arange(10_001, 10_401, dtype=U64)
        train.lookup({"user": more})
        [stats] = train.stats()
        evicted = {t.name: t.evictions for t in stats.tables}["user"]
        assert evicted >= 200
        now = _read(train, "user", ids)
        gone = ids[np.all(now == 0.0, axis=1)]  # a training read of an absent id is zeros
        assert gone.shape[0] == evicted
        wait_until(
            lambda: np.array_equal(_read(serve, "user", gone), _initial("user", gone)),
            "evictions",
        )
        kept = ids[~np.isin(ids, gone)]
        np.testing.assert_array_equal(_read(serve, "user", kept), now[~np.isin(ids, gone)])

        with pytest.raises(InvalidRequest, match="read-only serving replica"):
            serve.push({"user": (ids[:1], np.ones((1, 8), np.float32))})

        # The training shard dies: the replica keeps serving what it had.
        served = _read(serve, "user", kept)
        training.kill()
        time.sleep(0.5)
        np.testing.assert_array_equal(_read(serve, "user", kept), served)
        assert "SERVING" in _health(replica.address, token_file)

        # Back from its data dir (the checkpoint it wrote at start: no rows): the
        # replica copies the restarted shard and holds what it holds.
        back = training.restart()
        start_shards.track(back)
        wait_until(
            lambda: np.array_equal(_read(serve, "user", kept), _initial("user", kept)),
            "the restarted shard's rows",
        )
    assert "caught up with" in replica.log()


@pytest.mark.processes
def test_a_replica_starts_from_the_newest_checkpoint_and_asks_only_for_changes(
    write_job: Callable[..., Path], token_file: Path, start_shards: Any, tmp_path: Path
) -> None:
    job = write_job()
    [training] = start_shards(1, job, token_file)
    token = token_file.read_text().strip()
    first = ShardProcess.start(
        job, tmp_path / "replica-a", token_file=token_file, follow=training.address
    )
    start_shards.track(first)
    ids = np.arange(1, 3001, dtype=U64)
    with StoreClient.connect(f"grpc://{training.address}", token=token, retry=FAST) as train:
        wait_until(lambda: "SERVING" in _health(first.address, token_file), "first caught up")
        train.lookup({"item": ids})
        train.push({"item": (ids, np.full((3000, 4), 0.25, np.float32))})
        train.checkpoint(None, "full")  # names the change logs at its cut
        train.push({"item": (ids[:10], np.full((10, 4), 1.0, np.float32))})
        learned = _read(train, "item", ids)
        second = ShardProcess.start(
            job,
            tmp_path / "replica-b",
            token_file=token_file,
            follow=training.address,
            snapshots=str(training.data_dir),
        )
        start_shards.track(second)
        with StoreClient.connect(f"grpc://{second.address}", token=token, retry=FAST) as serve:
            wait_until(lambda: "caught up" in second.log(), "second caught up")
            np.testing.assert_array_equal(_read(serve, "item", ids), learned)
    log = second.log()
    assert "3000 rows from snapshots" in log
    assert "(0 table(s) copied" in log, log


@pytest.mark.processes
def test_a_replica_answers_syncing_until_it_reaches_its_training_shard(
    write_job: Callable[..., Path], token_file: Path, start_shards: Any, tmp_path: Path
) -> None:
    job = write_job()
    [training] = start_shards(1, job, token_file)
    port = training.port
    training.kill()
    replica = ShardProcess.start(job, tmp_path / "replica", token_file=token_file,
                                 follow=f"127.0.0.1:{port}", metrics_port=0)  # fmt: skip
    start_shards.track(replica)
    assert "SYNCING" in _health(replica.address, token_file)
    # Kubernetes' readiness probe: /healthz beside the metrics says the same over HTTP.
    assert replica.metrics_url is not None
    healthz = replica.metrics_url.replace("/metrics", "/healthz")
    assert _http(healthz) == (503, "SYNCING")
    token = token_file.read_text().strip()
    ids = np.array([7, 8], U64)
    # It holds nothing yet: reads are refused (retryable), not answered wrong.
    with (
        StoreClient.connect(f"grpc://{replica.address}", token=token, retry=FAST) as serve,
        pytest.raises(StoreUnavailable, match="copying its training shard"),
    ):
        _read(serve, "item", ids)
    back = training.restart()
    start_shards.track(back)
    wait_until(lambda: "SERVING" in _health(replica.address, token_file), "caught up")
    assert _http(healthz) == (200, "SERVING")
    with StoreClient.connect(f"grpc://{replica.address}", token=token, retry=FAST) as serve:
        np.testing.assert_array_equal(_read(serve, "item", ids), _initial("item", ids))


def _http(url: str) -> tuple[int, str]:
    """A GET's status and body (an error status is an answer too)."""
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            return int(reply.status), reply.read().decode().strip()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read().decode().strip()
