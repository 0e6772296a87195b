"""Tables that share one cache of pushed rows (the same arithmetic) are freshened as
exactly as tables on their own: the store, read after every earlier push landed, is
the oracle.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from embedding_store.client import StoreClient
from embedding_store.types import RowState, StoreConfig, TableConfig
from pipeline.types import TableBatch
from trainer.pusher import Pusher
from trainer.row_cache import PushedRowCache

ADAGRAD = {"kind": "adagrad", "lr": 0.1}
TABLES = {
    # "a" and "b" differ only in their initializer: one group, two numbers in it.
    "a": TableConfig(dim=4, optimizer=ADAGRAD, initializer={"kind": "normal", "std": 0.1}),
    "b": TableConfig(dim=4, optimizer=ADAGRAD, initializer={"kind": "uniform", "scale": 0.1}),
    "c": TableConfig(dim=4, optimizer={"kind": "sgd", "lr": 0.5}),
}


def batch(
    store: StoreClient, rng: np.random.Generator, vocabulary: int
) -> tuple[dict[str, TableBatch], float]:
    """A batch of small vocabularies (hot ids) looked up now, and when its lookup began
    ("a" and "b" share ids).
    """
    shared = np.unique(rng.integers(0, vocabulary, 8)).astype(np.uint64)
    ids = {"a": shared, "b": shared, "c": np.unique(rng.integers(0, 6, 5)).astype(np.uint64)}
    looked_up_at = time.time()
    rows = store.lookup(ids)
    tables = {
        name: TableBatch(
            fields=(name,),
            unique_ids=u,
            inverse=np.arange(len(u), dtype=np.int32),
            offsets=np.arange(len(u) + 1, dtype=np.int32),
            rows=rows[name],
        )
        for name, u in ids.items()
    }
    return tables, looked_up_at


@pytest.mark.parametrize(("cached_rows", "vocabulary"), [(1 << 19, 12), (96, 200)])
@pytest.mark.parametrize("staleness", [1, 3])
def test_a_shared_cache_trains_every_table_as_the_store_holds_it(
    staleness: int, cached_rows: int, vocabulary: int
) -> None:
    """96 rows over a larger vocabulary: the cache drops its older generation every few
    pushes (about 16 new rows a push), still holding every push a lookup in flight
    can have missed.
    """
    store = StoreClient.connect(
        "inproc://2", config=StoreConfig(tables=TABLES, row_dtype="float32")
    )
    pusher = Pusher(store, run_id="groups", fresh_rows=True, tables=TABLES, cached_rows=cached_rows)
    groups = {id(pusher._group_of(name)[0]) for name in TABLES}
    assert len(groups) == 2, "a and b share a group, c has its own"
    rng = np.random.default_rng(7)
    ahead = [batch(store, rng, vocabulary) for _ in range(staleness)]
    replaced = 0
    for _ in range(12):
        tables, looked_up_at = ahead.pop(0)
        done = pusher.freshen(tables, looked_up_at, wait=True)
        replaced += done.replaced
        pusher.drain()  # the oracle: every earlier push has landed
        now = store.lookup({k: t.unique_ids for k, t in tables.items()}, train=False)
        for name, table in tables.items():
            np.testing.assert_array_equal(table.rows, now[name], err_msg=name)
        grads = {
            k: (t.unique_ids, rng.standard_normal((len(t.unique_ids), 4)).astype(np.float32))
            for k, t in tables.items()
        }
        pusher.submit(grads)
        ahead.append(batch(store, rng, vocabulary))
    if staleness > 1:
        assert replaced > 0
    cache = pusher._group_of("a")[0].cache
    assert cache is not None
    assert (cache.previous is not None) == (cached_rows == 96)
    pusher.drain()
    pusher.close()
    store.close()


def test_the_cache_reads_across_its_generations_and_drops_the_oldest() -> None:
    cache = PushedRowCache(dim=1, width=0, max_rows=4)  # generations of 2 rows
    tab = np.zeros(2, np.int32)

    def put(ids: list[int], value: float, seq: int) -> None:
        rows = RowState(np.full((2, 1), value, np.float32), np.zeros((2, 0), np.float32),
                        np.full(2, seq))  # fmt: skip
        cache.put(tab, np.array(ids, np.uint64), rows, np.full((2, 1), seq), push=seq)

    put([1, 2], 1.0, 1)
    put([2, 3], 2.0, 2)  # full: [1, 2] becomes the previous generation
    keys = np.array([1, 2, 3, 4], np.uint64)
    missed, seen = cache.read(np.zeros(4, np.int32), keys, 0, np.ones(4, np.bool_))
    assert missed.tolist() == [1, 2, 1, 0], "a row's pushes are counted in both generations"
    assert seen.known.tolist() == [True, True, True, False]
    assert seen.rows.weights.ravel().tolist() == [1.0, 2.0, 2.0, 0.0], "the newest wins"
    put([5, 6], 3.0, 3)  # [1, 2] is dropped, [2, 3] is the previous generation
    missed, seen = cache.read(np.zeros(4, np.int32), keys, 0, np.zeros(4, np.bool_))
    assert missed.tolist() == [0, 1, 1, 0]
    assert seen.at.tolist() == [1, 2], "only rows that missed a push are read out"


def test_an_older_answer_never_replaces_a_newer_row() -> None:
    """Another rank's answer can come a step after this rank's newer one: the cache
    keeps whichever state includes more of the row's updates."""
    cache = PushedRowCache(dim=1, width=0, ranks=2)
    tab, ids = np.zeros(1, np.int32), np.array([7], np.uint64)

    def put(value: float, row_step: int, seen: list[int], push: int = 0) -> None:
        rows = RowState(np.full((1, 1), value, np.float32), np.zeros((1, 0), np.float32),
                        np.array([row_step]))  # fmt: skip
        cache.put(tab, ids, rows, np.array([seen]), acked=float(row_step), push=push)

    put(3.0, row_step=3, seen=[2, 1], push=2)  # this rank's push 2, after the other's 1
    put(2.0, row_step=2, seen=[1, 1])  # the other rank's push 1, told later
    _, seen = cache.read(tab, ids, 0, np.ones(1, np.bool_))
    assert seen.rows.weights.ravel().tolist() == [3.0]
    assert seen.seen.tolist() == [[2, 1]]
    put(4.0, row_step=4, seen=[2, 2])  # the other's push 2 on top: newer, taken
    _, seen = cache.read(tab, ids, 0, np.ones(1, np.bool_))
    assert seen.rows.weights.ravel().tolist() == [4.0]
    assert seen.seen.tolist() == [[2, 2]]


