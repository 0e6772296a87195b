"""Model-based test: the numba table against a plain-dict reference.

Random sequences of training lookups, read-only lookups, pushes (with
duplicate ids and non-finite gradients), evictions, TTL expiry, checkpoints and
restores run on a one-table shard and on the reference; after every step the
two must hold the same ids with the same rows. Eviction order among rows seen
at the same step is the table's choice, so the reference checks the LRU rule
and then follows it.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import hypothesis.strategies as st
import numpy as np
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from embedding_store.shard import StoreShard
from embedding_store.types import StoreConfig

DIM = 3
LR = 0.5
CAPACITY = 12
TTL = 6

ids_st = st.lists(st.integers(0, 30), min_size=0, max_size=10)


class TableModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.config = StoreConfig(
            tables={
                "t": {
                    "dim": DIM,
                    "optimizer": {"kind": "sgd", "lr": LR},
                    "capacity": CAPACITY,
                    "initial_rows": 2,
                    "ttl_steps": TTL,
                }
            },
            compression="none",
            keep_full_checkpoints=1000,
        )
        self.shard = StoreShard(self.config)
        self.rows: dict[int, np.ndarray] = {}
        self.seen: dict[int, int] = {}
        self.first_values: dict[int, np.ndarray] = {}
        self.clock = 0
        self.tmp = Path(tempfile.mkdtemp(prefix="table-model-"))
        self.saved: dict[int, tuple[dict[int, np.ndarray], dict[int, int], int]] = {}
        self.n_checkpoints = 0

    def teardown(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)

    @property
    def table(self):  # the shard swaps table objects on restore
        return self.shard.table("t")

    def _sync_removed(self, touched: set[int]) -> None:
        """Drop from the reference what the table removed, checking it was allowed."""
        now = {int(i) for i in self.table.ids()}
        removed = set(self.rows) - now
        assert not (removed & touched), "a row seen in this very call was removed"
        survivors = [self.seen[i] for i in now - touched]
        for i in removed:
            expired = self.seen[i] < self.clock - TTL
            oldest = not survivors or self.seen[i] <= min(survivors)
            assert expired or oldest, f"row {i} (seen {self.seen[i]}) evicted before older rows"
            del self.rows[i], self.seen[i]

    @rule(ids=ids_st)
    def lookup_train(self, ids: list[int]) -> None:
        arr = np.array(ids, dtype=np.uint64)
        got = self.shard.lookup({"t": arr})["t"]
        self.clock += 1
        assert self.table.clock == self.clock
        for i, row in zip(ids, got, strict=True):
            if i in self.rows:
                np.testing.assert_allclose(row, self.rows[i], rtol=1e-6, atol=1e-6)
            else:
                # A new (or re-created) row starts from its deterministic initial value.
                if i in self.first_values:
                    np.testing.assert_array_equal(row, self.first_values[i])
                self.first_values.setdefault(i, row.copy())
                self.rows[i] = row.copy()
            self.seen[i] = self.clock
        self._sync_removed(set(ids))
        assert len(self.table) <= CAPACITY
        for i in ids:
            assert i in self.rows, f"id {i} looked up in training mode has no row"

    @rule(ids=ids_st)
    def lookup_eval(self, ids: list[int]) -> None:
        got = self.shard.lookup({"t": np.array(ids, dtype=np.uint64)}, train=False)["t"]
        for i, row in zip(ids, got, strict=True):
            expected = self.rows.get(i, np.zeros(DIM, dtype=np.float32))
            np.testing.assert_array_equal(row, expected)

    @rule(ids=ids_st, seed=st.integers(0, 2**16), poison=st.booleans())
    def push(self, ids: list[int], seed: int, poison: bool) -> None:
        rng = np.random.default_rng(seed)
        grads = rng.normal(size=(len(ids), DIM)).astype(np.float32)
        if poison and ids:
            grads[0, 0] = np.inf
        result = self.shard.push({"t": (np.array(ids, dtype=np.uint64), grads)})
        summed: dict[int, np.ndarray] = {}
        absent = rejected = 0
        for k, (i, g) in enumerate(zip(ids, grads, strict=True)):
            if poison and k == 0:
                rejected += 1
            elif i not in self.rows:
                absent += 1
            else:
                summed[i] = summed.get(i, np.zeros(DIM, dtype=np.float32)) + g
        for i, g in summed.items():
            self.rows[i] = (self.rows[i] - np.float32(LR) * g).astype(np.float32)
        assert result.rejected_nonfinite == rejected
        assert result.dropped_not_admitted == absent
        assert result.applied == len(ids) - absent - rejected

    @rule(n=st.integers(1, 5))
    def evict(self, n: int) -> None:
        before = len(self.rows)
        evicted = self.table.evict(n)
        assert evicted == min(n, before)
        self._sync_removed(set())

    @rule()
    def expire(self) -> None:
        self.table.expire()
        self._sync_removed(set())
        assert all(s >= self.clock - TTL for s in self.seen.values())

    @rule(kind=st.sampled_from(["full", "delta", "auto"]))
    def checkpoint(self, kind: str) -> None:
        result = self.shard.checkpoint(self.tmp, kind)  # type: ignore[arg-type]
        self.n_checkpoints += 1
        assert result.seq == self.n_checkpoints
        self.saved[result.seq] = (
            {k: v.copy() for k, v in self.rows.items()},
            dict(self.seen),
            self.clock,
        )

    @precondition(lambda self: self.saved)
    @rule(data=st.data())
    def restore(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(sorted(self.saved)))
        self.shard.restore(self.tmp, upto_seq=seq)
        rows, seen, clock = self.saved[seq]
        self.rows = {k: v.copy() for k, v in rows.items()}
        self.seen = dict(seen)
        self.clock = clock
        # Checkpoints after the restored one describe a timeline that no longer exists.
        for later in [s for s in self.saved if s > seq]:
            del self.saved[later]
            for p in self.tmp.glob(f"*{later:08d}*"):
                p.unlink()
        self.n_checkpoints = seq

    @invariant()
    def same_rows(self) -> None:
        table_ids = sorted(int(i) for i in self.table.ids())
        assert table_ids == sorted(self.rows)
        rows, _, clock = self.table.export(dirty_only=False, mark_clean=False)
        assert clock == self.clock
        seen = dict(zip(rows.ids.tolist(), rows.last_seen.tolist(), strict=True))
        assert seen == self.seen
        if table_ids:
            got = self.table.lookup(np.array(table_ids, dtype=np.uint64), train=False)
            want = np.stack([self.rows[i] for i in table_ids])
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


TableModel.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
test_table_against_dict_reference = TableModel.TestCase
