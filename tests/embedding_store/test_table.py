"""Table behaviour: admission, initialization, TTL, clipping, bounds, options, threads."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from embedding_store.errors import InvalidRequest, UnknownTable
from embedding_store.hashing import shard_of
from embedding_store.shard import StoreShard
from embedding_store.table import EmbeddingTable
from embedding_store.types import StoreConfig, TableConfig


def _table(**kw: Any) -> EmbeddingTable:
    return EmbeddingTable(kw.pop("name", "t"), TableConfig(**{"dim": 4, **kw}))


def _ids(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.uint64)


def test_count_min_admission_needs_threshold_sightings() -> None:
    t = _table(admission={"kind": "count_min", "threshold": 3, "width": 1024})
    for _ in range(2):
        assert not t.lookup(_ids(5)).any(), "not yet admitted: reads as zeros"
        r = t.push(_ids(5), np.ones((1, 4), np.float32))
        assert r.dropped_not_admitted == 1
        assert r.applied == 0
    row = t.lookup(_ids(5))
    assert row.any()
    assert len(t) == 1
    s = t.stats()
    assert (s.admissions, s.rejected_admissions, s.dropped_not_admitted) == (1, 2, 2)


def test_probability_admission_admits_about_p_and_is_reproducible() -> None:
    ids = np.arange(20_000, dtype=np.uint64)
    a = _table(admission={"kind": "probability", "probability": 0.25}, capacity=50_000)
    b = _table(admission={"kind": "probability", "probability": 0.25}, capacity=50_000)
    a.lookup(ids)
    b.lookup(ids)
    assert 0.23 < len(a) / ids.shape[0] < 0.27
    assert sorted(a.ids().tolist()) == sorted(b.ids().tolist())
    a.lookup(ids)  # a second sighting is a second chance
    assert len(a) > len(b)


def test_read_only_lookup_never_creates_rows() -> None:
    t = _table()
    assert not t.lookup(_ids(1, 2, 3), train=False).any()
    assert len(t) == 0
    assert t.clock == 0


def test_initialization_is_deterministic_per_table_id_and_seed() -> None:
    ids = np.arange(2000, dtype=np.uint64)
    u = _table(initializer={"kind": "uniform", "scale": 0.5}).lookup(ids)
    assert np.abs(u).max() <= 0.5
    assert 0.2 < np.abs(u).mean() < 0.3
    np.testing.assert_array_equal(
        u, _table(initializer={"kind": "uniform", "scale": 0.5}).lookup(ids)
    )
    assert not np.array_equal(
        u, _table(name="other", initializer={"kind": "uniform", "scale": 0.5}).lookup(ids)
    )
    assert not np.array_equal(
        u, _table(seed=1, initializer={"kind": "uniform", "scale": 0.5}).lookup(ids)
    )
    n = _table(initializer={"kind": "normal", "mean": 1.0, "std": 0.1}).lookup(ids)
    assert abs(n.mean() - 1.0) < 0.01
    assert abs(n.std() - 0.1) < 0.01
    assert not _table(initializer={"kind": "zeros"}).lookup(ids).any()


def test_evicted_row_comes_back_with_its_initial_value() -> None:
    t = _table(capacity=10)
    first = t.lookup(_ids(1))
    t.push(_ids(1), np.ones((1, 4), np.float32))
    t.lookup(np.arange(100, 110, dtype=np.uint64))  # pushes 1 out
    assert 1 not in t.ids().tolist()
    np.testing.assert_array_equal(t.lookup(_ids(1)), first)


def test_ttl_expires_rows_unseen_for_ttl_steps() -> None:
    t = _table(ttl_steps=4)
    t.lookup(_ids(1, 2))
    for _ in range(6):
        t.lookup(_ids(2))
    assert sorted(t.ids().tolist()) == [2]
    assert t.stats().expirations == 1
    # Steps given by the caller move the clock; the lookup itself expires row 2.
    t.lookup(_ids(3), step=100)
    assert sorted(t.ids().tolist()) == [3]
    assert t.stats().expirations == 2
    # The explicit call expires without waiting for the next periodic scan.
    t.lookup(_ids(3), step=101)
    t.set_clock(200)
    assert t.expire() == 1
    assert len(t) == 0


def test_weight_clip_bounds_every_updated_weight() -> None:
    t = _table(optimizer={"kind": "sgd", "lr": 1.0}, weight_clip=0.25)
    ids = np.arange(50, dtype=np.uint64)
    t.lookup(ids)
    t.push(ids, np.random.default_rng(0).normal(size=(50, 4)).astype(np.float32) * 10)
    w = t.lookup(ids, train=False)
    assert np.abs(w).max() == pytest.approx(0.25)


@pytest.mark.parametrize("capacity", [100_000, 700_000])
def test_a_full_table_takes_at_most_1_5x_its_weights_and_optimizer_state(capacity: int) -> None:
    """The index is sized to the capacity, not to the next power of two (up to 2x)."""
    t = EmbeddingTable("t", TableConfig(dim=16, capacity=capacity, initial_rows=capacity))
    for start in range(0, capacity, 50_000):
        t.lookup(np.arange(start, min(capacity, start + 50_000), dtype=np.uint64))
    assert len(t) == capacity
    minimum = capacity * (16 + 16) * 4  # float32 weights and Adagrad accumulators
    assert t.memory_bytes <= 1.5 * minimum, t.memory_bytes / minimum


def test_memory_is_bounded_whatever_the_number_of_distinct_ids(tmp_path: Path) -> None:
    cap = 5000
    shard = StoreShard(StoreConfig(tables={"t": {"dim": 8, "capacity": cap, "initial_rows": 64}}))
    t = shard.table("t")
    rng = np.random.default_rng(0)
    peak = 0
    for step in range(100):  # 10x the capacity in distinct ids, plus repeats
        fresh = np.arange(step * 500, (step + 1) * 500, dtype=np.uint64)
        again = rng.integers(0, (step + 1) * 500, 200).astype(np.uint64)
        ids = np.concatenate([fresh, again])
        shard.lookup({"t": ids})
        shard.push({"t": (ids, np.ones((ids.shape[0], 8), np.float32))})
        if step % 25 == 0:
            shard.checkpoint(tmp_path, "auto")  # tombstones are bounded too
        peak = max(peak, t.memory_bytes)
        assert len(t) <= cap
    # The bound: a hash index of at most cap / 0.75 buckets of 32 bytes, plus cap
    # rows of weights, Adagrad state, step, free list and mark bytes, plus at most
    # cap tombstones.
    per_row = 8 * 4 + 8 * 4 + 8 + 8 + 1
    bound = 6667 * 32 + cap * per_row + cap * 8
    assert peak <= bound, (peak, bound)
    assert t.stats().evictions >= 50_000 - cap


def test_more_new_ids_in_one_call_than_capacity_overflow_cleanly() -> None:
    t = _table(capacity=8)
    rows = t.lookup(np.arange(20, dtype=np.uint64))
    assert len(t) == 8
    assert t.stats().overflow == 12
    assert np.count_nonzero(rows.any(axis=1)) == 8


def test_bad_inputs_name_the_field_and_value() -> None:
    shard = StoreShard(StoreConfig(tables={"t": {"dim": 4}}))
    with pytest.raises(UnknownTable, match=r"'nope'.*\['t'\]"):
        shard.lookup({"nope": _ids(1)})
    with pytest.raises(InvalidRequest, match=r"shape \(2, 3\)"):
        shard.push({"t": (_ids(1, 2), np.zeros((2, 3), np.float32))})
    with pytest.raises(InvalidRequest, match="float64"):
        shard.lookup({"t": np.array([1.5, 2.0])})
    with pytest.raises(ValueError, match="invalid table name"):
        StoreConfig(tables={"bad/name": {"dim": 4}})
    with pytest.raises(ValueError, match="nesterov"):
        TableConfig(dim=4, optimizer={"kind": "sgd", "nesterov": True})


def test_a_bad_push_applies_nothing() -> None:
    shard = StoreShard(StoreConfig(tables={"a": {"dim": 2}, "b": {"dim": 2}}))
    shard.lookup({"a": _ids(1), "b": _ids(1)})
    before = shard.lookup({"a": _ids(1)}, train=False)["a"]
    with pytest.raises(UnknownTable):
        shard.push({"a": (_ids(1), np.ones((1, 2), np.float32)), "zzz": (_ids(1), np.ones((1, 2)))})
    np.testing.assert_array_equal(shard.lookup({"a": _ids(1)}, train=False)["a"], before)


def test_remembered_push_ids_bounds_the_dedup_window() -> None:
    shard = StoreShard(StoreConfig(tables={"t": {"dim": 2}}, remembered_push_ids=2))
    shard.lookup({"t": _ids(1)})
    g = {"t": (_ids(1), np.ones((1, 2), np.float32))}
    assert not shard.push(g, request_id="a").duplicate_request
    assert shard.push(g, request_id="a").duplicate_request
    shard.push(g, request_id="b")
    shard.push(g, request_id="c")  # "a" is forgotten now
    assert not shard.push(g, request_id="a").duplicate_request


def test_compression_option_changes_the_files(tmp_path: Path) -> None:
    sizes = {}
    for comp in ("none", "zstd", "lz4"):
        shard = StoreShard(StoreConfig(tables={"t": {"dim": 16}}, compression=comp))
        shard.lookup({"t": np.arange(5000, dtype=np.uint64) % 100})  # 100 distinct rows
        shard.lookup({"t": np.arange(5000, dtype=np.uint64)})
        sizes[comp] = shard.checkpoint(tmp_path / comp, "full").bytes
    assert sizes["zstd"] < sizes["none"]
    assert sizes["lz4"] < sizes["none"]


def test_initial_rows_sets_the_first_allocation() -> None:
    small = _table(initial_rows=16, capacity=100_000)
    large = _table(initial_rows=50_000, capacity=100_000)
    assert small.memory_bytes < large.memory_bytes
    ids = np.arange(1000, dtype=np.uint64)
    np.testing.assert_array_equal(small.lookup(ids), large.lookup(ids))


def test_concurrent_calls_on_one_shard_stay_consistent() -> None:
    # SGD without momentum is additive, so the order of concurrent pushes does not
    # matter: the final rows must equal the initial rows minus lr * all gradients.
    shard = StoreShard(
        StoreConfig(tables={n: {"dim": 4, "optimizer": {"kind": "sgd", "lr": 0.01}} for n in "ab"})
    )
    ids = np.arange(300, dtype=np.uint64)
    init = {n: shard.lookup({n: ids})[n] for n in "ab"}
    total = {n: np.zeros((300, 4), np.float64) for n in "ab"}
    lock = threading.Lock()
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(40):
                n = "ab"[rng.integers(2)]
                sel = rng.choice(300, 64, replace=False).astype(np.uint64)
                g = rng.normal(size=(64, 4)).astype(np.float32)
                shard.lookup({n: sel})
                shard.push({n: (sel, g)})
                with lock:
                    np.add.at(total[n], sel.astype(np.int64), g)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    for n in "ab":
        got = shard.lookup({n: ids}, train=False)[n]
        np.testing.assert_allclose(got, init[n] - 0.01 * total[n], rtol=1e-4, atol=1e-5)


def test_routing_spreads_ids_and_moves_few_when_shards_are_added() -> None:
    ids = np.random.default_rng(0).integers(0, 2**63, 100_000).astype(np.uint64)
    three, four = shard_of(ids, 3), shard_of(ids, 4)
    counts = np.bincount(three, minlength=3)
    assert counts.min() > 0.3 * ids.shape[0]
    moved = np.mean(three != four)
    assert 0.2 < moved < 0.3  # jump hash moves about 1/4 of the ids from 3 to 4 shards
    assert np.all(four[three != four] == 3)


def test_a_table_group_reads_as_each_table_does_as_the_tables_grow() -> None:
    from embedding_store.table_group import TableGroup

    sgd = {"kind": "sgd", "lr": 1.0}
    tables = [
        EmbeddingTable("t0", TableConfig(dim=3, optimizer=sgd, initial_rows=16)),
        EmbeddingTable(
            "t1", TableConfig(dim=3, optimizer=sgd, initializer={"kind": "normal", "std": 0.5})
        ),
        EmbeddingTable("t2", TableConfig(dim=3, optimizer=sgd, initializer={"kind": "zeros"})),
    ]
    group = TableGroup(tables)
    rng = np.random.default_rng(1)
    learned: list[list[int]] = [[], [], []]
    for round_ in range(4):
        # Each round adds rows (t0 outgrows its 16 and replaces its arrays), then reads
        # learned and unknown ids of every table in one call.
        # Rows learned before are moved too, after t0 grew: a read of arrays the table
        # replaced would answer with their old values.
        for t, have in zip(tables, learned, strict=True):
            new = rng.integers(0, 1 << 40, 30 * (round_ + 1), dtype=np.uint64)
            t.lookup(new)
            have.extend(new.tolist())
            every = np.array(have, np.uint64)
            t.push(every, rng.normal(size=(every.shape[0], 3)).astype(np.float32))
        ids = np.concatenate(
            [rng.integers(0, 1 << 40, 200, dtype=np.uint64)]
            + [np.array(have, np.uint64) for have in learned]
        )
        which = np.concatenate(
            [rng.integers(0, 3, 200)] + [np.full(len(have), i) for i, have in enumerate(learned)]
        )
        before = [t.stats().unknown_reads for t in tables]
        out = np.empty((ids.shape[0], 3), np.float32)
        assert group.read(which, ids, out)
        halves = np.empty_like(out)
        assert group.read(which, ids, halves, half=True)
        np.testing.assert_array_equal(halves, out.astype(np.float16).astype(np.float32))
        for i, t in enumerate(tables):
            mine = which == i
            want, unknown = t.read(ids[mine])
            np.testing.assert_array_equal(out[mine], want)
            # The group's two reads were counted as the table's own is.
            assert t.stats().unknown_reads - before[i] == 3 * unknown
            assert unknown >= 40  # random ids of 2**40: unknown, so initial rows were read
    wider = np.empty((1, 4), np.float32)
    assert not group.read(np.zeros(1, np.int64), np.ones(1, np.uint64), wider)
    assert TableGroup([tables[0], EmbeddingTable("wide", TableConfig(dim=4))]).dim is None


def test_a_group_of_shards_reads_each_id_from_the_shard_that_owns_it() -> None:
    """``read_bounds``: table ``t``'s ids in ``ids[bounds[t]:bounds[t + 1]]``, the group
    holding every table of shard 0, then of shard 1, ...: each id is read from its
    owner (``shard_of``), as ``read`` with an explicit table index reads it."""
    from embedding_store.table_group import TableGroup

    sgd = {"kind": "sgd", "lr": 1.0}
    shards, names = 3, ("a", "b")
    tables = [
        EmbeddingTable(name, TableConfig(dim=2, optimizer=sgd))
        for _ in range(shards)
        for name in names
    ]
    rng = np.random.default_rng(5)
    ids = rng.integers(0, 1 << 40, 90, dtype=np.uint64)
    owner = shard_of(ids, shards)
    for i in range(ids.shape[0]):  # every id learned by its owner only
        t = tables[int(owner[i]) * len(names) + i % len(names)]
        t.lookup(ids[i : i + 1])
        t.push(ids[i : i + 1], rng.normal(size=(1, 2)).astype(np.float32))
    by_table = np.concatenate([ids[t :: len(names)] for t in range(len(names))])
    bounds = np.array([0, 45, 90])
    group = TableGroup(tables)
    got = np.empty((90, 2), np.float32)
    assert group.read_bounds(bounds, by_table, got, num_shards=shards)
    which = np.repeat(np.arange(len(names)), 45) + shard_of(by_table, shards) * len(names)
    want = np.empty_like(got)
    assert group.read(which, by_table, want)
    np.testing.assert_array_equal(got, want)
    assert sum(t.stats().unknown_reads for t in tables) == 0  # each read from its owner
    with pytest.raises(ValueError, match="2 tables of 2 shard"):
        group.read_bounds(bounds, by_table, got, num_shards=2)


def test_half_rounding_is_numpys_on_both_kernels() -> None:
    """The read's float16 rounding, with the CPU's instructions and without (CPUs that
    lack them), is numpy's ``astype(float16).astype(float32)`` on the hard cases."""
    import numba

    from embedding_store.kernels.float16 import half_rounded_bits as _half_rounded_bits
    from embedding_store.kernels.float16 import half_rounded_native as _half_rounded_native

    @numba.njit
    def each(kernel: Any, x: Any, out: Any) -> None:  # pragma: no cover - compiled
        for i in range(x.shape[0]):
            out[i] = kernel(x[i])

    edges = np.array(
        [0.0, -0.0, 1.0, 65504.0, 65519.99, 65520.0, 1e6, np.inf, -np.inf, 6.1035e-5,
         6.1e-5, 5.96e-8, 2.98e-8, 2.99e-8, 1e-10, 1 + 2**-11, 1 + 3 * 2**-11],
        np.float32,
    )  # fmt: skip
    rng = np.random.default_rng(3)
    bits = rng.integers(0, 1 << 32, 200_000, dtype=np.uint64).astype(np.uint32)
    x = np.concatenate([edges, -edges, bits.view(np.float32)])
    x = x[~np.isnan(x)]
    with np.errstate(over="ignore"):  # beyond float16's range: inf, as wanted
        want = x.astype(np.float16).astype(np.float32)
    for kernel in (_half_rounded_bits, _half_rounded_native):
        got = np.empty_like(x)
        each(kernel, x, got)
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
