"""A tiered table in real shard processes, against the same table all in memory.

Two stores of ``streamrec store serve`` processes get the same training calls: one
keeps at most a few hundred rows per shard in memory and the rest on disk, the
other keeps everything in memory. The table is ten times the memory budget. Along
the way a shard of each is killed and restarted from its checkpoint, and both are
resharded from two shards onto three. At the end every row, with its optimizer
state, step, last seen step and frequency, is the same in both.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from deploy.local.shards import ShardProcess
from embedding_store.client import StoreClient
from embedding_store.shard import StoreShard
from embedding_store.types import StoreConfig
from tests.support.processes import grpc_address

pytestmark = pytest.mark.processes

MEMORY_ROWS = 300
UNIVERSE = 6000  # ids: about 3,000 rows per shard of two, ten times the budget
DIM = 8
TABLE = {"dim": DIM, "optimizer": {"kind": "adagrad", "lr": 0.05}, "capacity": 100_000}


def skewed_ids(rng: np.random.Generator, n: int) -> np.ndarray:
    """Hot ids (Zipf ranks, scattered) and a uniform tail that reaches every id."""
    ranks = np.minimum(rng.zipf(1.2, n // 2) - 1, UNIVERSE - 1)
    tail = rng.integers(0, UNIVERSE, n - n // 2)
    return np.unique(np.concatenate([(ranks * 7919) % UNIVERSE, tail])).astype(np.uint64)


class Pair:
    """The tiered store and the all-in-memory one, called alike."""

    def __init__(
        self,
        start: Callable[..., list[ShardProcess]],
        jobs: tuple[Path, Path],
        token_file: Path,
        allow: tuple[Path, ...],
    ) -> None:
        self.start, self.jobs, self.token_file, self.allow = start, jobs, token_file, allow
        self.token = token_file.read_text().strip()
        self.procs: dict[str, list[ShardProcess]] = {}
        self.clients: dict[str, StoreClient] = {}

    def open(self, n: int, prefix: str) -> None:
        for kind, job in zip(("tiered", "memory"), self.jobs, strict=True):
            procs = self.start(n, job, self.token_file, f"{prefix}-{kind}", self.allow)
            self.procs[kind] = procs
            self.reconnect(kind)

    def reconnect(self, kind: str) -> None:
        if kind in self.clients:
            self.clients[kind].close()
        self.clients[kind] = StoreClient.connect(
            grpc_address(self.procs[kind]), token=self.token, row_dtype="float32"
        )

    def train(self, rng: np.random.Generator, steps: range) -> None:
        for step in steps:
            ids = skewed_ids(rng, 400)
            got = {k: c.lookup({"t": ids}, step=step)["t"] for k, c in self.clients.items()}
            np.testing.assert_array_equal(got["tiered"], got["memory"], err_msg=f"step {step}")
            grads = rng.standard_normal((ids.shape[0], DIM)).astype(np.float32)
            for client in self.clients.values():
                client.push({"t": (ids, grads)})

    def close(self) -> None:
        for client in self.clients.values():
            client.close()


def rows_of(checkpoint: Path, config: StoreConfig) -> dict[int, tuple[Any, ...]]:
    """Every row of a store's checkpoint (``shard-NNN`` folders), read in this process."""
    out: dict[int, tuple[Any, ...]] = {}
    for d in sorted(checkpoint.glob("shard-*")):
        shard = StoreShard(config)
        shard.restore(d)
        rows, _, _ = shard.table("t").export(False, mark_clean=False)
        for i in range(len(rows)):
            out[int(rows.ids[i])] = (
                rows.weights[i].tobytes(),
                rows.state[i].tobytes(),
                int(rows.row_step[i]),
                int(rows.last_seen[i]),
                int(rows.freq[i]),
            )
    return out


def test_a_tiered_store_trains_row_for_row_as_memory_alone_across_kill_and_reshard(
    tmp_path: Path,
    write_job: Callable[..., Path],
    token_file: Path,
    start_shards: Any,
) -> None:
    tiered = write_job("tiered.yaml", tables={"t": {**TABLE, "tier": {"memory_rows": MEMORY_ROWS}}})
    memory = write_job("memory.yaml", tables={"t": TABLE})
    pair = Pair(start_shards, (tiered, memory), token_file, (tmp_path,))
    rng = np.random.default_rng(3)
    try:
        pair.open(2, "first")
        pair.train(rng, range(0, 20))
        for client in pair.clients.values():
            client.checkpoint()  # full
        pair.train(rng, range(20, 30))
        for client in pair.clients.values():
            client.checkpoint()  # a delta on it: what changed, in memory or moved to disk
        pair.train(rng, range(30, 40))

        # A shard of each dies; restarted, each restores its newest checkpoint and the
        # pushes after it are gone from both alike.
        for kind in ("tiered", "memory"):
            dead = pair.procs[kind][1]
            dead.kill()
            pair.procs[kind][1] = dead.restart()
            start_shards.track(pair.procs[kind][1])
            pair.reconnect(kind)
        pair.train(rng, range(40, 60))
        for stats in pair.clients["tiered"].stats():  # over gRPC, as the metrics read them
            t = stats.tables[0]
            assert t.rows > 4 * MEMORY_ROWS, f"{t}: the tier held little"
            assert t.memory_rows <= MEMORY_ROWS
            assert t.disk_rows + t.memory_rows >= t.rows
            assert t.disk_bytes > 0
            assert t.promotions > 0
            assert t.demotions > 0
            assert 0 < t.tier_missed < t.tier_asked

        # Two shards onto three, each store from its own checkpoint.
        for kind, client in pair.clients.items():
            client.checkpoint(tmp_path / f"two-{kind}")
            client.close()
        pair.clients = {}
        for kind in ("tiered", "memory"):
            for proc in pair.procs[kind]:
                proc.kill()
        pair.open(3, "second")
        for kind, client in pair.clients.items():
            client.restore(tmp_path / f"two-{kind}")
        pair.train(rng, range(60, 80))

        for kind, client in pair.clients.items():
            client.checkpoint(tmp_path / f"end-{kind}", kind="full")
        # The tiered store's full snapshot is its tiers' own checkpoints: table files
        # linked to the live tiers' (no row copied), no rows file.
        end = tmp_path / "end-tiered"
        tables = list(end.glob("shard-*/*-full-t.tier.*.sst"))
        assert tables, sorted(p.name for p in end.glob("shard-*/*"))
        assert all(f.stat().st_nlink >= 2 for f in tables)
        assert not list(end.glob("shard-*/*.rows.arrow"))
    finally:
        pair.close()
    plain = StoreConfig.model_validate({"tables": {"t": TABLE}, "row_dtype": "float32"})
    want = rows_of(tmp_path / "end-memory", plain)
    got = rows_of(tmp_path / "end-tiered", plain)
    assert len(want) > 10 * MEMORY_ROWS
    assert got.keys() == want.keys()
    differ = [i for i in want if got[i] != want[i]]
    assert not differ, f"{len(differ)} rows differ, e.g. id {differ[0]}"
