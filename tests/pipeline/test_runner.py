"""StreamRunner on a real Dask cluster (worker processes) with real store shard processes."""

from __future__ import annotations

import itertools
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from distributed import Client, wait

from connectors.parquet import ParquetSource
from connectors.synthetic import (
    SyntheticConfig,
    SyntheticSource,
    synthetic_feature_spec,
    synthetic_store_section,
    write_parquet,
)
from embedding_store.client import StoreClient
from pipeline.prepare import StoreAddress, prepare
from pipeline.runner import StreamRunner
from pipeline.types import PreparedBatch
from tests.support.processes import dask_cluster

pytestmark = pytest.mark.processes

SPEC = synthetic_feature_spec()
EVENTS = 3000


@pytest.fixture(scope="module")
def store(start_store: Callable[[dict[str, Any]], StoreAddress]) -> StoreAddress:
    return start_store(synthetic_store_section(dim=8, row_dtype="float32"))


def _collect(runner: StreamRunner, limit: int | None = None) -> list[PreparedBatch]:
    out = []
    for batch in runner:
        out.append(batch)
        if limit is not None and len(out) >= limit:
            break
    return out


def _assert_tiles(batches: list[PreparedBatch], partitions: dict[str, tuple[int, int]]) -> None:
    """Per partition the batches' ranges tile [start, end) in order: no gap, no repeat."""
    for p, (start, end) in partitions.items():
        ranges = [(b.start, b.end) for b in batches if b.partition == p]
        assert ranges, f"no batch from {p}"
        assert ranges[0][0] == start
        assert ranges[-1][1] == end
        for (_, e), (s, _) in itertools.pairwise(ranges):
            assert e == s, f"{p}: gap or overlap at {e} -> {s}"


def test_every_record_once_in_order_and_equal_to_local_preparation(
    cluster: Client, store: StoreAddress
) -> None:
    source = SyntheticSource(SyntheticConfig(seed=3, partitions=2, events=EVENTS))
    runner = StreamRunner(cluster, source, SPEC, store, staleness=2, max_records=500)
    batches = _collect(runner)
    _assert_tiles(batches, {p: (0, EVENTS) for p in source.partitions()})
    assert runner.positions == dict.fromkeys(source.partitions(), EVENTS)
    assert sum(len(b) for b in batches) + runner.stats.bad_records == 2 * EVENTS
    # The oracle: the same chunks prepared in this process, without Dask.
    with StoreClient.connect(store.address, token=store.token) as client:
        for b in batches[:4]:
            chunk = source.plan(b.partition, b.start, 500)
            assert chunk is not None
            local, _ = prepare(chunk, source, SPEC, None, lookup=False)
            np.testing.assert_array_equal(b.labels, local.labels)
            np.testing.assert_array_equal(b.dense, local.dense)
            for name, t in b.tables.items():
                np.testing.assert_array_equal(t.unique_ids, local.tables[name].unique_ids)
                np.testing.assert_array_equal(t.inverse, local.tables[name].inverse)
                np.testing.assert_array_equal(t.offsets, local.tables[name].offsets)
                # Nothing was pushed, so the rows are what the store holds now.
                now = client.lookup({name: t.unique_ids}, train=False)[name]
                np.testing.assert_array_equal(t.rows, now)


@pytest.mark.parametrize("staleness", [0, 1, 3])
def test_at_most_staleness_batches_in_flight(cluster: Client, staleness: int) -> None:
    source = SyntheticSource(SyntheticConfig(seed=4, partitions=2, events=2000))
    runner = StreamRunner(cluster, source, SPEC, None, staleness=staleness, max_records=200)
    seen = 0
    for _ in runner:
        # While the consumer holds a batch, at most `staleness` more are in flight.
        assert runner._inflight_count() <= staleness
        seen += 1
    assert seen == 20


def test_results_are_fetched_while_the_consumer_holds_a_batch(cluster: Client) -> None:
    # A Dask result stays on its worker until asked for: the runner asks as soon as a
    # task is done, so the batches after the one being trained on are already here.
    source = SyntheticSource(SyntheticConfig(seed=4, partitions=2, events=2000))
    runner = StreamRunner(cluster, source, SPEC, None, staleness=3, max_records=200)
    batches = iter(runner)
    next(batches)
    ahead = list(runner._submitted)
    assert len(ahead) == 3
    wait([f for f, _, _ in ahead], timeout=30)  # computed (wait moves no data)
    deadline = time.monotonic() + 10
    while not all(fetch.done() for _, _, fetch in ahead) and time.monotonic() < deadline:
        time.sleep(0.01)
    # Here without the consumer asking for them.
    assert all(fetch.done() for _, _, fetch in ahead)
    assert [len(fetch.result()[0]) for _, _, fetch in ahead] == [200, 200, 200]
    assert sum(1 for _ in batches) == 19
    runner.close()