def test_a_push_larger_than_a_hold_of_the_lock_is_kept_whole() -> None:
    """A put of many rows is made in parts (the lock is let go between them) and the
    cache turns over generations midway: every row of the last pushes is read back as
    put, with its push counted, against a dict of what was put."""
    rng = np.random.default_rng(3)
    cache = PushedRowCache(dim=2, width=1, max_rows=60_000)
    newest: dict[tuple[int, int], tuple[float, int]] = {}
    for push in range(1, 5):
        n = 25_000
        tab = rng.integers(0, 3, n).astype(np.int32)
        ids = rng.integers(0, 40_000, n).astype(np.uint64)
        keys = np.unique(np.stack([tab.astype(np.uint64), ids], axis=1), axis=0)
        tab, ids = keys[:, 0].astype(np.int32), keys[:, 1]
        values = rng.standard_normal(ids.shape[0]).astype(np.float32)
        rows = RowState(np.repeat(values[:, None], 2, axis=1),
                        values[:, None].copy(), np.full(ids.shape[0], push))  # fmt: skip
        cache.put(tab, ids, rows, np.full((1, 1), push), push=push)
        for t, i, v in zip(tab.tolist(), ids.tolist(), values.tolist(), strict=True):
            newest[(t, i)] = (v, push)
    last = [(k, v) for k, v in newest.items() if v[1] == 4]
    tab = np.array([t for (t, _), _ in last], np.int32)
    ids = np.array([i for (_, i), _ in last], np.uint64)
    missed, seen = cache.read(tab, ids, 3, np.ones(ids.shape[0], np.bool_))
    assert seen.known.all()
    assert seen.rows.weights[:, 0].tolist() == [v for _, (v, _) in last]
    assert seen.rows.state[:, 0].tolist() == [v for _, (v, _) in last]
    assert (missed == 1).all(), "each row missed exactly its last push"
