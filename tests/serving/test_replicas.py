"""The server's in-place reader of its replicas against the store client's read of the
same replicas: the same rows, in the same dtype, and the same refusals."""

from __future__ import annotations

import numpy as np
import pytest

from embedding_store.client import StoreClient
from embedding_store.errors import InvalidRequest, StoreUnavailable
from embedding_store.shard import StoreShard
from embedding_store.types import StoreConfig
from serving.replicas import LocalReplicas

CONFIG = StoreConfig(
    tables={
        "user": {"dim": 4, "optimizer": {"kind": "sgd", "lr": 0.5}},
        "item": {"dim": 3, "optimizer": {"kind": "adagrad", "lr": 0.1}},
    }
)
# One dim: every table of every shard is read in one kernel call (TableGroup); the
# dims above are read table by table.
ONE_DIM = StoreConfig(
    tables={
        "user": {"dim": 4, "optimizer": {"kind": "sgd", "lr": 0.5}},
        "item": {
            "dim": 4, "optimizer": {"kind": "adagrad", "lr": 0.1},
            "initializer": {"kind": "normal", "std": 0.2},
        },
    }
)  # fmt: skip


@pytest.mark.parametrize("row_dtype", ["float16", "float32"])
@pytest.mark.parametrize("base", [CONFIG, ONE_DIM], ids=["dims", "one-dim"])
def test_rows_read_in_place_are_the_clients_rows(row_dtype: str, base: StoreConfig) -> None:
    config = base.model_copy(update={"row_dtype": row_dtype})
    rng = np.random.default_rng(5)
    training_shards = [StoreShard(config) for _ in range(3)]
    with StoreClient.from_shards(training_shards) as trainer:
        learned = rng.integers(0, 1 << 62, 400, dtype=np.uint64)
        for name, table in config.tables.items():
            dim = table.dim
            trainer.lookup({name: learned})
            trainer.push({name: (learned, rng.normal(size=(400, dim)))})
    replicas = LocalReplicas(config, training_shards, poll_s=0.02)
    try:
        assert replicas.wait_caught_up(timeout_s=30)
        client = StoreClient.from_shards(replicas.shards, row_dtype=config.row_dtype)
        # Learned ids and unknown ones, repeated, in one table's request and alone.
        requests = [
            {
                "user": learned[:50],
                "item": np.concatenate([learned[::7], np.array([1, 2, 3], np.uint64)]),
            },
            {"user": learned[3:4], "item": np.array([], np.uint64)},
            {"item": np.array([learned[9], learned[9], 12345], np.uint64)},
        ]
        for request in requests:
            mine = replicas.rows.lookup(request, train=False)
            theirs = client.lookup(request, train=False)
            assert set(mine) == set(request)
            for name in request:
                assert mine[name].dtype == np.dtype(row_dtype)
                assert mine[name].shape == theirs[name].shape
                np.testing.assert_array_equal(mine[name], theirs[name])
        client.close()
    finally:
        replicas.close()


def test_the_reader_refuses_what_the_client_refuses() -> None:
    training = [StoreShard(CONFIG), StoreShard(CONFIG)]
    replicas = LocalReplicas(CONFIG, training, poll_s=0.02)
    try:
        assert replicas.wait_caught_up(timeout_s=30)
        with pytest.raises(InvalidRequest, match=r"ids\[user\]"):
            replicas.rows.lookup({"user": np.array([0.5])})
        with pytest.raises(InvalidRequest, match="read-only"):
            replicas.rows.lookup({"user": np.array([1], np.uint64)}, train=True)
        replicas.shards[1].unavailable = "replica 1 has no copy yet"
        with pytest.raises(StoreUnavailable, match="no copy yet"):
            replicas.rows.lookup({"user": np.array([1], np.uint64)})
    finally:
        replicas.close()