def test_a_task_carries_its_chunk_not_the_runners_source_and_spec(cluster: Client) -> None:
    # The scheduler unpickles every task and keeps its streams' last thousand messages:
    # with the spec and source in each, a job's scheduler churned tens of MB a minute.
    source = SyntheticSource(SyntheticConfig(seed=4, partitions=2, events=2000))
    runner = StreamRunner(cluster, source, SPEC, None, staleness=3, max_records=200)
    batches = iter(runner)
    next(batches)

    def specs(dask_scheduler: Any) -> list[bytes]:
        import pickle

        return [
            pickle.dumps(ts.run_spec)
            for key, ts in dask_scheduler.tasks.items()
            if str(key).startswith("prepare-")
        ]

    # In flight (and the one yielded, until its release lands); the runner's next
    # submissions may still be on their way to the scheduler.
    deadline = time.monotonic() + 10
    while len(held := cluster.run_on_scheduler(specs)) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(held) >= 3
    for blob in held:
        assert b"Chunk" in blob
        assert b"FeatureSpec" not in blob, len(blob)
        assert b"SyntheticSource" not in blob, len(blob)
    # Every worker holds them once, and still prepares every chunk.
    assert sum(1 for _ in batches) == 19
    runner.close()


def test_tasks_are_spread_over_the_workers() -> None:
    # Left to choose, the scheduler gave one of two idle workers nearly every task: a
    # job's pipeline ran on one worker whatever cluster.workers said.
    with dask_cluster() as client:
        source = SyntheticSource(SyntheticConfig(seed=4, partitions=2, events=20_000))
        runner = StreamRunner(client, source, SPEC, None, staleness=3, max_records=200)
        for _ in runner:
            time.sleep(0.005)  # a consumer's step, so that tasks finish between asks
        runner.close()
        done = client.run(lambda dask_worker: dask_worker.state.executed_count)
    assert sum(done.values()) >= 100
    assert min(done.values()) >= 0.45 * sum(done.values()), done


def test_resume_from_positions_continues_without_overlap(cluster: Client, tmp_path: Path) -> None:
    path = tmp_path / "history.parquet"
    write_parquet(path, SyntheticConfig(seed=5), events=4000, row_group_size=500)
    first = StreamRunner(cluster, ParquetSource([path]), SPEC, None, staleness=1, max_records=500)
    head = _collect(first, limit=3)
    first.close()
    resumed = StreamRunner(
        cluster, ParquetSource([path]), SPEC, None, staleness=1, positions=first.positions
    )
    tail = _collect(resumed)
    (p,) = first.positions
    _assert_tiles(head + tail, {p: (0, 4000)})
    done, total = resumed.progress()
    assert (done, total) == (4000 - 1500, 4000 - 1500)


def test_a_killed_worker_costs_a_retry_not_a_record(tmp_path: Path) -> None:
    source = SyntheticSource(SyntheticConfig(seed=6, partitions=3, events=3000))
    with dask_cluster() as client:
        runner = StreamRunner(client, source, SPEC, None, staleness=4, max_records=250)
        batches = []
        pids = client.run(os.getpid)
        for i, batch in enumerate(runner):
            batches.append(batch)
            if i == 3:
                os.kill(next(iter(pids.values())), signal.SIGKILL)
        _assert_tiles(batches, {p: (0, 3000) for p in source.partitions()})
        assert len(batches) == 36


def test_a_lookup_on_a_dead_shard_reaches_the_trainer_as_store_unavailable(
    cluster: Client, start_shards: Callable[..., Any], write_job: Callable[..., Path]
) -> None:
    """The prepare task's error keeps its type across Dask: the job rolls back on it.

    Dask pickles a task's error; with the gRPC call object as its ``__context__``
    it did not pickle and arrived as a plain ``Exception``, which the job took
    for a crash instead of a lost shard.
    """
    from embedding_store.errors import StoreUnavailable
    from pipeline.prepare import StoreAddress as Address

    job = write_job(**synthetic_store_section(dim=8, row_dtype="float32"))
    [shard] = start_shards(1, job, None)
    address = Address(f"grpc://{shard.address}")
    shard.kill()
    source = SyntheticSource(SyntheticConfig(seed=1, partitions=1, events=100))
    runner = StreamRunner(cluster, source, SPEC, address, staleness=0, max_records=50, retries=0)
    with pytest.raises(StoreUnavailable, match="on shard"):
        next(iter(runner))
    runner.close()


@pytest.mark.parametrize("direct", [True, False])
def test_the_trainers_client_fetches_batches_from_the_workers_not_the_scheduler(
    store: StoreAddress, direct: bool
) -> None:
    """The job's client takes each batch from its worker; the scheduler relays none.

    Through the scheduler every batch was pickled in-band (its comms speak pickle
    protocol 4) and sent twice: about 5% of a small model's rate on 2 cores.
    """
    from distributed import LocalCluster

    from deploy.config import ClusterConfig
    from deploy.job import batch_client

    relayed: list[int] = []
    with LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0"
    ) as lc:
        scheduler = lc.scheduler
        assert scheduler is not None
        gather = scheduler.handlers["gather"]

        def counted(*args: Any, **kwargs: Any) -> Any:
            relayed.append(len(kwargs.get("keys", ())))
            return gather(*args, **kwargs)

        scheduler.handlers["gather"] = counted
        cluster = ClusterConfig() if direct else ClusterConfig(direct_to_workers=False)
        with batch_client(cluster, lc.scheduler_address) as client:
            source = SyntheticSource(SyntheticConfig(seed=2, partitions=2, events=1000))
            runner = StreamRunner(client, source, SPEC, store, staleness=2, max_records=250)
            batches = _collect(runner)
            runner.close()
    _assert_tiles(batches, {p: (0, 1000) for p in source.partitions()})
    assert all(t.rows is not None for b in batches for t in b.tables.values())
    if direct:
        assert relayed == []
    else:  # the counter sees the relay it guards against
        assert sum(relayed) == len(batches) == 8
