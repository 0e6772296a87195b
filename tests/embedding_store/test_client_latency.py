"""``StoreClient(latency_s=...)``: the benchmarking aid that adds a delay to every store call."""

from __future__ import annotations

import time

import numpy as np

from embedding_store.client import StoreClient
from embedding_store.types import StoreConfig

CONFIG = StoreConfig(tables={"user": {"dim": 4}}, row_dtype="float32")


def test_latency_delays_every_call() -> None:
    ids = np.arange(50, dtype=np.uint64)
    with StoreClient.connect("inproc://2", config=CONFIG, latency_s=0.05) as store:
        assert store.latency_s == 0.05
        t0 = time.perf_counter()
        rows = store.lookup({"user": ids})["user"]
        lookup_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        store.push({"user": (ids, np.ones((50, 4), np.float32))})
        push_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        store.stats()
        stats_s = time.perf_counter() - t0
    assert rows.shape == (50, 4)
    # Lower bounds only: a loaded machine may take longer, never shorter.
    assert lookup_s >= 0.05
    assert push_s >= 0.05
    assert stats_s >= 0.05


def test_no_latency_by_default() -> None:
    with StoreClient.connect("inproc://1", config=CONFIG) as store:
        assert store.latency_s == 0.0
