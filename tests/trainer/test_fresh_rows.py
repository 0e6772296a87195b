"""Fresh reads of a rank's own pushes, against real store shard processes over gRPC.

The semantics: on one rank, a row pushed at step t is what step t + 1 trains,
at any staleness. The hybrid loop's lookups run ``trainer.prefetch`` batches
ahead of it (as the runner's does), on small vocabularies so that nearly every
row of a batch was pushed by the batches just before it (hot ids).
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from deploy.local.shards import ShardProcess
from embedding_store.client import StoreClient
from pipeline.types import PreparedBatch
from tests.support.jobs import write_job_yaml
from tests.support.processes import grpc_address
from tests.trainer.loop_case import (
    BATCH,
    SPEC,
    TABLES,
    chunks,
    config,
    lazy_batches,
    source,
)
from trainer.dense_model import DenseModel
from trainer.loop import TrainLoop
from trainer.loop_options import Compute

pytestmark = pytest.mark.processes

STEPS = 12


def trained_rows_against_the_store(
    store: StoreClient, staleness: int, *, predict: bool = True, **kw: Any
) -> tuple[TrainLoop, list[dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]]]:
    """Run the hybrid loop; per step and table, the rows it trained, the store's rows of
    the same ids read just before the step (every earlier push of this one rank has
    landed then), and which ids the step before pushed. ``predict``: the loop knows the
    tables' configs (as a job's does), so it predicts the push in flight.
    """
    cfg = config("hybrid", staleness=staleness, **kw)
    dense = DenseModel(cfg, SPEC, store.dims, torch.device("cpu"))
    loop = TrainLoop(
        cfg, SPEC, store, dense, compute=Compute(store_tables=TABLES if predict else None)
    )
    seen: list[dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]] = []
    step = loop._forward_backward
    last: dict[str, Any] = {}

    def recorded(batch: PreparedBatch) -> dict[str, Any]:
        loop.pusher.drain()  # the store as of every push before this step
        now = store.lookup({k: t.unique_ids for k, t in batch.tables.items()}, train=False)
        seen.append(
            {
                k: (t.rows.copy(), now[k], np.isin(t.unique_ids, last.get(k, ())))  # type: ignore[union-attr]
                for k, t in batch.tables.items()
            }
        )
        grads = step(batch)
        last.clear()
        last.update({k: ids for k, (ids, _) in grads.items()})
        return grads

    loop._forward_backward = recorded  # type: ignore[method-assign]
    planned = chunks(source(), "synthetic/0", 0, STEPS * BATCH)
    stats = loop.run(lazy_batches(source(), planned, store, ahead=cfg.prefetch))
    assert stats.steps == STEPS
    return loop, seen


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """Two shard processes for the module (each test's rows are read against the store
    as it is, so tests sharing them do not disturb each other's assertions).
    """
    tmp = tmp_path_factory.mktemp("fresh-rows")
    tables = {name: t.model_dump(mode="json") for name, t in TABLES.items()}
    job = write_job_yaml(tmp / "job.yaml", store={"tables": tables, "row_dtype": "float16"})
    token = secrets.token_hex(16)
    (tmp / "token").write_text(token)
    procs = [ShardProcess.start(job, tmp / f"shard-{i}", token_file=tmp / "token") for i in (0, 1)]
    try:
        yield grpc_address(procs), token
    finally:
        for p in procs:
            p.kill()


@pytest.mark.parametrize("staleness", [1, 2, 4, 8])
def test_a_row_pushed_at_step_t_is_what_step_t_plus_1_trains(
    shards: tuple[str, str], staleness: int
) -> None:
    """``fresh_rows: exact`` with the default push queue (one push in flight, predicted
    where its rows' state is remembered, else waited for): every row is exact.
    """
    address, token = shards
    store = StoreClient.connect(address, token=token)
    loop, seen = trained_rows_against_the_store(store, staleness, fresh_rows="exact")
    for step, tables in enumerate(seen):
        for name, (trained, current, _) in tables.items():
            np.testing.assert_array_equal(trained, current, err_msg=f"step {step} table {name}")
    # The lookups ran ahead and missed pushes to these rows: the overlay did the work,
    # and the rows of the push in flight were predicted.
    if staleness > 1:
        assert max(loop.stats.missed_pushes_by_row) >= staleness - 1
        assert loop.stats.rows_freshened > 0
    assert set(loop.stats.trained_missed_pushes_by_row) == {0}
    store.close()


def test_bounded_fresh_rows_predict_what_they_remember_and_never_wait(
    shards: tuple[str, str],
) -> None:
    """The default: rows this rank pushed lately are exact, the others miss at most the
    push in flight, and no step waits for it.
    """
    address, token = shards
    store = StoreClient.connect(address, token=token)
    loop, seen = trained_rows_against_the_store(store, 4)
    inexact = sum(
        int((trained != current).any(axis=1).sum())
        for tables in seen
        for trained, current, _ in tables.values()
    )
    trained_missed = loop.stats.trained_missed_pushes_by_row
    assert loop.stats.fresh_waits == 0
    assert loop.stats.rows_predicted > 0
    assert max(trained_missed) <= 1
    # Only rows first pushed by the push in flight can differ (small vocabularies: few).
    assert inexact <= trained_missed.get(1, 0)
    store.close()


def test_without_a_push_in_flight_over_the_socket_rows_are_exact(shards: tuple[str, str]) -> None:
    """``push_queue: 0``, no shared memory: the frames' path, nothing to predict."""
    address, token = shards
    store = StoreClient.connect(address, token=token, shared_memory=False)
    loop, seen = trained_rows_against_the_store(store, 4, push_queue=0, fresh_rows="exact")
    for step, tables in enumerate(seen):
        for name, (trained, current, _) in tables.items():
            np.testing.assert_array_equal(trained, current, err_msg=f"step {step} table {name}")
    assert loop.stats.rows_freshened > 0
    store.close()


def test_without_the_tables_a_row_misses_at_most_the_push_in_flight(
    shards: tuple[str, str],
) -> None:
    """A loop that does not know the tables' optimizers cannot predict: a row trained at
    step t + 1 has every push of this rank but step t's; rows step t did not push are exact.
    """
    address, token = shards
    store = StoreClient.connect(address, token=token)
    loop, seen = trained_rows_against_the_store(store, 8, predict=False)  # bounded
    differ = 0
    for step, tables in enumerate(seen):
        for name, (trained, current, pushed_last) in tables.items():
            np.testing.assert_array_equal(
                trained[~pushed_last], current[~pushed_last], err_msg=f"step {step} table {name}"
            )
            differ += int((trained[pushed_last] != current[pushed_last]).any(axis=1).sum())
    assert max(loop.stats.missed_pushes_by_row) >= 7  # the lookups ran 7 batches ahead
    assert max(loop.stats.trained_missed_pushes_by_row) == 1
    assert differ > 0
    store.close()


def test_without_fresh_rows_a_hybrid_step_trains_rows_older_than_the_store(
    shards: tuple[str, str],
) -> None:
    """The defect fresh rows fix: hot rows trained without this rank's last pushes."""
    address, token = shards
    store = StoreClient.connect(address, token=token)
    _, seen = trained_rows_against_the_store(store, 4, fresh_rows="off", push_queue=0)
    stale = sum(
        int((trained != current).any(axis=1).sum())
        for tables in seen
        for trained, current, _ in tables.values()
    )
    assert stale > 0
    store.close()
